"""Speculative decoding with a draft model (engine option ``speculative_model``).

Greedy requests must give the tokens and logprobs of the engine without
speculation, whether the draft agrees with the target (the target itself) or
disagrees often (another random model with the same tokenizer); the engine's
counters must show drafts fed, so a pass where nothing was drafted fails.
The runner's rejection step over a small vocabulary must emit tokens with the
target's distribution (a chi-square test, as in
tests/engine/test_engine_speculation.py), with the request's temperature and
top-k applied to both models.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from switchyard_engine.sampling import RowSampler, final_scores
from switchyard_spec import EngineStartError, SamplingParams
from switchyard_xeon.runner import verify_rejection

from tests.support.engine_requests import Collector, greedy_request, prompt_of
from tests.support.family_models import ensure_family
from tests.support.xeon_engines import started_engine

NEW = 30
PROMPTS = [[11, 12, 13, 14, 15, 16, 17, 18] * 3, prompt_of(23), prompt_of(9, start=3)]


def _run(engine, prompts: list[list[int]]) -> list[list[tuple[int, float]]]:
    sink = Collector()
    for i, prompt in enumerate(prompts):
        engine.submit(greedy_request(f"d{i}", prompt, NEW), sink)
    out = []
    for i in range(len(prompts)):
        events = [e for e in sink.wait(f"d{i}") if e.error is None and e.token_id >= 0]
        out.append([(e.token_id, e.logprob) for e in events])
    return out


def _same(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert [lp for _, lp in g] == pytest.approx([lp for _, lp in w], abs=1e-4)


@pytest.mark.parametrize("draft", ["itself", "qwen2"])
def test_greedy_output_is_the_targets_with_a_draft_model(default_model_path, model_cache,
                                                         draft):
    folder = (default_model_path if draft == "itself"
              else ensure_family(draft, default_model_path, model_cache))
    plain = started_engine(default_model_path)
    spec = started_engine(default_model_path, speculate="4", speculative_model=str(folder))
    try:
        want = _run(plain, PROMPTS)
        _same(_run(spec, PROMPTS), want)  # together: the gate closes at 4 (3 here: open)
        for prompt, expected in zip(PROMPTS, want, strict=True):
            _same(_run(spec, [prompt]), [expected])
        counters = spec._scheduler.counters
        assert counters.draft_tokens > 0
        if draft == "itself":  # the same model drafts the target's own greedy tokens
            assert counters.accepted_tokens == counters.draft_tokens
        else:
            assert counters.accepted_tokens < counters.draft_tokens
        assert spec.stats().spec_method == "draft_model"
        # Every ended sequence dropped its draft cache.
        assert not spec._scheduler.drafter._states
    finally:
        plain.shutdown()
        spec.shutdown()


def test_a_failing_draft_forward_costs_drafts_not_output(default_model_path):
    """A draft model whose forward raises leaves every sequence's tokens as they were:
    the steps run without drafts."""
    plain = started_engine(default_model_path)
    spec = started_engine(default_model_path, speculate="4",
                          speculative_model=str(default_model_path))
    try:
        want = _run(plain, PROMPTS[:1])
        drafter = spec._scheduler.drafter
        _same(_run(spec, PROMPTS[:1]), want)  # the forward's argument name is now known
        drafted = spec._scheduler.counters.draft_tokens

        def broken(**kwargs):
            raise RuntimeError("position out of range")

        drafter.model = broken
        _same(_run(spec, PROMPTS[:1]), want)
        assert spec._scheduler.counters.draft_tokens == drafted
        assert drafter._failed and not drafter._states
    finally:
        plain.shutdown()
        spec.shutdown()


def test_a_draft_with_another_vocabulary_is_refused(default_model_path, tmp_path):
    other = tmp_path / "other-vocab"
    shutil.copytree(default_model_path, other)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens trade ids: same size, other meaning
    (other / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(EngineStartError, match="speculative_model.*not the target's"):
        started_engine(default_model_path, speculate="4", speculative_model=str(other))


@pytest.mark.parametrize(("options", "named"), [
    ({"speculative_model": "/nonexistent/draft"}, "no such folder"),
    ({"speculative_model": "{folder}", "speculate": "0"}, "needs speculate"),
])
def test_bad_draft_settings_stop_start_up_naming_the_option(default_model_path, options, named):
    options = {"speculate": "4", **options}
    options = {k: v.format(folder=default_model_path) for k, v in options.items()}
    with pytest.raises(EngineStartError, match=f"speculative_model.*{named}"):
        started_engine(default_model_path, **options)


VOCAB = 6
TRIALS = 4000
ALPHA = 1e-3
"""False-failure rate of each chi-square test below."""


def _chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """The p-value of Pearson's chi-square statistic over the cells with expected > 0."""
    cells = expected > 0
    assert counts[~cells].sum() == 0, "a token of probability 0 was emitted"
    stat = float(((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum())
    dof = int(cells.sum()) - 1
    chi2 = torch.distributions.Chi2(torch.tensor(float(dof)))
    # Chi2 has no survival function in torch: integrate its density numerically.
    xs = torch.linspace(stat, stat + 200.0, 20001, dtype=torch.float64)
    return float(torch.trapezoid(chi2.log_prob(xs.float()).double().exp(), xs))


def test_the_rejection_step_keeps_the_targets_distribution():
    """Two drafts from a q unlike the target, temperature 0.8 and top-k 5: the first
    emitted token follows p_0, and the second, given that the first kept draft 0,
    follows p_1."""
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(3, VOCAB, generator=gen) * 1.5
    params = SamplingParams(do_sample=True, temperature=0.8, top_k=5)
    sampler = RowSampler(params, [1], VOCAB, seed=3)
    p = [torch.softmax(final_scores(rows[j], sampler).double(), -1) for j in range(3)]
    q = torch.softmax(torch.randn(2, VOCAB, generator=gen, dtype=torch.float64) * 2, -1)
    # The draft most often kept first: its trials give the most second tokens to count.
    kept_first = int(torch.minimum(p[0], q[0]).argmax())
    first = torch.zeros(VOCAB, dtype=torch.float64)
    second = torch.zeros(VOCAB, dtype=torch.float64)
    for _ in range(TRIALS):
        drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        out = verify_rejection(sampler, drafts, rows, q)
        tokens = [out.token_id, *(t.token_id for t in out.more)]
        first[tokens[0]] += 1
        if drafts[0] == kept_first and tokens[0] == kept_first:  # draft 0 was kept
            second[tokens[1]] += 1
        assert out.logprob == pytest.approx(float(torch.log(p[0][tokens[0]])), abs=1e-5)
    assert second.sum() > 300
    assert _chi_square_p(first, p[0] * TRIALS) > ALPHA
    assert _chi_square_p(second, p[1] * second.sum()) > ALPHA


def test_the_chi_square_check_fails_the_draft_distribution():
    """The negative control: tokens drawn from q itself fail the same test against p."""
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(3, VOCAB, generator=gen) * 1.5
    sampler = RowSampler(SamplingParams(do_sample=True, temperature=0.8, top_k=5), [1],
                         VOCAB, seed=3)
    p0 = torch.softmax(final_scores(rows[0], sampler).double(), -1)
    q = torch.softmax(torch.randn(2, VOCAB, generator=gen, dtype=torch.float64) * 2, -1)
    counts = torch.bincount(torch.multinomial(q[0], TRIALS, replacement=True, generator=gen),
                            minlength=VOCAB).double()
    with pytest.raises(AssertionError, match="probability 0"):
        _chi_square_p(counts, p0 * TRIALS)
    q_in = q[0] * (p0 > 0)
    counts = torch.bincount(torch.multinomial(q_in, TRIALS, replacement=True, generator=gen),
                            minlength=VOCAB).double()
    assert _chi_square_p(counts, p0 * TRIALS) < ALPHA


def test_greedy_rejection_keeps_drafts_while_they_are_the_argmax():
    rows = torch.tensor([[0.0, 3.0, 1.0, 0.0], [2.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 5.0]])
    sampler = RowSampler(SamplingParams(), [1], 4)
    q = torch.full((2, 4), 0.25, dtype=torch.float64)
    out = verify_rejection(sampler, [1, 0], rows, q)
    assert [out.token_id, *(t.token_id for t in out.more)] == [1, 0, 3]
    sampler = RowSampler(SamplingParams(), [1], 4)
    out = verify_rejection(sampler, [1, 2], rows, q)
    assert [out.token_id, *(t.token_id for t in out.more)] == [1, 0]
    assert out.logprob == pytest.approx(float(torch.log_softmax(rows[0], -1)[1]))
