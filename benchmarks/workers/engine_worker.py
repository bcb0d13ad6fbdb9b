"""The Xeon engine in process, without the HTTP server: the peer llama.cpp's batch 1 is.

llama.cpp's one-stream row runs in its own process with no server in front,
so this worker gives Switchyard's engine the same terms: same prompts, greedy,
EOS ignored, every request submitted at once per wave, tokens stamped as the
engine emits them.

    python engine_worker.py --model DIR --prompts prompts.json --streams 1,8 \
        --new-tokens 128 --dtype float32

Prints one JSON record per wave on stdout (format in
`benchmarks/results.py:from_worker`).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from itertools import pairwise
from typing import Any

from switchyard_spec import (
    EngineConfig,
    EngineRequest,
    SamplingParams,
    StoppingParams,
    TokenEvent,
)
from switchyard_xeon.engine import XeonEngine
from transformers import AutoTokenizer


def run_wave(engine: XeonEngine, prompts: list[list[int]], streams: int, new_tokens: int,
             tag: str) -> dict[str, Any]:
    """Submit ``streams`` requests at once and stamp every token each one gets."""
    stamps: dict[str, list[float]] = {f"{tag}-{i}": [] for i in range(streams)}
    errors: dict[str, str] = {}
    finished = threading.Semaphore(0)

    def sink(event: TokenEvent) -> None:  # runs on the engine thread: never block here
        if event.token_id >= 0:
            stamps[event.request_id].append(time.perf_counter())
        if event.error is not None:
            errors[event.request_id] = event.error
        if event.finish_reason is not None or event.error is not None:
            finished.release()

    start = time.perf_counter()
    for i in range(streams):
        engine.submit(EngineRequest(
            request_id=f"{tag}-{i}", prompt_token_ids=tuple(prompts[i % len(prompts)]),
            sampling=SamplingParams(), logprobs=False,
            stopping=StoppingParams(max_new_tokens=new_tokens, ignore_eos=True),
        ), sink)
    for _ in range(streams):
        finished.acquire()
    requests = []
    for rid, times in stamps.items():
        if rid in errors or not times:
            requests.append({"error": errors.get(rid, "no tokens"), "output_tokens": 0})
            continue
        requests.append({"ttft_s": times[0] - start, "itl_s": [b - a for a, b in pairwise(times)],
                         "e2e_s": times[-1] - start, "output_tokens": len(times)})
    ends = [times[-1] for times in stamps.values() if times]
    return {"streams": streams, "wall_s": (max(ends) - start) if ends else 0.0,
            "requests": requests}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSON list of prompt strings")
    parser.add_argument("--streams", required=True, help="wave sizes, e.g. 1,8,32")
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()

    with open(args.prompts) as fh:
        texts: list[str] = json.load(fh)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    longest = max(map(len, prompts))
    # No prefix cache: every wave reuses the same prompts, which the cache would
    # otherwise serve from the previous wave (the other peers get no such help).
    engine = XeonEngine(EngineConfig(model_path=args.model, dtype=args.dtype,
                                     max_total_tokens=longest + args.new_tokens,
                                     options={"prefix_caching": "false"}))
    engine.start()
    engine.warmup()
    try:
        for streams in (int(s) for s in args.streams.split(",")):
            print(json.dumps(run_wave(engine, prompts, streams, args.new_tokens,
                                      f"w{streams}")), flush=True)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
