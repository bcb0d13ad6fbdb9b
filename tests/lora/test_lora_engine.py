"""The Xeon engine with LoRA adapters, against PEFT's ``PeftModel`` (unmerged) as the reference.

Every adapter of :data:`~tests.support.lora_adapters.ADAPTERS` (ranks 2-16,
targets as a list or a regex, rank/alpha patterns, rsLoRA) gives PEFT's
greedy tokens, with log-probabilities within 1e-4 (fp32); the base model's
output is PEFT's base model's while adapters are loaded; a batch of 32
streams mixing 4 adapters and the base gives each its own tokens; the prefix
cache never shares blocks across adapters. The engine's tests run three
times: on the native product (the default) with decode steps on the one-call
layer loop (panel linears), on the native product in the Python layer loop,
and on the grouped product in PyTorch ops.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from switchyard_spec import AdapterError, EngineStartError

from tests.support import kernel_paths
from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids
from tests.support.lora_adapters import ADAPTERS, PeftReference, lora_engine

NEW = 6


SET_UPS = {
    "native": {"lora_kernel": "native", "linears": "panel"},
    "native-python-loop": {"lora_kernel": "native", "forward": "decoder"},
    "grouped": {"lora_kernel": "grouped"},
}


@pytest.fixture(scope="module", params=list(SET_UPS))
def set_up(request) -> str:
    """The name of the engine's set-up (a key of SET_UPS)."""
    return request.param


@pytest.fixture(scope="module")
def engine(set_up: str, default_model_path: Path, adapter_dirs: dict[str, Path]):
    """The engine in ``set_up``. Each set-up pins what it checks: the product it asks for,
    and where it names the layer loop, that loop; the grouped set-up leaves the linears (and
    so whether base-only decode steps take the one-call loop) to the machine's default."""
    if set_up.startswith("native"):
        kernel_paths.require("lora")
    if set_up == "native":
        kernel_paths.require("decode_layers")
    engine = lora_engine(default_model_path, adapter_dirs, **SET_UPS[set_up])
    assert engine._adapters.kernel == SET_UPS[set_up]["lora_kernel"]
    if set_up == "native":
        assert engine._runner._forward.native is not None
    if set_up == "native-python-loop":
        assert engine._runner._forward.native is None
    yield engine
    engine.shutdown()


def _run(engine, prompts: list[tuple[list[int], str | None]], new: int = NEW,
         tag: str = "r") -> list[tuple[list[int], list[float], list]]:
    sink = Collector()
    for i, (prompt, adapter) in enumerate(prompts):
        request = greedy_request(f"{tag}{i}", prompt, new)
        engine.submit(request.__class__(**{**_fields(request), "adapter_id": adapter}), sink)
    out = []
    for i in range(len(prompts)):
        events = sink.wait(f"{tag}{i}")
        assert events[-1].error is None, events[-1].error
        out.append((token_ids(events), [e.logprob for e in events], events))
    return out


def _fields(request) -> dict:
    return {f: getattr(request, f) for f in request.__struct_fields__}


@pytest.mark.parametrize("adapter", [None, *ADAPTERS])
def test_each_adapter_gives_peft_tokens_and_logprobs(engine, peft_reference: PeftReference,
                                                     adapter: str | None) -> None:
    prompt = prompt_of(11, start=3)
    [(tokens, logprobs, _)] = _run(engine, [(prompt, adapter)])
    want_tokens, want_logprobs = peft_reference.greedy(prompt, NEW, adapter)
    assert tokens == want_tokens
    assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


def test_a_mixed_batch_of_32_streams_gives_each_its_own_tokens(
        engine, peft_reference: PeftReference) -> None:
    names = [None, *list(ADAPTERS)]  # the base and 4 adapters
    prompts = [(prompt_of(5 + i % 7, start=i), names[i % len(names)]) for i in range(32)]
    results = _run(engine, prompts, tag="mix")
    for (prompt, adapter), (tokens, logprobs, _) in zip(prompts, results, strict=True):
        want_tokens, want_logprobs = peft_reference.greedy(prompt, NEW, adapter)
        assert tokens == want_tokens, adapter
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


def test_native_adapter_rows_decode_on_the_one_call_layer_loop(
        engine, set_up: str, peft_reference: PeftReference,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the native product and the one-call loop, a decode step's adapter rows never
    take the Python layer loop; the other set-ups' do (the control), whether or not their
    base-only steps take the one-call loop."""
    forward = engine._runner._forward
    python_decodes = []
    layers = forward._layers

    def counting(h, residual, cos, sin, step, decode):
        if decode is not None:
            python_decodes.append(step.lora is not None)
        return layers(h, residual, cos, sin, step, decode)

    monkeypatch.setattr(forward, "_layers", counting)
    prompts = [(prompt_of(6, start=11), "all-r8"), (prompt_of(8, start=2), "attn-r4"),
               (prompt_of(7, start=30), None)]
    for (prompt, adapter), (tokens, _, _) in zip(prompts, _run(engine, prompts, tag="loop"),
                                                  strict=True):
        assert tokens == peft_reference.greedy(prompt, NEW, adapter)[0]
    if set_up == "native":
        assert python_decodes == []
    else:
        assert any(python_decodes)


def test_the_prefix_cache_keys_on_the_adapter(engine, peft_reference: PeftReference) -> None:
    prompt = prompt_of(21, start=77)  # five full blocks of 4
    first = _run(engine, [(prompt, "attn-r4")], tag="c1")[0]
    again = _run(engine, [(prompt, "attn-r4")], tag="c2")[0]
    other = _run(engine, [(prompt, "all-r8")], tag="c3")[0]
    base = _run(engine, [(prompt, None)], tag="c4")[0]
    assert again[2][0].cached_tokens == 20  # the same adapter shares its blocks
    assert other[2][0].cached_tokens == 0  # another adapter shares none
    assert base[2][0].cached_tokens == 0  # nor does the base model
    assert first[0] == again[0] == peft_reference.greedy(prompt, NEW, "attn-r4")[0]
    assert other[0] == peft_reference.greedy(prompt, NEW, "all-r8")[0]
    assert base[0] == peft_reference.greedy(prompt, NEW, None)[0]


def test_an_unknown_adapter_ends_the_sequence_with_an_error(engine) -> None:
    sink = Collector()
    request = greedy_request("u", prompt_of(5), 3)
    engine.submit(request.__class__(**{**_fields(request), "adapter_id": "nope"}), sink)
    [event] = sink.wait("u")
    assert event.error is not None and "nope" in event.error


def test_runtime_load_and_unload_leave_running_requests_alone(
        engine, adapter_dirs: dict[str, Path], peft_reference: PeftReference,
        tmp_path: Path) -> None:
    prompt = prompt_of(9, start=40)
    sink = Collector()
    request = greedy_request("long", prompt, 24)
    engine.submit(request.__class__(**{**_fields(request), "adapter_id": "kv-o-r16"}), sink)
    sink.wait_tokens("long", 2)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        engine.load_adapter("broken", str(tmp_path))  # a failed load, mid-generation
    engine.load_adapter("late", str(adapter_dirs["mlp-regex"]))
    [(tokens, _, _)] = _run(engine, [(prompt, "late")], tag="late")
    assert tokens == peft_reference.greedy(prompt, NEW, "mlp-regex")[0]
    engine.unload_adapter("kv-o-r16")  # "long" holds it: it finishes with it
    events = sink.wait("long")
    assert token_ids(events) == peft_reference.greedy(prompt, 24, "kv-o-r16")[0]
    gone = Collector()
    engine.submit(request.__class__(**{**_fields(request), "request_id": "gone",
                                       "adapter_id": "kv-o-r16"}), gone)
    assert "kv-o-r16" in (gone.wait("gone")[-1].error or "")
    engine.load_adapter("kv-o-r16", str(adapter_dirs["kv-o-r16"]))  # back for later tests


def test_lru_eviction_with_fewer_slots_than_adapters(
        default_model_path: Path, adapter_dirs: dict[str, Path],
        peft_reference: PeftReference) -> None:
    engine = lora_engine(default_model_path, adapter_dirs, max_loras=2)
    try:
        names = list(ADAPTERS)
        prompts = [(prompt_of(6 + i % 3, start=9 * i), names[i % 4]) for i in range(12)]
        results = _run(engine, prompts, tag="lru")
        for (prompt, adapter), (tokens, _, _) in zip(prompts, results, strict=True):
            assert tokens == peft_reference.greedy(prompt, NEW, adapter)[0], adapter
        bank = engine._adapters.bank  # how many folder reads the LRU made
        assert len(bank.held()) <= 2
        assert bank.loads_from_disk > len(names)
    finally:
        engine.shutdown()


def test_start_refuses_an_adapter_over_the_rank_limit(default_model_path: Path,
                                                      adapter_dirs: dict[str, Path]) -> None:
    with pytest.raises(EngineStartError, match="greater than max_lora_rank 8"):
        lora_engine(default_model_path, {"big": adapter_dirs["kv-o-r16"]}, max_lora_rank=8)


def test_bf16_dot_products_with_bf16_adapters_give_peft_tokens_within_bf16_ties(
        default_model_path: Path, adapter_dirs: dict[str, Path]) -> None:
    """``--dtype bfloat16`` on the bf16 dot-product panels holds adapters in bf16 (native
    product, one-call loop). Reference: PEFT with every weight, A and B included, rounded
    to bf16, in fp32 math; teacher-forced within bf16's near ties."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.support.greedy import BF16_TIE, assert_greedy_near

    kernel_paths.require("lora")
    kernel_paths.require("panel_dot bf16")
    names = ["all-r8", "kv-o-r16"]
    engine = lora_engine(default_model_path, {n: adapter_dirs[n] for n in names},
                         dtype="bfloat16")
    try:
        assert engine._adapters.kernel == "native"
        assert engine._adapters.dtype == torch.bfloat16
        assert engine._runner._forward.native is not None
        prompts = [(prompt_of(9, start=17), n) for n in names]
        got = [tokens for tokens, _, _ in _run(engine, prompts, tag="bf16")]
    finally:
        engine.shutdown()
    for (prompt, name), tokens in zip(prompts, got, strict=True):
        base = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, adapter_dirs[name]).eval()
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.bfloat16().float())
        assert_greedy_near(model, [prompt], [tokens], NEW, tol=BF16_TIE)
        with torch.no_grad(), model.disable_adapter():  # the adapter matters here
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        assert logits.argmax(-1).tolist() != tokens


def test_drafted_tokens_of_adapter_sequences_are_verified_with_their_adapter(
        default_model_path: Path, adapter_dirs: dict[str, Path],
        peft_reference: PeftReference) -> None:
    """With n-gram speculation an adapter sequence's verifying rows get its deltas (one-call
    loop): PEFT's greedy tokens and logprobs, and drafts did run."""
    kernel_paths.require("lora")
    names = ["all-r8", "kv-o-r16"]
    engine = lora_engine(default_model_path, {n: adapter_dirs[n] for n in names},
                         linears="panel", speculate="3", speculate_ngram_min="1")
    try:
        # A prompt that repeats itself, so single-token n-grams find drafts.
        prompts = [(prompt_of(4, start=21) * 3, name) for name in [*names, None]]
        results = _run(engine, prompts, new=10, tag="spec")
        drafts = engine.stats().spec_draft_tokens
    finally:
        engine.shutdown()
    for (prompt, adapter), (tokens, logprobs, _) in zip(prompts, results, strict=True):
        want_tokens, want_logprobs = peft_reference.greedy(prompt, 10, adapter)
        assert tokens == want_tokens, adapter
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)
    assert drafts > 0
