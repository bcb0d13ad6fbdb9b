#!/usr/bin/env python3
"""An agent client's first two turns, replayed from its own captured request.

Not a timed test: a measurement. Agent clients (the Codex CLI) resend the
whole conversation every turn (`store: false`), so what a server makes of
them is the first turn's prefill and how much of it the second turn reuses.

1. Capture: `--capture FILE --port P` listens on 127.0.0.1:P, writes the
   first `POST /v1/responses` body it gets to FILE and answers it with an
   error, so the client stops. Point the client at `http://127.0.0.1:P/v1`
   (for Codex: `-c 'model_providers.switchyard.base_url="http://127.0.0.1:P/v1"'`).
2. Replay: `--request FILE --url URL` sends that body to the server as turn 1
   (streamed, greedy unless the body sets `temperature`, `--max-output-tokens`
   tokens), then turn 2: the same input, turn 1's output items and one more
   user message, as the client would. Each trial gives the body a fresh random
   tag first, so trials do not share cached blocks.

Reported per turn: the median time to the first output event (text or a call)
over the trials, and the prompt and cached tokens the server counted (`usage`).

Usage:
  python benchmarks/agent_turns.py --capture /tmp/codex-first.json --port 18555
  CODEX_HOME=... codex exec --skip-git-repo-check -c '...base_url="http://127.0.0.1:18555/v1"' hi
  switchyard serve --dtype float32 &
  python benchmarks/agent_turns.py --request /tmp/codex-first.json --trials 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import httpx

FIRST_OUTPUT = ("response.output_text.delta", "response.output_item.added")


def capture(path: Path, port: int) -> None:
    """Write the first `POST /v1/responses` body that arrives to ``path``."""

    class Capture(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            if self.path.endswith("/responses") and not path.exists():
                path.write_bytes(body)
                print(f"captured {len(body)} bytes to {path}")
            self.send_response(400)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error":{"message":"captured","type":"invalid_request_error",'
                             b'"param":null,"code":null}}')

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    server = HTTPServer(("127.0.0.1", port), Capture)
    while not path.exists():
        server.handle_request()


def _turn(client: httpx.Client, body: dict[str, Any]) -> tuple[float, dict, list[Any]]:
    """(seconds to the first output event, usage, output items) of one streamed turn."""
    start = time.perf_counter()
    first = None
    event = ""
    with client.stream("POST", "/v1/responses", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                if event in FIRST_OUTPUT and first is None:
                    first = time.perf_counter()
                if event in ("response.completed", "response.incomplete"):
                    done = json.loads(line[len("data: "):])["response"]
                    return (first or time.perf_counter()) - start, done["usage"], done["output"]
    raise RuntimeError("the stream ended without response.completed")


def replay(url: str, request: dict[str, Any], trials: int, max_output: int) -> None:
    rows: dict[int, list[tuple[float, int, int]]] = {1: [], 2: []}
    with httpx.Client(base_url=url, timeout=1800) as client:
        for _ in range(trials):
            tag = {"type": "message", "role": "user",
                   "content": [{"type": "input_text", "text": f"[{uuid.uuid4().hex}]"}]}
            items = request["input"] if isinstance(request["input"], list) else [
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": request["input"]}]}]
            body = {"temperature": 0, **request, "input": [tag, *items], "stream": True,
                    "store": False, "max_output_tokens": max_output}
            seconds, usage, output = _turn(client, body)
            rows[1].append((seconds, usage["input_tokens"],
                            usage["input_tokens_details"]["cached_tokens"]))
            follow = {"type": "message", "role": "user",
                      "content": [{"type": "input_text", "text": "Thanks. And in one word?"}]}
            body = {**body, "input": [*body["input"], *output, follow]}
            seconds, usage, _ = _turn(client, body)
            rows[2].append((seconds, usage["input_tokens"],
                            usage["input_tokens_details"]["cached_tokens"]))
    print("| turn | time to first output (median) | prompt / cached tokens |")
    print("|---:|---:|---:|")
    for turn, values in rows.items():
        ttft = statistics.median(v[0] for v in values)
        print(f"| {turn} | {ttft * 1000:.0f} ms | {values[-1][1]:,} / {values[-1][2]:,} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capture", type=Path, help="write the first request body here")
    parser.add_argument("--port", type=int, default=18555)
    parser.add_argument("--request", type=Path, help="a captured request body to replay")
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--max-output-tokens", type=int, default=16)
    args = parser.parse_args()
    if args.capture is not None:
        capture(args.capture, args.port)
    elif args.request is not None:
        request = json.loads(args.request.read_text())
        request.pop("model", None)
        replay(args.url, request, args.trials, args.max_output_tokens)
    else:
        parser.error("give --capture FILE or --request FILE")


if __name__ == "__main__":
    main()
