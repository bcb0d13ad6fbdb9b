"""Contract features through the real engine: logit_bias, the watermark, prompt log-probs."""

from __future__ import annotations

import pytest
import torch

from switchyard_spec import EngineRequest, SamplingParams, StoppingParams

from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids

HASH_KEY = 15485863  # TGI's watermark hash key, restated here to check the engine independently


def _request(rid: str, prompt: list[int], max_new: int, **sampling: object) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=tuple(prompt),
                         sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
                         stopping=StoppingParams(max_new_tokens=max_new, ignore_eos=True))


def _run(engine, request: EngineRequest):
    sink = Collector()
    engine.submit(request, sink)
    events = sink.wait(request.request_id)
    assert not any(e.error for e in events), events[-1].error
    return events


def test_logit_bias_forces_and_bans_under_greedy(shared_engine, hf_greedy, reference_model):
    prompt = prompt_of(11, 3)
    plain = hf_greedy(prompt, 6)
    forced = token_ids(_run(shared_engine, _request("force", prompt, 6,
                                                    logit_bias=((1234, 100.0),))))
    assert forced == [1234] * 6
    banned = token_ids(_run(shared_engine, _request("ban", prompt, 1,
                                                    logit_bias=((plain[0], -100.0),))))
    assert banned != plain[:1]
    # Banning the greedy choice leaves the runner-up.
    with torch.inference_mode():
        logits = reference_model(torch.tensor([prompt])).logits[0, -1]
    assert banned == [int(logits.topk(2).indices[1])]


def _green(previous: int, vocab: int, gamma: float = 0.5) -> set[int]:
    gen = torch.Generator()
    gen.manual_seed(HASH_KEY * previous)
    return set(torch.randperm(vocab, generator=gen)[: int(vocab * gamma)].tolist())


def _green_fraction(prompt: list[int], tokens: list[int], vocab: int) -> float:
    previous = [prompt[-1], *tokens[:-1]]
    return sum(t in _green(p, vocab) for p, t in zip(previous, tokens, strict=True)) / len(tokens)


def test_watermark_makes_sampled_text_mostly_green(shared_engine, monkeypatch):
    monkeypatch.delenv("WATERMARK_GAMMA", raising=False)
    vocab = shared_engine.info.vocab_size
    prompt = prompt_of(8, 21)
    marked = token_ids(_run(shared_engine, _request("wm", prompt, 200, do_sample=True, seed=5,
                                                    watermark=True)))
    plain = token_ids(_run(shared_engine, _request("no-wm", prompt, 200, do_sample=True, seed=5)))
    assert len(marked) == 200
    # gamma = 0.5 of the vocabulary is green; unmarked text lands there about half the time.
    assert _green_fraction(prompt, marked, vocab) > 0.7
    assert _green_fraction(prompt, plain, vocab) < 0.62


def test_prompt_logprobs_match_a_full_forward(shared_engine, reference_model):
    prompt = prompt_of(23, 8)
    runner = shared_engine._runner
    kept: list[int] = []
    original = runner.forward

    def spy(seqs, keep=None):
        kept.append(len(keep))
        return original(seqs, keep)

    runner.forward = spy
    try:
        sink = Collector()
        asking = EngineRequest(request_id="plp", prompt_token_ids=tuple(prompt),
                               sampling=SamplingParams(), prompt_logprobs=True,
                               stopping=StoppingParams(max_new_tokens=3, ignore_eos=True))
        shared_engine.submit(asking, sink)
        shared_engine.submit(greedy_request("plain", prompt_of(9), 3), sink)
        shared_engine.submit(EngineRequest(
            request_id="one", prompt_token_ids=(7,), sampling=SamplingParams(),
            prompt_logprobs=True, stopping=StoppingParams(max_new_tokens=1, ignore_eos=True)), sink)
        events = sink.wait("plp")
        plain, one = sink.wait("plain"), sink.wait("one")
    finally:
        runner.forward = original

    with torch.inference_mode():
        logits = reference_model(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])
    got = torch.tensor(events[0].prompt_logprobs)
    assert got.shape == (len(prompt) - 1,)
    torch.testing.assert_close(got, expected[:, 0], atol=1e-4, rtol=0)
    assert all(e.prompt_logprobs == () for e in events[1:])
    assert all(e.prompt_logprobs == () for e in plain)
    assert one[0].prompt_logprobs == ()  # a one-token prompt has nothing to score
    # Only the asking request's prompt reached lm_head; plain steps keep one row per sequence.
    assert max(kept) <= len(prompt) + 2
    assert kept[-1] <= 3


@pytest.mark.parametrize("logprobs", [True, False])
def test_logprobs_flag(shared_engine, logprobs):
    request = EngineRequest(request_id=f"lp-{logprobs}", prompt_token_ids=tuple(prompt_of(5)),
                            sampling=SamplingParams(), logprobs=logprobs,
                            stopping=StoppingParams(max_new_tokens=3, ignore_eos=True))
    events = _run(shared_engine, request)
    assert all((e.logprob < 0.0) is logprobs for e in events)
