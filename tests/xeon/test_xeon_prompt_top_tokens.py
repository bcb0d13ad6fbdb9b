"""`TokenEvent.prompt_top_tokens`: the most likely tokens at each prompt position, from prefill.

Checked against `transformers` (float32) on the same prompt, whole and in
prefill chunks, beside sequences that ask for less or nothing.
"""

from __future__ import annotations

import torch

from switchyard_engine.logprobs import prompt_scores, token_logprobs
from switchyard_spec import EngineRequest, SamplingParams, StoppingParams

from tests.support.engine_requests import Collector, prompt_of


def _asking(rid: str, prompt: list[int], top_n: int) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=tuple(prompt),
                         sampling=SamplingParams(top_n_tokens=top_n), prompt_logprobs=True,
                         stopping=StoppingParams(max_new_tokens=2, ignore_eos=True))


def _reference(reference_model, prompt: list[int], top_n: int):
    with torch.inference_mode():
        logits = reference_model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).topk(top_n, dim=-1)


def _check(events, prompt: list[int], top_n: int, reference_model) -> None:
    first = events[0]
    assert len(first.prompt_top_tokens) == len(first.prompt_logprobs) == len(prompt) - 1
    values, ids = _reference(reference_model, prompt, top_n)
    for row, top in enumerate(first.prompt_top_tokens):
        assert len(top) == top_n
        assert [t.id for t in top] == ids[row].tolist()
        torch.testing.assert_close(torch.tensor([t.logprob for t in top]), values[row],
                                   atol=1e-4, rtol=0)
        # The prompt token's value and its own alternative's are the same number.
        for t in top:
            if t.id == prompt[row + 1]:
                assert t.logprob == first.prompt_logprobs[row]
    assert all(e.prompt_top_tokens == () for e in events[1:])


def test_prompt_top_tokens_match_transformers(shared_engine, reference_model):
    sink = Collector()
    long_prompt, short_prompt = prompt_of(40, 3), prompt_of(9, 5)
    shared_engine.submit(_asking("top3", long_prompt, 3), sink)
    shared_engine.submit(_asking("top1", short_prompt, 1), sink)
    shared_engine.submit(_asking("top0", short_prompt, 0), sink)
    plain = EngineRequest(request_id="plain", prompt_token_ids=tuple(short_prompt),
                          sampling=SamplingParams(top_n_tokens=2),
                          stopping=StoppingParams(max_new_tokens=2, ignore_eos=True))
    shared_engine.submit(plain, sink)
    _check(sink.wait("top3"), long_prompt, 3, reference_model)
    _check(sink.wait("top1"), short_prompt, 1, reference_model)
    no_top = sink.wait("top0")[0]
    assert no_top.prompt_top_tokens == () and len(no_top.prompt_logprobs) == len(short_prompt) - 1
    plain_first = sink.wait("plain")[0]
    assert plain_first.prompt_top_tokens == () and plain_first.prompt_logprobs == ()
    assert len(plain_first.top_tokens) == 2  # generated tokens keep their own alternatives


def test_prompt_top_tokens_over_prefill_chunks(make_engine, reference_model):
    engine = make_engine(max_batch_prefill_tokens=8)
    prompt = prompt_of(30, 7)
    sink = Collector()
    engine.submit(_asking("chunked", prompt, 2), sink)
    _check(sink.wait("chunked"), prompt, 2, reference_model)


def test_prompt_scores_share_one_logsumexp():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(20, 50, generator=gen) * 3
    targets = logits.argmax(-1)  # every target is its row's best
    scores = prompt_scores(logits, targets, top_n=4, chunk_rows=6)
    assert torch.equal(scores.top_ids[:, 0], targets)
    assert torch.equal(scores.top_logprobs[:, 0], scores.logprobs)  # bit for bit
    expected = torch.log_softmax(logits, -1).topk(4, dim=-1)
    torch.testing.assert_close(scores.top_logprobs, expected.values)
    assert torch.equal(token_logprobs(logits, targets, chunk_rows=6), scores.logprobs)
    assert prompt_scores(logits, targets, top_n=0).top_ids.shape == (20, 0)
    assert prompt_scores(logits, targets, top_n=99).top_ids.shape == (20, 50)
