#!/usr/bin/env python3
"""Chained Responses turns against the same conversation resent as chat, in one run.

Not a timed test: a measurement. Against one running server, each trial
holds a 10-turn conversation two ways, interleaved turn by turn so that both
see the same machine state:

- `responses`: each turn is `POST /v1/responses` with only the new user
  message and `previous_response_id` of the last turn;
- `chat`: each turn resends the whole conversation so far (the same user
  messages and the assistant answers the chat route gave) to
  `/v1/chat/completions`, with the server's prefix cache on.

Every turn is streamed; the time to first token is from the request to the
first text delta. Reported per turn: the median TTFT of each way over the
trials, their ratio (responses / chat), and the prompt and cached token
counts each way reports (`usage`). Each trial's conversation starts with a
random tag, one per way, so neither trials nor the two ways share cached
blocks.

`--opening-rules N` puts N numbered house rules before the opening (about 22
tokens each on SmolLM2's tokenizer), so the first turn carries an agent-sized
prompt, as a coding agent's instructions and tool list make it (Codex's first
prompt is about 6,500 tokens: `--opening-rules 300`); turn 2 then shows what
the cached prefix saves.

Usage:
  switchyard serve --dtype float32 --max-total-tokens 2048 &
  python benchmarks/responses_chain.py --url http://127.0.0.1:8080 [--turns 10] [--trials 5]
  switchyard serve --dtype float32 &   # the model's own context (8,192 on the default model)
  python benchmarks/responses_chain.py --turns 2 --trials 3 --opening-rules 300
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from typing import Any

import httpx

OPENING = ("You are helping me plan a week of cooking. I have a small kitchen, two pans, "
           "an oven, and I like vegetables, rice and fish. Keep every answer short.")
QUESTIONS = ["What should I cook on Monday?", "And on Tuesday?", "Something with fish?",
             "What goes with it?", "A vegetarian day?", "Something quick for Friday?",
             "A weekend dish?", "What do I need to buy?", "Which day is the cheapest?",
             "Summarize the week."]


def _stream(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[float, str, dict]:
    """(seconds to the first text, the whole text, usage) of one streamed request."""
    start = time.perf_counter()
    first = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    event = ""
    with client.stream("POST", path, json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[len("event: "):]
                continue
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[len("data: "):])
            if path.endswith("/responses"):
                if event == "response.output_text.delta" and data["delta"]:
                    first = first or time.perf_counter()
                    text.append(data["delta"])
                elif event in ("response.completed", "response.incomplete"):
                    usage = data["response"]["usage"]
                    usage["id"] = data["response"]["id"]
            else:
                if data.get("usage"):
                    usage = data["usage"]
                for choice in data.get("choices", []):
                    if choice["delta"].get("content"):
                        first = first or time.perf_counter()
                        text.append(choice["delta"]["content"])
    return (first or time.perf_counter()) - start, "".join(text), usage


def rules(count: int) -> str:
    """`count` numbered house rules: an agent-sized preamble for the first turn."""
    return " ".join(f"Rule {i}: when step {i} is done, check it twice and report it."
                    for i in range(1, count + 1))


def trial(client: httpx.Client, model: str, turns: int, max_tokens: int,
          preamble: str = "") -> list[dict]:
    """One conversation both ways; a row per turn."""
    # Each way its own opening tag: neither warms the other's prefix cache.
    tags = [uuid.uuid4().hex[:12] for _ in range(2)]
    messages: list[dict[str, str]] = []
    previous = None
    rows = []
    for turn in range(turns):
        question = QUESTIONS[turn % len(QUESTIONS)]
        asked = [f"[{tag}] {preamble} {OPENING} {question}" if turn == 0 else question
                 for tag in tags]
        body = {"model": model, "input": asked[0], "max_output_tokens": max_tokens,
                "temperature": 0, "stream": True}
        if previous:
            body["previous_response_id"] = previous
        r_ttft, _, r_usage = _stream(client, "/v1/responses", body)
        previous = r_usage["id"]
        messages.append({"role": "user", "content": asked[1]})
        c_ttft, c_text, c_usage = _stream(client, "/v1/chat/completions", {
            "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}})
        messages.append({"role": "assistant", "content": c_text})
        rows.append({
            "turn": turn + 1, "responses_ttft_s": r_ttft, "chat_ttft_s": c_ttft,
            "responses_prompt": r_usage["input_tokens"],
            "responses_cached": r_usage["input_tokens_details"]["cached_tokens"],
            "chat_prompt": c_usage["prompt_tokens"],
            "chat_cached": c_usage["prompt_tokens_details"]["cached_tokens"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--model", default="tgi")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--opening-rules", type=int, default=0,
                        help="House rules before the opening: a long first prompt.")
    parser.add_argument("--out", default=None, help="Write the rows as JSON here.")
    args = parser.parse_args()
    preamble = rules(args.opening_rules)
    with httpx.Client(base_url=args.url.rstrip("/").removesuffix("/v1"), timeout=600) as client:
        trial(client, args.model, 2, 4)  # warm the routes once
        runs = [trial(client, args.model, args.turns, args.max_tokens, preamble)
                for _ in range(args.trials)]
    print("| turn | responses TTFT ms | chat TTFT ms | ratio | responses prompt / cached "
          "| chat prompt / cached |")
    print("|---:|---:|---:|---:|---:|---:|")
    summary = []
    for t in range(args.turns):
        rows = [run[t] for run in runs]
        r = statistics.median(row["responses_ttft_s"] for row in rows) * 1000
        c = statistics.median(row["chat_ttft_s"] for row in rows) * 1000
        last = rows[-1]
        print(f"| {t + 1} | {r:.1f} | {c:.1f} | {r / c:.2f} | {last['responses_prompt']} / "
              f"{last['responses_cached']} | {last['chat_prompt']} / {last['chat_cached']} |")
        summary.append({"turn": t + 1, "responses_ttft_ms": r, "chat_ttft_ms": c})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
