"""A step's LoRA rows for the native kernel (``kernels/lora.cpp``): rows grouped by adapter.

:class:`NativeLora` is what the decoder gets in ``StepMetadata.lora`` when
the engine's adapters run natively: the step's adapter rows listed group
by group, and each group's adapter as a flat buffer and table
(:mod:`switchyard_engine.lora.flat`). A step of decode rows hands the four
to ``decode_layers``, which adds the deltas after each projection inside
its one-call layer loop; the Python layer loop (prefill and mixed steps)
calls :meth:`NativeLora.add_` per projection, the same kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from switchyard_engine.lora.layouts import PROJECTIONS

PROJECTION_INDEX = {name: index for index, name in enumerate(PROJECTIONS)}
"""The kernel's projection numbers: q|k|v 0, o 1, gate|up 2, down 3."""


@dataclass
class NativeLora:
    """A step's adapter rows and adapters in the native kernel's form; see the module."""

    rows: torch.Tensor
    """int64 [n]: the packed rows that run an adapter, group by group."""
    starts: torch.Tensor
    """int64 [groups + 1]: group g's rows are ``rows[starts[g]:starts[g + 1]]``."""
    weights: list[torch.Tensor]
    """Each group's adapter as a flat fp32 or bf16 buffer."""
    tables: list[torch.Tensor]
    """Each group's table of offsets, ranks and columns (int64 [layers, 4, 3, 5])."""
    _blocks: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False)

    def add_(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor,
             rows: slice | None = None) -> None:
        """``out += delta`` over ``x`` for ``projection`` in ``layer`` (``rows``: a row block
        of the step, ``x`` and ``out`` holding only its rows; None for all rows)."""
        listed, starts = (self.rows, self.starts) if rows is None else self._block(rows)
        torch.ops.switchyard_xeon.lora_add_(x, out, listed, starts, self.weights, self.tables,
                                            layer, PROJECTION_INDEX[projection])

    def _block(self, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """The listed rows inside ``rows``, renumbered from its start, and their group starts."""
        key = (rows.start or 0, rows.stop)
        found = self._blocks.get(key)
        if found is None:
            begin, end = key
            inside = (self.rows >= begin) & (self.rows < end)
            counts = [int(inside[a:b].sum()) for a, b in zip(self.starts[:-1].tolist(),
                                                             self.starts[1:].tolist(),
                                                             strict=True)]
            starts = torch.tensor([0, *counts], dtype=torch.long).cumsum(0)
            found = self._blocks[key] = ((self.rows[inside] - begin).contiguous(), starts)
        return found
