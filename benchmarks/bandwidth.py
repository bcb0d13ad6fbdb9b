"""Memory bandwidth, measured with torch, and the batch-1 decode bound it implies.

Decoding one token at batch 1 reads every weight once (plus the KV cache so
far), and on a CPU that read, not arithmetic, sets the pace. So

    bound tokens/s = read bandwidth (bytes/s) / bytes read per decode step

The read bandwidth is measured STREAM-style in the same run as the peers: a
tensor far larger than the last-level cache is summed (pure read) and copied
(read + write), best of a few repetitions, with torch's own threads — the same
threads a torch engine decodes with.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

import msgspec

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class Bandwidth(msgspec.Struct, frozen=True):
    """GB/s (10^9 bytes per second), best of `repeats`."""

    read_gbs: float
    """`tensor.sum()`: bytes of the tensor / time."""
    copy_gbs: float
    """`dst.copy_(src)`: bytes read + bytes written / time."""
    size_mib: int
    threads: int
    repeats: int


class DecodeBound(msgspec.Struct, frozen=True):
    """What one batch-1 decode step must read, and the speed limit that follows."""

    weight_bytes: int
    kv_bytes: int
    """KV cache read per step at the mean context length of the benchmark."""
    tokens_per_s: float


def measure_bandwidth(size_mib: int = 1024, repeats: int = 5) -> Bandwidth:
    """Sum and copy a `size_mib` float32 tensor; report the best rate of each."""
    import torch

    n = size_mib * (1 << 20) // 4
    src = torch.ones(n, dtype=torch.float32)  # written once, so every page is really mapped
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    best_sum = best_copy = float("inf")
    src.sum()  # first touch of the reduction's code path and thread pool
    for _ in range(repeats):
        start = time.perf_counter()
        src.sum()
        best_sum = min(best_sum, time.perf_counter() - start)
        start = time.perf_counter()
        dst.copy_(src)
        best_copy = min(best_copy, time.perf_counter() - start)
    return Bandwidth(read_gbs=nbytes / best_sum / 1e9, copy_gbs=2 * nbytes / best_copy / 1e9,
                     size_mib=size_mib, threads=torch.get_num_threads(), repeats=repeats)


def safetensors_params(model_dir: Path) -> int:
    """Parameters stored in a model folder's safetensors files, read from their headers.

    A tied embedding / LM head is stored once, and a decode step reads it once
    (as the LM head; the embedding lookup reads one row), so stored = read.
    """
    total = 0
    for file in sorted(model_dir.glob("*.safetensors")):
        with file.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in info["shape"]:
                count *= dim
            total += count
    if total == 0:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return total


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int) -> int:
    """K and V for one token across all layers."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    layers = int(config["num_hidden_layers"])
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def decode_bound(model_dir: Path, bandwidth: Bandwidth, prompt_tokens: int, new_tokens: int,
                 dtype: str = "bfloat16", checkpoint_dtype: str | None = None) -> DecodeBound:
    """Batch-1 decode bound for a model folder served in `dtype`.

    Weights count at the narrower of `dtype` and the checkpoint's own dtype: a
    bf16 checkpoint served in fp32 holds no more information than its bf16
    bytes, so an engine that keeps them as bf16 reads only those.
    """
    size = _DTYPE_BYTES[dtype]
    config = json.loads((model_dir / "config.json").read_text())
    weight_size = min(size, _DTYPE_BYTES[checkpoint_dtype or dtype])
    weights = safetensors_params(model_dir) * weight_size
    mean_context = prompt_tokens + new_tokens // 2
    kv = kv_bytes_per_token(config, size) * mean_context
    return DecodeBound(weight_bytes=weights, kv_bytes=kv,
                       tokens_per_s=bandwidth.read_gbs * 1e9 / (weights + kv))


if __name__ == "__main__":
    print(msgspec.json.encode(measure_bandwidth()).decode())
