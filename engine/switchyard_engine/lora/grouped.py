"""Each row's adapter over a (fused) projection: the grouped low-rank product.

A step's rows belong to groups, one per adapter present in the step (group
-1 is the base model: no delta). For a projection ``out = x @ W.T`` the
delta of a row in group ``g`` whose adapter adapts module ``m`` is
``scaling * (x @ A.T) @ B.T``, added to the columns of ``out`` that ``m``
owns (a fused q|k|v or gate|up output holds several modules side by side).

Three ways to compute it, all in fp32 whatever the base's dtype or
quantization (the delta is added to ``out`` at the end):

- :func:`add_grouped` (the default): the step's rows gathered group by
  group into a [groups, rows, in] batch (padded to the largest group), one
  batched matmul shrinks them with each group's own A, one per module
  expands them with its B, and the results are added back at their rows.
  Only each row's own adapter is computed, in a handful of calls per
  projection. A step whose groups are too uneven to pad (a long prompt
  beside a few decodes) takes :func:`add_looped` instead.
- :func:`add_stacked`: every group's A matrices are stacked
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


@dataclass(frozen=True)
class Grouped:
    """One projection's adapters, batched per group for :func:`add_grouped`."""

    a: torch.Tensor
    """fp32 [groups, in, R]: each group's A.T of every adapted part side by side."""
    b: torch.Tensor
    """fp32 [groups, R, end - start]: each group's ``(B * scaling).T`` of every part, each
    in its part's rows and columns, zero elsewhere: one expand covers a fused output."""
    start: int
    end: int
    """The output columns the adapted parts span."""


def group_stack(adapters: Sequence[LoraAdapter], layout: Layout) -> Grouped | None:
    """Batch ``adapters`` per group over ``layout``; None if none adapts it.

    Ranks are padded to the largest of each part with zeros, and a group
    whose adapter lacks a part has zeros there: padding adds nothing. The
    zeros cost arithmetic in the expand (each row multiplies every part's
    columns), which at decode sizes is cheaper than a call per part.
    """
    blocks: list[tuple[Part, int, list]] = []
    for part in layout:
        modules = [adapter.modules.get(part.module) for adapter in adapters]
        rank = max((m.rank for m in modules if m is not None), default=0)
        if rank:
            blocks.append((part, rank, modules))
    if not blocks:
        return None
    start, end = blocks[0][0].start, blocks[-1][0].end
    fan_in = next(m.a.shape[1] for _, _, ms in blocks for m in ms if m is not None)
    total = sum(rank for _, rank, _ in blocks)
    a = torch.zeros(len(adapters), fan_in, total)
    b = torch.zeros(len(adapters), total, end - start)
    col = 0
    for part, rank, modules in blocks:
        for g, m in enumerate(modules):
            if m is not None:
                a[g, :, col:col + m.rank] = m.a.t()
                b[g, col:col + m.rank, part.start - start:part.end - start] = (
                    m.b * m.scaling).t()
        col += rank
    return Grouped(a=a, b=b, start=start, end=end)


@dataclass(frozen=True)
class RowGather:
    """A step's rows in group order, padded to the largest group (see :func:`add_grouped`)."""

    gather: torch.Tensor
    """int64 [groups * width]: the packed row in each slot (padding slots repeat row 0)."""
    valid: torch.Tensor
    """int64 [n]: the slots that hold a real row, in group order."""
    rows: torch.Tensor
    """int64 [n]: the packed row of each of ``valid``."""
    groups: int
    width: int


def row_gather(groups: torch.Tensor, count: int) -> RowGather | None:
    """The padded gather of ``groups`` (int64 [T, 1]) over ``count`` groups; None when
    padding would add more than half the work (then the looped path is cheaper)."""
    flat = groups.view(-1)
    members = [torch.nonzero(flat == g).view(-1) for g in range(count)]
    width = max(len(m) for m in members)
    used = sum(len(m) for m in members)
    if count * width > 1.5 * used + 4 * count:
        return None
    gather = torch.zeros(count, width, dtype=torch.long)
    slots = []
    for g, m in enumerate(members):
        gather[g, :len(m)] = m
        slots.append(torch.arange(len(m)) + g * width)
    return RowGather(gather=gather.view(-1), valid=torch.cat(slots), rows=torch.cat(members),
                     groups=count, width=width)


def add_grouped(x: torch.Tensor, out: torch.Tensor, grouped: Grouped, plan: RowGather) -> None:
    """``out += delta``, each row shrunk and expanded with its own group's matrices."""
    xs = x.index_select(0, plan.gather).float().view(plan.groups, plan.width, -1)
    delta = torch.bmm(torch.bmm(xs, grouped.a), grouped.b).view(plan.groups * plan.width, -1)
    if plan.valid.numel() != delta.shape[0]:  # drop the padding slots
        delta = delta.index_select(0, plan.valid)
    target = out if grouped.start == 0 and grouped.end == out.shape[1] else (
        out[:, grouped.start:grouped.end])
    target.index_add_(0, plan.rows, delta.to(out.dtype))


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
    stacks: dict[tuple[int, str], Grouped | Stacked | None]
    """Per (layer, projection): the stacked adapters (shared between steps with the same
    adapters; see :class:`~switchyard_engine.lora.bank.AdapterBank`)."""
    layouts: dict[tuple[int, str], Layout]
    kernel: str = "grouped"
    """``grouped`` (:func:`add_grouped`), ``stacked`` (:func:`add_stacked`) or ``looped``
    (:func:`add_looped`, the plain PyTorch-ops path)."""
    _plan: RowGather | None = field(default=None, repr=False)
    _planned: bool = field(default=False, repr=False)
    _members: list[torch.Tensor] | None = field(default=None, repr=False)

    def add_(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor,
             rows: slice | None = None) -> None:
        """Add the deltas of ``projection`` in ``layer`` for rows ``rows`` of the step."""
        groups = self.groups if rows is None else self.groups[rows]
        key = (layer, projection)
        kernel = self.kernel
        if kernel == "grouped":
            if rows is not None:
                kernel = "looped"  # a row block of a big step: its groups are uneven anyway
            else:
                if not self._planned:
                    self._plan, self._planned = row_gather(groups, len(self.adapters)), True
                if self._plan is None:
                    kernel = "looped"
        if kernel == "grouped":
            assert self._plan is not None
            grouped = self.stacks.get(key)
            if grouped is None and key not in self.stacks:
                layout = self.layouts.get(key)
                grouped = self.stacks[key] = (group_stack(self.adapters, layout)
                                              if layout else None)
            if grouped is not None:
                add_grouped(x, out, grouped, self._plan)  # type: ignore[arg-type]
            return
        if kernel == "looped":
            layout = self.layouts.get(key)
            if layout is None:
                return
            index = self._members if rows is None else None
            if index is None:
                flat = groups.view(-1)
                index = [torch.nonzero(flat == g).view(-1) for g in range(len(self.adapters))]
                if rows is None:
                    self._members = index
            add_looped(x, out, self.adapters, layout, index)
            return
        skey = (layer, projection + ":stacked")  # the same cache, its own entries
        stacked = self.stacks.get(skey)
        if stacked is None and skey not in self.stacks:
            layout = self.layouts.get(key)
            stacked = self.stacks[skey] = stack(self.adapters, layout) if layout else None
        if stacked is not None:
            add_stacked(x, out, stacked, groups)  # type: ignore[arg-type]
