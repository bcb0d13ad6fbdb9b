"""The fallback runner's padded decode batch: the cache row helpers, the runner on a scripted
schedule, and the engine with sequences joining and leaving at different steps.

- :mod:`switchyard_xeon.padded_cache` on hand-made ``DynamicCache`` objects (full and
  sliding-window layers): right alignment, left padding, row selection, trimming, round trips.
- :class:`~switchyard_xeon.fallback.FallbackRunner` driven step by step (no scheduler)
  through prefill chunks, joins, a row that skips a step, a finished row, an aborted row (the
  longest, so the batch narrows), a preemption and its re-prefill; every row's logits at
  every step must equal a plain transformers forward over that sequence alone.
- The engine, per family, with requests submitted while others decode, different lengths and
  ``max_new_tokens``, one aborted mid-generation: each sequence's tokens and log-probs against
  its own single-sequence transformers reference (near ties allowed, as the other parity tests).
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterator

import pytest
import torch
from transformers.cache_utils import (
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticCache,
)

from switchyard_spec import FinishReason
from switchyard_xeon import fallback, padded_cache
from switchyard_xeon.engine import XeonEngine
from switchyard_xeon.fallback import FallbackRunner

from tests.support.engine_requests import token_ids
from tests.support.greedy import transformers_greedy
from tests.support.joining_sequences import (
    LOGPROB_TOL,
    check_against_alone,
    join_and_leave,
    sequence_tokens,
)
from tests.support.tiny_models import IDS, LAYERS, fallback_family, saved_fallback_family
from tests.support.xeon_engines import started_with_log

HEADS, DIM = 2, 3


# ------------------------------------------------------------------ padded_cache helpers
def _cache(n: int, window: int = 5, base: float = 0.0) -> DynamicCache:
    """One row of ``n`` tokens through the real update path: a full layer, then a sliding one.

    Key ``[0, h, t, d]`` is ``base + 100 t + 10 h + d + 1`` (never 0, so padding shows);
    values are the keys negated.
    """
    cache = DynamicCache()
    cache.layers = [DynamicLayer(), DynamicSlidingWindowLayer(sliding_window=window)]
    t = torch.arange(n, dtype=torch.float32)[:, None] * 100
    keys = (base + t + torch.arange(HEADS)[:, None, None] * 10 + torch.arange(DIM) + 1)[None]
    for i in range(2):
        cache.update(keys.clone(), -keys.clone(), i)
    return cache


def test_concat_right_aligns_rows_and_pads_on_the_left():
    short, long = _cache(3), _cache(7, base=0.5)
    batch = padded_cache.concat([short, long])
    full, sliding = batch.layers
    assert full.keys.shape == (2, HEADS, 7, DIM)
    assert torch.equal(full.keys[0, :, 4:], short.layers[0].keys[0])
    assert not full.keys[0, :, :4].any() and not full.values[0, :, :4].any()
    assert torch.equal(full.keys[1], long.layers[0].keys[0])
    # The sliding layer holds window - 1 = 4 columns: the short row's 3, padded by one.
    assert sliding.keys.shape == (2, HEADS, 4, DIM)
    assert not sliding.keys[0, :, :1].any()
    assert torch.equal(sliding.keys[0, :, 1:], short.layers[1].keys[0])
    assert torch.equal(sliding.values[1], long.layers[1].values[0])
    assert sliding.cumulative_length == 7 == padded_cache.width(batch) == batch.get_seq_length()
    assert batch.get_mask_sizes(1, 1) == (5, 3)  # 4 held + 1 new, from padded column 7 - 4


def test_select_gives_each_row_back_as_it_was():
    rows = [_cache(n, base=n / 10) for n in (3, 7, 5)]
    batch = padded_cache.concat([padded_cache.concat(rows[:2]), rows[2]])  # a batch, then one
    for i, (row, n) in enumerate(zip(rows, (3, 7, 5), strict=True)):
        alone = padded_cache.select(batch, [i], n)
        assert alone.get_seq_length() == n
        for got, want in zip(alone.layers, row.layers, strict=True):
            assert torch.equal(got.keys, want.keys) and torch.equal(got.values, want.values)
            assert type(got) is type(want)
        assert alone.layers[1].cumulative_length == n


def test_select_drops_rows_and_trims_the_padding_no_kept_row_needs():
    batch = padded_cache.concat([_cache(3), _cache(9), _cache(5)])
    kept = padded_cache.select(batch, [2, 0], 5)  # the longest left; reordered
    full, sliding = kept.layers
    assert full.keys.shape == (2, HEADS, 5, DIM) and sliding.cumulative_length == 5
    assert torch.equal(full.keys[0], _cache(5).layers[0].keys[0])
    assert torch.equal(full.keys[1, :, 2:], _cache(3).layers[0].keys[0])
    assert sliding.keys.shape == (2, HEADS, 4, DIM)
    assert padded_cache.select(batch, [0, 1, 2], 9) is batch  # nothing to change
    with pytest.raises(ValueError):
        padded_cache.select(batch, [0], 12)


def test_the_helpers_leave_their_inputs_alone():
    a, b = _cache(2), _cache(6)
    before = [(layer.keys.clone(), layer.values.clone()) for layer in a.layers + b.layers]
    batch = padded_cache.concat([a, b])
    padded_cache.select(batch, [1], 6)
    batch.update(torch.ones(2, HEADS, 1, DIM), torch.ones(2, HEADS, 1, DIM), 0)
    after = [(layer.keys, layer.values) for layer in a.layers + b.layers]
    assert all(torch.equal(x, y) and torch.equal(v, w)
               for (x, v), (y, w) in zip(before, after, strict=True))
    assert a.get_seq_length() == 2 and b.layers[1].cumulative_length == 6


def test_concat_refuses_layers_that_differ():
    with pytest.raises(ValueError, match="do not batch"):
        padded_cache.concat([_cache(3, window=5), _cache(3, window=6)])


def test_row_mask_hides_each_rows_padding():
    assert padded_cache.row_mask([2, 4, 1]).tolist() == [
        [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]


class _OddLayer(DynamicLayer):
    pass


def test_only_plain_dynamic_caches_batch():
    assert padded_cache.unbatchable(_cache(3)) == ""
    static = StaticCache(config=fallback_family("stablelm").config, max_cache_len=8)
    assert "StaticCache" in padded_cache.unbatchable(static)
    odd = _cache(3)
    odd.layers[0] = _OddLayer()
    assert padded_cache.unbatchable(odd) == "cache layer 0 is a _OddLayer"
    empty = _cache(3)
    empty.layers[1] = DynamicSlidingWindowLayer(sliding_window=4)
    assert padded_cache.unbatchable(empty) == "cache layer 1 holds no keys of its own"
    recording = _cache(3)
    recording.layers[1].activate_past_recording()
    assert "records past states" in padded_cache.unbatchable(recording)


# ------------------------------------------------------------------ the runner, scripted
def _gpt_oss() -> torch.nn.Module:
    import transformers as T

    return T.GptOssForCausalLM(T.GptOssConfig(
        intermediate_size=32, num_local_experts=2, num_experts_per_tok=1, num_key_value_heads=2,
        head_dim=16, sliding_window=8, **LAYERS, **IDS))


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = _gpt_oss() if name == "gpt_oss" else fallback_family(name)
    if name == "gpt_oss":
        model.set_attn_implementation("eager")  # as the engine runs it (sinks)
    return model.eval()


class _Seq:
    """What the runner reads of a sequence, fed a fixed token list (teacher forcing)."""

    _ids = itertools.count(10_000)

    def __init__(self, name: str, tokens: list[int]) -> None:
        self.request_id = name
        self.seq_id = next(self._ids)
        self.all = tokens
        self.tokens: list[int] = []
        self.num_cached = 0
        self.num_scheduled = 0

    @property
    def new_tokens(self) -> list[int]:
        return self.tokens[self.num_cached:self.num_cached + self.num_scheduled]

    @property
    def samples(self) -> bool:
        return self.num_cached + self.num_scheduled == len(self.tokens)


class _Blocks:
    """The block manager as the runner reads it: who holds blocks, and the pool's size."""

    block_size = 4

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.live: set[int] = set()

    def table(self, seq_id: int) -> list[int]:
        return [0] if seq_id in self.live else []


SCHEDULE = [  # (sequence, tokens fed) per step; "-x" x finishes, "!x" x is aborted, "^x" preempted
    [("a", 8)], [("a", 8)], [("a", 6), ("b", 5)],
    [("a", 1), ("b", 1)],                      # both join an empty batch
    [("a", 1), ("b", 1), ("c", 8)],
    [("a", 1), ("c", 8)],                      # b skips a step: taken out, kept on its own
    [("a", 1), ("b", 1), ("c", 4)],            # b back in; c's prompt ends (samples)
    [("a", 1), ("b", 1), ("c", 1)],            # c joins
    ["-b", ("a", 1), ("c", 1), ("d", 7)],      # b finished: its row leaves
    ["!a", ("c", 1), ("d", 1)],                # a (the longest) aborted: the batch narrows
    [("c", 1), ("d", 1)],
    ["^c", ("c", 8), ("d", 1)],                # c preempted and re-prefilled from token 0
    [("c", 8), ("d", 1)],
    [("c", 9), ("d", 1)],
    [("c", 1), ("d", 1)],                      # c joins again
    [("c", 1), ("d", 1)],
]
PROMPT_LENGTHS = {"a": 22, "b": 5, "c": 20, "d": 7}


def _drive(runner: FallbackRunner, blocks: _Blocks, model: torch.nn.Module) -> None:
    """Run SCHEDULE; every fed row's last logits must equal a forward over its tokens alone."""
    seqs = {name: _Seq(name, sequence_tokens(40, seed)) for seed, name in enumerate("abcd")}
    for step, plan in enumerate(SCHEDULE):
        batch = []
        for item in plan:
            if isinstance(item, str):  # a sequence leaves: its blocks go
                seq = seqs[item[1:]]
                blocks.live.discard(seq.seq_id)
                if item[0] == "^":
                    seq.num_cached = 0
                continue
            seq = seqs[item[0]]
            seq.num_scheduled = item[1]
            seq.tokens = seq.all[:seq.num_cached + item[1]]
            blocks.live.add(seq.seq_id)
            batch.append(seq)
        got = runner.forward(batch)
        with torch.inference_mode():
            want = torch.stack([model(torch.tensor([s.tokens])).logits[0, -1] for s in batch])
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5,
                                   msg=lambda m, step=step: f"step {step}: {m}")
        for seq in batch:
            seq.num_cached += seq.num_scheduled
    blocks.live.clear()
    del seqs, batch, seq
    gc.collect()


FAMILIES = ["bloom", "mpt", "stablelm", "falcon", "gemma2", "gpt_oss"]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """As the engines here run (TEST_OPTIONS): tiny models gain nothing from more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name, pool", [*((f, "large") for f in FAMILIES),
                                        ("bloom", "small"), ("gemma2", "small")])
def test_a_scripted_schedule_matches_each_sequence_alone(name, pool):
    """Joins, a skipped step, a finished row, an abort, a preemption: exact logits throughout.

    With a small pool the padding budget keeps some rows out of the batch (on their own
    caches), which must not change a thing either.
    """
    model = _model(name)
    blocks = _Blocks(1000 if pool == "large" else 4)
    with torch.inference_mode():
        runner = FallbackRunner(model, blocks)  # type: ignore[arg-type]
        assert runner.mode.padded, runner.mode.reason
        _drive(runner, blocks, model)
    assert runner.padded_steps >= 10
    if pool == "large":
        assert runner.most_rows == 3 and runner.rows_alone == 0
        assert runner.rows_joined >= 3 and runner.rows_left >= 3
    else:  # 16 tokens of pool: at most 4 of padding
        assert runner.rows_alone > 0
    assert runner.live_caches == 0 and runner.batch_rows == []


def test_per_sequence_mode_runs_the_same_schedule():
    model = _model("gemma2")
    blocks = _Blocks(1000)
    with torch.inference_mode():
        runner = FallbackRunner(model, blocks, padded=False)  # type: ignore[arg-type]
        assert not runner.mode.padded and "turned off" in runner.mode.reason
        _drive(runner, blocks, model)
    assert runner.padded_steps == 0 and runner.live_caches == 0


def test_a_forward_without_positions_or_known_mask_positions_stays_per_sequence(monkeypatch):
    model = _model("stablelm")
    monkeypatch.setattr(model.config, "model_type", "somethingelse")
    runner = FallbackRunner(model, _Blocks(100))  # type: ignore[arg-type]
    assert runner.mode.padded
    runner._takes_positions = False
    mode = runner.decode_mode()
    assert not mode.padded and "takes no position_ids" in mode.reason


def test_the_probe_catches_wrong_positions(monkeypatch):
    """Positions taken from the padded cache length (what a forward without position_ids
    does) differ from per-sequence forwards, and the probe says so."""
    model = _model("stablelm")
    runner = FallbackRunner(model, _Blocks(100))  # type: ignore[arg-type]
    runner._takes_positions = False
    monkeypatch.setitem(fallback.POSITIONS_FROM_MASK, "stablelm", "claimed")
    mode = runner.decode_mode()
    assert not mode.padded and "differ from per-sequence forwards" in mode.reason


def test_an_unbatchable_cache_keeps_per_sequence_forwards(monkeypatch):
    monkeypatch.setattr(padded_cache, "unbatchable", lambda cache: "cache layer 0 is a Thing")
    runner = FallbackRunner(_model("bloom"), _Blocks(100))  # type: ignore[arg-type]
    assert runner.mode == fallback.DecodeMode(False, "cache layer 0 is a Thing")


# ------------------------------------------------------------------ the engine


@pytest.fixture(scope="module", params=["bloom", "stablelm", "falcon", "gemma2"])
def served(request, tmp_path_factory) -> Iterator[tuple[torch.nn.Module, XeonEngine, list[str]]]:
    folder = tmp_path_factory.mktemp(f"{request.param}_batching")
    model = saved_fallback_family(request.param, folder)
    # Bloom and Gemma 2 take the paged path by default: the fallback is asked for.
    engine, lines = started_with_log(folder, forward="fallback")
    yield model, engine, lines
    engine.shutdown()


def test_start_up_logs_padded_decode_and_why(served):
    _, engine, lines = served
    (line,) = [line for line in lines if line.startswith("fallback decode: ")]
    assert line.startswith("fallback decode: one padded forward over a batched cache per step")
    assert "a probe step matched per-sequence forwards" in line
    assert engine._runner.mode.padded


def test_sequences_joining_and_leaving_get_what_each_gets_alone(served):
    """a runs 14 tokens; b joins at a's 2nd token and leaves after 5; c (a 33-token prompt in
    16-token chunks, prompt log-probs) joins at a's 4th; e runs from the start and is aborted
    at a's 6th; d joins when b finishes. Each against its own transformers reference."""
    model, engine, _ = served
    runner = engine._runner
    joined, left = runner.rows_joined, runner.rows_left
    new = {"a": 14, "b": 5, "c": 9, "d": 6, "e": 60}
    prompts, events = join_and_leave(engine, new)
    assert events["e"][-1].finish_reason is FinishReason.ABORTED
    assert 6 <= len(token_ids(events["e"])) < new["e"]
    for rid, got in events.items():
        assert all(e.error is None for e in got), rid
        if rid != "e":
            assert len(token_ids(got)) == new[rid], rid
        check_against_alone(model, prompts[rid], got)
        want = transformers_greedy(model, [prompts[rid]], len(token_ids(got)))[0]
        if token_ids(got) != want:  # only past a near tie (checked above, teacher-forced)
            first = next(i for i, (x, y) in enumerate(zip(token_ids(got), want)) if x != y)
            print(f"{rid}: differs from generate at token {first} (a near tie)")
    # c's prompt log-probs, scored alone while the others decoded.
    prompt = prompts["c"]
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    want = logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(events["c"][0].prompt_logprobs), want,
                               atol=LOGPROB_TOL, rtol=0)
    assert runner.rows_joined - joined >= 3 and runner.rows_left - left >= 3
    assert runner.most_rows >= 3
