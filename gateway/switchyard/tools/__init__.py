"""Tool calling in one place: parsing a model's tool calls out of its text (every
family's format) and OpenAI's `tools` / `tool_choice` on chat completions."""
