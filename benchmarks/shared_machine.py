#!/usr/bin/env python3
"""Time per token on a machine the server shares: alone, then beside busy processes.

Not a timed test: a measurement. Against one running server, a single
greedy stream's median gap between tokens (after the first few) is taken
with the machine otherwise idle, then again while `--busy N` Python
processes spin on the CPU. The ratio says what the neighbours cost: a server
whose threads yield gracefully slows by at most the share of cores the
neighbours take (2x for one busy process on 2 cores); threads that spin in
lock-step while a neighbour holds one of their cores lose more.

Usage:
  switchyard serve &                                   # the default model
  python benchmarks/shared_machine.py --url http://127.0.0.1:8080 --busy 1
  switchyard serve --engine-option num_threads=1 &     # the same, one engine thread
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import httpx


def _gap_ms(url: str, tokens: int) -> float:
    """The median time between streamed tokens of one greedy completion, in ms."""
    body = {"prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times: list[float] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times[8:], times[9:])]  # past the first tokens' warm-up
    return statistics.median(gaps) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--busy", type=int, default=1, help="busy processes beside the server")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--trials", type=int, default=2)
    args = parser.parse_args()
    _gap_ms(args.url, 16)  # warm
    idle = min(_gap_ms(args.url, args.tokens) for _ in range(args.trials))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    try:
        time.sleep(2.5)  # the neighbours run, and the engine has seen them (two 1 s windows)
        busy = min(_gap_ms(args.url, args.tokens) for _ in range(args.trials))
    finally:
        for hog in hogs:
            hog.kill()
    cpus = len(os.sched_getaffinity(0))
    print(f"{cpus} CPUs; {args.busy} busy process(es)")
    print(f"alone: {idle:.1f} ms/token; beside them: {busy:.1f} ms/token; "
          f"ratio {busy / idle:.2f} (their share of the cores: {args.busy}/{cpus})")


if __name__ == "__main__":
    main()
