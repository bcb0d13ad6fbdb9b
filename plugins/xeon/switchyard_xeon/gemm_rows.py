"""Rows decide the kernel: from how many rows a linear leaves the row kernel for AMX.

The dot-product panels (``kernels/panel_dot_bf16.cpp``) have two paths over
the same packed weights: the row kernel, a weight stream that wins at a few
rows (batch-1 and small-batch decode), and AMX tiles (``tdpbf16ps``), which
win once a call has enough rows to fill them (prefill chunks, wide decode
batches). Where they cross depends on the machine (its cores, its memory
bandwidth, its caches) and on the model's shapes, so the engine measures it
at load on the model's own first-layer linears, a sweep of a few tens of
milliseconds, and logs it; ``--engine-option gemm_rows=N`` sets it instead
(``gemm_rows=0``: AMX for every call; a large N: never).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from switchyard_xeon import options as read_options
from switchyard_xeon.kernels import checks
from switchyard_xeon.linears import PanelLinear

logger = logging.getLogger("switchyard.xeon")

SWEEP_ROWS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)
"""Row counts the sweep times on both paths."""
NEVER = 1 << 40
"""A crossover no call reaches: the row kernel for every call."""


@dataclass(frozen=True)
class Crossover:
    """The row count from which calls take AMX, and where it came from (for the log)."""

    rows: int
    source: str

    def describe(self) -> str:
        """E.g. "AMX from 8 rows, the row kernel below (measured: ...)"."""
        if self.rows >= NEVER:
            return f"the row kernel for every call ({self.source})"
        if self.rows <= 1:
            return f"AMX for every call ({self.source})"
        return f"AMX from {self.rows} rows, the row kernel below ({self.source})"


def choose_crossover(model: torch.nn.Module, options: dict[str, str]) -> Crossover | None:
    """Set the dot-product panels' AMX crossover for ``model`` and return it.

    None where there is nothing to choose: no AMX here (or its check failed),
    or no linear of the model on the dot-product panels.
    """
    # Read first, so that a bad value is refused on every machine, AMX or not.
    override = read_options.number(options, "gemm_rows", int, -1, 0)
    if checks.amx_rows() < 0:
        return None
    linears = _dot_linears(model)
    if not linears:
        return None
    if override >= 0:
        crossover = Crossover(int(min(override, NEVER)), "gemm_rows option")
    else:
        crossover = measure(linears)
    torch.ops.switchyard_xeon.bf16_amx_rows(crossover.rows)
    return crossover


def measure(linears: list[PanelLinear], rows: tuple[int, ...] = SWEEP_ROWS,
            rounds: int = 3) -> Crossover:
    """Time ``linears`` on both paths at each row count; the crossover is the fewest
    rows from which AMX was at least as fast at every larger count swept."""
    ops = torch.ops.switchyard_xeon
    inputs = {m.in_features: torch.randn(max(rows), m.in_features) for m in linears}
    took: dict[tuple[int, int], float] = {}
    try:
        with torch.inference_mode():
            for count in rows:
                for _ in range(rounds):
                    for route in (NEVER, 0):  # interleaved: drift hits both alike
                        ops.bf16_amx_rows(route)
                        start = time.perf_counter()
                        for m in linears:
                            m.rows(inputs[m.in_features][:count])
                        spent = time.perf_counter() - start
                        took[route, count] = min(took.get((route, count), spent), spent)
    finally:
        ops.bf16_amx_rows(NEVER)
    crossover = rows[-1] * 2
    for count in reversed(rows):
        if took[0, count] > took[NEVER, count]:
            break
        crossover = count
    detail = ", ".join(f"{count} rows {took[NEVER, count] * 1e3:.2f} / {took[0, count] * 1e3:.2f} ms"
                       for count in rows if count in (1, 8, 16, 32, 64))
    return Crossover(crossover, f"measured on {len(linears)} linears, row kernel / AMX: {detail}")


def _dot_linears(model: torch.nn.Module) -> list[PanelLinear]:
    """The first decoder layer's linears on the dot-product panels (bf16 or int8 weights),
    or the first four such linears of a model without numbered layers."""
    dot = [(name, m) for name, m in model.named_modules()
           if isinstance(m, PanelLinear) and _dot_layout(m.packed_weight)]
    first = [m for name, m in dot if ".0." in f".{name}."]
    return first or [m for _, m in dot[:4]]


def _dot_layout(packed: torch.Tensor) -> bool:
    """Whether ``packed`` is in a layout with an AMX path: ``panel_dot_bf16.cpp``'s
    [panels, k-pair steps, 32] of bf16 or int8 weights."""
    return (packed.dim() == 3 and packed.size(2) == 32
            and packed.dtype in (torch.bfloat16, torch.int8))
