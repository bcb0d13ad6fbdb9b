"""Each row's adapter over a (fused) projection: the grouped low-rank product.

A step's rows belong to groups, one per adapter present in the step (group
-1 is the base model: no delta). For a projection ``out = x @ W.T`` the
delta of a row in group ``g`` whose adapter adapts module ``m`` is
``scaling * (x @ A.T) @ B.T``, added to the columns of ``out`` that ``m``
owns (a fused q|k|v or gate|up output holds several modules side by side).

Two ways to compute it, both in fp32 whatever the base's dtype or
quantization (the delta is added to ``out`` at the end):

- :func:`add_stacked` (the default): every group's A matrices are stacked
  into one [R, in] matrix, so the shrink is one matmul for all rows; each
  row keeps only its own group's columns (a 0/1 mask: block-diagonal by
  group), and each module's expand is one ``addmm`` over its columns. The
  other groups' columns cost arithmetic, not calls: at decode sizes a call
  costs more than the few thousand multiply-adds it would save.
- :func:`add_looped` (the plain PyTorch-ops path, as vLLM's CPU path and
  TGI's fallback do it): per group and module, gather the rows, shrink,
  expand, scale and scatter them back. Kept to measure against.

Scaling is folded into the stacked B (``B * scaling``) once per stack.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from switchyard_engine.lora.folder import LoraAdapter


@dataclass(frozen=True)
class Part:
    """One module's share of a projection's output: columns ``start .. end``."""

    module: str
    """The module path adapters name, e.g. ``model.layers.3.self_attn.k_proj``."""
    start: int
    end: int


Layout = tuple[Part, ...]
"""A projection's parts in output order (one part for an unfused projection)."""


@dataclass(frozen=True)
class Expand:
    """One part's expand: columns ``cols`` of the shrunk rows times ``bt`` go to ``start .. end``."""

    start: int
    end: int
    cols: slice
    bt: torch.Tensor
    """fp32 [len(cols), end - start]: the groups' ``(B * scaling).T`` stacked along rows."""


@dataclass(frozen=True)
class Stacked:
    """One projection's adapters, stacked for :func:`add_stacked`."""

    a: torch.Tensor
    """fp32 [R, in]: every group's A of every part, part by part."""
    owner: torch.Tensor
    """int64 [1, R]: the group each of the R columns belongs to."""
    expands: tuple[Expand, ...]


def stack(adapters: Sequence[LoraAdapter], layout: Layout) -> Stacked | None:
    """Stack ``adapters`` (group ``g`` is ``adapters[g]``) over ``layout``; None if none adapts it."""
    a_parts: list[torch.Tensor] = []
    owners: list[int] = []
    expands: list[Expand] = []
    col = 0
    for part in layout:
        bts = []
        begin = col
        for group, adapter in enumerate(adapters):
            module = adapter.modules.get(part.module)
            if module is None:
                continue
            a_parts.append(module.a)
            bts.append((module.b * module.scaling).t())
            owners.extend([group] * module.rank)
            col += module.rank
        if bts:
            expands.append(Expand(part.start, part.end, slice(begin, col),
                                  torch.cat(bts).contiguous()))
    if not a_parts:
        return None
    return Stacked(a=torch.cat(a_parts).contiguous(),
                   owner=torch.tensor(owners, dtype=torch.long).unsqueeze(0),
                   expands=tuple(expands))


def add_stacked(x: torch.Tensor, out: torch.Tensor, stacked: Stacked, groups: torch.Tensor
                ) -> None:
    """``out += delta`` for rows ``x`` [T, in] of groups ``groups`` (int64 [T, 1]); see module."""
    shrunk = x.float() @ stacked.a.t()
    shrunk.mul_(stacked.owner == groups)  # each row keeps its own group's columns
    fp32 = out.dtype == torch.float32
    for e in stacked.expands:
        target = out[:, e.start:e.end]
        if fp32:
            target.addmm_(shrunk[:, e.cols], e.bt)
        else:  # bf16/fp16 activations: the low-rank path stays fp32, rounded once when added
            target.add_((shrunk[:, e.cols] @ e.bt).to(out.dtype))


def add_looped(x: torch.Tensor, out: torch.Tensor, adapters: Sequence[LoraAdapter],
               layout: Layout, rows: Sequence[torch.Tensor]) -> None:
    """The same delta, group by group and module by module (``rows[g]``: group g's row indices)."""
    for adapter, index in zip(adapters, rows, strict=True):
        if index.numel() == 0:
            continue
        xs = x.index_select(0, index).float()
        for part in layout:
            module = adapter.modules.get(part.module)
            if module is None:
                continue
            delta = (xs @ module.a.t()) @ module.b.t() * module.scaling
            target = out[:, part.start:part.end]
            target.index_add_(0, index, delta.to(out.dtype))


@dataclass
class StepLora:
    """A step's adapters: which group each packed row is in, and how to add their deltas.

    Built once per step by the engine; the decoder calls :meth:`add_` after
    each projection it computes (``rows`` is the row block it computed, None
    for all rows).
    """

    adapters: tuple[LoraAdapter, ...]
    groups: torch.Tensor
    """int64 [T, 1]: each packed row's group (index into ``adapters``), -1 for the base."""
    stacks: dict[tuple[int, str], Stacked | None]
    """Per (layer, projection): the stacked adapters (shared between steps with the same
    adapters; see :class:`~switchyard_engine.lora.bank.AdapterBank`)."""
    layouts: dict[tuple[int, str], Layout]
    looped: bool = False
    """Use :func:`add_looped` (the plain PyTorch-ops path) instead of :func:`add_stacked`."""
    _rows: list[torch.Tensor] | None = field(default=None, repr=False)

    def add_(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor,
             rows: slice | None = None) -> None:
        """Add the deltas of ``projection`` in ``layer`` for rows ``rows`` of the step."""
        groups = self.groups if rows is None else self.groups[rows]
        key = (layer, projection)
        if self.looped:
            layout = self.layouts.get(key)
            if layout is None:
                return
            flat = groups.view(-1)
            index = [torch.nonzero(flat == g).view(-1) for g in range(len(self.adapters))]
            add_looped(x, out, self.adapters, layout, index)
            return
        stacked = self.stacks.get(key)
        if stacked is None and key not in self.stacks:
            layout = self.layouts.get(key)
            stacked = self.stacks[key] = stack(self.adapters, layout) if layout else None
        if stacked is not None:
            add_stacked(x, out, stacked, groups)
