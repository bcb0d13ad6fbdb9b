"""Shared helpers for the kernel micro-benchmarks: the project's packages on
sys.path, the 135M model shape, and a header line with the load average
(the machine may be shared; compare variants from one run only).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
for sub in ("gateway", "spec", "plugins/xeon", "plugins/quant"):
    p = str(REPO / sub)
    if p not in sys.path:
        sys.path.insert(0, p)

# SmolLM2-135M shape: (out_features, in_features) of each linear of one layer.
SMALL = dict(hidden=576, inter=1536, layers=30, heads=9, kv_heads=3, head_dim=64, vocab=49152)


def layer_linears(cfg: dict = SMALL) -> dict[str, tuple[int, int]]:
    h, i, d = cfg["hidden"], cfg["inter"], cfg["head_dim"]
    return {
        "q": (cfg["heads"] * d, h), "k": (cfg["kv_heads"] * d, h), "v": (cfg["kv_heads"] * d, h),
        "o": (h, cfg["heads"] * d), "gate": (i, h), "up": (i, h), "down": (h, i),
    }


def load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def header(title: str) -> None:
    print(f"# {title}")
    print(f"# torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load {load()}, nice {os.nice(0)}")
