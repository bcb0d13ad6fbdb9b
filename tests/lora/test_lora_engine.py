"""The Xeon engine with LoRA adapters, against PEFT's ``PeftModel`` (unmerged) as the reference.

Every adapter of :data:`~tests.support.lora_adapters.ADAPTERS` (ranks 2-16,
targets as a list or a regex, rank/alpha patterns, rsLoRA) gives PEFT's
greedy tokens, with log-probabilities within 1e-4 (fp32); the base model's
output is PEFT's base model's while adapters are loaded; a batch of 32
streams mixing 4 adapters and the base gives each its own tokens; the prefix
cache never shares blocks across adapters.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from switchyard_spec import AdapterError, EngineStartError

from tests.support.engine_requests import Collector, greedy_request, prompt_of, token_ids
from tests.support.lora_adapters import ADAPTERS, PeftReference, lora_engine

NEW = 6


@pytest.fixture(scope="module")
def engine(default_model_path: Path, adapter_dirs: dict[str, Path]):
    engine = lora_engine(default_model_path, adapter_dirs)
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
