"""Fixtures for the Xeon engine tests: a real engine on the default model, and helpers.

Everything runs the real model (the gateway's embedded tiny Llama) in float32,
so greedy output can be compared token for token with ``transformers``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from switchyard_spec import (
    EngineConfig,
    EngineRequest,
    SamplingParams,
    StoppingParams,
    TokenEvent,
)
from switchyard_xeon.engine import XeonEngine

from tests.support.tiny_models import DECODER_FAMILIES

WAIT_S = 60.0
TEST_OPTIONS = {"num_threads": "1"}
"""The tiny test model gains nothing from more threads, and on a busy machine (CI,
parallel sessions) OpenMP threads waiting at barriers for a descheduled peer
make every step many times slower."""


class Collector:
    """A thread-safe sink that records events per request and signals when each ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, list[TokenEvent]] = {}
        self._done: dict[str, threading.Event] = {}
        self._arrived = threading.Condition(self._lock)
        self.order: list[tuple[str, int]] = []
        """(request_id, index within that request) of every event, in arrival order."""

    def __call__(self, event: TokenEvent) -> None:
        with self._lock:
            events = self._events.setdefault(event.request_id, [])
            self.order.append((event.request_id, len(events)))
            events.append(event)
            if event.finish_reason is not None or event.error is not None:
                self._flag(event.request_id).set()
            self._arrived.notify_all()

    def _flag(self, rid: str) -> threading.Event:
        return self._done.setdefault(rid, threading.Event())

    def wait(self, rid: str, timeout: float = WAIT_S) -> list[TokenEvent]:
        """All events of ``rid`` once it has ended."""
        with self._lock:
            flag = self._flag(rid)
        assert flag.wait(timeout), f"{rid} did not finish within {timeout}s"
        return self.events(rid)

    def wait_tokens(self, rid: str, count: int, timeout: float = WAIT_S) -> list[TokenEvent]:
        """Block until ``rid`` has at least ``count`` events."""
        with self._arrived:
            ok = self._arrived.wait_for(lambda: len(self._events.get(rid, [])) >= count, timeout)
        assert ok, f"{rid} produced fewer than {count} events within {timeout}s"
        return self.events(rid)

    def events(self, rid: str) -> list[TokenEvent]:
        """A copy of the events seen so far for ``rid``."""
        with self._lock:
            return list(self._events.get(rid, []))


def greedy_request(rid: str, prompt: list[int], max_new: int, **stopping: object) -> EngineRequest:
    """A greedy request that ignores EOS unless told otherwise."""
    stopping.setdefault("ignore_eos", True)
    return EngineRequest(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(),
        stopping=StoppingParams(max_new_tokens=max_new, **stopping),  # type: ignore[arg-type]
    )


def token_ids(events: list[TokenEvent]) -> list[int]:
    """The generated ids of a finished sequence's events."""
    return [e.token_id for e in events if e.error is None and e.token_id >= 0]


@pytest.fixture(scope="session")
def reference_model(default_model_path: Path) -> torch.nn.Module:
    """The same model through plain transformers (its own attention), float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_greedy(reference_model: torch.nn.Module) -> Callable[[list[int], int], list[int]]:
    """``model.generate(do_sample=False)`` continuation of a prompt, EOS ignored."""

    def run(prompt: list[int], max_new: int) -> list[int]:
        with torch.inference_mode():
            out = reference_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new,
                eos_token_id=None,  # never stop at EOS: the engine requests ignore it
                pad_token_id=0,
            )
        ids = out[0, len(prompt) :].tolist()
        assert len(ids) == max_new
        return ids

    return run


@pytest.fixture
def make_engine(default_model_path: Path) -> Iterator[Callable[..., XeonEngine]]:
    """Build and start engines on the default model (float32); all are shut down after."""
    engines: list[XeonEngine] = []

    def build(options: dict[str, str] | None = None, **limits: int) -> XeonEngine:
        engine = XeonEngine(EngineConfig(model_path=str(default_model_path), dtype="float32",
                                         options={**TEST_OPTIONS, **(options or {})},
                                         **limits))  # type: ignore[arg-type]
        engine.start()
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        engine.shutdown()


@pytest.fixture(scope="module")
def shared_engine(default_model_path: Path) -> Iterator[XeonEngine]:
    """One started, warmed engine for tests that do not change its limits."""
    engine = XeonEngine(EngineConfig(model_path=str(default_model_path), dtype="float32",
                                     options=TEST_OPTIONS))
    engine.start()
    engine.warmup()
    yield engine
    engine.shutdown()


def prompt_of(length: int, start: int = 5) -> list[int]:
    """A deterministic prompt of ``length`` ordinary ids (away from the special tokens)."""
    return [(start + 7 * i) % 1900 + 10 for i in range(length)]


def hf_min_new_tokens(model: torch.nn.Module, prompt: list[int], max_new: int, min_new: int,
                      eos: int, eos_bias: float) -> tuple[list[int], list[float]]:
    """``generate(do_sample=False, min_new_tokens=...)`` with ``eos_bias`` added to the EOS
    logit (transformers' ``SequenceBiasLogitsProcessor``), stopping at EOS.

    Returns the generated ids (EOS included when it ended them) and each one's
    log-probability under the processed scores it was chosen from (bias and the
    min-new-tokens mask applied), the distribution an engine reports.
    """
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=max_new, min_new_tokens=min_new,
            eos_token_id=eos, pad_token_id=0, sequence_bias={(eos,): eos_bias},
            output_scores=True, return_dict_in_generate=True)
    ids = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, ids,
                                                                                strict=True)]
    return ids, logprobs


@pytest.fixture(scope="module", params=sorted(DECODER_FAMILIES))
def family_model(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A tiny random model of one family the hand-written decoder claims
    (:data:`~tests.support.tiny_models.DECODER_FAMILIES`), saved as a model folder, and its
    fp32 reference."""
    torch.manual_seed(0)
    model = DECODER_FAMILIES[request.param]().eval()
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return folder, model
