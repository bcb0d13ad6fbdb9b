"""The static KV cache: one contiguous row of ``max_total_tokens`` per sequence, per layer.

Layout, per layer: keys and values of shape ``[rows + 1, kv_heads,
max_total_tokens, head_dim]``. Row ``r`` belongs to one running sequence for
its whole life, and column ``t`` holds its token ``t``; the extra last row is
scratch, written by the padding rows of a prefill batch. This is the old
tgi-gaudi layout (a cache padded to ``MAX_TOTAL_TOKENS``): every shape the
device runs depends only on bucket sizes, never on a sequence's length, a
sequence never runs out of cache once admitted (no preemption), and no block
table is gathered per step. It reserves a full row per sequence, which
docs/gaudi.md weighs against a paged cache.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    """Per-layer key and value tensors of ``rows`` sequences (plus a scratch row)."""

    def __init__(self, num_layers: int, rows: int, kv_heads: int, length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (rows + 1, kv_heads, length, head_dim)
        self.rows = rows
        self.length = length
        self.dtype = dtype
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def scratch_row(self) -> int:
        """The row padding rows write to: no sequence reads it."""
        return self.rows

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def move(self, src: int, dst: int, columns: int) -> None:
        """Copy the first ``columns`` tokens of row ``src`` into row ``dst``, every layer."""
        for layer in (*self.keys, *self.values):
            layer[dst, :, :columns].copy_(layer[src, :, :columns])
