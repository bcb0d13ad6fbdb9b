"""Rows decide the kernel: the dot-product panels' AMX path and the crossover the engine sets.

Both paths read the same packed weights; each is checked against its matmul
in float64 (bf16-rounded inputs and weights, fp32 sums), and against the other
on the same call, for the shapes whose edges the AMX path handles apart:
rows that do not fill a tile, K that is not a whole k-step (copied panels)
and K that is (panels read in place), an odd panel count, int8 weights.
"""

from __future__ import annotations

import logging

import pytest
import torch

from switchyard_spec import EngineConfig
from switchyard_xeon.engine import XeonEngine
from switchyard_xeon.gemm_rows import NEVER, Crossover, choose_crossover, measure
from switchyard_xeon.linears import PanelLinear, pack_linears

from tests.support import kernel_paths
from tests.support.tiny_models import tiny_llama
from tests.support.xeon_options import TEST_OPTIONS


@pytest.fixture
def amx():
    """The bf16 panels' AMX path; skips where the CPU or the build lacks it. Restores
    the process's crossover afterwards."""
    from switchyard_xeon.kernels import load_kernels

    assert load_kernels().fn is not None, load_kernels().reason
    kernel_paths.require("panel_dot amx")
    ops = torch.ops.switchyard_xeon
    saved = ops.bf16_amx_rows(-1)
    yield ops
    ops.bf16_amx_rows(saved)


def run(ops, route: int, x: torch.Tensor, packed: torch.Tensor, bias, n: int) -> torch.Tensor:
    ops.bf16_amx_rows(route)
    return ops.panel_linear(x, packed, bias, n)


@pytest.mark.parametrize("rows", [1, 15, 16, 33, 100, 1000])  # part tiles, whole ones, chunks
@pytest.mark.parametrize("out_features", [16, 45, 130])  # one panel, ragged, odd panel count
@pytest.mark.parametrize("in_features", [64, 9, 576])  # whole k-steps, a padded pair, 18 steps
@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_amx_path_is_the_matmul_of_the_same_panels(amx, rows, out_features, in_features,
                                                  weights):
    gen = torch.Generator().manual_seed(rows * 7 + out_features * 3 + in_features)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if out_features != 16 else None
    if weights == "bf16":
        weight = torch.randn(out_features, in_features, generator=gen)
        packed = amx.pack_panels_bf16_dot(weight)
        seen = weight.bfloat16().double()
    else:
        q = torch.randint(-127, 128, (out_features, in_features), generator=gen,
                          dtype=torch.int8)
        scale = torch.rand(out_features, generator=gen) / 50
        packed = amx.pack_panels_int8_dot(q, scale)
        seen = q.double() * scale.double()[:, None]
    want = x.bfloat16().double() @ seen.T
    if bias is not None:
        want += bias.double()
    tiles = run(amx, 0, x, packed, bias, out_features)
    stream = run(amx, NEVER, x, packed, bias, out_features)
    tol = 1e-5 * max(1.0, in_features ** 0.5) * max(1.0, want.abs().max().item())
    torch.testing.assert_close(tiles.double(), want, atol=tol, rtol=1e-5)
    torch.testing.assert_close(tiles, stream, atol=tol, rtol=1e-5)


def test_crossover_decides_which_path_a_call_takes(amx):
    """The same call on either side of the crossover: the paths sum in different orders,
    so a large K tells them apart bit for bit; each stays within rounding of the other."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 4096, generator=gen)
    packed = amx.pack_panels_bf16_dot(weight)
    x = torch.randn(8, 4096, generator=gen)
    tiles = run(amx, 0, x, packed, None, 64)
    stream = run(amx, NEVER, x, packed, None, 64)
    assert not torch.equal(tiles, stream)
    assert torch.equal(run(amx, 8, x, packed, None, 64), tiles)  # 8 rows >= 8: AMX
    assert torch.equal(run(amx, 9, x, packed, None, 64), stream)  # below it: the row kernel
    torch.testing.assert_close(tiles, stream, atol=1e-3, rtol=1e-4)


def test_measured_crossover_is_a_swept_row_count(amx):
    model = tiny_llama(torch.float32)
    pack_linears(model, panels=True, bf16_dot=True)
    linears = [m for m in model.modules() if isinstance(m, PanelLinear)]
    crossover = measure(linears, rows=(1, 4, 16, 64), rounds=1)
    assert crossover.rows in (1, 4, 16, 64, 128)
    assert "row kernel / AMX" in crossover.source and "64 rows" in crossover.source


@pytest.mark.parametrize("gemm_rows", ["", "24"])
def test_engine_logs_its_crossover_measured_or_given(amx, default_model_path, caplog, gemm_rows):
    """A bf16 engine (the dot panels) measures its crossover at load unless the option sets it."""
    options = {**TEST_OPTIONS, **({"gemm_rows": gemm_rows} if gemm_rows else {})}
    engine = XeonEngine(EngineConfig(model_path=str(default_model_path), dtype="bfloat16",
                                     options=options))
    with caplog.at_level(logging.INFO, logger="switchyard.xeon"):
        engine.start()
    try:
        if gemm_rows:
            assert amx.bf16_amx_rows(-1) == 24
            assert ("many-row linears: AMX from 24 rows, the row kernel below "
                    "(gemm_rows option)") in caplog.text
        else:
            assert "many-row linears:" in caplog.text and "row kernel / AMX" in caplog.text
    finally:
        engine.shutdown()


def test_describe_names_both_ends():
    assert Crossover(0, "x").describe() == "AMX for every call (x)"
    assert Crossover(NEVER, "x").describe() == "the row kernel for every call (x)"


def test_gemm_rows_option_is_checked():
    """On any machine: the value is read before the engine knows whether it has AMX."""
    from switchyard_spec import EngineStartError

    model = tiny_llama(torch.float32)
    pack_linears(model, panels=True, bf16_dot=True)
    with pytest.raises(EngineStartError, match="gemm_rows"):
        choose_crossover(model, {"gemm_rows": "-3"})
    with pytest.raises(EngineStartError, match="gemm_rows"):
        choose_crossover(model, {"gemm_rows": "many"})
