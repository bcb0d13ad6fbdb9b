"""The Xeon engine in process, one configuration against another, in the same run.

For each engine configuration (``--variant name=key=value,key=value``; the
keys are ``--engine-option`` keys, and ``quantize``), start a real ``XeonEngine`` on a model
folder, submit waves of N greedy requests (``--prompt-tokens`` prompt,
exactly ``--new-tokens`` new tokens), and report output tokens/s, mean ms per
decode step and time to first token. Configurations run one after another in
rounds (each round runs every variant once, each in a fresh process: two
engines in one process would share the cores between two OpenMP pools), so a
machine that gets busier mid-run skews all of them alike; the table keeps the
best round of each.

    .venv/bin/python benchmarks/engine_paths.py --model /tmp/bench-models/small \\
        --streams 1 32 --variant stock=linears=stock,attention=sdpa --variant fast=

No HTTP: this isolates the engine's forward path (kernels, linears, per-step
Python). ``benchmarks/compare_peers.py`` measures the whole server against peers.
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

ROOT = Path(__file__).resolve().parents[1]
for sub in ("gateway", "spec", "plugins/xeon", "plugins/quant"):
    sys.path.insert(0, str(ROOT / sub))

from switchyard_spec import (  # noqa: E402
    EngineConfig,
    EngineRequest,
    SamplingParams,
    StoppingParams,
    TokenEvent,
)
from switchyard.plugins import PluginHost  # noqa: E402
from switchyard_xeon.engine import XeonEngine  # noqa: E402


def run_wave(engine: XeonEngine, streams: int, prompt: int, new: int, vocab: int,
             tag: str) -> dict[str, float]:
    """Submit ``streams`` requests at once; wait for all; timings of the wave."""
    # The sink runs on the engine's thread: it must never block, or the engine stalls.
    done = threading.Semaphore(0)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    counts: dict[str, int] = {}

    def sink(event: TokenEvent) -> None:
        now = time.perf_counter()
        rid = event.request_id
        if event.token_id >= 0:
            first.setdefault(rid, now)
            last[rid] = now
            counts[rid] = counts.get(rid, 0) + 1
        if event.finish_reason is not None or event.error is not None:
            if event.error:
                print(f"  {rid}: {event.error}", file=sys.stderr)
            done.release()

    start = time.perf_counter()
    for i in range(streams):
        ids = tuple((7 + 31 * i + 17 * j) % (vocab - 3) + 3 for j in range(prompt))
        engine.submit(EngineRequest(
            request_id=f"{tag}-{i}", prompt_token_ids=ids, sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=new, ignore_eos=True), logprobs=False,
        ), sink)
    for _ in range(streams):
        done.acquire()
    end = max(last.values())
    tokens = sum(counts.values())
    decode = [(last[r] - first[r]) / max(1, counts[r] - 1) for r in first]
    return {
        "tok_s": tokens / (end - start),
        "step_ms": 1000 * statistics.median(decode),
        "ttft_ms": 1000 * statistics.median(v - start for v in first.values()),
    }


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``name=key=value,key=value`` -> (name, options); ``env.NAME=value`` keys set an
    environment variable of the variant's process instead (e.g.
    ``env.SWITCHYARD_XEON_ISA=avx2``)."""
    name, _, rest = text.partition("=")
    options = dict(item.split("=", 1) for item in rest.split(",") if item)
    return name, options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--variant", action="append", required=True)
    parser.add_argument("--one", action="store_true",
                        help="(internal) run one variant, one round, print JSON rows")
    args = parser.parse_args()
    if args.one:
        measure_one(args)
        return
    # Each variant runs in a process of its own, one round at a time: two engines in one
    # process are two compute threads with an OpenMP pool each, and libgomp then makes
    # both pools sleep between parallel regions (benchmarks/kernels/omp_pools.py).
    best: dict[tuple[str, int], dict[str, float]] = {}
    for r in range(args.rounds):
        for text in args.variant:
            name = parse_variant(text)[0]
            argv = [sys.executable, __file__, "--one", "--variant", text, "--model", args.model,
                    "--dtype", args.dtype, "--prompt-tokens", str(args.prompt_tokens),
                    "--new-tokens", str(args.new_tokens), "--streams",
                    *map(str, args.streams)]
            env = {**os.environ, **{key.removeprefix("env."): value for key, value
                                    in parse_variant(text)[1].items() if key.startswith("env.")}}
            out = subprocess.run(argv, check=True, capture_output=True, text=True,
                                 env=env).stdout
            for line in out.splitlines():
                if not line.startswith("{"):
                    continue
                row = json.loads(line)
                key = (name, int(row["streams"]))
                if key not in best or row["tok_s"] > best[key]["tok_s"]:
                    best[key] = row
                print(f"round {r} {name:>10} streams {row['streams']:>3}: {row['tok_s']:7.1f} "
                      f"tok/s step {row['step_ms']:6.1f} ms ttft {row['ttft_ms']:7.0f} ms "
                      f"(load {os.getloadavg()[0]:.1f})", flush=True)
    print("\n| variant | streams | tok/s | decode ms/step | TTFT p50 ms |\n|---|---:|---:|---:|---:|")
    for (name, streams), row in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"| {name} | {streams} | {row['tok_s']:.1f} | {row['step_ms']:.1f} | "
              f"{row['ttft_ms']:.0f} |")


def measure_one(args: argparse.Namespace) -> None:
    """In this process: start the one variant's engine, run each wave once, print JSON rows."""
    name, options = parse_variant(args.variant[0])
    options = {k: v for k, v in options.items() if not k.startswith("env.")}  # set already
    quantize = options.pop("quantize", None)  # an EngineConfig field, not an option
    # The method as `switchyard serve` finds it: from the installed plugins, for this engine.
    host = PluginHost.from_entry_points()
    quantization = host.resolve_quantization(quantize, host.engines()["xeon"])
    engine = XeonEngine(EngineConfig(model_path=args.model, dtype=args.dtype,
                                     max_total_tokens=args.prompt_tokens + args.new_tokens,
                                     quantize=quantize, quantization=quantization,
                                     options=options))
    engine.start()
    try:
        engine.warmup()
        vocab = engine.info.vocab_size  # type: ignore[union-attr]
        for streams in args.streams:
            row = run_wave(engine, streams, args.prompt_tokens, args.new_tokens, vocab,
                           f"{name}-{streams}")
            print(json.dumps({"streams": streams, **row}), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
