"""`switchyard bench`: a load generator for any TGI or OpenAI-compatible server.

One job per module:

- `profile`: what to run (warmup, a max-throughput run, a sweep of constant rates).
- `prompts`: prompts of a chosen length in the served model's tokens.
- `client`: one streamed request against one API, timed token by token.
- `runner`: closed-loop and open-loop (constant-rate) phases on asyncio.
- `stats`: percentiles and per-phase aggregates.
- `report`: the terminal table and the JSON file; `plots`: the PNG charts.
- `command`: the glue that `switchyard bench` calls.

It measures Switchyard and its peers (TGI, vLLM, ...) the same way, so the
numbers can be compared.
"""
