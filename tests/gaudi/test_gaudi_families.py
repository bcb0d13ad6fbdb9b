"""Greedy parity with transformers ``generate`` for each family, prompts sharing one padded batch.

Each family is a tiny random model saved as a model folder: Llama, Mistral
with a sliding window shorter than the prompts, Qwen2 with biased projections
and a window on its first layer, Phi-3 with fused projections and partial
rotary. Prompts of 6, 21 and 33 tokens are prefilled in one step, padded to
4 rows of 48 tokens, then decoded together in a padded batch of 4 rows, and
each must give exactly the tokens ``generate`` gives for it alone, unpadded.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from switchyard_gaudi.warmup_plan import DECODE, PREFILL, Shape

from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids
from tests.support.greedy import generate_greedy

SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
             initializer_range=0.1)


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**SMALL))


def _mistral() -> torch.nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(sliding_window=8, **SMALL))


def _qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(use_sliding_window=True, sliding_window=8, max_window_layers=1, **SMALL)
    return Qwen2ForCausalLM(config)


def _phi3() -> torch.nn.Module:
    from transformers import Phi3Config, Phi3ForCausalLM

    return Phi3ForCausalLM(Phi3Config(partial_rotary_factor=0.5, pad_token_id=0, **SMALL))


FAMILIES: dict[str, Callable[[], torch.nn.Module]] = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "phi3": _phi3}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A tiny random model of one family, saved as a model folder, and its fp32 reference."""
    torch.manual_seed(0)
    model = FAMILIES[request.param]().eval()
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return folder, model


def park_first_decode(engine) -> tuple[threading.Event, threading.Event, list[Shape]]:
    """Make the engine's first decode step wait for a gate, and record every step's shape.

    Returns (entered, gate, shapes): ``entered`` is set when the loop is parked
    inside that step, so requests submitted before ``gate`` is set are all
    queued together at the next step boundary.
    """
    runner = engine._runner
    entered, gate = threading.Event(), threading.Event()
    shapes: list[Shape] = []
    prefill, decode = runner.prefill, runner.decode

    def spy_prefill(seqs, shape):
        shapes.append(shape)
        return prefill(seqs, shape)

    def spy_decode(seqs, shape):
        if not entered.is_set():
            entered.set()
            gate.wait(30)
        shapes.append(shape)
        return decode(seqs, shape)

    runner.prefill, runner.decode = spy_prefill, spy_decode
    return entered, gate, shapes


def test_greedy_tokens_equal_generate_with_prompts_in_one_padded_batch(family, make_gaudi):
    folder, model = family
    # Warmup off: only the shapes used compile, which keeps four families fast.
    engine = make_gaudi(folder, env={"WARMUP_ENABLED": "false"}, max_batch_prefill_tokens=192)
    entered, gate, shapes = park_first_decode(engine)
    sink = Collector()
    blocker = [t % 500 + 1 for t in prompt_of(4, start=9)]
    engine.submit(greedy_request("blocker", blocker, 12), sink)
    assert entered.wait(60)
    prompts = {f"p{n}": [t % 500 + 1 for t in prompt_of(n, start=n)] for n in (6, 21, 33)}
    for rid, prompt in prompts.items():
        engine.submit(greedy_request(rid, prompt, 10), sink)
    gate.set()
    prompts["blocker"] = blocker
    for rid, prompt in prompts.items():
        assert token_ids(sink.wait(rid)) == generate_greedy(model, prompt, 12 if rid == "blocker"
                                                            else 10), rid
    # The blocker prefilled alone (2 rows of 16) and decoded once while the three queued;
    # they shared one prefill, padded to 4 rows of the 48-token bucket (21 and 33 are longer
    # than the 8-token windows), then decoded with the blocker in batches of 4 rows.
    assert shapes[:3] == [Shape(PREFILL, 2, 16), Shape(DECODE, 4, 96), Shape(PREFILL, 4, 48)]
    assert set(shapes[3:]) == {Shape(DECODE, 4, 96)}
