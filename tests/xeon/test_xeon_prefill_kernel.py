"""Prefill attention over the paged cache: the native kernel and its twin, SDPA per sequence.

Both are checked against the float64 definition written out here, in one test
parametrised over the two paths: an AVX-512 build runs both, an AVX2 build (no
native prefill kernel) the SDPA path the engine takes there. Engine-level greedy
parity through them (chunked prefill, windows, four families) is in
``test_xeon_decoder.py``, whose models have head_dim 64.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from switchyard_xeon.attention import PrefillRows, StepMetadata, attend_packed
from switchyard_xeon.kernels import load_kernels
from switchyard_xeon.kv_cache import CacheShape, PagedKVCache

from tests.support import kernel_paths
from tests.support.paged_cases import random_paged_case


@pytest.fixture
def prefill():
    kernel_paths.require("paged_prefill")
    return load_kernels().prefill


def naive_prefill(q, k_pool, v_pool, tables, lens, starts, counts, scale, window):
    """Row by row, head by head, in float64: row ``r`` of a sequence of ``n`` new tokens and
    ``L`` cached ones sits at position ``L - n + r`` and attends to the positions up to its
    own (within ``window`` when > 0); a query head shares the key head of its group."""
    _, heads, dim = q.shape
    kv_heads, _, block, _ = k_pool.shape
    out = {}
    for s in range(len(lens)):
        length, start, n = int(lens[s]), int(starts[s]), int(counts[s])
        pos = torch.arange(length)
        slots = tables[s].long()[pos // block] * block + pos % block
        for r in range(n):
            at = length - n + r
            first = max(0, at - window + 1) if window else 0
            for h in range(heads):
                kvh = h // (heads // kv_heads)
                keys = k_pool[kvh].reshape(-1, dim)[slots[first : at + 1]].double()
                values = v_pool[kvh].reshape(-1, dim)[slots[first : at + 1]].double()
                weights = torch.softmax(keys @ q[start + r, h].double() * scale, dim=0)
                out[start + r, h] = weights @ values
    return out


def sdpa_prefill(q, k_pool, v_pool, tables, lens, starts, counts, scale, window,
                 by_kernel: list[bool] | None = None, sdpa_dtype: torch.dtype | None = None):
    """The engine's path without the native kernel: its attention over a one-layer cache.

    With ``by_kernel``, the engine's split for long prompts: the native kernel takes
    the sequences marked True in one call, SDPA (in ``sdpa_dtype``) the others."""
    kv_heads, blocks, block, dim = k_pool.shape
    cache = PagedKVCache(CacheShape(1, kv_heads, dim), k_pool.dtype, blocks, block)
    cache.keys[0], cache.values[0] = k_pool, v_pool
    spans, used = [], []
    for s in range(len(lens)):
        width = -(-int(lens[s]) // block)
        spans.append((len(used), width))
        used += tables[s, :width].tolist()
    pre = None
    if by_kernel is not None:
        mine = torch.tensor([i for i, k in enumerate(by_kernel) if k])
        pre = PrefillRows(load_kernels().prefill, tables[mine].contiguous(), lens[mine],
                          starts[mine], counts[mine])
    step = StepMetadata(cache=cache, slots=torch.empty(0, dtype=torch.long),
                        blocks=torch.tensor(used, dtype=torch.long), spans=spans,
                        context_lens=[int(n) for n in lens], query_lens=[int(n) for n in counts],
                        offsets=[int(n) for n in starts], prefill=pre, by_kernel=by_kernel,
                        sdpa_dtype=sdpa_dtype)
    # The new keys and values are read from the cache (every sequence has a span), not these.
    unused = torch.empty(kv_heads, q.shape[0], dim)
    return attend_packed(0, q.transpose(0, 1), unused, unused, step, scale, window or None)


def _case(gen: torch.Generator, pool_dtype: torch.dtype, dim: int, lens: list[int],
          counts: list[int]):
    """Pools with each sequence's blocks scattered, q with a gap row between sequences."""
    seed = int(torch.randint(1 << 30, (1,), generator=gen))
    _, k, v, tables, lens_t = random_paged_case(pool_dtype, dim, 6, 2, lens, block=4, seed=seed)
    starts, row = [], 0
    for n in counts:
        starts.append(row)
        row += n + 1  # an unowned row after each sequence
    q = torch.randn(row, 6, dim, generator=gen)
    return (q, k, v, tables, lens_t, torch.tensor(starts, dtype=torch.int32),
            torch.tensor(counts, dtype=torch.int32))


@pytest.mark.parametrize("path", ["paged_prefill", "sdpa", "sdpa-two-calls", "split",
                                  "split-bf16"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("window", [0, 3, 40])
def test_prefill_attention_matches_the_definition(path, pool_dtype, dim, window, monkeypatch):
    """``split``: the engine's long-prompt routing, kernel and SDPA in one step; in bf16
    (``split-bf16``, the bf16-matmul engine's choice) SDPA rounds queries and weights.
    ``sdpa-two-calls``: every chunk after cached context as big chunks take it, two
    flash calls (prefix, then its own keys) merged by their log-sum-exps."""
    tolerance = 2e-5
    if path == "sdpa-two-calls":
        from switchyard_xeon import attention

        if attention._FLASH_WITH_LSE is None:
            pytest.skip("this torch has no CPU flash attention with log-sum-exps")
        monkeypatch.setattr(attention, "SPLIT_FROM_PAIRS", 1)
    if path == "paged_prefill":
        kernel_paths.require("paged_prefill")
        attend = load_kernels().prefill
    elif path.startswith("split"):
        kernel_paths.require("paged_prefill")
        bf16 = path == "split-bf16"
        if bf16:
            tolerance = 3e-2
        attend = partial(sdpa_prefill, by_kernel=[False, True, False, True, False],
                         sdpa_dtype=torch.bfloat16 if bf16 else None)
    else:
        attend = sdpa_prefill
    gen = torch.Generator().manual_seed(dim + window)
    # Fresh prompts (count == length, one longer than a row chunk of 16), chunks
    # after cached context, a single row after a long context.
    lens, counts = [37, 5, 20, 1, 60], [37, 5, 9, 1, 1]
    q, k, v, tables, lens_t, starts, counts_t = _case(gen, pool_dtype, dim, lens, counts)
    args = (q, k, v, tables, lens_t, starts, counts_t, dim**-0.5, window)
    got, want = attend(*args), naive_prefill(*args)
    for (row, head), value in want.items():
        torch.testing.assert_close(got[row, head].double(), value, atol=tolerance, rtol=1e-4)


def test_prefill_kernel_rejects_bad_inputs(prefill):
    gen = torch.Generator().manual_seed(0)
    q, k, v, tables, lens, starts, counts = _case(gen, torch.float32, 64, [8, 4], [8, 2])
    with pytest.raises(RuntimeError, match="64 or 128"):
        prefill(q[..., :32].contiguous(), k[..., :32].contiguous(), v[..., :32].contiguous(),
                tables, lens, starts, counts, 0.1, 0)
    with pytest.raises(RuntimeError, match="float32 q"):
        prefill(q.bfloat16(), k.bfloat16(), v.bfloat16(), tables, lens, starts, counts, 0.1, 0)
    with pytest.raises(RuntimeError, match="int32"):
        prefill(q, k, v, tables.long(), lens, starts, counts, 0.1, 0)
    with pytest.raises(RuntimeError, match="does not fit"):  # more rows than cached tokens
        prefill(q, k, v, tables, lens, starts, torch.tensor([9, 2], dtype=torch.int32), 0.1, 0)
    with pytest.raises(RuntimeError, match="does not fit"):  # rows past the end of q
        prefill(q, k, v, tables, lens, torch.tensor([0, q.shape[0] - 1], dtype=torch.int32),
                counts, 0.1, 0)
    with pytest.raises(RuntimeError, match="does not fit"):  # a context longer than its table
        prefill(q, k, v, tables, torch.tensor([8, 40], dtype=torch.int32), starts, counts, 0.1, 0)


def test_the_engine_takes_the_kernel_only_for_head_sizes_it_has(make_engine, caplog):
    """The default model's heads are 32 wide: its prefill stays on SDPA, said at start-up."""
    with caplog.at_level("INFO", logger="switchyard.xeon"):
        engine = make_engine()
    assert engine._runner.prefill_kernel is None
    assert "prefill attention: SDPA per sequence" in caplog.text
