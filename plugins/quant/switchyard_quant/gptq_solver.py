"""GPTQ for one linear layer (Frantar et al., 2022): 4-bit rounding with Hessian error feedback.

Round to nearest (:mod:`switchyard_quant.int4`) treats each weight alone.
GPTQ minimises the layer's output error ``||X W^T - X Q^T||^2`` over
calibration inputs ``X`` instead: it rounds one input column ``k`` of ``W``
at a time and spreads that column's rounding error over the columns not yet
rounded, weighted by the inverse of the Hessian ``H = 2 X^T X``, so that
correlated inputs cancel each other's errors. The steps, as the paper gives
them:

- ``H`` is a running average over calibration tokens
  (:class:`HessianAccumulator`, float64).
- An input that calibration never saw nonzero (a zero diagonal: a dead
  column) gets ``H[k, k] = 1`` and its weights 0: nothing reaches them, and
  0 is exact in every group.
- Dampening: ``percdamp`` (default 0.01) times the mean of the diagonal is
  added to it, which keeps ``H`` positive definite and the updates bounded.
- The updates use the upper Cholesky factor of ``H^-1``; row ``k`` of it
  gives column ``k``'s error-feedback weights.
- Columns go in blocks of ``block_size`` (128): within a block each rounded
  column updates the rest of the block at once, and the block's errors
  update all later columns in one matrix product (the paper's lazy batches).
- Groups: each group of ``group_size`` (32, 64 or 128) inputs gets the
  asymmetric uint4 scale and zero point of ``int4``'s RTN, computed from the
  group's weights as they stand when the solver reaches the group's first
  column, that is after the error feedback of every earlier column
  (``static_groups`` false, as in the reference implementation). A group
  never crosses a block (``block_size`` is a multiple of ``group_size``), so
  its weights are the up-to-date ones.
- Column order: by default (``desc_act`` false) columns go in their own
  order, so each group's inputs are consecutive and ``g_idx`` is
  ``k // group_size``. With ``act_order`` (the paper's heuristic, GPTQ's
  ``desc_act``) they go in order of decreasing Hessian diagonal (a stable
  sort, so ties keep the inputs' order and the result is deterministic):
  the inputs with the largest activations are rounded first, while the
  most columns remain to absorb their error, and the groups are formed in
  that order. The record then stores the columns in that order and says so
  in ``input_order`` (:mod:`switchyard_quant.gptq_act_order`); the writer
  turns it into GPTQ's ``g_idx``.

The result is the record RTN produces (``uint4_group_asym(group_size)``: codes
0..15 packed along K, float32 scales, uint8 zero points), with ``(q - z) * s``
per group, so the GPTQ writer stores it unchanged. The scales are rounded to
float16 before the group's codes are chosen, because GPTQ folders store
float16 scales: the weights the error feedback sees are exactly the ones the
folder holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from switchyard_spec import QuantizedWeight, uint4_group_asym

from switchyard_quant.int4 import UINT4_MAX, pack_uint4_along_k

GROUP_SIZES = (32, 64, 128)
"""The group sizes of the ``uint4_group_asym`` formats."""
DEFAULT_DAMP = 0.01
DEFAULT_BLOCK = 128
SMALLEST_FP16 = 2.0 ** -24
"""The smallest positive float16: a group's scale is never below it."""


@dataclass
class HessianAccumulator:
    """``H = 2 X^T X / tokens`` over every input row seen by :meth:`add`, in float64."""

    in_features: int
    hessian: torch.Tensor = field(init=False)
    tokens: int = 0

    def __post_init__(self) -> None:
        self.hessian = torch.zeros(self.in_features, self.in_features, dtype=torch.float64)

    def add(self, inputs: torch.Tensor) -> None:
        """Fold in a batch of inputs ``[..., K]`` (one row per token), keeping the average."""
        x = inputs.detach().reshape(-1, self.in_features).to(torch.float64)
        rows = x.shape[0]
        if rows == 0:
            return
        total = self.tokens + rows
        self.hessian.mul_(self.tokens / total)
        self.hessian.addmm_(x.T, x, alpha=2.0 / total)
        self.tokens = total


def prepare_hessian(hessian: torch.Tensor, weight: torch.Tensor, percdamp: float,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dead columns handled and the diagonal dampened: copies of ``hessian`` and ``weight``."""
    if not 0.0 < percdamp <= 1.0:
        raise ValueError(f"GPTQ: dampening must be in (0, 1], not {percdamp}")
    h = hessian.to(torch.float64).clone()
    w = weight.detach().to(torch.float64).clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    diagonal = torch.diagonal(h)
    diagonal += percdamp * float(diagonal.mean())
    return h, w


def inverse_cholesky_upper(hessian: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor ``U`` of ``H^-1`` (``H^-1 = U^T U``); ValueError if ``H`` is not
    positive definite."""
    lower, info = torch.linalg.cholesky_ex(hessian)
    if int(info):
        raise ValueError("GPTQ: the dampened Hessian is not positive definite; raise the "
                         "dampening (--damp)")
    inverse = torch.cholesky_inverse(lower)
    upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
    if int(info):
        raise ValueError("GPTQ: the inverse Hessian is not positive definite; raise the "
                         "dampening (--damp)")
    return upper


def group_parameters(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (float16 values) and zero point (0..15) per row of ``weights [N, G]``, as RTN's.

    The range is the row's minimum and maximum widened to include 0;
    ``s = (max - min) / 15`` rounded to float16, ``z = round(-min / s)``.
    """
    low = weights.amin(1).clamp(max=0.0)
    high = weights.amax(1).clamp(min=0.0)
    scale = (high - low) / UINT4_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group
    scale = scale.to(torch.float16).to(torch.float64)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError("GPTQ: a group's scale is outside float16's range")
    scale = scale.clamp(min=SMALLEST_FP16)
    zero = torch.round(-low / scale).clamp(0, UINT4_MAX)
    return scale, zero


def round_column(column: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One column's codes 0..15 and the weights they stand for, ``(q - z) * s``."""
    codes = torch.round(column / scale + zero).clamp(0, UINT4_MAX)
    return codes, (codes - zero) * scale


def _check(weight: torch.Tensor, hessian: torch.Tensor, group_size: int, block_size: int) -> None:
    if weight.dim() != 2:
        raise ValueError(f"GPTQ: a weight must be [N, K], not {tuple(weight.shape)}")
    k = weight.shape[1]
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"GPTQ: the Hessian is {tuple(hessian.shape)}, the weight has K={k}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"GPTQ: group size {group_size} is not one of {GROUP_SIZES}")
    if block_size % group_size:
        raise ValueError(f"GPTQ: block size {block_size} is not a multiple of the group size "
                         f"{group_size}")


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, group_size: int = 128,
                  percdamp: float = DEFAULT_DAMP, block_size: int = DEFAULT_BLOCK,
                  act_order: bool = False) -> QuantizedWeight:
    """GPTQ-round ``weight [N, K]`` to uint4 given its inputs' Hessian ``[K, K]``.

    Returns a ``uint4_group_asym(group_size)`` record, as
    :func:`switchyard_quant.int4.quantize_uint4` does; with ``act_order`` its
    columns are stored in the order they were rounded (``input_order``, None
    when that is the inputs' own order).
    """
    _check(weight, hessian, group_size, block_size)
    h, w = prepare_hessian(hessian, weight, percdamp)
    order = None
    if act_order:
        order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        if torch.equal(order, torch.arange(order.shape[0])):
            order = None
        else:
            h, w = h[order][:, order], w[:, order]
    upper = inverse_cholesky_upper(h)
    n, k = w.shape
    groups = -(-k // group_size)
    codes = torch.zeros(n, k, dtype=torch.float64)
    scales = torch.zeros(n, groups, dtype=torch.float64)
    zeros = torch.zeros(n, groups, dtype=torch.float64)
    for start in range(0, k, block_size):
        end = min(start + block_size, k)
        errors = _solve_block(w, upper, start, end, group_size, codes, scales, zeros)
        w[:, end:] -= errors @ upper[start:end, end:]
    return QuantizedWeight(format=uint4_group_asym(group_size), out_features=n, in_features=k,
                           data=pack_uint4_along_k(codes.to(torch.uint8)),
                           scales=scales.to(torch.float32).contiguous(),
                           zero_points=zeros.to(torch.uint8).contiguous(),
                           input_order=order)


def _solve_block(w: torch.Tensor, upper: torch.Tensor, start: int, end: int, group_size: int,
                 codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Round columns ``start:end`` with in-block error feedback; their scaled errors ``[N, B]``.

    Fills ``codes``, ``scales`` and ``zeros`` for these columns and groups.
    """
    block = w[:, start:end].clone()
    inverse = upper[start:end, start:end]
    errors = torch.zeros_like(block)
    scale = zero = None
    for i in range(end - start):
        column = start + i
        if column % group_size == 0:
            group = column // group_size
            scale, zero = group_parameters(block[:, i:i + group_size])
            scales[:, group], zeros[:, group] = scale, zero
        q, rounded = round_column(block[:, i], scale, zero)
        codes[:, column] = q
        error = (block[:, i] - rounded) / inverse[i, i]
        block[:, i:] -= error[:, None] * inverse[i, i:][None, :]
        errors[:, i] = error
    return errors
