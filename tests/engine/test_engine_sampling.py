"""switchyard_engine.sampling on synthetic logits, checked against transformers' processors."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from switchyard_engine.sampling import (
    RowSampler,
    apply_logit_bias,
    apply_penalties,
    sample,
    sample_step,
    warp,
)
from switchyard_engine.topk_filter import filter_candidates
from switchyard_engine.watermark import WatermarkConfig, greenlist
from switchyard_spec import SamplingParams

from tests.support.sampling_reference import transformers_warp

V = 64


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=gen) * 3


def _row(params: SamplingParams, prompt: tuple[int, ...] = (), seed: int | None = None,
         **kwargs: object) -> RowSampler:
    if params.do_sample and seed is None:
        seed = params.seed if params.seed is not None else 0
    return RowSampler(params, prompt, V, seed=seed, **kwargs)  # type: ignore[arg-type]


def test_greedy_rows_take_argmax_and_raw_logprobs():
    logits = _logits(5)
    rows = [_row(SamplingParams(top_n_tokens=3)) for _ in range(5)]
    out = sample(logits, rows)
    raw = torch.log_softmax(logits, -1)
    for i, tok in enumerate(out):
        assert tok.token_id == int(logits[i].argmax())
        assert tok.logprob == pytest.approx(float(raw[i, tok.token_id]), abs=1e-6)
        assert [t.id for t in tok.top_tokens] == raw[i].topk(3).indices.tolist()


def test_top_k_one_equals_greedy():
    logits = _logits(8, seed=1)
    rows = [_row(SamplingParams(do_sample=True, top_k=1, temperature=2.0, seed=i)) for i in range(8)]
    out = sample(logits, rows)
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()
    # Everything but the one survivor is filtered, so it carries all the mass.
    assert all(t.logprob == pytest.approx(0.0, abs=1e-6) for t in out)


def test_sampled_logprob_uses_temperature_processed_logits():
    logits = _logits(1, seed=2)
    (tok,) = sample(logits, [_row(SamplingParams(do_sample=True, temperature=0.5, seed=3))])
    expected = torch.log_softmax(logits / 0.5, -1)[0, tok.token_id]
    assert tok.logprob == pytest.approx(float(expected), abs=1e-5)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(do_sample=True, temperature=0.7, top_k=10),
        SamplingParams(do_sample=True, top_p=0.8),
        SamplingParams(do_sample=True, temperature=1.5, top_k=20, top_p=0.6),
        SamplingParams(do_sample=True, typical_p=0.7),
        SamplingParams(do_sample=True, temperature=0.9, top_k=30, top_p=0.9, typical_p=0.8),
        SamplingParams(do_sample=True, min_p=0.1),
        SamplingParams(do_sample=True, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
        SamplingParams(do_sample=True, min_p=0.2, typical_p=0.9),
    ],
)
def test_warp_matches_transformers_in_a_mixed_batch(params):
    """Each row of a heterogeneous batch is warped exactly as transformers warps it alone."""
    logits = _logits(4, seed=4)
    batch = [params, SamplingParams(do_sample=True), params,
             SamplingParams(do_sample=True, top_k=5, top_p=0.5)]
    warped = warp(logits, batch)
    for i, p in enumerate(batch):
        expected = transformers_warp(logits[i : i + 1], p)[0]
        assert torch.equal(torch.isinf(warped[i]), torch.isinf(expected)), (i, p)
        finite = ~torch.isinf(expected)
        torch.testing.assert_close(warped[i][finite], expected[finite])


def _hf_kept_mass_before(scores: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Each token's probability mass before it, exactly (float64), after temperature and
    top-k, with the tokens in descending order of probability: where top-p cuts."""
    scaled = scores.double() / p.temperature
    if p.top_k:
        kth = scaled.topk(p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    order = probs.argsort(descending=True)
    before = torch.empty_like(probs)
    before[order] = probs[order].cumsum(0) - probs[order]
    return before


CUT_TOLERANCE = 2e-5
"""How far from ``top_p`` the exact mass before a token may lie for our kept set and
transformers' to disagree on it. Both compute that mass in float32 over the whole
vocabulary, in different orders (transformers sums the ascending probabilities, we the
descending ones); at 49,152 tokens the two sums differ by a few 1e-6 (5.9e-6 at most in
the rows below). A token whose mass before it is further from ``top_p`` than this is a
real disagreement."""


def test_warp_keeps_transformers_set_at_a_real_vocabulary_size():
    """300 rows at SmolLM2's vocabulary (49,152 > CANDIDATES), the path every sampled
    request on a real model takes, against transformers' warpers row by row.

    Rows with top-k keep exactly transformers' set. A row with top-p and no top-k may
    differ from it only at the cut, on tokens whose exact mass before them is within
    float32 summation error (CUT_TOLERANCE) of top_p: 291 of these 300 rows match exactly,
    the other 9 (all top-p without top-k) by one or two such tokens each; at least 95% must
    match exactly. Kept tokens keep transformers' values exactly.
    """
    vocab, n = 49152, 300
    gen = torch.Generator().manual_seed(49152)
    rnd = random.Random(49152)
    scale = torch.tensor([rnd.choice([1.0, 2.0, 3.0, 4.0, 6.0]) for _ in range(n)])
    logits = torch.randn(n, vocab, generator=gen) * scale[:, None]
    params = []
    for _ in range(n):
        top_k = rnd.choice([0, 0, 5, 20, 50, 100, 256, 400])
        top_p = rnd.choice([1.0, 0.5, 0.8, 0.9, 0.95, 0.99])
        if not top_k and top_p == 1.0:
            top_p = 0.9
        params.append(SamplingParams(do_sample=True, temperature=rnd.choice([0.5, 0.7, 1.0, 1.3]),
                                     top_k=top_k, top_p=top_p))
    ours = warp(logits, params)
    temperatures = torch.tensor([p.temperature for p in params])[:, None]
    refiltered = filter_candidates(logits / temperatures, [p.top_k for p in params],
                                   [p.top_p for p in params]).exact
    exact = 0
    for i, p in enumerate(params):
        expected = transformers_warp(logits[i : i + 1], p)[0]
        kept, want = torch.isfinite(ours[i]), torch.isfinite(expected)
        both = kept & want
        assert torch.equal(ours[i][both], expected[both]), (i, p)
        if torch.equal(kept, want):
            exact += 1
            continue
        assert not p.top_k and p.top_p < 1.0, (i, p, "a row with top-k differs")
        differ = (kept ^ want).nonzero()[:, 0]
        off = (_hf_kept_mass_before(logits[i], p)[differ] - p.top_p).abs()
        assert float(off.max()) < CUT_TOLERANCE, (i, p, differ.tolist(), off.tolist())
    assert exact >= 0.95 * n, exact
    # Most rows were decided on their candidates, not refiltered by a full sort.
    assert int((~refiltered).sum()) >= n // 2, int((~refiltered).sum())


def test_min_p_only_samples_tokens_near_the_most_likely():
    logits = torch.full((1, V), -10.0)
    logits[0, :3] = torch.tensor([3.0, 2.5, 1.0])  # p(1)/p(0) = 0.61, p(2)/p(0) = 0.14
    drawn = set()
    for seed in range(200):
        (tok,) = sample(logits, [_row(SamplingParams(do_sample=True, min_p=0.3), seed=seed)])
        drawn.add(tok.token_id)
    assert drawn == {0, 1}


def test_top_p_only_samples_from_the_nucleus():
    logits = torch.full((1, V), -10.0)
    logits[0, :3] = torch.tensor([3.0, 2.5, 2.0])  # the three carry ~all the mass
    nucleus = set()
    for seed in range(200):
        (tok,) = sample(logits, [_row(SamplingParams(do_sample=True, top_p=0.7), seed=seed)])
        nucleus.add(tok.token_id)
    # p(0)=0.51, p(1)=0.31: 0.7 needs both, and never the third.
    assert nucleus == {0, 1}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = torch.full((1, V), float("-inf"))
    logits[0, :3] = probs.log()
    counts = torch.zeros(3)
    for seed in range(3000):
        (tok,) = sample(logits, [_row(SamplingParams(do_sample=True), seed=seed)])
        counts[tok.token_id] += 1
    torch.testing.assert_close(counts / counts.sum(), probs, atol=0.03, rtol=0)


def test_repetition_penalty_matches_transformers():
    logits = _logits(2, seed=5)
    prompt = (1, 2, 3, 40)
    row = _row(SamplingParams(repetition_penalty=1.3), prompt)
    row.record(7)
    plain = _row(SamplingParams())
    out = apply_penalties(logits, [row, plain])
    ids = torch.tensor([[1, 2, 3, 40, 7]])
    expected = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits[:1].clone())
    torch.testing.assert_close(out[0], expected[0])
    torch.testing.assert_close(out[1], logits[1])


def test_frequency_and_presence_count_only_the_output():
    logits = torch.zeros(1, V)
    row = _row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt=(9, 9, 9))
    for tok in (4, 4, 6):
        row.record(tok)
    out = apply_penalties(logits, [row])[0]
    assert out[4] == pytest.approx(-(2 * 0.5 + 0.25))
    assert out[6] == pytest.approx(-(0.5 + 0.25))
    assert out[9] == 0.0  # prompt tokens are not counted


def test_penalties_apply_to_greedy_rows():
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 8] = 2.0, 1.9
    row = _row(SamplingParams(repetition_penalty=2.0), prompt=(3,))
    (tok,) = sample(logits, [row])
    assert tok.token_id == 8


def test_a_tiny_repetition_penalty_keeps_logprobs_finite():
    """Dividing a logit by a tiny penalty overflows float32: the largest finite value stands in."""
    logits = torch.zeros(2, V)
    logits[:, 3] = 50.0
    rows = [_row(SamplingParams(repetition_penalty=1e-38), prompt=(3,), logprobs=True),
            _row(SamplingParams(), logprobs=True)]
    tokens = sample_step(logits, rows).tokens
    assert [t.token_id for t in tokens] == [3, 3]
    assert all(t.logprob == t.logprob and t.logprob <= 0.0 for t in tokens)  # not NaN


def test_seeded_rows_ignore_batch_mates():
    target = SamplingParams(do_sample=True, temperature=1.2, top_p=0.9, seed=77)
    logits = _logits(6, seed=6)
    alone_row = _row(target)
    alone = [sample(logits[2:3], [alone_row])[0].token_id for _ in range(10)]
    rows = [_row(SamplingParams(do_sample=True, seed=i)) for i in range(6)]
    rows[2] = _row(target)
    rows[4] = _row(SamplingParams())
    crowded = [sample(logits, rows)[2].token_id for _ in range(10)]
    assert alone == crowded


def test_top_n_is_per_row():
    logits = _logits(3, seed=7)
    rows = [_row(SamplingParams(top_n_tokens=n)) for n in (0, 2, 5)]
    out = sample(logits, rows)
    assert [len(t.top_tokens) for t in out] == [0, 2, 5]


def test_one_host_transfer_per_step(monkeypatch):
    """The whole batch's results leave the device in a single tolist() call."""
    calls = {"tolist": 0, "item": 0}
    real_tolist, real_item = torch.Tensor.tolist, torch.Tensor.item

    def counting_tolist(self):
        calls["tolist"] += 1
        return real_tolist(self)

    def counting_item(self):
        calls["item"] += 1
        return real_item(self)

    rows = [
        _row(SamplingParams(top_n_tokens=2, logit_bias=((3, 5.0),))),
        _row(SamplingParams(do_sample=True, top_k=5, top_p=0.9, typical_p=0.9, seed=1,
                            repetition_penalty=1.2, frequency_penalty=0.1, watermark=True),
             prompt=(1, 2)),
        _row(SamplingParams(do_sample=True, temperature=0.5, seed=2, watermark=True)),
    ]
    logits = _logits(3, seed=8)
    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    result = sample_step(logits, rows, carry=torch.tensor([-0.5, -1.25]))
    assert calls == {"tolist": 1, "item": 0}
    assert result.carried == [-0.5, -1.25] and len(result.tokens) == 3


def test_logit_bias_forces_and_bans_under_greedy():
    logits = _logits(3, seed=9)
    best = logits.argmax(-1)
    forced = int(logits[0].argmin())
    rows = [
        _row(SamplingParams(logit_bias=((forced, 100.0),))),
        _row(SamplingParams(logit_bias=((int(best[1]), -100.0),))),
        _row(SamplingParams()),
    ]
    out = sample(logits, rows)
    assert out[0].token_id == forced
    assert out[1].token_id == int(logits[1].topk(2).indices[1])
    assert out[2].token_id == int(best[2])
    # The bias is part of the logits a greedy row reports its logprob from.
    assert out[0].logprob == pytest.approx(
        float(torch.log_softmax(apply_logit_bias(logits, rows), -1)[0, forced]), abs=1e-6)


def test_logit_bias_comes_before_penalties_and_sampling():
    logits = torch.zeros(2, V)
    row = _row(SamplingParams(logit_bias=((4, 3.0), (70, 1.0)), repetition_penalty=2.0),
               prompt=(4,))
    out = apply_penalties(apply_logit_bias(logits, [row, _row(SamplingParams())]),
                          [row, _row(SamplingParams())])
    assert out[0, 4] == pytest.approx(1.5)  # (0 + 3) / 2: the penalty sees the biased logit
    assert out[1].abs().sum() == 0  # out-of-vocabulary ids (70) are ignored, other rows untouched
    sampled = _row(SamplingParams(do_sample=True, top_k=3, logit_bias=((9, 100.0),)), seed=5)
    assert all(sample(_logits(1, seed=s), [sampled])[0].token_id == 9 for s in range(5))


def test_watermark_biases_green_tokens_for_greedy_and_sampled_rows():
    logits = torch.zeros(2, V)
    prompt = (17,)
    green = set(greenlist(17, V, 0.5).tolist())
    rows = [_row(SamplingParams(watermark=True), prompt),
            # A large delta makes the sampled row's choice certain, not just likely.
            _row(SamplingParams(do_sample=True, watermark=True), prompt, seed=3,
                 watermark=WatermarkConfig(gamma=0.5, delta=50.0))]
    for tok in sample(logits, rows):
        assert tok.token_id in green
    # The next step is seeded by the token just chosen.
    rows[0].record(23)
    assert sample(logits[:1], rows[:1])[0].token_id in set(greenlist(23, V, 0.5).tolist())


def test_watermark_uses_the_given_settings_and_not_the_sampling_generator():
    plain = _row(SamplingParams(do_sample=True, seed=8))
    marked = _row(SamplingParams(do_sample=True, seed=8, watermark=True),
                  watermark=WatermarkConfig(gamma=0.5, delta=0.0))
    logits = _logits(1, seed=10)
    # delta 0 changes no logit; the green-list draw must not disturb the seeded noise.
    assert [sample(logits, [plain])[0].token_id for _ in range(5)] == \
        [sample(logits, [marked])[0].token_id for _ in range(5)]


def test_logprobs_can_be_skipped():
    logits = _logits(2, seed=11)
    rows = [_row(SamplingParams(), logprobs=False),
            _row(SamplingParams(do_sample=True, seed=1), logprobs=False)]
    out = sample(logits, rows)
    assert [t.logprob for t in out] == [0.0, 0.0]
    assert out[0].token_id == int(logits[0].argmax())
    # One row that wants them brings them back for the step.
    rows.append(_row(SamplingParams()))
    assert sample(logits[[0, 1, 0]], rows)[2].logprob < 0.0


def _shaped(vocab: int, head: list[float], tail: float, rows: int = 1) -> torch.Tensor:
    """Rows of ``vocab`` logits: ``head`` on the first ids, ``tail`` on all the others."""
    logits = torch.full((rows, vocab), tail)
    logits[:, : len(head)] = torch.tensor(head)
    return logits


def _chi_square(draws: list[int], probs: torch.Tensor, bins: int) -> float:
    """Pearson's statistic of the draws against ``probs`` ([vocab]): the ``bins - 1`` most
    likely ids one bin each, everything else one more bin."""
    order = probs.argsort(descending=True)
    bin_of = torch.full_like(order, bins - 1)
    bin_of[order[: bins - 1]] = torch.arange(bins - 1)
    expected = torch.zeros(bins, dtype=torch.float64).index_add_(0, bin_of, probs.double())
    observed = torch.zeros(bins, dtype=torch.float64).index_add_(
        0, bin_of[torch.tensor(draws)], torch.ones(len(draws), dtype=torch.float64))
    expected *= len(draws)
    assert float(expected.min()) > 20, "too few expected draws per bin for the statistic"
    return float(((observed - expected) ** 2 / expected).sum())


_HEAD = [4.0, 3.2, 2.5, 1.9, 1.4, 1.0]


@pytest.mark.parametrize(
    ("head", "tail", "params", "bins", "refiltered"),
    [
        # Top-p on the candidates: the 994 tail tokens hold 0.6% of the mass.
        (_HEAD, -8.0, SamplingParams(do_sample=True, top_p=0.95), 5, False),
        # Temperature, top-k, then top-p, on the candidates.
        (_HEAD, -8.0, SamplingParams(do_sample=True, temperature=0.8, top_k=5, top_p=0.99),
         5, False),
        # The candidates hold too little of the mass: refiltered by a full sort, the
        # cut inside the tail's run of ties; the kept tail is one bin.
        ([4.0, 3.5, 3.0, 2.5], 0.0, SamplingParams(do_sample=True, top_p=0.97), 5, True),
        # No filter: the whole softmax, the tail one bin.
        (_HEAD, -3.0, SamplingParams(do_sample=True), 7, None),
        # Typical-p after top-p.
        (_HEAD, -8.0, SamplingParams(do_sample=True, top_p=0.99, typical_p=0.9), 4, None),
    ],
)
def test_draws_follow_the_kept_softmax(head, tail, params, bins, refiltered):
    """Thousands of seeds, one row each, in one batch: the picks must match softmax(warp)."""
    vocab, draws = 1000, 8000
    logits = _shaped(vocab, head, tail, rows=draws)
    if refiltered is not None:
        scaled = logits[:1] / params.temperature
        path = filter_candidates(scaled, [params.top_k], [params.top_p])
        assert bool(path.exact[0]) is refiltered
    rows = [RowSampler(params, (), vocab, seed=seed) for seed in range(draws)]
    picks = [t.token_id for t in sample(logits, rows)]
    kept = warp(logits[:1], [params])[0]
    probs = torch.softmax(kept, dim=-1)
    assert all(torch.isfinite(kept[picks]).tolist()), "a removed token was drawn"
    # The 1e-6 tail of the chi-square with bins - 1 <= 6 degrees of freedom lies below 40;
    # a shifted inverse CDF, or probabilities off by a temperature of 0.8, land far above.
    assert _chi_square(picks, probs, bins) < 40.0


def test_inverse_cdf_never_lands_on_a_zero_probability_token():
    """A uniform rounded up to the total mass still picks the last kept token."""
    from switchyard_engine.inverse_cdf import inverse_cdf

    probs = torch.tensor([[0.5, 0.0, 0.5, 0.0, 0.0], [0.0, 0.25, 0.75, 0.0, 0.0]])
    ones = torch.ones(2, dtype=torch.float64)
    assert inverse_cdf(probs, ones).tolist() == [2, 2]
    assert inverse_cdf(probs, torch.zeros(2, dtype=torch.float64)).tolist() == [0, 1]
    assert inverse_cdf(probs, torch.tensor([0.5, 0.25], dtype=torch.float64)).tolist() == [2, 2]


def test_seeded_rows_ignore_batch_mates_on_a_large_vocabulary():
    """Candidate rows, refiltered rows and unfiltered rows each keep their own token stream,
    next to a mate whose top-k widens the batch's candidates and a greedy mate."""
    vocab = 3000
    gen = torch.Generator().manual_seed(12)
    logits = torch.cat([
        torch.randn(1, vocab, generator=gen) * 4,  # peaked: on its candidates
        torch.randn(1, vocab, generator=gen) * 0.05,  # flat: refiltered
        (torch.randn(1, vocab, generator=gen) * 2).round(),  # runs of ties everywhere
        torch.randn(1, vocab, generator=gen) * 3,
    ])
    targets = [SamplingParams(do_sample=True, top_p=0.9, seed=1),
               SamplingParams(do_sample=True, temperature=0.8, top_p=0.8, seed=2),
               SamplingParams(do_sample=True, top_k=30, top_p=0.7, seed=3),
               SamplingParams(do_sample=True, temperature=1.3, seed=4)]

    def rows_for(params: list[SamplingParams]) -> list[RowSampler]:
        return [RowSampler(p, (), vocab, seed=p.seed) for p in params]

    alone_rows = rows_for(targets)
    alone = [[sample(logits[i : i + 1], [alone_rows[i]])[0].token_id for _ in range(8)]
             for i in range(4)]
    mates = [SamplingParams(do_sample=True, top_k=1200, top_p=0.95, seed=9), SamplingParams()]
    crowd_rows = rows_for([*targets, *mates])
    crowd_logits = torch.cat([logits, logits[:2]])
    steps = [[t.token_id for t in sample(crowd_logits, crowd_rows)[:4]] for _ in range(8)]
    assert [list(col) for col in zip(*steps)] == alone


def test_inverse_cdf_by_blocks_matches_one_running_sum():
    """A whole vocabulary is searched block by block; the pick is the one-pass pick."""
    from switchyard_engine.inverse_cdf import inverse_cdf

    gen = torch.Generator().manual_seed(13)
    for vocab in (2049, 5000, 49152):
        probs = torch.softmax(torch.randn(64, vocab, generator=gen) * 3, dim=-1)
        probs[:, ::7] = 0.0
        probs[1] = 0.0
        probs[1, [0, vocab - 1]] = 0.5  # the first and the last entry only
        u = torch.rand(64, generator=gen, dtype=torch.float64)
        u[:3] = torch.tensor([0.0, 1.0 - 2.0**-53, 0.5], dtype=torch.float64)
        cdf = probs.cumsum(dim=-1, dtype=torch.float64)
        total = cdf[:, -1:].contiguous()
        one_pass = torch.minimum(torch.searchsorted(cdf, u[:, None] * total, right=True),
                                 torch.searchsorted(cdf, total))[:, 0]
        picks = inverse_cdf(probs, u)
        assert torch.equal(picks, one_pass), vocab
        assert bool((probs.gather(1, picks[:, None]) > 0).all())
