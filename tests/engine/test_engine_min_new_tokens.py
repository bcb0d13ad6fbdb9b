"""``StoppingParams.min_new_tokens`` in the toolkit's sampling, against transformers' processor;
and the two new contract fields across the engine process's pipe."""

from __future__ import annotations

import math
import socket

import pytest
import torch
from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

from switchyard_engine.admission import make_sampler, request_problem
from switchyard_engine.sampling import RowSampler, apply_eos_holds, sample_step
from switchyard_engine.watermark import WatermarkConfig
from switchyard.engine_process.wire import Connection, Events, Submit, ToChild, ToParent
from switchyard_spec import EngineRequest, SamplingParams, StoppingParams, TokenEvent

V = 64
EOS = (3, 7)


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=gen)
    logits[:, list(EOS)] += 6.0  # EOS is every row's favourite
    return logits


def _row(min_new: int, generated: int, params: SamplingParams | None = None,
         eos: tuple[int, ...] = EOS) -> RowSampler:
    params = params or SamplingParams()
    row = RowSampler(params, (1, 2), V, seed=0 if params.do_sample else None,
                     min_new_tokens=min_new, eos_token_ids=eos)
    for _ in range(generated):
        row.record(11)
    return row


@pytest.mark.parametrize(("min_new", "generated"), [(0, 0), (3, 0), (3, 2), (3, 3), (3, 5)])
def test_the_mask_is_transformers_min_new_tokens_processor(min_new, generated):
    logits = _logits(2, seed=min_new + generated)
    prompt = 4
    # transformers counts new tokens from the length of the input ids.
    ids = torch.zeros(2, prompt + generated, dtype=torch.long)
    expected = MinNewTokensLengthLogitsProcessor(prompt, min_new, list(EOS))(ids, logits.clone())
    rows = [_row(min_new, generated), _row(min_new, generated)]
    assert torch.equal(apply_eos_holds(logits, rows), expected)
    assert rows[0].holds_eos == (generated < min_new)


def test_held_rows_choose_among_the_rest_and_report_that_distribution():
    logits = _logits(3, seed=1)
    sampled = SamplingParams(do_sample=True, seed=5, top_n_tokens=4)
    rows = [_row(2, 0, SamplingParams(top_n_tokens=4)), _row(2, 0, sampled), _row(0, 0)]
    out = sample_step(logits, rows).tokens
    masked = logits.clone()
    masked[:2, list(EOS)] = float("-inf")
    assert out[0].token_id == int(masked[0].argmax())
    assert out[0].logprob == pytest.approx(float(torch.log_softmax(masked[0], -1).max()))
    assert out[1].token_id not in EOS
    for tok in out[:2]:
        assert not {t.id for t in tok.top_tokens} & set(EOS)
    assert out[2].token_id in EOS  # not held: EOS wins as before


def test_the_hold_lifts_after_min_new_tokens_recorded_tokens():
    row = _row(2, 0)
    logits = _logits(1)
    chosen = []
    for _ in range(3):
        tok = sample_step(logits, [row]).tokens[0]
        chosen.append(tok.token_id)
        row.record(tok.token_id)
    assert chosen[0] not in EOS and chosen[1] not in EOS and chosen[2] in EOS


def test_a_row_that_only_eos_can_end_keeps_eos_and_never_goes_nan():
    """The grammar wins: when it allows only EOS, EOS is taken despite min_new_tokens."""
    only_eos = torch.full((2, V), float("-inf"))
    only_eos[0, EOS[0]] = 1.0
    only_eos[1, [EOS[1], 20]] = torch.tensor([5.0, 0.0])  # EOS and one other token allowed
    rows = [_row(4, 0, SamplingParams(top_n_tokens=2)),
            _row(4, 0, SamplingParams(do_sample=True, seed=1, top_k=5))]
    out = sample_step(only_eos, rows).tokens
    assert out[0].token_id == EOS[0] and out[0].logprob == 0.0
    assert out[1].token_id == 20 and math.isfinite(out[1].logprob)


def test_eos_ids_outside_the_vocabulary_are_ignored_and_no_eos_means_no_hold():
    assert not _row(3, 0, eos=(V + 5,)).holds_eos
    assert not _row(3, 0, eos=()).holds_eos
    row = _row(3, 0, eos=(V + 5, EOS[0]))
    assert row.holds_eos and row.eos_ids.tolist() == [EOS[0]]


def test_make_sampler_takes_the_request_stopping_and_negative_values_are_refused():
    request = EngineRequest(request_id="r", prompt_token_ids=(1, 2), sampling=SamplingParams(),
                            stopping=StoppingParams(max_new_tokens=8, min_new_tokens=3,
                                                    eos_token_ids=EOS))
    row = make_sampler(request, V, WatermarkConfig())
    assert row.min_new_tokens == 3 and row.holds_eos
    assert row.eos_ids.tolist() == sorted(EOS)
    assert request_problem(request, V) is None
    bad = EngineRequest(request_id="r", prompt_token_ids=(1,), sampling=SamplingParams(),
                        stopping=StoppingParams(max_new_tokens=8, min_new_tokens=-1))
    assert request_problem(bad, V) == "min_new_tokens must not be negative"


def test_the_engine_process_pipe_carries_both_fields():
    ours, theirs = socket.socketpair()
    parent, child = Connection(ours, ToParent), Connection(theirs, ToChild)
    try:
        request = EngineRequest(request_id="r1", prompt_token_ids=(1, 2, 3),
                                sampling=SamplingParams(),
                                stopping=StoppingParams(max_new_tokens=9, min_new_tokens=4,
                                                        eos_token_ids=(2,)))
        parent.send(Submit(request=request))
        got = child.recv()
        assert isinstance(got, Submit) and got.request.stopping.min_new_tokens == 4
        event = TokenEvent(request_id="r1", token_id=7, prompt_tokens=40, cached_tokens=32)
        child.send(Events(events=[event], steps=[]))
        frame = parent.recv()
        assert isinstance(frame, Events) and frame.events[0].cached_tokens == 32
    finally:
        parent.close()
        child.close()
