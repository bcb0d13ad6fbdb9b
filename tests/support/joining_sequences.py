"""Sequences joining and leaving a running engine batch, each checked against itself alone.

:func:`join_and_leave` runs five sequences over one engine on a fixed script
(joins at given tokens of another, a chunked prompt with prompt log-probs, an
abort, a join when another finishes); :func:`check_against_alone` checks one
sequence's events, teacher-forced, against a transformers forward over that
sequence alone: tokens (near ties allowed), log-probs and top tokens.
"""

from __future__ import annotations

import pytest
import torch

from switchyard_spec import EngineRequest, SamplingParams, StoppingParams

from tests.support.engine_requests import Collector, token_ids

TOP_N = 2
LOGPROB_TOL = 1e-4
TIE = 1e-4
"""fp32: a padded forward sums in another order than the reference, ~1e-6 apart; a token
may differ from ``generate``'s only where the two best logits are closer than this."""


def sequence_tokens(n: int, seed: int) -> list[int]:
    """``n`` deterministic ids in a 512-token vocabulary, away from the special ones."""
    return [(37 * i + 11 * seed) % 500 + 3 for i in range(n)]


def top_n_request(rid: str, prompt: list[int], new: int, **extra: object) -> EngineRequest:
    """A greedy request for ``new`` tokens (EOS ignored), each with its :data:`TOP_N` best."""
    return EngineRequest(request_id=rid, prompt_token_ids=tuple(prompt),
                         sampling=SamplingParams(top_n_tokens=TOP_N),
                         stopping=StoppingParams(max_new_tokens=new, ignore_eos=True), **extra)


def check_against_alone(model: torch.nn.Module, prompt: list[int], events: list) -> None:
    """Teacher-forced on the engine's tokens: each is the greedy choice (or within TIE of
    it), with its log-prob and alternatives as a forward over prompt + tokens gives them."""
    tokens = token_ids(events)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    logprobs = torch.log_softmax(logits, -1)
    chosen = torch.tensor(tokens)[:, None]
    margin = logits.max(-1).values - logits.gather(-1, chosen)[:, 0]
    assert float(margin.max()) <= TIE, (prompt, tokens, margin.tolist())
    got = [e for e in events if e.token_id >= 0]
    torch.testing.assert_close(torch.tensor([e.logprob for e in got]),
                               logprobs.gather(-1, chosen)[:, 0], atol=LOGPROB_TOL, rtol=0)
    values, ids = logprobs.topk(TOP_N, -1)
    for e, want_ids, want_values in zip(got, ids.tolist(), values.tolist(), strict=True):
        if abs(want_values[0] - want_values[1]) > TIE:
            assert [t.id for t in e.top_tokens] == want_ids
        assert [t.logprob for t in e.top_tokens] == pytest.approx(want_values, abs=LOGPROB_TOL)


def join_and_leave(engine, new: dict[str, int]) -> tuple[dict[str, list[int]], dict[str, list]]:
    """Five sequences over one engine, ``new[x]`` tokens each: a from the start; b joins at
    a's 2nd token; c (a 33-token prompt in 16-token chunks, prompt log-probs) at a's 4th; e
    runs from the start and is aborted at a's 6th; d joins when b finishes. Their prompts
    and events."""
    prompts = {"a": sequence_tokens(21, 1), "b": sequence_tokens(6, 2),
               "c": sequence_tokens(33, 3), "d": sequence_tokens(11, 4),
               "e": sequence_tokens(9, 5)}
    sink = Collector()

    def on_event(event):  # the loop thread: what it submits or aborts lands at the next step
        sink(event)
        if event.request_id == "a":
            count = len(sink.events("a"))
            if count == 2:
                engine.submit(top_n_request("b", prompts["b"], new["b"]), on_event)
            elif count == 4:
                engine.submit(top_n_request("c", prompts["c"], new["c"], prompt_logprobs=True),
                              on_event)
            elif count == 6:
                engine.abort("e")
        elif event.request_id == "b" and event.finish_reason is not None:
            engine.submit(top_n_request("d", prompts["d"], new["d"]), on_event)

    engine.submit(top_n_request("a", prompts["a"], new["a"]), on_event)
    engine.submit(top_n_request("e", prompts["e"], new["e"]), on_event)
    events = {rid: sink.wait(rid) for rid in "abce"}
    events["d"] = sink.wait("d")
    return prompts, events
