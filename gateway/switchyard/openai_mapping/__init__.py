"""How OpenAI requests map onto Switchyard's generation: plans from request fields,
completion prompts and logprobs, and the streaming pieces chat and completions share."""
