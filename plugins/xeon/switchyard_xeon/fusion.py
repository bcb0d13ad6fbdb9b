"""Sibling projections that share one matmul: what every packed linear kind fuses with.

``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` read the same
input; the engine stacks their weights into one linear (of whichever kind:
oneDNN-packed, panels, quantized, FP8) whose output each sibling slices.
:mod:`switchyard_xeon.linears` and :mod:`switchyard_xeon.fp8_linears` both
fuse through this module.
"""

from __future__ import annotations

import torch

SIBLING_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"),
                                               ("gate_proj", "up_proj"))
"""Child names of one parent that project the same input and can share one matmul."""


class SharedMatmul:
    """One matmul whose output is split among sibling modules called on the same input."""

    def __init__(self, linear: torch.nn.Module, sizes: list[int]) -> None:
        self.linear = linear
        self.sizes = sizes
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] = ()
        self._left = 0

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        # Identity, not equality: the siblings of one layer receive the very same
        # tensor. Any other input (a different call order or model) recomputes,
        # which is slower but still right.
        if self._input is not x or not self._left:
            self._parts = self.linear(x).split(self.sizes, dim=-1)
            self._input, self._left = x, len(self.sizes)
        self._left -= 1
        out = self._parts[index]
        if not self._left:  # every sibling has its slice: let the activations go
            self._input, self._parts = None, ()
        return out


class FusedSibling(torch.nn.Module):
    """Stands in for one projection of a fused group; returns its slice of the shared matmul."""

    def __init__(self, shared: SharedMatmul, index: int, out_features: int) -> None:
        super().__init__()
        self._shared = shared
        self.index = index
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """This projection's columns of the group's output for ``x``."""
        return self._shared.part(x, self.index)

    def extra_repr(self) -> str:
        return f"part={self.index}, out_features={self.out_features}"


def fused_name(names: tuple[str, ...]) -> str:
    """The parent's attribute name for the fused module of sibling ``names``."""
    return "_fused_" + "_".join(names)
