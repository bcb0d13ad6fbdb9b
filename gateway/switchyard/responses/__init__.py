"""OpenAI's Responses API behind `/v1/responses`: items, prompt, output, store, runs."""
