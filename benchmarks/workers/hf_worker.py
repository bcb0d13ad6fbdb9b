"""transformers in-process: `generate` (static batches) or `generate_batch` (continuous batching).

Run as a script in its own process, so the orchestrator can bound it with a
timeout and so its torch state cannot touch the next peer:

    python hf_worker.py --mode generate --model DIR --prompts prompts.json \
        --streams 1,8 --new-tokens 128 --dtype bfloat16

It prints one JSON record per batch size on stdout as soon as that size is
done (format in `benchmarks/results.py:from_worker`). EOS is ignored so every
request produces exactly `--new-tokens` tokens, as on the HTTP peers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from itertools import pairwise
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    ContinuousBatchingConfig,
    GenerationConfig,
)
from transformers.generation.streamers import BaseStreamer


class StepClock(BaseStreamer):
    """Stamps the time of every decoding step; `generate` calls `put` once per step.

    The first `put` carries the prompt, not a generated token, so it is skipped.
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _request(start: float, stamps: list[float], tokens: int) -> dict[str, Any]:
    """One request's timing from its token timestamps."""
    if not stamps:
        return {"error": "no tokens", "output_tokens": 0}
    return {"ttft_s": stamps[0] - start,
            "itl_s": [b - a for a, b in pairwise(stamps)],
            "e2e_s": stamps[-1] - start, "output_tokens": tokens}


def run_generate(model: Any, tok: Any, prompts: list[str], streams: int,
                 new_tokens: int) -> dict[str, Any]:
    """One `generate` call over `streams` left-padded prompts; all share step times."""
    batch = tok(prompts[:streams], return_tensors="pt", padding=True)
    clock = StepClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, streamer=clock, pad_token_id=tok.pad_token_id)
    wall = time.perf_counter() - start
    made = int(out.shape[1] - batch["input_ids"].shape[1])
    return {"streams": streams, "wall_s": wall,
            "requests": [_request(start, clock.times, made) for _ in range(streams)]}


def run_generate_batch(model: Any, tok: Any, prompts: list[str], streams: int,
                       new_tokens: int) -> dict[str, Any]:
    """One `generate_batch` call; the manager stamps each request's tokens itself."""
    inputs = [tok(p)["input_ids"] for p in prompts[:streams]]
    # eos_token_id=-1 is the manager's "no EOS"; None would fall back to the model's EOS.
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                              pad_token_id=tok.pad_token_id)
    # Sized for this wave: left to itself on a CPU the manager guesses the KV cache from
    # free memory and spends tens of seconds zeroing gigabytes it never uses.
    page = 256
    pages_per_request = -(-(max(map(len, inputs)) + new_tokens) // page)
    cb_config = ContinuousBatchingConfig(page_size=page, num_blocks=streams * pages_per_request + 4,
                                         max_batch_tokens=2048)
    outputs = model.generate_batch(inputs=inputs, generation_config=config,
                                   continuous_batching_config=cb_config, record_timestamps=True,
                                   progress_bar=False, warmup=False)
    requests, first, last = [], float("inf"), 0.0
    for output in outputs.values():
        stamps = list(output.timestamps or [])
        if output.error is not None or not stamps:
            requests.append({"error": str(output.error or "no tokens"), "output_tokens": 0})
            continue
        # created_time: when the request entered the manager, after the manager's set-up,
        # which a server pays once at start and not per request.
        first, last = min(first, output.created_time), max(last, stamps[-1])
        requests.append(_request(output.created_time, stamps, len(output.generated_tokens)))
    missing = streams - len(requests)
    requests += [{"error": "no result returned", "output_tokens": 0}] * missing
    wall = last - first if last else 0.0
    return {"streams": streams, "wall_s": wall, "requests": requests}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["generate", "generate_batch"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True, help="JSON list of prompt strings")
    parser.add_argument("--streams", required=True, help="batch sizes, e.g. 1,8,32")
    parser.add_argument("--new-tokens", type=int, required=True)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()

    with open(args.prompts) as fh:
        prompts: list[str] = json.load(fh)
    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model.eval()
    run = run_generate if args.mode == "generate" else run_generate_batch
    run(model, tok, prompts, 1, 4)  # warm up kernels and allocator before anything is timed
    for streams in (int(s) for s in args.streams.split(",")):
        try:
            record = run(model, tok, prompts, streams, args.new_tokens)
        except Exception as exc:  # noqa: BLE001 - one failed size must not hide the others
            record = {"streams": streams, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
