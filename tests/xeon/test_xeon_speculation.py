"""N-gram speculative decoding on the Xeon engine: the same tokens as without it.

Each test runs the same greedy requests on an engine with speculation off
and on (``speculate``), and requires the same tokens, and the same logprobs
within float32 rounding (a verifying sequence's positions attend as decode
rows of their own lengths; the plain sequence's one row per step). Prompts that repeat themselves make
the drafts accept; fresh ones make them fail; both are asked together so
that the batch mixes them. The engine's own counters must show drafts fed
and accepted, so a test that passed because nothing was drafted would fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from switchyard_spec import (
    EngineConfig,
    EngineRequest,
    EngineStartError,
    SamplingParams,
    StoppingParams,
)
from switchyard_xeon.engine import XeonEngine
from switchyard_xeon.linears import PanelLinear

from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids
from tests.support.family_models import ensure_family
from tests.support.xeon_engines import started_engine
from tests.support.xeon_options import TEST_OPTIONS

NEW = 40
REPEATED = [11, 12, 13, 14, 15, 16, 17, 18] * 4
PROMPTS = [REPEATED, prompt_of(23), [*prompt_of(9, start=3)] * 3]
# Each engine below looks up single tokens too (speculate_ngram_min=1): the random model's
# text repeats single tokens more than pairs, so its drafts are kept often enough to test.


def _run(engine: XeonEngine, prompts: list[list[int]], new: int = NEW,
         **stopping: object) -> list[list[tuple[int, float]]]:
    sink = Collector()
    for i, prompt in enumerate(prompts):
        engine.submit(greedy_request(f"r{i}", prompt, new, **stopping), sink)
    out = []
    for i in range(len(prompts)):
        events = [e for e in sink.wait(f"r{i}") if e.error is None and e.token_id >= 0]
        assert len(events) == len(token_ids(events))
        out.append([(e.token_id, e.logprob) for e in events])
    return out


def _same(got: list[list[tuple[int, float]]], want: list[list[tuple[int, float]]]) -> None:
    for g, w in zip(got, want, strict=True):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert [lp for _, lp in g] == pytest.approx([lp for _, lp in w], abs=1e-4)


@pytest.fixture(scope="module")
def folders(default_model_path: Path, model_cache: Path) -> dict[str, Path]:
    out = {"llama": default_model_path}
    for name in ("qwen2", "phi3", "mistral"):
        out[name] = ensure_family(name, default_model_path, model_cache)
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "mistral"])
def test_greedy_tokens_are_those_without_speculation(folders, family):
    plain = started_engine(folders[family])
    spec = started_engine(folders[family], speculate="4", speculate_ngram_min="1")
    try:
        want = _run(plain, PROMPTS)
        _same(_run(spec, PROMPTS), want)
        for prompt in PROMPTS:  # alone, each step speculates (the gate is open)
            _same(_run(spec, [prompt]), _run(plain, [prompt]))
        counters = spec._scheduler.counters
        assert counters.draft_tokens > 0 and counters.accepted_tokens <= counters.draft_tokens
        # A random model's greedy text repeats itself on some families, which then keep
        # drafts; on the others every draft fails, and the tokens must still be the same.
        if family in ("llama", "qwen2"):
            assert counters.accepted_tokens > 0
        assert plain._scheduler.counters.draft_tokens == 0
    finally:
        plain.shutdown()
        spec.shutdown()


def test_without_prefix_caching_and_under_preemption(default_model_path):
    """Speculation with prefix caching off, and with a cache so small that sequences are
    preempted and resume (re-prefilling prompt and output) while others speculate."""
    plain = started_engine(default_model_path, prefix_caching="false")
    spec = started_engine(default_model_path, prefix_caching="false", speculate="6",
                          speculate_ngram_min="1")
    try:
        _same(_run(spec, PROMPTS), _run(plain, PROMPTS))
    finally:
        plain.shutdown()
        spec.shutdown()
    spec = _small_cache(default_model_path, speculate="6", speculate_ngram_min="1")
    plain = _small_cache(default_model_path)
    try:
        prompts = [REPEATED, prompt_of(30), prompt_of(28, start=9)]
        want = _run(plain, prompts, new=60)
        _same(_run(spec, prompts, new=60), want)
        assert spec._scheduler.counters.preemptions > 0
        assert spec._scheduler.counters.accepted_tokens > 0
    finally:
        plain.shutdown()
        spec.shutdown()


def _small_cache(folder: Path, **options: str) -> XeonEngine:
    """An engine whose cache holds 160 tokens: three 90-token sequences cannot all fit."""
    engine = XeonEngine(EngineConfig(
        model_path=str(folder), dtype="float32", max_batch_prefill_tokens=16,
        max_batch_total_tokens=160, max_total_tokens=128,
        options={**TEST_OPTIONS, "block_size": "4", **options}))
    engine.start()
    return engine


def test_eos_and_max_tokens_end_the_step_where_they_fall(default_model_path):
    """A kept draft that is EOS, or that reaches max_new_tokens, ends the sequence there:
    the tokens after it in the same step are not sent."""
    plain = started_engine(default_model_path)
    spec = started_engine(default_model_path, speculate="8", speculate_ngram_min="1")
    try:
        for new in (1, 2, 5, 13):
            _same(_run(spec, [REPEATED], new=new), _run(plain, [REPEATED], new=new))
        want = _run(plain, PROMPTS, ignore_eos=False)
        _same(_run(spec, PROMPTS, ignore_eos=False), want)
    finally:
        plain.shutdown()
        spec.shutdown()


def test_seeded_sampling_speculates_and_keeps_the_request_seed(default_model_path):
    """Sampled rows draft too; each run with the same seed gives the same tokens (the draws
    differ from a run without drafts, whose distribution is the same: see
    tests/engine/test_engine_speculation.py)."""
    spec = started_engine(default_model_path, speculate="4", speculate_ngram_min="1")
    try:
        def sampled() -> list[int]:
            sink = Collector()
            spec.submit(EngineRequest(
                request_id="s", prompt_token_ids=tuple(REPEATED),
                sampling=SamplingParams(do_sample=True, temperature=0.3, seed=5),
                stopping=StoppingParams(max_new_tokens=30, ignore_eos=True)), sink)
            events = sink.wait("s")
            assert all(e.seed == 5 for e in events)
            return token_ids(events)

        first = sampled()
        assert len(first) == 30 and sampled() == first
        assert spec._scheduler.counters.draft_tokens > 0
    finally:
        spec.shutdown()


@pytest.mark.parametrize(("options", "named"), [
    ({"speculate": "17"}, "speculate='17' must be at most 16"),
    ({"speculate": "x"}, "speculate='x'"),
    ({"speculate": "2", "speculate_ngram_min": "4", "speculate_ngram_max": "2"},
     "speculate_ngram_min=4"),
])
def test_bad_settings_stop_start_up_naming_the_option(default_model_path, options, named):
    with pytest.raises(EngineStartError, match=named):
        started_engine(default_model_path, **options)


def test_metrics_show_the_engines_own_draft_counts(default_model_path):
    """`/metrics`' speculative counters are the scheduler's own counts, labelled `ngram`."""
    from types import SimpleNamespace

    from switchyard.telemetry.metrics import Metrics

    spec = started_engine(default_model_path, speculate="4", speculate_ngram_min="1")
    try:
        _run(spec, PROMPTS)
        counters = spec._scheduler.counters
        model = SimpleNamespace(name="m", engine_spec=SimpleNamespace(name="xeon"), warmup=None,
                                engine=spec)
        text = Metrics(lambda: [model]).exposition().decode()
    finally:
        spec.shutdown()
    labels = '{model="m",engine="xeon",method="ngram"}'
    for name, value in (("drafts", counters.drafts), ("draft_tokens", counters.draft_tokens),
                        ("accepted_tokens", counters.accepted_tokens)):
        assert f"switchyard_spec_decode_num_{name}{labels} {value}\n" in text, text
    assert counters.accepted_tokens > 0
    assert "# TYPE switchyard_spec_decode_num_draft_tokens counter" in text


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_verifying_rows_ride_the_decode_kernel_within_the_row_tile(default_model_path, dtype):
    """A verifying sequence's positions are packed as decode rows of one table, each
    attending up to its own position, so a step of them takes the decode kernel's
    one-call path; and no sequence feeds more positions than the linear kernels' row
    tile, where the engine's linears are panel ones."""
    spec = started_engine(default_model_path, dtype, speculate="8", speculate_ngram_min="1")
    runner = spec._runner
    steps: list[tuple[list[tuple[int, int, int]], object]] = []
    pack = runner.pack

    def recording_pack(seqs, keep=None):
        packed = pack(seqs, keep)
        fed = [(s.num_cached, s.num_scheduled, len(s.drafts)) for s in seqs]
        steps.append((fed, packed.step.decode))
        return packed

    runner.pack = recording_pack
    try:
        _run(spec, [REPEATED], new=60)
    finally:
        spec.shutdown()
    verifying = [(fed, decode) for fed, decode in steps if fed[0][2]]
    assert verifying, "no step drafted"
    rows = spec._scheduler.speculate.verify_rows
    qkv = runner._forward.layers[0].qkv
    # Float weights run on kernels/panel_gemm.cpp or panel_dot_bf16.cpp: kRows = 6.
    assert rows == (6 if isinstance(getattr(qkv, "__self__", qkv), PanelLinear) else 0)
    for fed, decode in verifying:
        (start, scheduled, drafts), = fed
        assert scheduled == drafts + 1
        if rows:
            assert scheduled <= rows
        if runner.decode_kernel is not None:
            assert decode is not None and decode.rows is None  # every row decodes
            assert decode.lens.tolist() == list(range(start + 1, start + scheduled + 1))
            assert len({tuple(t) for t in decode.tables.tolist()}) == 1
    assert max(scheduled for (_, scheduled, _), in (f for f, _ in verifying)) > 1


def test_a_constrained_request_beside_drafting_ones_is_unchanged(default_model_path):
    """A grammar row does not draft, but it shares steps with rows that do: its tokens, and
    theirs, are those of the engine without speculation."""
    from switchyard_spec import Constraint, ConstraintKind, SamplingParams

    def run(engine: XeonEngine) -> tuple[list[int], list[tuple[int, float]]]:
        sink = Collector()
        engine.submit(greedy_request("free", REPEATED, 80), sink)
        sink.wait_tokens("free", 24)  # by now its own text repeats: it drafts
        engine.submit(EngineRequest(
            request_id="constrained", prompt_token_ids=tuple(prompt_of(5)),
            sampling=SamplingParams(), stopping=StoppingParams(max_new_tokens=20),
            constraint=Constraint(kind=ConstraintKind.REGEX, spec=r"[a-e ]{20}")), sink)
        events = sink.wait("constrained")
        assert events[-1].error is None, events[-1].error
        free = [(e.token_id, e.logprob) for e in sink.wait("free")
                if e.error is None and e.token_id >= 0]
        return token_ids(events), free

    plain = started_engine(default_model_path)
    spec = started_engine(default_model_path, speculate="4", speculate_ngram_min="1")
    shared = []
    pack = spec._runner.pack

    def recording_pack(seqs, keep=None):
        kinds = {s.request.constraint is not None for s in seqs}
        shared.append(kinds == {True, False} and any(s.drafts for s in seqs))
        return pack(seqs, keep)

    spec._runner.pack = recording_pack
    try:
        want_constrained, want_free = run(plain)
        got_constrained, got_free = run(spec)
        assert got_constrained == want_constrained
        _same([got_free], [want_free])
        assert any(shared), "no step held the constrained row beside a drafting one"
    finally:
        plain.shutdown()
        spec.shutdown()
