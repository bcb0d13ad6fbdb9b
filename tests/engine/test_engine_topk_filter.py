"""switchyard_engine.topk_filter: the candidate filter keeps exactly what a full sort keeps.

The full sort here is the project's former filter for top-k and top-p; typical-p, which
the filter applies after them, is transformers' own ``TypicalLogitsWarper``
(``tests/support/sampling_reference.py``). The comparison with transformers' warpers for
all of them at a real vocabulary size, with its stated tolerance at the top-p cut, is
``test_warp_keeps_transformers_set_at_a_real_vocabulary_size`` in test_engine_sampling.py.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import torch

from switchyard_engine.sampling import warp
from switchyard_engine.topk_filter import CANDIDATES, filter_candidates
from switchyard_spec import SamplingParams

from tests.support.sampling_reference import transformers_typical

_NEG_INF = float("-inf")


def _reference_warp(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The full-sort warp that the candidate filter replaced, its algorithm kept verbatim for
    top-k and top-p; typical-p is transformers' warper, row by row.

    The tests apply it to one row at a time: in a batch, its top-p pass also ran over
    rows with top_p=1, whose tails it cut wherever float32 rounded the mass before them
    to 1.0 (see test_a_row_without_top_p_keeps_its_tail_next_to_top_p_rows).
    """
    device = scores.device
    finfo = torch.finfo(scores.dtype)
    temps = scores.new_tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
    temps = temps.clamp(min=finfo.tiny, max=finfo.max)[:, None]
    scaled = scores / temps
    overflow = torch.isposinf(scaled).any(dim=-1, keepdim=True)
    if overflow.any():
        shifted = (scores - scores.amax(dim=-1, keepdim=True)) / temps
        scaled = torch.where(overflow, shifted, scaled)
    scores = scaled
    vocab = scores.shape[1]

    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    ps = [p.top_p for p in params]
    if any(ks) or any(p < 1.0 for p in ps):
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_scores, dtype=torch.bool)
        if any(ks):
            k = torch.tensor([k if k else vocab for k in ks], device=device)
            kth = sorted_scores.gather(1, (k - 1)[:, None])
            remove |= sorted_scores < kth
        if any(p < 1.0 for p in ps):
            top_p = scores.new_tensor(ps)[:, None]
            probs = torch.softmax(sorted_scores.masked_fill(remove, _NEG_INF), dim=-1)
            before = probs.cumsum(dim=-1) - probs
            remove |= before >= top_p
            remove[:, 0] = False
        scores = scores.masked_fill(remove.scatter(1, order, remove), _NEG_INF)

    rows = [transformers_typical(scores[i : i + 1], p.typical_p) if p.typical_p < 1.0
            else scores[i : i + 1] for i, p in enumerate(params)]
    return torch.cat(rows)


def _kinds(rows: int, vocab: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Logit rows of every shape that matters: peaked, flat, tied, tied at the cut."""
    out = []
    for r in range(rows):
        kind = r % 6
        if kind == 0:  # Gaussian, from flat to very peaked
            row = torch.randn(vocab, generator=gen) * [0.5, 1.0, 3.0, 8.0][r % 4]
        elif kind == 1:  # integers: long runs of equal scores everywhere
            row = (torch.randn(vocab, generator=gen) * 2).round()
        elif kind == 2:  # nearly flat: the nucleus holds thousands of tokens
            row = torch.randn(vocab, generator=gen) * 0.01
        elif kind == 3:  # exactly flat
            row = torch.zeros(vocab)
        elif kind == 4:  # a few strong tokens, a tie right behind them, a flat tail
            row = torch.randn(vocab, generator=gen) * 0.1
            row[:8] = torch.tensor([9.0, 8.0, 7.0, 7.0, 7.0, 6.5, 6.5, 6.0])
        else:  # peaked with a run of ties around the 256th place (or the middle)
            row = torch.randn(vocab, generator=gen) * 3
            at = min(CANDIDATES, vocab // 2)
            top = row.sort(descending=True).values
            row[(row <= top[at - 10]) & (row >= top[at + 10])] = top[at]
        out.append(row)
    return out


_TEMPERATURES = [1e-30, 0.05, 0.7, 1.0, 1.5, 1e30]
_TOP_P = [1e-9, 0.05, 0.3, 0.5, 0.9, 0.95, 0.99, 0.999999, 1.0]


def _params(rnd: random.Random, vocab: int) -> SamplingParams:
    top_k = rnd.choice([0, 0, 0, 1, 2, 5, 50, CANDIDATES, CANDIDATES + 44, vocab - 1, vocab + 5])
    return SamplingParams(do_sample=True, temperature=rnd.choice(_TEMPERATURES),
                          top_k=top_k, top_p=rnd.choice(_TOP_P),
                          typical_p=rnd.choice([1.0, 1.0, 1.0, 0.9]))


@pytest.mark.parametrize("vocab", [100, 3000, 49152])
def test_candidate_filter_keeps_what_the_full_sort_keeps(vocab):
    """Random batches, each row checked against the full-sort warp of that row alone."""
    gen = torch.Generator().manual_seed(vocab)
    rnd = random.Random(vocab)
    batches = 8 if vocab < 10000 else 2
    for _ in range(batches):
        logits = torch.stack(_kinds(24, vocab, gen))
        params = [_params(rnd, vocab) for _ in range(24)]
        warped = warp(logits, params)
        for i, p in enumerate(params):
            expected = _reference_warp(logits[i : i + 1], [p])[0]
            assert torch.equal(warped[i], expected), (i, p)


def test_the_fast_path_and_the_fallback_both_run():
    """Peaked rows stay on their candidates; flat rows and ties at the cut are refiltered."""
    vocab = 4000
    gen = torch.Generator().manual_seed(0)
    peaked = torch.randn(4, vocab, generator=gen) * 8
    flat = torch.randn(2, vocab, generator=gen) * 0.01
    tied = torch.full((1, vocab), -5.0)
    tied[0, :4] = torch.tensor([3.0, 2.0, 2.0, 2.0])  # top_p 0.35 cuts inside the run of 2.0
    scores = torch.cat([peaked, flat, tied])
    out = filter_candidates(scores, [0, 40, 0, 0, 0, 0, 0], [0.9, 0.9, 0.5, 0.99, 0.9, 0.5, 0.35])
    assert out.exact.tolist() == [False] * 4 + [True] * 3
    for i in range(4):
        kept = int(out.kept[i])
        ids = out.cand_ids[i, :kept].tolist()
        assert set(ids) == set(torch.isfinite(out.scores[i]).nonzero()[:, 0].tolist())
        # Candidates come by descending score.
        assert out.cand_scores[i, :kept].tolist() == sorted(scores[i, ids].tolist(), reverse=True)


def test_top_k_above_the_candidate_count_widens_the_candidates():
    vocab = 2000
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(do_sample=True, top_k=700, top_p=0.999),
              SamplingParams(do_sample=True, top_k=3)]
    warped = warp(logits, params)
    assert int(torch.isfinite(warped[0]).sum()) > CANDIDATES
    assert int(torch.isfinite(warped[1]).sum()) == 3
    for i, p in enumerate(params):
        assert torch.equal(warped[i], _reference_warp(logits[i : i + 1], [p])[0])


def test_a_row_keeps_the_same_tokens_whatever_its_batch_mates_ask():
    """A mate with a large top-k widens the shared topk; a row's kept set must not move."""
    vocab = 3000
    gen = torch.Generator().manual_seed(5)
    logits = torch.stack(_kinds(12, vocab, gen))
    rnd = random.Random(5)
    params = [_params(rnd, vocab) for _ in range(12)]
    alone = torch.cat([warp(logits[i : i + 1], [p]) for i, p in enumerate(params)])
    wide = SamplingParams(do_sample=True, top_k=1500, top_p=0.9)
    mixed = warp(torch.cat([logits, logits[:1]]), [*params, wide])[:12]
    assert torch.equal(alone, mixed)


def test_top_p_at_the_full_sorts_own_rounded_mass():
    """top_p equal to the mass before a token, as the full sort rounds it, to the last bit.

    The candidates normalise over the vocabulary in another order, so their mass differs
    in the last bits; without the refiltering margin some of these rows would flip a token.
    """
    vocab = 49152
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(9)) * 3 / 0.7
    sorted_scores = logits.sort(dim=-1, descending=True).values
    probs = torch.softmax(sorted_scores, dim=-1)
    before = probs.cumsum(dim=-1) - probs
    rows, params = [], []
    for i in range(8):
        for place in (3, 17, 60, 150):
            mass = before[i, place]
            for top_p in (mass, torch.nextafter(mass, torch.tensor(0.0)),
                          torch.nextafter(mass, torch.tensor(1.0))):
                rows.append(logits[i])
                params.append(SamplingParams(do_sample=True, top_p=float(top_p)))
    warped = warp(torch.stack(rows), params)
    for i, p in enumerate(params):
        assert torch.equal(warped[i], _reference_warp(rows[i][None], [p])[0]), (i, p)


def test_a_nucleus_beyond_the_candidates_needs_no_sort_of_ids(monkeypatch):
    """Rows whose nucleus outgrows the candidates are refiltered from their sorted values."""
    import switchyard_engine.topk_filter as topk_filter

    sorted_rows: list[torch.Tensor] = []
    real = topk_filter.filter_exact

    def recording(scaled, top_k, top_p):
        sorted_rows.extend(scaled)
        return real(scaled, top_k, top_p)

    monkeypatch.setattr(topk_filter, "filter_exact", recording)
    vocab = 49152
    logits = torch.randn(16, vocab, generator=torch.Generator().manual_seed(21)) * 3
    params = [SamplingParams(do_sample=True, temperature=0.7, top_p=p) for p in (0.9, 0.95)] * 8
    warped = warp(logits, params)
    wide = (torch.isfinite(warped).sum(dim=-1) > CANDIDATES).nonzero()[:, 0].tolist()
    unsorted = [i for i in wide
                if not any(torch.equal(logits[i] / 0.7, row) for row in sorted_rows)]
    assert unsorted, "every row with a wide nucleus went to the sort of ids"
    for i, p in enumerate(params):
        assert torch.equal(warped[i], _reference_warp(logits[i : i + 1], [p])[0]), (i, p)


def test_a_row_without_top_p_keeps_its_tail_next_to_top_p_rows():
    """The full sort's float32 mass reaches 1.0 before the last tokens; top_p=1 must not cut."""
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(4)) * 3
    params = [SamplingParams(do_sample=True), SamplingParams(do_sample=True, top_p=0.9),
              SamplingParams(do_sample=True, top_k=20), SamplingParams(do_sample=True, top_p=0.5)]
    warped = warp(logits, params)
    assert torch.equal(warped[0], logits[0])
    assert int(torch.isfinite(warped[2]).sum()) == 20
