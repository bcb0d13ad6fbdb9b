#!/usr/bin/env python3
"""The Gaudi engine on the CPU device against the Xeon engine, in one run, in process.

Not a timed test: a measurement. It reports

1. warmup of the Gaudi engine (seconds, shapes, graphs compiled) with the
   seed's default bucket variables, and with the seed's Llama2-7B command
   (PREFILL_BATCH_BUCKET_SIZE=2, BATCH_BUCKET_SIZE=32,
   PAD_SEQUENCE_TO_MULTIPLE_OF=256, --max-input-length 1024
   --max-total-tokens 2048 --max-batch-prefill-tokens 2048
   --max-batch-total-tokens 65536);
2. output tokens/s and the median time to first token of both engines at
   each stream count (default 1 and 32), every stream a prompt of
   ``--prompt-tokens`` and ``--new-tokens`` greedy tokens, EOS ignored.

On a CPU the Gaudi engine is the test vehicle of an HPU design (padded
shapes, a cache row per sequence, dynamo-compiled graphs), not a CPU engine:
the numbers say what that design costs here, nothing about an HPU.

Usage: python benchmarks/gaudi_vs_xeon.py [--model DIR] [--streams 1,32] [--out FILE.json]
(without --model it builds the SmolLM2-135M shape with benchmarks/make_model.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from switchyard_spec import Engine, EngineConfig, EngineRequest, SamplingParams, StoppingParams

HERE = Path(__file__).resolve().parent
SEED_ENV = {"PREFILL_BATCH_BUCKET_SIZE": "2", "BATCH_BUCKET_SIZE": "32",
            "PAD_SEQUENCE_TO_MULTIPLE_OF": "256"}
SEED_LIMITS = dict(max_total_tokens=2048, max_batch_prefill_tokens=2048,
                   max_batch_total_tokens=65536)


def small_model(cache: Path) -> Path:
    """The SmolLM2-135M shape with random weights, built once into ``cache``."""
    folder = cache / "small"
    if not (folder / "config.json").exists():
        subprocess.run([sys.executable, str(HERE / "make_model.py"), "small", "--out",
                        str(cache)], check=True)
    return folder


def gaudi(model: Path, dtype: str, threads: int, env: dict[str, str], max_input: int,
          **limits: int) -> Engine:
    """A started Gaudi engine on the CPU device."""
    from switchyard_gaudi.engine import GaudiEngine

    options = {"device": "cpu", "num_threads": str(threads)}
    return GaudiEngine(EngineConfig(model_path=str(model), dtype=dtype, options=options,
                                    max_input_tokens=max_input, **limits), env=env)


def xeon(model: Path, dtype: str, threads: int, **limits: int) -> Engine:
    """A Xeon engine (prefix caching off: every prompt here is distinct anyway)."""
    from switchyard_xeon.engine import XeonEngine

    return XeonEngine(EngineConfig(model_path=str(model), dtype=dtype, options={
        "num_threads": str(threads), "prefix_caching": "false"}, **limits))


def warmup_row(name: str, engine: Engine) -> dict[str, object]:
    """Start and warm ``engine``; its warmup seconds, shapes and graphs compiled."""
    engine.start()
    report = engine.warmup()
    plan = getattr(engine, "plan", None)
    row = {"engine": name, "warmup_s": round(report.seconds, 2),
           "shapes": len(plan.shapes) if plan is not None else None,
           "graphs": getattr(engine, "compiles", None),
           "max_batch_total_tokens": report.max_batch_total_tokens}
    print(f"warmup {name}: {row}", flush=True)
    return row


def load(engine: Engine, streams: int, prompt_tokens: int, new_tokens: int,
         vocab: int) -> dict[str, float]:
    """``streams`` requests at once; output tokens/s and median time to first token."""
    done = threading.Barrier(streams + 1)
    first: dict[str, float] = {}
    count = [0]
    lock = threading.Lock()

    def sink_for(rid: str, sent: float):
        def sink(event) -> None:
            with lock:
                if rid not in first:
                    first[rid] = time.perf_counter() - sent
                if event.error is None and event.token_id >= 0:
                    count[0] += 1
            if event.finish_reason is not None or event.error is not None:
                threading.Thread(target=done.wait).start()
        return sink

    begin = time.perf_counter()
    for i in range(streams):
        prompt = tuple((97 * i + 13 * j) % (vocab - 100) + 50 for j in range(prompt_tokens))
        rid = f"s{i}-{begin}"
        engine.submit(EngineRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=new_tokens, ignore_eos=True)),
            sink_for(rid, time.perf_counter()))
    done.wait()
    seconds = time.perf_counter() - begin
    return {"tokens_per_s": round(count[0] / seconds, 1),
            "ttft_p50_s": round(statistics.median(first.values()), 3)}


def main() -> None:
    """Run both parts and print (and optionally write) the results."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "switchyard-bench")
    parser.add_argument("--streams", default="1,32")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--skip-seed-warmup", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or small_model(args.cache)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    streams = [int(s) for s in args.streams.split(",")]
    total = args.prompt_tokens + args.new_tokens
    limits = dict(max_total_tokens=total, max_batch_size=max(streams))
    results: dict[str, object] = {"model": str(model), "dtype": args.dtype,
                                  "threads": args.threads, "warmup": [], "load": []}
    engines = {
        "gaudi (seed defaults)": lambda: gaudi(model, args.dtype, args.threads, {},
                                               args.prompt_tokens, **limits),
        "xeon": lambda: xeon(model, args.dtype, args.threads, **limits),
    }
    for name, build in engines.items():
        engine = build()
        try:
            results["warmup"].append(warmup_row(name, engine))
            for n in streams:
                row = {"engine": name, "streams": n,
                       **load(engine, n, args.prompt_tokens, args.new_tokens, vocab)}
                print(f"load {row}", flush=True)
                results["load"].append(row)
            if hasattr(engine, "padding"):
                results["gaudi_padding"] = dict(engine.padding)
        finally:
            engine.shutdown()
    if not args.skip_seed_warmup:
        engine = gaudi(model, args.dtype, args.threads, SEED_ENV, 1024, **SEED_LIMITS)
        try:
            results["warmup"].append(warmup_row("gaudi (seed's Llama2 command)", engine))
        finally:
            engine.shutdown()
    print(json.dumps(results, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
