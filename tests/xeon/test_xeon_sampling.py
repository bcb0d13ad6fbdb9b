"""Sampling through the engine: seeds, reproducibility across batch mates, logprobs."""

from __future__ import annotations

import math

import msgspec
import pytest
import torch
from switchyard_spec import EngineRequest, SamplingParams, StoppingParams

from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids
from tests.support.tgi_watermark import Z_THRESHOLD, TgiWatermark, z_score

SAMPLED = SamplingParams(do_sample=True, temperature=1.3, top_k=50, top_p=0.95, seed=4242,
                         repetition_penalty=1.1, top_n_tokens=3)


def _sampled(rid: str, params: SamplingParams = SAMPLED, max_new: int = 20) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=tuple(prompt_of(12, 99)),
                         sampling=params,
                         stopping=StoppingParams(max_new_tokens=max_new, ignore_eos=True))


def test_seeded_sampling_is_reproducible_with_batch_mates(shared_engine):
    sink = Collector()
    shared_engine.submit(_sampled("alone"), sink)
    alone = sink.wait("alone")

    mates = [
        greedy_request("mate-greedy", prompt_of(30, 7), 25),
        _sampled("mate-sampled", SamplingParams(do_sample=True, temperature=0.7, typical_p=0.9,
                                               seed=1, frequency_penalty=0.5), 25),
        _sampled("mate-unseeded", SamplingParams(do_sample=True), 25),
    ]
    for req in mates:
        shared_engine.submit(req, sink)
    sink.wait_tokens("mate-greedy", 3)  # the seeded one joins a busy batch
    shared_engine.submit(_sampled("crowded"), sink)
    crowded = sink.wait("crowded")
    for req in mates:
        sink.wait(req.request_id)

    assert token_ids(alone) == token_ids(crowded)
    # Batch shapes change float rounding a little, never the choice.
    assert [e.logprob for e in alone] == pytest.approx([e.logprob for e in crowded], abs=1e-4)
    assert all(e.seed == 4242 for e in alone + crowded)
    unseeded = sink.events("mate-unseeded")
    assert unseeded[0].seed is not None  # the engine picked one and reports it


def test_seed_changes_the_output(shared_engine):
    sink = Collector()
    shared_engine.submit(_sampled("a"), sink)
    # The same parameters but the seed: only the seed can make the outputs differ.
    shared_engine.submit(_sampled("b", msgspec.structs.replace(SAMPLED, seed=7)), sink)
    assert token_ids(sink.wait("a")) != token_ids(sink.wait("b"))


def test_logprobs_and_top_tokens(shared_engine):
    sink = Collector()
    params = SamplingParams(top_n_tokens=4)
    shared_engine.submit(EngineRequest(request_id="g", prompt_token_ids=tuple(prompt_of(9)),
                                       sampling=params,
                                       stopping=StoppingParams(max_new_tokens=5)), sink)
    for event in sink.wait("g"):
        assert len(event.top_tokens) == 4
        best = event.top_tokens[0]
        # Greedy: the chosen token is the most likely one, with the same logprob.
        assert best.id == event.token_id and math.isclose(best.logprob, event.logprob)
        assert event.logprob <= 0.0
        logps = [t.logprob for t in event.top_tokens]
        assert logps == sorted(logps, reverse=True)


# ------------------------------------------------------- against outside references


def _marked(rid: str, params: SamplingParams, prompt: list[int], max_new: int) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt_token_ids=tuple(prompt), sampling=params,
                         stopping=StoppingParams(max_new_tokens=max_new, ignore_eos=True))


def _run(engine, request: EngineRequest) -> list[int]:
    sink = Collector()
    engine.submit(request, sink)
    return token_ids(sink.wait(request.request_id))


def test_watermarked_greedy_is_generate_with_tgis_processor(shared_engine, reference_model):
    """Greedy with ``watermark``: the tokens of transformers' ``generate`` with TGI's watermark
    processor (tests/support/tgi_watermark.py) ahead of the argmax, with gamma and delta from
    the environment as TGI reads them (its defaults, 0.5 and 2.0, when unset)."""
    from transformers import LogitsProcessorList

    prompt, new = prompt_of(12, 99), 24
    got = _run(shared_engine, _marked("wm-greedy", SamplingParams(watermark=True), prompt, new))
    with torch.inference_mode():
        out = reference_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0,
            logits_processor=LogitsProcessorList([TgiWatermark.from_env()]))
    want = out[0, len(prompt):].tolist()
    assert got == want
    # The watermark decided tokens: plain greedy goes elsewhere.
    assert got != _run(shared_engine, greedy_request("wm-plain", prompt, new))


def test_watermark_detector_separates_marked_from_plain_samples(shared_engine, reference_model):
    """Kirchenbauer et al.'s z-score, computed from TGI's green lists, over 200 sampled tokens:
    above their threshold of 4 with the watermark, near 0 without (same seed, same prompt)."""
    vocab = reference_model.get_output_embeddings().weight.shape[0]
    prompt, new = prompt_of(10, 3), 200
    marked = _run(shared_engine, _marked(
        "wm-sampled", SamplingParams(do_sample=True, seed=2026, watermark=True), prompt, new))
    plain = _run(shared_engine, _marked(
        "wm-unmarked", SamplingParams(do_sample=True, seed=2026), prompt, new))
    assert len(marked) == len(plain) == new
    gamma = TgiWatermark.from_env().gamma
    z_marked = z_score(prompt[-1], marked, vocab, gamma)
    z_plain = z_score(prompt[-1], plain, vocab, gamma)
    # The random-weight model's next-token distribution is nearly flat, so delta 2 moves
    # the green share from 0.5 to about e^2 / (1 + e^2) = 0.88: z near 10 at 200 tokens
    # (11.7 here, and -1.0 without).
    assert z_marked > Z_THRESHOLD + 3, z_marked
    assert abs(z_plain) < Z_THRESHOLD - 1, z_plain


def _teacher_forced_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' float32 next-token logits before each of ``tokens`` ([len(tokens), V])."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]


@pytest.mark.parametrize("top_k", [0, 40])
def test_seeded_samples_are_the_reference_draws(shared_engine, reference_model, top_k):
    """What the sampler promises (switchyard_engine.sampling): a sampled row owns a
    ``torch.Generator`` seeded with the request's seed and draws one float64 uniform from
    it per step; the token is where the cumulative kept probabilities first pass that
    share of their total, in vocabulary order, or for a row decided on its top-k
    candidates in their order (descending probability, ties by ascending id). The
    reference redoes that draw from transformers' logits, in float64."""
    seed, temperature, new = 123456789, 0.8, 16
    prompt = prompt_of(9, 41)
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, seed=seed)
    got = _run(shared_engine, _marked(f"ref-draw-{top_k}", params, prompt, new))
    logits = _teacher_forced_logits(reference_model, prompt, got).double() / temperature
    gen = torch.Generator().manual_seed(seed)
    want, margins = [], []
    for row in logits:
        if top_k:
            kth = row.topk(top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
            # descending probability, ties by ascending id
            order = sorted(range(len(row)), key=lambda i: (-float(row[i]), i))[:top_k]
        else:
            order = list(range(len(row)))
        probs = torch.softmax(row, dim=-1)[order]
        cdf = probs.cumsum(0)
        u = float(torch.rand(1, generator=gen, dtype=torch.float64))
        point = u * float(cdf[-1])
        at = int(torch.searchsorted(cdf, torch.tensor([point], dtype=torch.float64),
                                    right=True))
        want.append(order[at])
        # How far the draw lies from the edges of its token's interval: float32 logits
        # (ours against transformers') move those edges by well under 1e-7.
        low = float(cdf[at - 1]) if at else 0.0
        margins.append(min(point - low, float(cdf[at]) - point))
    assert min(margins) > 1e-6, "a draw fell on an edge: choose another seed"
    assert got == want
    # Another seed draws other uniforms, so other tokens.
    other = msgspec.structs.replace(params, seed=seed + 1)
    assert _run(shared_engine, _marked(f"ref-draw-{top_k}-other", other, prompt, new)) != got
