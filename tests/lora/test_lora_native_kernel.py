"""The native grouped LoRA kernel (``kernels/lora.cpp``), against a per-row float64 reference.

Each row's expected delta is computed alone, in float64, from the adapter's
own matrices (``scaling * B @ A @ x`` for every module its adapter adapts,
placed in that module's columns of the fused output): neither the flat
buffer nor any other product path is the reference. Sizes are odd so every
vector loop has a tail; groups of 1 to 9 rows cover the kernel's four-row
blocks and their remainders.
"""

from __future__ import annotations

import pytest
import torch
from switchyard_engine.lora.config import AdapterConfig
from switchyard_engine.lora.flat import flatten
from switchyard_engine.lora.folder import LoraAdapter, LoraModule
from switchyard_engine.lora.grouped import Part

from tests.support import kernel_paths

IN = 37
LAYOUT = (Part("q", 0, 40), Part("k", 40, 53), Part("v", 53, 66))
WIDTH = LAYOUT[-1].end
LAYOUTS = {(0, "qkv"): LAYOUT, (1, "qkv"): LAYOUT, (1, "o"): (Part("o", 0, WIDTH),)}
PROJECTIONS = ("qkv", "o", "gate_up", "down")


@pytest.fixture(scope="module", autouse=True)
def _kernels() -> None:
    from switchyard_xeon.kernels import load_kernels

    load_kernels()
    kernel_paths.require("lora")


def _adapter(name: str, ranks: dict[str, int], seed: int) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    modules = {}
    for module, rank in ranks.items():
        fan_in = IN if module != "o" else WIDTH
        out = next((p.end - p.start for p in LAYOUT if p.module == module), WIDTH)
        modules[module] = LoraModule(a=torch.randn(rank, fan_in, generator=gen),
                                     b=torch.randn(out, rank, generator=gen), scaling=0.5 + seed)
    return LoraAdapter(name=name, path="", modules=modules,
                       config=AdapterConfig(rank=1, alpha=1, target_modules=()))


ADAPTERS = (_adapter("a", {"q": 2, "v": 3}, 1), _adapter("b", {"k": 16}, 2),
            _adapter("c", {"q": 1, "k": 5, "v": 7, "o": 3}, 3))


def _expected(x: torch.Tensor, groups: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Each row's delta alone in float64, over the matrices rounded to ``dtype`` as stored."""
    out = torch.zeros(x.shape[0], WIDTH, dtype=torch.float64)
    for row, group in enumerate(groups):
        if group < 0:
            continue
        for part in LAYOUT:
            m = ADAPTERS[group].modules.get(part.module)
            if m is not None:
                a = m.a.to(dtype).double()
                b = (m.b * m.scaling).to(dtype).double()
                out[row, part.start:part.end] += b @ (a @ x[row].double())
    return out


def _call(x, out, groups: list[int], dtype: torch.dtype, layer: int = 0,
          projection: int = 0) -> None:
    present = sorted({g for g in groups if g >= 0})
    rows = [r for g in present for r, gg in enumerate(groups) if gg == g]
    counts = [groups.count(g) for g in present]
    flats = [flatten(ADAPTERS[g], LAYOUTS, PROJECTIONS, 2, dtype) for g in present]
    torch.ops.switchyard_xeon.lora_add_(
        x, out, torch.tensor(rows, dtype=torch.long),
        torch.tensor([0, *counts], dtype=torch.long).cumsum(0),
        [f.weights for f in flats], [f.table for f in flats], layer, projection)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [
    [0, -1, 2, 1, 0, 2, -1, 1, 1],
    [1] * 9 + [0] * 5 + [2] * 4 + [-1] * 3,  # blocks of four and their remainders
    [2],
    [-1, -1],  # base rows only: nothing added
])
def test_each_row_gets_its_own_adapter_and_base_rows_nothing(groups: list[int],
                                                             dtype: torch.dtype) -> None:
    x = torch.randn(len(groups), IN, generator=torch.Generator().manual_seed(7))
    base = torch.randn(len(groups), WIDTH, generator=torch.Generator().manual_seed(8))
    out = base.clone()
    _call(x, out, groups, dtype)
    torch.testing.assert_close((out - base).double(), _expected(x, groups, dtype),
                               atol=1e-4, rtol=1e-5)


def test_a_projection_is_adapted_only_by_the_adapters_that_target_it() -> None:
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(5))
    out = torch.zeros(3, WIDTH)
    _call(x, out, [0, 1, -1], torch.float32, layer=1, projection=1)  # a and b lack o
    _call(x[:, :IN].contiguous(), out, [0, 1, 2], torch.float32, layer=0, projection=3)
    assert torch.equal(out, torch.zeros(3, WIDTH))
    _call(x, out, [-1, 2, -1], torch.float32, layer=1, projection=1)  # c's o, in layer 1
    m = ADAPTERS[2].modules["o"]
    want = (m.b.double() * m.scaling) @ (m.a.double() @ x[1].double())
    torch.testing.assert_close(out[1].double(), want, atol=1e-4, rtol=1e-5)
    assert torch.equal(out[[0, 2]], torch.zeros(2, WIDTH))


def test_rows_of_a_wider_buffer_and_row_blocks() -> None:
    """x and out may be row blocks of bigger tensors (the decoder's views): strides are kept."""
    from switchyard_xeon.native_lora import NativeLora

    groups = [0, 2, -1, 1, 1, 0, 2]
    x = torch.randn(len(groups), IN, generator=torch.Generator().manual_seed(3))
    present = [0, 1, 2]
    flats = [flatten(ADAPTERS[g], LAYOUTS, PROJECTIONS, 2, torch.float32) for g in present]
    rows = [r for g in present for r, gg in enumerate(groups) if gg == g]
    step = NativeLora(rows=torch.tensor(rows),
                      starts=torch.tensor([0, *[groups.count(g) for g in present]]).cumsum(0),
                      weights=[f.weights for f in flats], tables=[f.table for f in flats])
    wide = torch.zeros(len(groups), WIDTH + 10)
    out = wide[:, 5:5 + WIDTH]  # rows 10 numbers apart, not contiguous as a whole
    for block in (slice(0, 3), slice(3, len(groups))):
        step.add_(0, "qkv", x[block], out[block], block)
    torch.testing.assert_close(out.double(), _expected(x, groups, torch.float32),
                               atol=1e-4, rtol=1e-5)
    assert torch.equal(wide[:, :5], torch.zeros(len(groups), 5))


def test_bad_arguments_are_errors_not_crashes() -> None:
    x = torch.randn(2, IN)
    out = torch.zeros(2, WIDTH)
    flat = flatten(ADAPTERS[1], LAYOUTS, PROJECTIONS, 2, torch.float32)
    op = torch.ops.switchyard_xeon.lora_add_
    starts = torch.tensor([0, 2])
    with pytest.raises(RuntimeError, match="out of range"):
        op(x, out, torch.tensor([0, 5]), starts, [flat.weights], [flat.table], 0, 0)
    with pytest.raises(RuntimeError, match="does not fit"):
        op(x, out, torch.tensor([0, 1]), starts, [flat.weights[:10]], [flat.table], 0, 0)
    with pytest.raises(RuntimeError, match="covering the call"):
        op(x, out, torch.tensor([0, 1]), starts, [flat.weights], [flat.table], 2, 0)
    with pytest.raises(RuntimeError, match="one weight buffer"):
        op(x, out, torch.tensor([0, 1]), starts, [], [], 0, 0)
    assert torch.equal(out, torch.zeros(2, WIDTH))
