"""Logit soft-capping (Gemma 2) and ALiBi biases (Bloom, MPT, Falcon) on the paged path.

Each attention path (the native paged decode kernel, the native paged
prefill kernel, the SDPA path of :func:`~switchyard_xeon.attention.attend_packed`)
is checked against attention written out in plain PyTorch here (scores,
cap, bias, mask, softmax) over ragged shapes, GQA, chunks after cached
context and sliding windows; the slopes against transformers' own tensors;
and tiny random models of each family against transformers ``generate``,
with chunked prefill, batched decode and prefix-cache hits.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from switchyard_xeon.alibi_attention import alibi_slopes, installed
from switchyard_xeon.attention import DecodeRows, PrefillRows, StepMetadata, attend_packed
from switchyard_xeon.kernels import load_kernels
from switchyard_xeon.kv_cache import PagedKVCache, cache_shape
from switchyard_xeon.runner import ModelRunner

from tests.support.engine_requests import Collector, greedy_request, token_ids
from tests.support.family_models import build_model
from tests.support.greedy import transformers_greedy
from tests.support.xeon_engines import engine_tokens, started_engine

SLOPES6 = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.7, 0.03])


def _explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: list[int], scale: float,
              window: int, softcap: float, slopes: torch.Tensor | None) -> torch.Tensor:
    """q [n, H, D] at positions ``qpos`` over k/v [L, KVH, D] at positions 0..L-1 -> [n, H, D]."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, i in enumerate(qpos):
        for h in range(heads):
            kh = h // (heads // kv_heads)
            s = (k[:, kh].double() @ q[r, h].double()) * scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            j = torch.arange(k.shape[0], dtype=torch.float64)
            if slopes is not None:
                s = s + float(slopes[h]) * (j - i)
            seen = (j <= i) & ((j > i - window) if window else True)
            s = s.masked_fill(~seen, float("-inf"))
            out[r, h] = torch.softmax(s, 0) @ v[:, kh].double()
    return out.float()


def _paged(lengths: list[int], kv_heads: int, dim: int, size: int, dtype: torch.dtype,
           gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                          list[torch.Tensor], list[torch.Tensor]]:
    """Pools holding one sequence per length in scattered blocks; its tables and own K/V."""
    blocks = sum(-(-n // size) for n in lengths) + 3
    order = torch.randperm(blocks, generator=gen).tolist()
    k_pool = torch.randn(kv_heads, blocks, size, dim, generator=gen).to(dtype)
    v_pool = torch.randn(kv_heads, blocks, size, dim, generator=gen).to(dtype)
    width = max(-(-n // size) for n in lengths)
    tables, keys, values = [], [], []
    for n in lengths:
        own = [order.pop() for _ in range(-(-n // size))]
        tables.append(own + [0] * (width - len(own)))
        idx = torch.tensor(own)
        keys.append(k_pool.index_select(1, idx).reshape(kv_heads, -1, dim)[:, :n].transpose(0, 1))
        values.append(v_pool.index_select(1, idx).reshape(kv_heads, -1, dim)[:, :n].transpose(0, 1))
    return k_pool, v_pool, torch.tensor(tables, dtype=torch.int32), keys, values


CASES = [  # (heads, kv_heads, head_dim, window, softcap, alibi)
    pytest.param(6, 2, 64, 0, 2.5, False, id="softcap-gqa"),
    pytest.param(4, 4, 128, 5, 1.0, False, id="softcap-window"),
    pytest.param(6, 6, 64, 0, 0.0, True, id="alibi"),
    pytest.param(6, 3, 128, 7, 0.0, True, id="alibi-gqa-window"),
    pytest.param(6, 1, 64, 0, 30.0, True, id="both-mqa"),
]


@pytest.mark.parametrize("pools", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "window", "softcap", "alibi"), CASES)
def test_native_decode_kernel(heads, kv_heads, dim, window, softcap, alibi, pools):
    kernel = load_kernels().fn
    if kernel is None:
        pytest.skip("native kernels unavailable here")
    gen = torch.Generator().manual_seed(1)
    lengths = [1, 9, 23, 40]
    k_pool, v_pool, tables, keys, values = _paged(lengths, kv_heads, dim, 4, pools, gen)
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    slopes = SLOPES6[:heads].contiguous() if alibi else None
    got = kernel(q, k_pool, v_pool, tables, torch.tensor(lengths, dtype=torch.int32), dim**-0.5,
                 window, softcap, slopes)
    for b, n in enumerate(lengths):
        want = _explicit(q[b : b + 1], keys[b].float(), values[b].float(), [n - 1], dim**-0.5,
                         window, softcap, slopes)
        torch.testing.assert_close(got[b : b + 1], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("pools", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "window", "softcap", "alibi"), CASES)
def test_native_prefill_kernel(heads, kv_heads, dim, window, softcap, alibi, pools):
    """Fresh prompts and chunks after cached context, rows of several sequences in one call."""
    kernel = load_kernels().prefill
    if kernel is None:
        pytest.skip("the native prefill kernel is built for AVX-512 machines only")
    gen = torch.Generator().manual_seed(2)
    lengths, counts = [5, 21, 37, 3], [5, 8, 19, 1]  # the 2nd and 3rd after cached context
    k_pool, v_pool, tables, keys, values = _paged(lengths, kv_heads, dim, 4, pools, gen)
    starts = [0, 6, 14, 34]  # row 5 belongs to nobody
    q = torch.randn(36, heads, dim, generator=gen)
    slopes = SLOPES6[:heads].contiguous() if alibi else None
    int32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
    got = kernel(q, k_pool, v_pool, tables, int32(lengths), int32(starts), int32(counts),
                 dim**-0.5, window, softcap, slopes)
    for s, (n, c, at) in enumerate(zip(lengths, counts, starts, strict=True)):
        want = _explicit(q[at : at + c], keys[s].float(), values[s].float(),
                         list(range(n - c, n)), dim**-0.5, window, softcap, slopes)
        torch.testing.assert_close(got[at : at + c], want, atol=2e-5, rtol=1e-4)


def test_kernels_refuse_bad_slopes():
    kernel = load_kernels().fn
    if kernel is None:
        pytest.skip("native kernels unavailable here")
    q = torch.randn(1, 4, 64)
    pool = torch.randn(4, 2, 4, 64)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="alibi_slopes"):
        kernel(q, pool, pool, table, lens, 0.125, 0, 0.0, torch.ones(3))
    with pytest.raises(RuntimeError, match="alibi_slopes"):
        kernel(q, pool, pool, table, lens, 0.125, 0, 0.0, torch.ones(4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="softcap"):
        kernel(q, pool, pool, table, lens, 0.125, 0, -1.0, None)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "window", "softcap", "alibi"), CASES)
def test_sdpa_path(heads, kv_heads, dim, window, softcap, alibi, cache_dtype):
    """attend_packed without kernels: a fresh prompt, a chunk after cached context and a decode
    row in one packed step, each over its own blocks."""
    gen = torch.Generator().manual_seed(3)
    size, lengths, counts = 4, [7, 19, 12], [7, 6, 1]
    cache = PagedKVCache(cache_shape(_Config(heads, kv_heads, dim)), cache_dtype, 16, size)
    order = torch.randperm(16, generator=gen).tolist()
    tables = [[order.pop() for _ in range(-(-n // size))] for n in lengths]
    full_k = [torch.randn(kv_heads, n, dim, generator=gen) for n in lengths]
    full_v = [torch.randn(kv_heads, n, dim, generator=gen) for n in lengths]
    for table, n, k, v in zip(tables, lengths, full_k, full_v, strict=True):
        slots = torch.tensor([table[p // size] * size + p % size for p in range(n)])
        cache.write(0, slots, k, v)
    offsets = [0, 7, 13]
    spans, blocks = [], []
    for table, n, c in zip(tables, lengths, counts, strict=True):
        if n == c:
            spans.append(None)
        else:
            spans.append((len(blocks), len(table)))
            blocks.extend(table)
    q = torch.randn(heads, sum(counts), dim, generator=gen)
    new_k = torch.cat([k[:, n - c :] for k, n, c in zip(full_k, lengths, counts, strict=True)], 1)
    new_v = torch.cat([v[:, n - c :] for v, n, c in zip(full_v, lengths, counts, strict=True)], 1)
    step = StepMetadata(cache, torch.zeros(0, dtype=torch.long), torch.tensor(blocks), spans,
                        lengths, counts, offsets)
    slopes = SLOPES6[:heads].contiguous() if alibi else None
    got = attend_packed(0, q, new_k, new_v, step, dim**-0.5, window or None,
                        softcap=softcap or None, alibi_slopes=slopes)
    for k, v, n, c, at in zip(full_k, full_v, lengths, counts, offsets, strict=True):
        k, v = (t.to(cache_dtype).float().transpose(0, 1) for t in (k, v))
        want = _explicit(q[:, at : at + c].transpose(0, 1), k, v, list(range(n - c, n)),
                         dim**-0.5, window, softcap, slopes)
        torch.testing.assert_close(got[at : at + c], want, atol=2e-5, rtol=1e-4)


class _Config:
    def __init__(self, heads: int, kv_heads: int, dim: int) -> None:
        self.num_attention_heads, self.num_key_value_heads = heads, kv_heads
        self.head_dim, self.hidden_size, self.num_hidden_layers = dim, heads * dim, 1


def test_packed_attention_passes_softcap_and_the_kernels_take_it():
    """A packed step through the kernels (decode rows and prefill rows in one call each)
    equals the SDPA path on the same cache, soft-capped and biased."""
    status = load_kernels()
    if status.fn is None or status.prefill is None:
        pytest.skip("native decode and prefill kernels unavailable here")
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, size = 4, 2, 64, 4
    cache = PagedKVCache(cache_shape(_Config(heads, kv_heads, dim)), torch.float32, 12, size)
    cache.keys[0].copy_(torch.randn(cache.keys[0].shape, generator=gen))
    cache.values[0].copy_(torch.randn(cache.values[0].shape, generator=gen))
    # A decode row (length 10), then a chunk of 5 after 6 cached tokens.
    tables = [[3, 7, 1], [5, 0, 9]]
    q = torch.randn(heads, 6, dim, generator=gen)
    unused = torch.zeros(kv_heads, 6, dim)
    int32 = lambda xs: torch.tensor(xs, dtype=torch.int32)
    base = dict(cache=cache, slots=torch.zeros(0, dtype=torch.long),
                blocks=torch.tensor(tables[1]), spans=[(0, 3)], context_lens=[11],
                query_lens=[5], offsets=[1])
    rows = torch.tensor([0])
    fast = StepMetadata(**base, decode=DecodeRows(status.fn, rows, int32(tables[:1]), int32([10])),
                        prefill=PrefillRows(status.prefill, int32(tables[1:]), int32([11]),
                                            int32([1]), int32([5])))
    slow = StepMetadata(cache=cache, slots=base["slots"],
                        blocks=torch.tensor(tables[0] + tables[1]), spans=[(0, 3), (3, 3)],
                        context_lens=[10, 11], query_lens=[1, 5], offsets=[0, 1])
    for softcap, slopes in ((3.0, None), (None, SLOPES6[:heads].contiguous())):
        got = attend_packed(0, q, unused, unused, fast, dim**-0.5, None, softcap, slopes)
        want = attend_packed(0, q, unused, unused, slow, dim**-0.5, None, softcap, slopes)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("heads", [1, 4, 6, 12, 16, 24, 32])
def test_slopes_equal_transformers(heads):
    """The kernels' slopes give back transformers' own bias tensors, up to a per-row shift."""
    import transformers as T
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor as bloom_alibi
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor as falcon_alibi
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    hidden, length = 8 * heads, 20
    j = torch.arange(length, dtype=torch.float32)
    ones = torch.ones(1, length, dtype=torch.long)
    bloom = T.BloomForCausalLM(T.BloomConfig(hidden_size=hidden, n_layer=1, n_head=heads,
                                             vocab_size=16))
    torch.testing.assert_close(alibi_slopes(bloom)[:, None] * j,
                               bloom_alibi(ones, heads, torch.float32)[:, 0], rtol=0, atol=0)
    mpt = T.MptForCausalLM(T.MptConfig(d_model=hidden, n_heads=heads, n_layers=1, vocab_size=16,
                                       max_seq_len=length))
    want = build_mpt_alibi_tensor(heads, length)[:, 0]  # slope * (j - newest)
    torch.testing.assert_close(alibi_slopes(mpt)[:, None] * (j - (length - 1)), want,
                               rtol=1e-6, atol=0)
    falcon = T.FalconForCausalLM(T.FalconConfig(hidden_size=hidden, num_hidden_layers=1,
                                                num_attention_heads=heads, alibi=True,
                                                vocab_size=16))
    # Falcon scales q·k + alibi together by 1/sqrt(head_dim); its bias is bf16.
    want = falcon_alibi(ones, heads, torch.float32)[:, 0] / math.sqrt(8)
    torch.testing.assert_close(alibi_slopes(falcon)[:, None] * j, want, rtol=4e-3, atol=0)
    if heads & (heads - 1) == 0:  # the ALiBi paper's geometric sequence, 2^(-8k/n)
        paper = torch.tensor([2 ** (-8 * (k + 1) / heads) for k in range(heads)])
        for model in (bloom, mpt):
            torch.testing.assert_close(alibi_slopes(model), paper, rtol=1e-6, atol=0)


# --------------------------------------------------------------------- whole models

PROMPTS = [[(7 * i + s) % 500 + 3 for i in range(n)] for n, s in ((21, 1), (6, 2), (37, 3))]
NEW = 10


def _model(name: str) -> torch.nn.Module:
    import transformers as T

    ids = dict(vocab_size=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
               initializer_range=0.2)
    layers = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=256)
    if name == "falcon_alibi":  # multi_query: one K/V head
        return T.FalconForCausalLM(T.FalconConfig(alibi=True, **layers, **ids))
    if name == "falcon_alibi_mha":  # falcon-rw's layout: Bloom's fused q|k|v per head
        return T.FalconForCausalLM(T.FalconConfig(alibi=True, multi_query=False,
                                                  parallel_attn=False, bias=True, **layers, **ids))
    if name == "falcon_alibi_gqa":
        return T.FalconForCausalLM(T.FalconConfig(alibi=True, new_decoder_architecture=True,
                                                  num_kv_heads=2, **layers, **ids))
    if name == "bloom_d64":  # head_dim 64: the native prefill kernel's size
        return T.BloomForCausalLM(T.BloomConfig(hidden_size=128, n_layer=2, n_head=2, **ids))
    if name == "gemma2_d64":
        return T.Gemma2ForCausalLM(T.Gemma2Config(
            intermediate_size=96, head_dim=64, sliding_window=8, num_key_value_heads=1,
            query_pre_attn_scalar=48, attn_logit_softcapping=5.0, **layers, **ids))
    if name == "mpt_clip":
        cfg = T.MptConfig(d_model=64, n_heads=4, n_layers=2, max_seq_len=256, expansion_ratio=2,
                          **ids)
        cfg.attn_config.clip_qkv = 0.5
        return T.MptForCausalLM(cfg)
    return build_model(name)  # tests/support/family_models.py's bloom, mpt, gemma2


MODELS = ["bloom", "mpt", "gemma2", "falcon_alibi", "falcon_alibi_mha", "falcon_alibi_gqa",
          "bloom_d64", "gemma2_d64", "mpt_clip"]


@pytest.fixture(scope="module", params=MODELS)
def family(request, tmp_path_factory) -> Iterator[tuple[str, torch.nn.Module, Path]]:
    name = request.param
    torch.manual_seed(0)
    model = _model(name).eval()
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder)
    yield name, model, folder


@pytest.mark.parametrize("attention", ["auto", "sdpa"])
def test_greedy_tokens_on_the_paged_path_equal_generate(family, attention):
    """Three prompts together (batched decode, 16-token prefill chunks), then two prompts that
    share a 24-token prefix one after the other (the second reads the first's blocks)."""
    name, model, folder = family
    engine = started_engine(folder, attention=attention)
    try:
        assert type(engine._runner) is ModelRunner  # the paged path, not the fallback
        if "gemma2" not in name:
            assert installed(engine._runner._forward.model)
        assert engine_tokens(engine, PROMPTS, NEW) == transformers_greedy(model, PROMPTS, NEW)
        shared = PROMPTS[2][:24]
        pair = [shared + [5, 9, 11], shared + [40, 41]]
        hits = engine._scheduler.counters.prefix_hit_tokens
        sink = Collector()
        got = []
        for i, prompt in enumerate(pair):
            engine.submit(greedy_request(f"p{i}", prompt, NEW), sink)
            got.append(token_ids(sink.wait(f"p{i}")))
        assert engine._scheduler.counters.prefix_hit_tokens - hits >= 20
        assert got == transformers_greedy(model, pair, NEW)
    finally:
        engine.shutdown()


def test_forward_fallback_still_forces_the_fallback(tmp_path):
    from switchyard_xeon.fallback import FallbackRunner

    torch.manual_seed(0)
    model = _model("bloom").eval()
    model.save_pretrained(tmp_path)
    engine = started_engine(tmp_path, forward="fallback")
    try:
        assert type(engine._runner) is FallbackRunner
        assert engine_tokens(engine, PROMPTS[:1], 4) == transformers_greedy(model, PROMPTS[:1], 4)
    finally:
        engine.shutdown()


def test_unsupported_alibi_variants_are_named():
    import transformers as T
    from switchyard_xeon.alibi_attention import unsupported
    from switchyard_xeon.model_paths import class_unsupported

    tp = T.BloomConfig(pretraining_tp=2, slow_but_exact=True)
    assert "slow_but_exact" in class_unsupported(T.BloomForCausalLM, tp)
    assert class_unsupported(T.BloomForCausalLM, T.BloomConfig()) == ""
    rotary = T.FalconConfig(alibi=False)
    assert unsupported(T.FalconForCausalLM, rotary) is None
    assert "attention interface" in class_unsupported(T.FalconForCausalLM, rotary)
    assert class_unsupported(T.Gemma2ForCausalLM, T.Gemma2Config()) == ""
