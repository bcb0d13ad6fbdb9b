#!/usr/bin/env python3
"""The Gaudi engine on the CPU device, unsharded and with `--num-shard 2` (AutoTP over gloo).

Not a timed test: a measurement of what sharding costs and changes on the
CPU stand-in. For one rank and for two it reports

1. start-up (rank 0 loads; with two ranks the follower process starts, joins
   the gloo group and loads its copy meanwhile) and warmup (seconds, shapes,
   graphs compiled on rank 0 and on rank 1);
2. the largest absolute difference between the two runs' logits for one
   prefill of a fixed prompt (float32);
3. the median decode step and output tokens/s of ``--streams`` greedy streams
   of ``--prompt-tokens`` + ``--new-tokens`` tokens, EOS ignored.

Every rank runs ``--threads`` intra-op threads. On a CPU two ranks share one
machine's cores and memory bandwidth and talk over loopback TCP: the numbers
say what the design costs here, nothing about HPUs linked by HCCL.

Usage: python benchmarks/gaudi_sharding.py [--model DIR] [--threads 1] [--streams 4]
(without --model: the gateway's embedded tiny Llama, built into /tmp/switchyard-bench).
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import torch
from switchyard_spec import EngineConfig, EngineRequest, SamplingParams, StoppingParams

ENV = {"PAD_SEQUENCE_TO_MULTIPLE_OF": "32", "PREFILL_BATCH_BUCKET_SIZE": "2",
       "BATCH_BUCKET_SIZE": "4"}


def run(model: Path, ranks: int, args: argparse.Namespace) -> dict[str, object]:
    """Start, warm, score one prompt and decode the streams on ``ranks`` ranks."""
    from switchyard_gaudi.engine import GaudiEngine

    total = args.prompt_tokens + args.new_tokens
    config = EngineConfig(model_path=str(model), dtype="float32", num_shard=ranks,
                          max_total_tokens=total, max_input_tokens=args.prompt_tokens,
                          max_batch_size=args.streams, max_batch_prefill_tokens=2 * 64,
                          options={"device": "cpu", "num_threads": str(args.threads)})
    engine = GaudiEngine(config, env=dict(ENV))
    begin = time.perf_counter()
    engine.start()
    started = time.perf_counter() - begin
    warm = engine.warmup().seconds
    shapes = len(engine.plan.shapes)  # type: ignore[union-attr]
    compiled = [engine.compiles, *engine.follower_compiles()]
    ids = torch.tensor([[(7 * i + 3) % 1000 + 10 for i in range(args.prompt_tokens)]])
    with torch.inference_mode():  # the loop is idle: this thread drives the ranks meanwhile
        logits, _ = engine._runner.forward_prefill(  # type: ignore[union-attr]
            ids, torch.tensor([0]), torch.tensor([args.prompt_tokens - 1]))
    steps: list[float] = []
    engine.set_step_observer(lambda r: steps.append(r.seconds) if r.method == "decode" else None)
    ended: list[str] = []
    done = threading.Event()

    def sink(event: object) -> None:
        if getattr(event, "finish_reason", None) is not None or getattr(event, "error", None):
            ended.append(str(getattr(event, "request_id", "")))
            if len(ended) == args.streams:
                done.set()

    begin = time.perf_counter()
    for s in range(args.streams):
        engine.submit(EngineRequest(
            request_id=f"s{s}", prompt_token_ids=tuple(int(t) + s for t in ids[0]),
            sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=args.new_tokens, ignore_eos=True)), sink)
    done.wait(timeout=600)
    wall = time.perf_counter() - begin
    engine.shutdown()
    return {"ranks": ranks, "start_s": started, "warmup_s": warm, "shapes": shapes,
            "compiled": compiled, "logits": logits[0].clone(),
            "decode_step_ms": 1000 * statistics.median(steps),
            "tokens_per_s": args.streams * args.new_tokens / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    model = args.model
    if model is None:
        from switchyard.models.random_model import ensure_random_model

        model = ensure_random_model(Path("/tmp/switchyard-bench"))
    results = [run(model, ranks, args) for ranks in (1, 2)]
    diff = float((results[1]["logits"] - results[0]["logits"]).abs().max())  # type: ignore
    for r in results:
        print(f"ranks {r['ranks']}: start {r['start_s']:.1f}s, warmup {r['warmup_s']:.1f}s for "
              f"{r['shapes']} shapes (graphs compiled per rank: {r['compiled']}), decode step "
              f"{r['decode_step_ms']:.1f} ms (median, {args.streams} streams), "
              f"{r['tokens_per_s']:.0f} tokens/s")
    print(f"largest |logit difference|, one prefill, 1 rank vs 2: {diff:.2e}")


if __name__ == "__main__":
    main()
