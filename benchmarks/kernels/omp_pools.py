"""One decode step's matmuls timed with one OpenMP pool in the process, and with two.

libgomp keeps a pool of worker threads per thread that runs parallel regions.
When the main thread has run one (loading and packing weights, say) and the
engine's compute thread then runs its own, the process holds two pools; with
more OpenMP threads than cores libgomp stops spinning between regions and
puts workers to sleep, and every small region pays for waking them. This is
why ``XeonEngine`` loads the model on its compute thread.

Each mode runs in a fresh process (a pool cannot be taken back):

- ``one``: weights packed and swept on one thread (what the engine does);
- ``two``: weights packed on the main thread, swept on a second thread.

    .venv/bin/python benchmarks/kernels/omp_pools.py --rounds 3

The sweep is every linear of the 135M shape at one row (a batch-1 decode
step's matmuls), on the bf16 dot-product panels where the CPU has AVX512_BF16
and on the fp32 panels otherwise; best of 20 sweeps per process.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time

import torch
from common import SMALL, header, layer_linears  # also puts the project's packages on sys.path

from switchyard_xeon.kernels import load_kernels


def sweep_ms(packed: list[tuple[torch.Tensor, int, int]], repeats: int = 20) -> float:
    """Best time of ``repeats`` sweeps over every packed weight at one row, in ms."""
    inputs = {k: torch.randn(1, k) for _, _, k in packed}
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for weight, n, k in packed:
            torch.ops.switchyard_xeon.panel_linear(inputs[k], weight, None, n)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def pack_step() -> list[tuple[torch.Tensor, int, int]]:
    """The 135M shape's linears (q|k|v and gate|up fused) and LM head, packed as the engine does."""
    status = load_kernels()
    assert status.fn is not None, status.reason
    ops = torch.ops.switchyard_xeon
    pack = ops.pack_panels_bf16_dot if status.bf16_dot else (
        lambda w: ops.pack_panels(w.bfloat16()))
    shapes = layer_linears(SMALL)
    hidden = SMALL["hidden"]
    layer = [(shapes["q"][0] + shapes["k"][0] + shapes["v"][0], hidden), shapes["o"],
             (2 * shapes["gate"][0], hidden), shapes["down"]]
    weights = layer * SMALL["layers"] + [(SMALL["vocab"], hidden)]
    return [(pack(torch.randn(n, k) * 0.02), n, k) for n, k in weights]


def run_mode(mode: str) -> float:
    """One process's measurement (see the module docstring)."""
    threads = torch.get_num_threads()
    if mode == "two":
        packed = pack_step()  # parallel regions on the main thread: its pool exists now
    result: dict[str, float] = {}

    def compute() -> None:
        torch.set_num_threads(threads)  # OpenMP settings are per thread
        result["ms"] = sweep_ms(packed if mode == "two" else pack_step())

    thread = threading.Thread(target=compute)
    thread.start()
    thread.join()
    return result["ms"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", choices=["one", "two"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:  # a child process: print the one number
        print(f"{run_mode(args.mode):.3f}")
        return
    header("omp_pools")
    times: dict[str, list[float]] = {"one": [], "two": []}
    for _ in range(args.rounds):  # alternate, so drift hits both modes alike
        for mode in times:
            out = subprocess.run([sys.executable, __file__, "--mode", mode], check=True,
                                 capture_output=True, text=True).stdout
            times[mode].append(float(out.strip().splitlines()[-1]))
    for mode, values in times.items():
        print(f"{mode} pool{'s' if mode == 'two' else ''}: "
              + ", ".join(f"{v:.1f}" for v in values) + " ms per sweep")


if __name__ == "__main__":
    main()
