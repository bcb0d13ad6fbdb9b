"""Thread settings: OpenMP threads, wait policy and binding, with and without one competing busy thread.

The competitor is one Python process spinning (what the HTTP event loop or a
tokenizer looks like to the scheduler). Each configuration runs in a fresh
process (OpenMP reads its environment once) and times the 135M weight sweep
(oneDNN-packed bf16, gemv.py) at M=1 and M=32.

torch's OpenMP runtime here is GNU libgomp (torch/lib/libgomp.so.1): the
KMP_* variables of Intel's runtime do nothing; OMP_WAIT_POLICY, OMP_PROC_BIND,
OMP_PLACES and GOMP_SPINCOUNT are the knobs.

  nice -n 5 .venv/bin/python benchmarks/cpu_path/threads.py [--gate]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r"""
import json, statistics, sys, time, torch
sys.path.insert(0, %(here)r)
import gemv
from common import wait_idle
torch.set_num_threads(%(threads)d)
ws = gemv.make_weights(True, dtype=torch.float32)
items, call = gemv.v_mkldnn_bf16(ws)
res = {}
with torch.inference_mode():
    for m in (1, 32):
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16) for k in (576, 1536)}
        def sweep():
            for it, w in zip(items, ws):
                call(xs[w.shape[1]], it)
        sweep(); sweep()
        ts = []
        for _ in range(%(reps)d):
            if %(gate)r:
                wait_idle(0.4)  # the competitor takes one core: wait for the other to be free
            t0 = time.perf_counter(); sweep(); ts.append(time.perf_counter() - t0)
        res[m] = (statistics.median(ts) * 1e3, min(ts) * 1e3)
print(json.dumps(res))
"""

CONFIGS = {
    "1 thread": (1, {}),
    "2 threads": (2, {}),
    "2 threads, OMP_WAIT_POLICY=PASSIVE": (2, {"OMP_WAIT_POLICY": "PASSIVE"}),
    "2 threads, OMP_WAIT_POLICY=ACTIVE": (2, {"OMP_WAIT_POLICY": "ACTIVE"}),
    "2 threads, GOMP_SPINCOUNT=1000": (2, {"GOMP_SPINCOUNT": "1000"}),
    "2 threads, GOMP_SPINCOUNT=10000": (2, {"GOMP_SPINCOUNT": "10000"}),
    "2 threads, GOMP_SPINCOUNT=100000": (2, {"GOMP_SPINCOUNT": "100000"}),
    "2 threads, OMP_PROC_BIND=close OMP_PLACES=cores": (2, {"OMP_PROC_BIND": "close",
                                                            "OMP_PLACES": "cores"}),
    "2 threads, PROC_BIND=close + PASSIVE": (2, {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores",
                                                "OMP_WAIT_POLICY": "PASSIVE"}),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--gate", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--configs", nargs="+", help="substrings of config names to run")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    import common
    print(f"# thread settings; load {common.load()}")
    rows = []
    for competitor in (False, True):
        for name, (threads, env) in CONFIGS.items():
            if args.configs and not any(c in name for c in args.configs):
                continue
            spin = None
            if competitor:
                spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                code = CHILD % {"here": str(HERE), "threads": threads, "reps": args.reps,
                                "gate": args.gate and not competitor}
                out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                                     capture_output=True, text=True, check=True).stdout
            finally:
                if spin is not None:
                    spin.kill()
                    spin.wait()
            res = json.loads(out.strip().splitlines()[-1])
            rows.append(dict(config=name, competitor=competitor, m1=res["1"], m32=res["32"]))
            print(f"{name:48s} competitor={'yes' if competitor else 'no ':3s}  "
                  f"M=1 {res['1'][0]:7.2f} ms (min {res['1'][1]:6.2f})   "
                  f"M=32 {res['32'][0]:7.2f} ms (min {res['32'][1]:6.2f})", flush=True)
    print(f"# load after: {common.load()}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
