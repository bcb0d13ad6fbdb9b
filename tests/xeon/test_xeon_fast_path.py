"""The Xeon engine's fast forward path: the native paged decode kernel and fused/packed linears.

Each piece is checked against plain math first, then the engine with it against
the engine without it (same greedy tokens), so a wrong kernel cannot hide
behind the parity tests of the whole engine.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from switchyard_xeon.engine import XeonEngine
from switchyard_xeon.kernels import load_kernels
from switchyard_xeon.kernels.reference import paged_decode_reference
from switchyard_xeon.linears import (
    FusedSibling,
    PackedLinear,
    PanelLinear,
    _check_packing,
    holds_bf16,
    pack_linears,
)

from tests.support import kernel_paths
from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids
from tests.support.paged_cases import random_paged_case
from tests.support.tiny_models import tiny_llama


def naive_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 tables: torch.Tensor, lens: torch.Tensor, scale: float,
                 window: int) -> torch.Tensor:
    """Row by row, head by head, in float64: the definition the kernels must meet."""
    batch, heads, dim = q.shape
    kv_heads, _, block, _ = k_pool.shape
    out = torch.empty(batch, heads, dim, dtype=torch.float64)
    for b in range(batch):
        length = int(lens[b])
        first = max(0, length - window) if window else 0
        pos = torch.arange(first, length)
        slots = tables[b].long()[pos // block] * block + pos % block
        for h in range(heads):
            kvh = h // (heads // kv_heads)
            keys = k_pool[kvh].reshape(-1, dim)[slots].double()
            values = v_pool[kvh].reshape(-1, dim)[slots].double()
            weights = torch.softmax(keys @ q[b, h].double() * scale, dim=0)
            out[b, h] = weights @ values
    return out


CASES = [
    # dtype, head_dim, heads, kv_heads, context lengths, window
    (torch.float32, 64, 9, 3, [1, 17, 130, 16], 0),
    (torch.float32, 128, 4, 4, [33, 2], 0),
    (torch.float32, 80, 8, 1, [50, 300, 7], 0),
    (torch.float32, 64, 6, 2, [40, 100, 5], 24),
    (torch.bfloat16, 64, 9, 3, [1, 17, 130, 16], 0),
    (torch.bfloat16, 128, 14, 2, [200, 64], 0),
    (torch.bfloat16, 96, 6, 3, [70, 3], 31),
]


@pytest.fixture(scope="module")
def kernel() -> Callable[..., torch.Tensor]:
    """The built kernel: it must build wherever the tests run (g++ and ninja are deps)."""
    status = load_kernels()
    assert status.fn is not None, status.reason
    return status.fn


@pytest.mark.parametrize("dtype,dim,heads,kv_heads,lens,window", CASES)
def test_native_kernel_matches_the_definition(kernel, dtype, dim, heads, kv_heads, lens, window):
    kernel_paths.require("paged_attention")
    q, k, v, tables, n = random_paged_case(dtype, dim, heads, kv_heads, lens)
    got = kernel(q, k, v, tables, n, dim**-0.5, window)
    want = naive_decode(q, k, v, tables, n, dim**-0.5, window)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,dim,heads,kv_heads,lens,window", CASES)
def test_portable_path_matches_the_definition(dtype, dim, heads, kv_heads, lens, window):
    q, k, v, tables, n = random_paged_case(dtype, dim, heads, kv_heads, lens, seed=1)
    got = paged_decode_reference(q, k, v, tables, n, dim**-0.5, window)
    want = naive_decode(q, k, v, tables, n, dim**-0.5, window)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dim,window", [(64, 0), (64, 9), (80, 0)])  # the 64 path and the generic
def test_kernel_reads_bf16_pools_under_an_fp32_query(kernel, dim, window):
    """The bf16 matmul mode's cache: bf16 pools, fp32 queries and output."""
    kernel_paths.require("paged_attention")
    q, k, v, tables, n = random_paged_case(torch.float32, dim, 6, 2, [1, 17, 40], seed=3)
    k, v = k.bfloat16(), v.bfloat16()
    got = kernel(q, k, v, tables, n, dim**-0.5, window)
    assert got.dtype == torch.float32
    want = naive_decode(q, k.float(), v.float(), tables, n, dim**-0.5, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(paged_decode_reference(q, k, v, tables, n, dim**-0.5, window),
                               got, atol=1e-5, rtol=1e-5)


def test_kernel_rejects_bad_inputs(kernel):
    q, k, v, tables, n = random_paged_case(torch.float32, 64, 4, 2, [5])
    with pytest.raises(RuntimeError, match="int32"):
        kernel(q, k, v, tables.long(), n, 0.125, 0)
    with pytest.raises(RuntimeError, match="dtype"):
        kernel(q.double(), k, v, tables, n, 0.125, 0)


@pytest.mark.parametrize("panels", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_give_the_same_logits(bias, panels, kernel):
    model = tiny_llama(torch.float32, bias)
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.inference_mode():
        before = model(ids).logits
        report = pack_linears(model, panels=panels)
        after = model(ids).logits
    # 2 layers x 2 groups, each group one packed matmul, plus o_proj, down_proj, lm_head
    assert report.fused_groups == 4 and report.packed == 4 + 2 * 2 + 1
    layout, cls = ("panel", PanelLinear) if panels else ("oneDNN", PackedLinear)
    assert report.describe() == f"{layout}-packed float32 (9 linears, 4 fused groups)"
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.k_proj, FusedSibling)
    assert isinstance(layer.mlp.up_proj, FusedSibling)
    assert isinstance(layer.self_attn.o_proj, cls)
    assert isinstance(model.lm_head, cls)
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 97, 200])  # micro-kernel tails, row chunks
@pytest.mark.parametrize("out_features", [1, 16, 45, 130])  # whole and ragged panels
def test_panel_linear_matches_f_linear(kernel, rows, out_features):
    kernel_paths.require("panel_gemm fp32")
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    linear = torch.nn.Linear(72, out_features)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, 72, generator=gen))
        linear.bias.copy_(torch.randn(out_features, generator=gen))
    panel = PanelLinear(linear.weight, linear.bias)
    unbiased = PanelLinear(linear.weight, None)
    x = torch.randn(2, rows, 72, generator=gen)
    with torch.inference_mode():
        torch.testing.assert_close(panel(x), linear(x), atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(unbiased(x[:, :1].transpose(0, 1)),
                                   linear(x[:, :1].transpose(0, 1)) - linear.bias,
                                   atol=1e-4, rtol=1e-5)


def test_panel_linear_rejects_mismatched_inputs(kernel):
    packed = torch.ops.switchyard_xeon.pack_panels(torch.zeros(20, 8))
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.switchyard_xeon.panel_linear(torch.zeros(3, 9), packed, None, 20)
    with pytest.raises(RuntimeError, match="does not match"):
        torch.ops.switchyard_xeon.panel_linear(torch.zeros(3, 8), packed, None, 33)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.switchyard_xeon.panel_linear(torch.zeros(3, 8), packed, torch.zeros(19), 20)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.switchyard_xeon.pack_panels(torch.zeros(4, 4, dtype=torch.float16))


def test_holds_bf16_tells_bf16_checkpoints_from_fp32_ones():
    weight = torch.randn(8, 24, generator=torch.Generator().manual_seed(0))
    assert not holds_bf16(weight)
    assert holds_bf16(weight.bfloat16().float())  # a bf16 checkpoint loaded in fp32
    assert not holds_bf16(weight.bfloat16())  # already bf16: nothing to narrow
    nudged = weight.bfloat16().float()
    nudged[3, 5] = nudged[3, 5].nextafter(torch.tensor(1.0))  # one value off the bf16 grid
    assert not holds_bf16(nudged)


@pytest.mark.parametrize("rows", [1, 6, 7, 96, 97, 200])  # widened in registers / in a buffer
def test_bf16_valued_panels_are_stored_as_bf16_with_the_same_results(kernel, rows):
    kernel_paths.require("panel_gemm bf16-stored")
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(45, 72, generator=gen).bfloat16().float()
    bias = torch.randn(45, generator=gen)
    narrow, wide = PanelLinear(weight, bias), PanelLinear(weight, bias, narrow=False)
    assert narrow.narrowed and narrow.packed_weight.dtype == torch.bfloat16
    assert not wide.narrowed and wide.packed_weight.dtype == torch.float32
    assert "stored=bf16" in repr(narrow)
    x = torch.randn(rows, 72, generator=gen)
    with torch.inference_mode():
        got = narrow(x)
        # The same fp32 values in the same order of FMAs: bit for bit.
        assert torch.equal(got, wide(x))
        torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias),
                                   atol=1e-4, rtol=1e-5)
    assert not PanelLinear(torch.randn(45, 72, generator=gen), bias).narrowed


def test_pack_report_counts_narrowed_panels(kernel):
    model = tiny_llama(torch.bfloat16).float()  # a bf16 checkpoint loaded in fp32
    report = pack_linears(model, panels=True)
    # per layer q|k|v, o, gate|up, down; plus the LM head
    assert report.narrowed == report.packed == 2 * 4 + 1
    assert "9 hold only bf16 values and are stored as bf16" in report.describe()
    assert pack_linears(tiny_llama(torch.bfloat16).float(), panels=True,
                        narrow=False).narrowed == 0
    assert pack_linears(tiny_llama(torch.float32), panels=True).narrowed == 0


@pytest.fixture
def bf16_dot(kernel):
    """The bf16 dot-product panels; skips where the kernels were built without AVX512_BF16."""
    kernel_paths.require("panel_dot bf16")
    return torch.ops.switchyard_xeon


@pytest.mark.parametrize("path", ["panel_dot bf16", "panel_gemm bf16-stored"])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 97, 600])  # micro-kernel tails, row chunks of 512
@pytest.mark.parametrize("out_features", [1, 16, 45, 130])  # ragged, odd and even panel counts
@pytest.mark.parametrize("in_features", [72, 9])  # whole k pairs, a padded last pair
def test_panels_over_bf16_weights_are_their_matmul(kernel, path, rows, out_features,
                                                   in_features):
    """bf16 weights on either ISA: the dot-product panels (AVX512_BF16) round the inputs
    to bf16 too; their AVX2 twin, the fp32 panel GEMM over bf16-stored weights, keeps
    them fp32. Each is its matmul, fp32 sums and bias, to summation order."""
    kernel_paths.require(path)
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    narrow = weight.bfloat16().float()
    if path == "panel_dot bf16":
        panel = PanelLinear(weight, bias, bf16_dot=True)
        assert panel.packed_weight.dtype == torch.bfloat16 and "bf16 dot products" in repr(panel)
        inputs = x.bfloat16().float()
    else:
        panel = PanelLinear(narrow, bias)  # a bf16 checkpoint loaded in fp32
        assert panel.narrowed and panel.packed_weight.dtype == torch.bfloat16
        inputs = x
    want = torch.nn.functional.linear(inputs.double(), narrow.double(), bias.double())
    with torch.inference_mode():
        got = panel(x)
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
        if path == "panel_dot bf16":
            assert not torch.allclose(got, torch.nn.functional.linear(x, weight, bias),
                                      atol=1e-5, rtol=0)  # it really rounds: not the fp32 product


def test_bf16_dot_panels_reject_mismatched_inputs(bf16_dot):
    packed = bf16_dot.pack_panels_bf16_dot(torch.zeros(20, 9))
    assert packed.shape == (2, 5, 32)  # [panels, k pairs, 16 features x 2]
    with pytest.raises(RuntimeError, match="does not match"):
        bf16_dot.panel_linear(torch.zeros(3, 11), packed, None, 20)
    with pytest.raises(RuntimeError, match="does not match"):
        bf16_dot.panel_linear(torch.zeros(3, 9), packed, None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        bf16_dot.panel_linear(torch.zeros(3, 9), packed, torch.zeros(19), 20)


def test_pack_report_names_bf16_dot_panels(bf16_dot):
    model = tiny_llama(torch.float32)
    report = pack_linears(model, panels=True, bf16_dot=True)
    assert report.packed == 9 and report.narrowed == 0
    assert report.describe() == ("panel-packed float32 (9 linears, 4 fused groups; bf16 weights "
                                 "and bf16 dot products (AVX512_BF16), fp32 sums)")
    assert all(m.bf16_dot for m in model.modules() if isinstance(m, PanelLinear))


def test_fp16_linears_are_fused_but_left_stock():
    model = tiny_llama(torch.float16)
    report = pack_linears(model)
    assert report.fused_groups == 4 and report.packed == 0
    assert report.reason == "weights are float16"
    assert type(model.lm_head) is torch.nn.Linear
    assert report.describe() == "stock, 4 fused groups (weights are float16)"


def test_bf16_linears_are_packed_where_the_cpu_can():
    model = tiny_llama(torch.bfloat16)
    reason = _check_packing(model.lm_head)
    if reason:  # oneDNN's bf16 reorder needs AVX-512 or AVX-NE-CONVERT
        report = pack_linears(model)
        assert report.packed == 0 and report.reason == reason
        assert "stock" in report.describe()
        pytest.skip(f"this CPU cannot pack bf16 weights: {reason}")
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    with torch.inference_mode():
        before = model(ids).logits.float()
        report = pack_linears(model)
        after = model(ids).logits.float()
    assert report.packed > 0 and isinstance(model.lm_head, PackedLinear)
    torch.testing.assert_close(after, before, atol=5e-2, rtol=5e-2)


def generate(engine: XeonEngine, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Submit all prompts at once (so decode steps batch them) and return their tokens."""
    sink = Collector()
    for i, prompt in enumerate(prompts):
        engine.submit(greedy_request(f"r{i}", prompt, new), sink)
    return [token_ids(sink.wait(f"r{i}")) for i in range(len(prompts))]


def test_engine_with_fast_path_matches_portable_path(make_engine, caplog):
    """Batched decode through the kernel and fused linears gives the portable path's tokens.

    A small prefill budget chunks the long prompts, so steps mix decode rows
    (kernel) with prefill chunks (SDPA) as well as running pure decode steps.
    """
    prompts = [prompt_of(n, start=s) for n, s in ((5, 1), (40, 2), (17, 3), (90, 4))]
    with caplog.at_level("INFO", logger="switchyard.xeon"):
        fast = make_engine({"block_size": "4"}, max_batch_prefill_tokens=24)
    level = load_kernels().variant
    assert f"decode attention: native kernels for {level}" in caplog.text
    assert "fused groups" in caplog.text
    # fp32 linears take the panel kernel where it was measured to win: the AVX2 level.
    panels = level == "avx2"
    assert ("linears: panel-packed float32" in caplog.text) == panels
    assert ("linears: oneDNN-packed float32" in caplog.text) == (not panels)
    portable = make_engine({"block_size": "4", "attention": "sdpa", "linears": "stock"},
                           max_batch_prefill_tokens=24)
    assert fast._runner.decode_kernel is not None and portable._runner.decode_kernel is None
    assert generate(fast, prompts, 12) == generate(portable, prompts, 12)


def test_engine_options_are_checked(make_engine):
    from switchyard_spec import EngineStartError

    with pytest.raises(EngineStartError, match="attention"):
        make_engine({"attention": "flash"})
    with pytest.raises(EngineStartError, match="linears"):
        make_engine({"linears": "fast"})


def test_models_whose_attention_the_paged_kernels_lack_are_sent_to_the_fallback():
    """Sink (gpt-oss) attention: the paged runner's precondition refuses it, and the engine's
    path choice names why it takes the fallback instead (served there:
    tests/xeon/test_xeon_fallback.py). Soft-capped attention (Gemma 2) passes: the paged
    kernels compute it (tests/xeon/test_xeon_alibi_softcap.py)."""
    from switchyard_spec import EngineStartError
    from switchyard_xeon.model_paths import loaded_model_unsupported
    from switchyard_xeon.runner import check_supported
    from transformers import Gemma2Config, Gemma2ForCausalLM, GptOssConfig, GptOssForCausalLM

    small = dict(vocab_size=97, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16)
    gemma = Gemma2ForCausalLM(Gemma2Config(intermediate_size=48, **small))
    check_supported(gemma)
    assert loaded_model_unsupported(gemma) == ""
    gpt_oss = GptOssForCausalLM(GptOssConfig(intermediate_size=32, num_local_experts=2,
                                             num_experts_per_tok=1, **small))
    with pytest.raises(EngineStartError, match="sinks"):
        check_supported(gpt_oss)
    assert "attention sinks" in loaded_model_unsupported(gpt_oss)
    assert loaded_model_unsupported(tiny_llama(torch.float32)) == ""
    check_supported(tiny_llama(torch.float32))  # the families the engine serves pass
