"""An adapter as one flat buffer and a table of where each module's matrices lie in it.

The form a native kernel reads (the Xeon engine's ``kernels/lora.cpp``): one
1-D tensor of fp32 or bf16 numbers per adapter, and an int64 table
[layers, projections, PARTS, FIELDS] whose row for part ``p`` of
projection ``j`` in layer ``i`` is

    (a_offset, b_offset, rank, col_start, col_end)

- ``a_offset``: where A [rank, in] starts, row-major (each row one rank's
  weights over the projection's input: a contiguous dot product);
- ``b_offset``: where ``(B * scaling).T`` [rank, col_end - col_start]
  starts, row-major (each row one rank's contribution to the part's output
  columns: a contiguous multiply-add);
- ``rank`` 0 for a part the adapter leaves alone;
- ``col_start .. col_end``: the part's columns of the (fused) projection's output.

Scaling is folded into B once, here. Only each module's own rank is
stored: no padding, so a step reads exactly the adapter's numbers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from switchyard_engine.lora.folder import LoraAdapter
from switchyard_engine.lora.grouped import Layout

PARTS = 3
"""Parts per projection the table holds (q|k|v is the most: three modules)."""
FIELDS = 5
"""Numbers per part: a_offset, b_offset, rank, col_start, col_end."""


@dataclass(frozen=True)
class FlatAdapter:
    """One adapter in the native kernel's form; see the module docstring."""

    weights: torch.Tensor
    """1-D fp32 or bf16: every adapted part's A then (B * scaling).T."""
    table: torch.Tensor
    """int64 [layers, projections, PARTS, FIELDS]."""


def flatten(adapter: LoraAdapter, layouts: Mapping[tuple[int, str], Layout],
            projections: Sequence[str], layers: int, dtype: torch.dtype = torch.float32
            ) -> FlatAdapter:
    """``adapter`` over a model of ``layers`` layers whose projections are ``projections``.

    ``layouts[(layer, projection)]`` says which module owns which output
    columns; a projection with more than :data:`PARTS` parts is an error
    (no Llama-family layout has one).
    """
    table = torch.zeros(layers, len(projections), PARTS, FIELDS, dtype=torch.long)
    chunks: list[torch.Tensor] = []
    offset = 0
    for layer in range(layers):
        for j, projection in enumerate(projections):
            layout = layouts.get((layer, projection), ())
            if len(layout) > PARTS:
                raise ValueError(f"{projection} has {len(layout)} parts; the table holds {PARTS}")
            for p, part in enumerate(layout):
                module = adapter.modules.get(part.module)
                if module is None:
                    continue
                a = module.a.contiguous().view(-1)
                bt = (module.b * module.scaling).t().contiguous().view(-1)
                table[layer, j, p] = torch.tensor(
                    [offset, offset + a.numel(), module.rank, part.start, part.end])
                chunks += [a, bt]
                offset += a.numel() + bt.numel()
    weights = torch.cat(chunks) if chunks else torch.zeros(0)
    return FlatAdapter(weights=weights.to(dtype).contiguous(), table=table)
