"""The native paged prefill attention kernel against its PyTorch reference.

Engine-level greedy parity through it (chunked prefill, windows, four
families) is in ``test_xeon_decoder.py``, whose models have head_dim 64.
"""

from __future__ import annotations

import pytest
import torch

from switchyard_xeon.kernels import load_kernels
from switchyard_xeon.kernels.reference import paged_prefill_reference

from tests.xeon.test_xeon_fast_path import random_case


@pytest.fixture
def prefill():
    kernel = load_kernels().prefill
    if kernel is None:
        pytest.skip(f"no native prefill kernel here ({load_kernels().reason}; AVX-512 builds only)")
    return kernel


def _case(gen: torch.Generator, pool_dtype: torch.dtype, dim: int, lens: list[int],
          counts: list[int]):
    """Pools with each sequence's blocks scattered, q with a gap row between sequences."""
    seed = int(torch.randint(1 << 30, (1,), generator=gen))
    _, k, v, tables, lens_t = random_case(pool_dtype, dim, 6, 2, lens, block=4, seed=seed)
    starts, row = [], 0
    for n in counts:
        starts.append(row)
        row += n + 1  # an unowned row after each sequence
    q = torch.randn(row, 6, dim, generator=gen)
    return (q, k, v, tables, lens_t, torch.tensor(starts, dtype=torch.int32),
            torch.tensor(counts, dtype=torch.int32))


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("window", [0, 3, 40])
def test_prefill_kernel_matches_the_reference(prefill, pool_dtype, dim, window):
    gen = torch.Generator().manual_seed(dim + window)
    # Fresh prompts (count == length, one longer than a row chunk of 16), chunks
    # after cached context, a single row after a long context.
    lens, counts = [37, 5, 20, 1, 60], [37, 5, 9, 1, 1]
    q, k, v, tables, lens_t, starts, counts_t = _case(gen, pool_dtype, dim, lens, counts)
    args = (q, k, v, tables, lens_t, starts, counts_t, dim**-0.5, window)
    got, want = prefill(*args), paged_prefill_reference(*args)
    for start, n in zip(starts.tolist(), counts, strict=True):
        torch.testing.assert_close(got[start : start + n], want[start : start + n],
                                   atol=2e-5, rtol=1e-4)


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
