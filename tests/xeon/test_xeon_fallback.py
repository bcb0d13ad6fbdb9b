"""Every decoder-only family transformers runs: the paged path where it can go, the fallback
elsewhere, and a clear start-up error for what is not a causal LM.

Each family is a tiny random model (2 layers, hidden 64, fixed seed) saved as
a model folder. Its engine serves three prompts of different lengths
submitted together, so they share steps and the longer ones are prefilled in
16-token chunks; greedy tokens must equal transformers ``generate`` on the
same model. The fallback runner (``switchyard_xeon.fallback``) is also
checked for prompt log-probs against a transformers forward pass, abort in
the middle of a generation, and preemption (its per-sequence cache rebuilt).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from switchyard_spec import (
    EngineConfig,
    EngineRequest,
    EngineStartError,
    FinishReason,
    SamplingParams,
    StoppingParams,
)
from switchyard_xeon.engine import XeonEngine
from switchyard_xeon.fallback import FallbackRunner
from switchyard_xeon.runner import ModelRunner

from tests.support.engine_requests import Collector, greedy_request, token_ids
from tests.support.greedy import transformers_greedy
from tests.support.tiny_models import IDS, LAYERS, MIXED_PROMPTS, saved_fallback_family
from tests.support.waiting import eventually
from tests.support.xeon_engines import engine_tokens, started_engine, started_with_log
from tests.support.xeon_options import TEST_OPTIONS

PATHS = {
    "bloom": "paged", "mpt": "paged", "stablelm": "fallback", "gemma2": "paged",
    "falcon": "fallback", "gpt_neox": "paged", "gptj": "paged", "opt": "paged",
    "gpt_bigcode": "paged",
}
"""The path each family takes with transformers 5 (which classes use its attention interface;
Bloom's and MPT's ALiBi attention is replaced by switchyard_xeon/alibi_attention.py)."""

WHY = {
    "stablelm": "does not use transformers' attention interface",
    "falcon": "does not use transformers' attention interface",
}

NEW = 8


@pytest.fixture(scope="module", params=sorted(PATHS))
def family(request, tmp_path_factory) -> Iterator[tuple[str, torch.nn.Module, XeonEngine,
                                                        list[str]]]:
    """One family's reference model, its started engine and the engine's start-up log."""
    name = request.param
    folder = tmp_path_factory.mktemp(name)
    model = saved_fallback_family(name, folder)
    engine, lines = started_with_log(folder)
    yield name, model, engine, lines
    engine.shutdown()


def test_greedy_tokens_equal_generate(family):
    """Three prompts submitted together (shared steps, chunked prefill): ``generate``'s tokens."""
    _, model, engine, _ = family
    want = transformers_greedy(model, MIXED_PROMPTS, NEW)
    assert engine_tokens(engine, MIXED_PROMPTS, NEW) == want


def test_start_up_logs_the_path_and_why(family):
    name, _, engine, lines = family
    (line,) = [line for line in lines if line.startswith("path: ")]
    if PATHS[name] == "fallback":
        assert line.startswith("path: fallback: the model's own attention")
        assert WHY[name] in line and type(engine._runner) is FallbackRunner
        assert any("prefix caching off" in line for line in lines)
    else:
        assert line.startswith("path: paged attention") and type(engine._runner) is ModelRunner


@pytest.fixture(scope="module")
def bloom(tmp_path_factory) -> Iterator[tuple[torch.nn.Module, Callable[..., XeonEngine]]]:
    """A Bloom reference model and a factory of engines on it, forced onto the fallback
    (Bloom takes the paged path by default), all shut down after."""
    folder = tmp_path_factory.mktemp("bloom_fb")
    model = saved_fallback_family("bloom", folder)
    engines: list[XeonEngine] = []

    def start(**config: object) -> XeonEngine:
        engine = XeonEngine(EngineConfig(
            model_path=str(folder), dtype="float32", max_batch_prefill_tokens=16,
            options={**TEST_OPTIONS, "block_size": "4", "forward": "fallback"},
            **config))  # type: ignore[arg-type]
        engine.start()
        engines.append(engine)
        return engine

    yield model, start
    for engine in engines:
        engine.shutdown()


def test_prompt_logprobs_and_top_tokens_match_a_forward_pass(bloom):
    """Scored across two prefill chunks, beside a plain request, on the fallback path."""
    model, start = bloom
    engine = start()
    prompt, top_n = MIXED_PROMPTS[2], 3
    sink = Collector()
    engine.submit(EngineRequest(
        request_id="scored", prompt_token_ids=tuple(prompt), prompt_logprobs=True,
        sampling=SamplingParams(top_n_tokens=top_n),
        stopping=StoppingParams(max_new_tokens=3, ignore_eos=True)), sink)
    engine.submit(greedy_request("plain", MIXED_PROMPTS[0], 3), sink)
    first = sink.wait("scored")[0]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    want = logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    assert len(first.prompt_logprobs) == len(prompt) - 1
    torch.testing.assert_close(torch.tensor(first.prompt_logprobs), want, atol=1e-4, rtol=0)
    values, ids = logprobs[:-1].topk(top_n, dim=-1)
    assert [[t.id for t in row] for row in first.prompt_top_tokens] == ids.tolist()
    torch.testing.assert_close(torch.tensor([[t.logprob for t in row]
                                             for row in first.prompt_top_tokens]),
                               values, atol=1e-4, rtol=0)
    # The first generated token: greedy, with its log-prob under the last prompt position.
    assert first.token_id == int(logits[-1].argmax())
    assert first.logprob == pytest.approx(float(logprobs[-1].max()), abs=1e-4)
    assert token_ids(sink.wait("plain")) == transformers_greedy(model, [MIXED_PROMPTS[0]], 3)[0]


def test_abort_mid_generation_frees_the_sequence(bloom):
    """Aborted after its third token: it ends ABORTED, its batch mate goes on unchanged, and
    its cache and blocks are let go."""
    model, start = bloom
    engine = start()
    sink = Collector()

    def abort_at_third(event):  # on the loop thread: the abort lands at the next step boundary
        sink(event)
        if len(sink.events("long")) == 3:
            engine.abort("long")

    engine.submit(greedy_request("long", MIXED_PROMPTS[1], 100), abort_at_third)
    engine.submit(greedy_request("mate", MIXED_PROMPTS[0], 12), sink)
    long_events = sink.wait("long")
    assert long_events[-1].finish_reason is FinishReason.ABORTED
    assert token_ids(long_events) == transformers_greedy(model, [MIXED_PROMPTS[1]], 3)[0]
    assert token_ids(sink.wait("mate")) == transformers_greedy(model, [MIXED_PROMPTS[0]], 12)[0]
    runner = engine._runner
    eventually(lambda: runner.live_caches == 0, timeout=30, interval=0.01,
               what="no live cache in the runner")
    blocks = engine._scheduler.blocks
    assert blocks.num_free_blocks == blocks.num_blocks


def test_preempted_sequences_rebuild_their_cache(bloom):
    """A cache too small for all three: the newest are preempted and re-prefilled, and every
    sequence still gets ``generate``'s tokens."""
    model, start = bloom
    engine = start(max_batch_total_tokens=48, max_total_tokens=48)
    prompts = [MIXED_PROMPTS[0], MIXED_PROMPTS[1], MIXED_PROMPTS[0][:14]]
    assert engine_tokens(engine, prompts, 12) == transformers_greedy(model, prompts, 12)
    assert engine.cache_stats().preemptions > 0


def test_forward_fallback_serves_a_paged_family(tmp_path):
    """``forward=fallback`` puts any model on the fallback; Llama's tokens are unchanged."""
    import transformers as T

    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(intermediate_size=96, num_key_value_heads=2,
                                             **LAYERS, **IDS)).eval()
    model.save_pretrained(tmp_path)
    engine = started_engine(tmp_path, forward="fallback")
    try:
        assert type(engine._runner) is FallbackRunner
        want = transformers_greedy(model, MIXED_PROMPTS, NEW)
        assert engine_tokens(engine, MIXED_PROMPTS, NEW) == want
    finally:
        engine.shutdown()


def test_an_encoder_decoder_model_is_refused_by_name(tmp_path):
    import transformers as T

    T.T5ForConditionalGeneration(T.T5Config(vocab_size=512, d_model=64, d_ff=128, d_kv=16,
                                            num_layers=2, num_heads=4)).save_pretrained(tmp_path)
    engine = XeonEngine(EngineConfig(model_path=str(tmp_path), dtype="float32",
                                     options=TEST_OPTIONS))
    with pytest.raises(EngineStartError, match=r"'t5' \(T5ForConditionalGeneration\) is an "
                                               r"encoder-decoder model; .*decoder-only"):
        engine.start()


def test_a_model_with_attention_sinks_goes_back_to_its_own_attention(tmp_path):
    """gpt-oss loads with the paged attention (its class takes the interface), shows its sinks
    once loaded, and is switched to its default attention on the fallback, same tokens."""
    import transformers as T

    torch.manual_seed(0)
    model = T.GptOssForCausalLM(T.GptOssConfig(
        intermediate_size=32, num_local_experts=2, num_experts_per_tok=1, num_key_value_heads=2,
        head_dim=16, **LAYERS, **IDS)).eval()
    model.save_pretrained(tmp_path)
    engine = started_engine(tmp_path)
    try:
        assert type(engine._runner) is FallbackRunner
        assert engine._runner.model.config._attn_implementation == "eager"
        prompts = MIXED_PROMPTS[:2]
        assert engine_tokens(engine, prompts, 6) == transformers_greedy(model, prompts, 6)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("forward", ["auto", "transformers"])
def test_a_model_with_one_attention_head_is_served(tmp_path, forward):
    """One head: q's head dimension has size 1, whose stride PyTorch leaves arbitrary; the
    paged kernels must not refuse it (they did: "q's heads must be dense")."""
    import transformers as T

    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(
        intermediate_size=128, hidden_size=16, num_hidden_layers=2, num_attention_heads=1,
        num_key_value_heads=1, max_position_embeddings=128, **IDS)).eval()
    model.save_pretrained(tmp_path)
    engine = started_engine(tmp_path, forward=forward)
    try:
        want = transformers_greedy(model, MIXED_PROMPTS, NEW)
        assert engine_tokens(engine, MIXED_PROMPTS, NEW) == want
    finally:
        engine.shutdown()
