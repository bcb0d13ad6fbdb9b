"""What every engine's compute loop shares: its thread, its stopping rule, its event delivery.

- :func:`start_compute_thread`: the model loads on the thread that will run
  the loop, not the caller's. OpenMP keeps one worker pool per thread that
  runs parallel regions; a second, idle pool left on the loading thread makes
  libgomp put every worker to sleep between regions (docs/xeon.md).
- :func:`finish_reason`: when a sequence stops on its own (EOS or length).
- :func:`deliver`: a sink that raises is logged, never allowed to stop the loop.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from switchyard_spec import EngineRequest, EventSink, FinishReason, TokenEvent

if TYPE_CHECKING:
    from switchyard_engine.sampling import RowSampler

logger = logging.getLogger("switchyard.engine")

T = TypeVar("T")


def start_compute_thread(name: str, load: Callable[[], T],
                         loop: Callable[[], None]) -> tuple[threading.Thread, T]:
    """Run ``load`` then ``loop`` on a new daemon thread; return it and what ``load`` returned.

    Blocks until ``load`` is done. If it raises, the thread ends and the error
    is raised here, in the caller's thread (``Engine.start``'s caller).
    """
    loaded = threading.Event()
    outcome: list[T | BaseException] = []

    def run() -> None:
        try:
            outcome.append(load())
        except BaseException as exc:  # handed to the caller below
            outcome.append(exc)
            return
        finally:
            loaded.set()
        loop()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    loaded.wait()
    result = outcome[0]
    if isinstance(result, BaseException):
        thread.join()
        raise result
    return thread, result


class GeneratingSequence(Protocol):
    """What :func:`finish_reason` reads of an engine's sequence."""

    @property
    def request(self) -> EngineRequest: ...

    @property
    def tokens(self) -> list[int]: ...

    @property
    def generated(self) -> int: ...

    @property
    def ignore_eos(self) -> bool: ...

    @property
    def max_length(self) -> int: ...

    @property
    def sampler(self) -> RowSampler: ...


def finish_reason(seq: GeneratingSequence, token_id: int) -> FinishReason | None:
    """Why ``seq`` stops after generating ``token_id``, or None if it goes on."""
    stopping = seq.request.stopping
    if not seq.ignore_eos and token_id in stopping.eos_token_ids:
        return FinishReason.EOS_TOKEN
    grammar = seq.sampler.grammar
    if grammar is not None and grammar.terminated:
        return FinishReason.EOS_TOKEN  # the grammar took its stop token: the text is complete
    if seq.generated >= stopping.max_new_tokens or len(seq.tokens) >= seq.max_length:
        return FinishReason.LENGTH
    return None


def deliver(sink: EventSink, event: TokenEvent) -> None:
    """Call a sink; a failing sink is logged, never allowed to stop the loop."""
    try:
        sink(event)
    except Exception:
        logger.exception("event sink for %s raised", event.request_id)
