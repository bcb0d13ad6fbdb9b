"""The hand-written Llama-family decoder and the fused ops it runs on.

The ops are checked against transformers' own modules and functions, then the
engine on the decoder against transformers ``generate`` (greedy, token for
token) for each family it claims: Llama (the default model, everywhere else
in the suite), Mistral with a sliding window shorter than the prompt, Qwen2
with biased projections and sliding layers, and Phi-3 with checkpoint-fused
projections and partial rotary.
"""

from __future__ import annotations


import pytest
import torch

from switchyard_xeon.decoder import (
    LlamaFamilyDecoder,
    TransformersForward,
    decoder_unsupported,
    row_blocks,
)
from switchyard_xeon.kernels import load_kernels
from switchyard_xeon.kernels.reference import TorchFusedOps
from switchyard_xeon.linears import pack_linears
from switchyard_xeon.machine import read_cpu_info

from tests.support import kernel_paths
from tests.support.bf16_reference import with_bf16_matmuls
from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids
from tests.support.greedy import assert_greedy_near, transformers_greedy
from tests.support.tiny_models import SMALL, llama, qwen2
from tests.support.xeon_engines import engine_tokens, started_engine


@pytest.fixture(scope="module")
def native_ops():
    status = load_kernels()
    assert status.fused is not None, status.reason  # g++ and ninja are test dependencies
    kernel_paths.require("fused_ops")
    return status.fused


@pytest.fixture(params=["native", "torch"])
def ops(request, native_ops):
    return native_ops if request.param == "native" else TorchFusedOps()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_transformers_rmsnorm(ops, dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(80, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(80, generator=gen).to(dtype)
    x, residual = (torch.randn(7, 80, generator=gen).to(dtype) for _ in range(2))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-6), norm(x), **tol)
    got_x, got_r = x.clone(), residual.clone()
    ops.add_rms_norm_(got_x, got_r, norm.weight, 1e-6)
    torch.testing.assert_close(got_r, residual + x, **tol)
    torch.testing.assert_close(got_x, norm(residual + x), **tol)


@pytest.mark.parametrize("rot", [16, 8])  # full rotary (Llama) and partial (Phi-3)
def test_rotary_store_matches_transformers_and_fills_the_slots(ops, rot):
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    heads, kv_heads, dim, tokens = 4, 2, 16, 5
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    angles = torch.randn(tokens, rot // 2, generator=gen)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    q = qkv[:, : heads * dim].view(1, tokens, heads, dim).transpose(1, 2)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(1, tokens, kv_heads, dim).transpose(1, 2)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    k_pool, v_pool = torch.zeros(2, kv_heads, 4, 4, dim)
    slots = torch.tensor([3, 12, 0, 7, 15])
    got = qkv.clone()
    ops.rotary_store_(got, cos, sin, k_pool, v_pool, slots, heads, kv_heads)
    torch.testing.assert_close(got[:, : heads * dim].view(tokens, heads, dim),
                               want_q[0].transpose(0, 1))
    flat_k, flat_v = k_pool.view(kv_heads, 16, dim), v_pool.view(kv_heads, 16, dim)
    torch.testing.assert_close(flat_k[:, slots], want_k[0])
    torch.testing.assert_close(flat_v[:, slots],
                               qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
                               .transpose(0, 1))
    untouched = [s for s in range(16) if s not in slots.tolist()]
    assert not flat_k[:, untouched].any() and not flat_v[:, untouched].any()


def test_rotary_store_rounds_into_bf16_pools_under_fp32(ops):
    """fp32 q|k|v into a bf16 cache: the same rotation, keys and values stored rounded."""
    heads, kv_heads, dim, tokens = 4, 2, 16, 3
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    angles = torch.randn(tokens, 6, generator=gen)
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    slots = torch.tensor([1, 6, 2])
    wide_k, wide_v = torch.zeros(2, kv_heads, 2, 4, dim)
    narrow_k, narrow_v = torch.zeros(2, kv_heads, 2, 4, dim, dtype=torch.bfloat16)
    wide, narrow = qkv.clone(), qkv.clone()
    ops.rotary_store_(wide, cos, sin, wide_k, wide_v, slots, heads, kv_heads)
    ops.rotary_store_(narrow, cos, sin, narrow_k, narrow_v, slots, heads, kv_heads)
    assert torch.equal(narrow, wide)  # the activations stay fp32
    assert torch.equal(narrow_k, wide_k.bfloat16()) and torch.equal(narrow_v, wide_v.bfloat16())


def test_silu_and_mul_matches_the_llama_mlp(ops):
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2 * 40, generator=gen)
    torch.testing.assert_close(ops.silu_and_mul(x), torch.nn.functional.silu(x[:, :40]) * x[:, 40:])


def test_native_ops_reject_bad_inputs(native_ops):
    pool = torch.zeros(2, 4, 4, 16)
    qkv = torch.zeros(2, 8 * 16)
    cos = torch.zeros(2, 16)
    with pytest.raises(RuntimeError, match="slot out of range"):
        native_ops.rotary_store_(qkv, cos, cos, pool, pool.clone(), torch.tensor([0, 16]), 4, 2)
    with pytest.raises(RuntimeError, match="qkv width"):
        native_ops.rotary_store_(qkv, cos, cos, pool, pool.clone(), torch.tensor([0, 1]), 5, 2)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        native_ops.silu_and_mul(torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="weight"):
        native_ops.rms_norm(torch.zeros(2, 8), torch.zeros(9), 1e-6)


def test_decode_layers_rejects_mismatched_layer_lists(native_ops):
    kernel_paths.require("decode_layers")
    ops = torch.ops.switchyard_xeon
    x = torch.zeros(1, 64)
    pool = torch.zeros(2, 4, 4, 16)
    one = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="six weights"):  # one layer, five weights
        ops.decode_layers(x, x.clone(), torch.zeros(1, 16), torch.zeros(1, 16),
                          torch.zeros(1, dtype=torch.long), one[None], one + 1, [x] * 5,
                          [None] * 4, [pool], [pool], [0.25], [0], [1e-5], 4, 2)
    with pytest.raises(RuntimeError, match=r"\[tokens, hidden\]"):
        ops.decode_layers(x, torch.zeros(2, 64), torch.zeros(1, 16), torch.zeros(1, 16),
                          torch.zeros(1, dtype=torch.long), one[None], one + 1, [x] * 6,
                          [None] * 4, [pool], [pool], [0.25], [0], [1e-5], 4, 2)

# ------------------------------------------------------------------ families


def _panels_here() -> bool:
    """Whether fp32 projections take the panel kernel here (AVX2 without AVX-512)."""
    flags = read_cpu_info().flags
    return {"avx2", "fma"} <= flags and "avx512f" not in flags


def test_the_families_take_the_decoder_and_others_do_not(family_model):
    from transformers import GemmaConfig, GemmaForCausalLM

    _, model = family_model
    fresh = type(model)(model.config)
    if type(model).__name__ != "Phi3ForCausalLM":  # Phi-3 ships q|k|v and gate|up fused
        assert decoder_unsupported(fresh) == "projections are not fused"
    pack_linears(fresh)
    assert decoder_unsupported(fresh) == ""
    gemma = GemmaForCausalLM(GemmaConfig(head_dim=16, **SMALL))  # (1 + w) norms, GELU
    pack_linears(gemma)
    assert "not one of" in decoder_unsupported(gemma)


def test_engine_on_the_decoder_matches_transformers_generate(family_model, caplog):
    """Greedy tokens equal ``generate``'s, with chunked prefill, on every forward pass.

    The decoder's decode steps run as one native call (``forward=auto``; the
    projections are panel linears, which ``linears=panel`` asks for on any
    CPU) or as its Python loop (``forward=decoder``); transformers' own
    forward is the third.
    """
    folder, model = family_model
    prompts = [prompt_of(n, start=s) for n, s in ((21, 1), (6, 2), (33, 3))]
    prompts = [[t % 500 + 1 for t in p] for p in prompts]
    new = 10
    want = transformers_greedy(model, prompts, new)
    got = {}
    panels = load_kernels().fn is not None
    for forward in ("auto", "decoder", "transformers"):
        with caplog.at_level("INFO", logger="switchyard.xeon"):
            engine = started_engine(folder, forward=forward, linears="panel")
        try:
            runner_forward = engine._runner._forward
            expected = TransformersForward if forward == "transformers" else LlamaFamilyDecoder
            assert isinstance(runner_forward, expected)
            if forward != "transformers":
                # decode steps in one native call (decode_layers.cpp) or a Python loop
                assert (runner_forward.native is not None) == (forward == "auto" and panels)
            got[forward] = engine_tokens(engine, prompts, new)
        finally:
            engine.shutdown()
    assert "forward: hand-written Llama-family decoder, native fused ops" in caplog.text
    assert ("decode steps run every layer in one native call" in caplog.text) == panels
    native_prefill = load_kernels().prefill is not None
    # This parity covers the kernels the engine took here: the native prefill kernel where
    # the build has it, SDPA per sequence (its twin) elsewhere.
    for path in ("paged_attention", "fused_ops", "decode_layers", "panel_gemm fp32",
                 "paged_prefill"):
        kernel_paths.note(path)
    assert ("prefill attention: native paged kernel" in caplog.text) == native_prefill
    assert got["auto"] == want
    assert got["decoder"] == want
    assert got["transformers"] == want


def test_the_near_tie_check_rejects_other_tokens(family_model):
    """``assert_greedy_near`` is no blanket pass: the reference's own greedy tokens pass,
    the same tokens with one changed do not."""
    _, model = family_model
    prompts = [[t % 500 + 1 for t in prompt_of(21, start=1)]]
    want = transformers_greedy(model, prompts, 10)
    assert_greedy_near(model, prompts, want, 10, tol=0.0)
    wrong = [want[0][:4] + [(want[0][4] + 1) % 500] + want[0][5:]]
    with pytest.raises(AssertionError):
        assert_greedy_near(model, prompts, wrong, 10)


def test_bf16_on_dot_panels_matches_generate_with_bf16_matmuls(family_model, caplog):
    """``--dtype bfloat16`` on AVX512_BF16: bf16 matmuls and KV cache, fp32 in between; parity
    up to near ties (``assert_greedy_near``).

    The reference is the same transformers model with each linear made a bf16
    matmul and attention over bf16-rounded keys and values; decode steps run
    in one native call, in the Python loop, and in transformers' own forward
    (the path of other architectures); prefill comes in chunks of 16 tokens.
    """
    kernel_paths.require("panel_dot bf16")
    folder, model = family_model
    prompts = [[t % 500 + 1 for t in prompt_of(n, start=s)] for n, s in ((21, 1), (6, 2))]
    reference = with_bf16_matmuls(model)
    for forward in ("auto", "decoder", "transformers"):
        caplog.clear()
        with caplog.at_level("INFO", logger="switchyard.xeon"):
            engine = started_engine(folder, dtype="bfloat16", forward=forward)
        try:
            assert engine.info is not None and engine.info.dtype == "bfloat16"
            assert "bf16 weights and bf16 dot products" in caplog.text
            assert engine._runner.cache.dtype == torch.bfloat16
            if forward != "transformers":
                assert (engine._runner._forward.native is not None) == (forward == "auto")
            assert_greedy_near(reference, prompts, engine_tokens(engine, prompts, 10), 10)
        finally:
            engine.shutdown()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_prefill_chunks_on_sdpa_keep_generate_tokens(family_model, caplog, dtype):
    """Sequences with many query-key pairs leave the prefill kernel for SDPA (fp32, or bf16
    under bf16 matmuls). A low threshold (400 pairs) splits the steps of these prompts
    (16-token chunks) between the two: greedy tokens stay ``generate``'s (bf16: up to
    near ties against the bf16-matmul reference)."""
    kernel_paths.require("paged_prefill")
    if dtype == "bfloat16":
        kernel_paths.require("panel_dot bf16")
    folder, model = family_model
    prompts = [[t % 500 + 1 for t in prompt_of(n, start=s)] for n, s in ((60, 1), (6, 2), (33, 3))]
    with caplog.at_level("INFO", logger="switchyard.xeon"):
        engine = started_engine(folder, dtype=dtype, sdpa_prefill_pairs="400")
    try:
        assert (f"sequences of 400 query-key pairs or more take SDPA in {dtype}"
                in caplog.text)
        got = engine_tokens(engine, prompts, 10)
    finally:
        engine.shutdown()
    if dtype == "float32":
        assert got == transformers_greedy(model, prompts, 10)
    else:
        assert_greedy_near(with_bf16_matmuls(model), prompts, got, 10)


def test_row_blocks_cover_the_rows_in_near_equal_slices():
    assert row_blocks(7, 8) == [None]
    assert row_blocks(8, 8) == [None]
    assert row_blocks(9, 8) == [slice(0, 5), slice(5, 9)]
    assert row_blocks(4096, 1024) == [slice(i, i + 1024) for i in range(0, 4096, 1024)]
    blocks = row_blocks(1000, 300)
    assert [b.stop - b.start for b in blocks] == [250, 250, 250, 250]


def test_big_steps_run_their_rows_in_blocks_with_the_same_tokens(tmp_path, monkeypatch):
    """Prefill steps longer than ROW_BLOCK run norms, projections and MLP block by block."""
    from switchyard_xeon import decoder

    torch.manual_seed(0)
    model = qwen2().eval()  # biases on q|k|v
    model.save_pretrained(tmp_path)
    prompts = [[t % 500 + 1 for t in prompt_of(n, start=s)] for n, s in ((21, 1), (9, 2))]
    want = transformers_greedy(model, prompts, 6)
    calls: list[int] = []
    real = decoder.row_blocks

    def spy(tokens: int, block: int | None = None) -> list[slice | None]:
        blocks = real(tokens, block)
        calls.append(len(blocks))
        return blocks

    monkeypatch.setattr(decoder, "ROW_BLOCK", 5)
    monkeypatch.setattr(decoder, "row_blocks", spy)
    engine = started_engine(tmp_path, forward="decoder")
    try:
        assert engine_tokens(engine, prompts, 6) == want
    finally:
        engine.shutdown()
    assert max(calls) >= 4  # a 16-token prefill step in blocks of at most 5 rows


def test_a_bf16_checkpoint_run_in_fp32_gives_generate_tokens(tmp_path, caplog):
    """bf16 weights loaded in fp32 go back to bf16 storage (panels) without changing a token."""
    torch.manual_seed(0)
    model = llama().to(torch.bfloat16).eval()
    model.save_pretrained(tmp_path)
    model = model.float()
    prompts = [[t % 500 + 1 for t in prompt_of(n, start=s)] for n, s in ((19, 1), (7, 2))]
    want = transformers_greedy(model, prompts, 10)
    got = {}
    for storage in ("auto", "float32"):
        caplog.clear()
        with caplog.at_level("INFO", logger="switchyard.xeon"):
            engine = started_engine(tmp_path, panel_storage=storage)
        try:
            if _panels_here():
                assert "linears: panel-packed float32" in caplog.text
                assert ("13 hold only bf16 values" in caplog.text) == (storage == "auto")
            got[storage] = engine_tokens(engine, prompts, 10)
        finally:
            engine.shutdown()
    assert got["auto"] == got["float32"] == want


def test_without_native_kernels_the_decoder_runs_on_torch_ops(make_engine, hf_greedy, monkeypatch,
                                                              caplog):
    """No compiler (or SWITCHYARD_XEON_KERNELS=0): PyTorch ops, SDPA and oneDNN, same tokens."""
    from switchyard_xeon import assembly
    from switchyard_xeon.kernels import KernelStatus

    monkeypatch.setattr(assembly, "load_kernels",
                        lambda: KernelStatus(None, "native kernels disabled for the test"))
    with caplog.at_level("INFO", logger="switchyard.xeon"):
        engine = make_engine({"block_size": "4"}, max_batch_prefill_tokens=16)
    assert "forward: hand-written Llama-family decoder, PyTorch ops" in caplog.text
    assert "linears: oneDNN-packed float32" in caplog.text
    assert engine._runner.decode_kernel is None
    prompts = [prompt_of(n, start=s) for n, s in ((23, 1), (5, 2))]
    sink = Collector()
    for i, prompt in enumerate(prompts):
        engine.submit(greedy_request(f"r{i}", prompt, 8), sink)
    assert [token_ids(sink.wait(f"r{i}")) for i in range(2)] == [hf_greedy(p, 8) for p in prompts]
