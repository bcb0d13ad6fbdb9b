"""Act-order GPTQ: a layer's groups along K in another order than its inputs, as a permutation.

With act-order (``desc_act``) GPTQ rounds a layer's input columns in order of
decreasing Hessian diagonal and forms its groups in that order, so input
``k`` belongs to group ``g_idx[k]`` and a group's inputs are scattered over
K. The uint4 formats want each group's weights consecutive along K. Sorting
the inputs by ``g_idx`` (a stable sort: ``order``) makes them so: the stored
column ``j`` is input ``order[j]``, group ``j // group_size``. The record
keeps ``order`` (``QuantizedWeight.input_order``) and the engine gathers
each input row in that order before the kernel: ``x[..., order] @ W_s.T``
equals ``x @ W.T``.

A ``g_idx`` is an act-order assignment only when every group but the last
holds exactly ``group_size`` inputs (the last the rest): what GPTQ's tools
write. Anything else could not be stored in groups of ``group_size`` and is
refused.
"""

from __future__ import annotations

import torch


def order_from_g_idx(g_idx: torch.Tensor, group_size: int, in_features: int,
                     groups: int) -> torch.Tensor | None:
    """The stored order of the inputs for ``g_idx`` (int64 ``[K]``); None when it is the inputs' own.

    ``group_size`` is the checkpoint's (``-1``: one group of ``in_features``).
    ``ValueError`` says what is wrong with a ``g_idx`` that is no act-order
    assignment: its length, a group outside ``0..groups-1``, or a group that
    does not hold ``group_size`` inputs (the last: the remainder).
    """
    if g_idx.dim() != 1 or g_idx.shape[0] != in_features:
        raise ValueError(f"has shape {list(g_idx.shape)}, expected [{in_features}] (one group "
                         "per input)")
    if g_idx.dtype.is_floating_point or g_idx.dtype == torch.bool:
        raise ValueError(f"is {str(g_idx.dtype).removeprefix('torch.')}, expected an integer type")
    index = g_idx.to(torch.int64)
    low, high = int(index.min()), int(index.max())
    if low < 0 or high >= groups:
        raise ValueError(f"names group {low if low < 0 else high}, outside the {groups} groups "
                         f"0..{groups - 1} that qzeros and scales hold")
    size = in_features if group_size == -1 else group_size
    counts = torch.bincount(index, minlength=groups)
    want = torch.full((groups,), size, dtype=torch.int64)
    want[-1] = in_features - size * (groups - 1)
    if not torch.equal(counts, want):
        bad = int(torch.nonzero(counts != want)[0])
        raise ValueError(f"assigns {int(counts[bad])} inputs to group {bad}, which must hold "
                         f"{int(want[bad])} (group_size {group_size}): not an act-order "
                         "assignment the uint4 groups can store")
    order = torch.argsort(index, stable=True)
    if torch.equal(order, torch.arange(in_features)):
        return None
    return order


def restore_input_order(stored: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """A weight ``[N, K]`` whose columns are stored in ``order``, back in the inputs' order."""
    if order is None:
        return stored
    weight = torch.empty_like(stored)
    weight[:, order] = stored
    return weight


def g_idx_of(order: torch.Tensor | None, group_size: int, in_features: int) -> torch.Tensor:
    """GPTQ's ``g_idx`` (int32 ``[K]``) of columns stored in ``order`` in groups of ``group_size``."""
    stored_groups = torch.arange(in_features, dtype=torch.int32) // group_size
    if order is None:
        return stored_groups
    g_idx = torch.empty_like(stored_groups)
    g_idx[order] = stored_groups
    return g_idx
