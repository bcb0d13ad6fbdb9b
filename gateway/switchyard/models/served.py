"""One served model: its tokenizer, its engine, its limits and its admission control.

`ServedModel.submit` is the only way the HTTP side talks to an engine: it hands
a request to the engine's own thread at once and returns an `EventStream`, an
async iterator over the engine's callbacks on the event loop. Closing the
stream early aborts the sequence (a client that disconnects, a stop string
that matched). Submitting is synchronous on purpose: the sequences of one HTTP
request (OpenAI `n`, TGI `best_of`) are handed over back to back, with no
await in between, so the engine admits them into the same batch.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import weakref
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar

from switchyard.engine_process import EngineProcess
from switchyard.errors import ApiError, overloaded_error
from switchyard.settings import TokenLimits
from switchyard.text import TextTokenizer
from switchyard_spec import (
    Engine,
    EngineRequest,
    EngineSpec,
    FinishReason,
    ModelInfo,
    TokenEvent,
    WarmupReport,
)

if TYPE_CHECKING:
    from switchyard.media.processor import VisionProcessor

log = logging.getLogger("switchyard.models")

_request_counter = itertools.count()

HEALTH_PROBE_TIMEOUT_S = 30.0
"""How long an engine's liveness probe may take before the model counts as down."""


@dataclass
class Admission:
    """A non-blocking counter of in-flight requests: over the limit is a 429 at once."""

    limit: int
    in_flight: int = 0

    def check(self) -> None:
        """Raise the overloaded error if no permit is free now (taking none)."""
        if self.in_flight >= self.limit:
            raise overloaded_error()

    def acquire(self) -> None:
        """Take a permit or raise the overloaded error."""
        self.check()
        self.in_flight += 1

    def release(self) -> None:
        """Give a permit back."""
        self.in_flight -= 1


class _Mailbox:
    """Token events from engine threads to one event loop, a wake-up per burst.

    An engine emits a step's events back to back, one per sequence; a
    ``call_soon_threadsafe`` each would wake the loop (a write to its self-pipe)
    once per event, and every wake-up on a CPU server can preempt one of the
    engine's compute threads mid-step. Events queue here, and only the first of
    a burst schedules the loop callback that hands them all to their streams,
    in order. Measured at 32 streams on the 135M shape (2-core Zen 4 VM, four
    alternating pairs of `benchmarks/compare_peers.py --peers switchyard`):
    442 against 427 tokens/s on average, three pairs of four in its favour,
    within the VM's drift.
    """

    _by_loop: ClassVar[weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox]] = (
        weakref.WeakKeyDictionary())
    _create: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: deque[tuple[asyncio.Queue[TokenEvent], TokenEvent]] = deque()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _Mailbox:
        """The mailbox of ``loop`` (one per loop, made on first use)."""
        with cls._create:
            box = cls._by_loop.get(loop)
            if box is None:
                box = cls._by_loop[loop] = cls(loop)
            return box

    def post(self, queue: asyncio.Queue[TokenEvent], event: TokenEvent) -> None:
        """From any thread: queue ``event`` for ``queue``; wake the loop if it is not already due."""
        with self._lock:
            first = not self._pending
            self._pending.append((queue, event))
        if first:
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: nobody is left to read
                pass

    def _drain(self) -> None:
        with self._lock:
            items, self._pending = self._pending, deque()
        for queue, event in items:
            queue.put_nowait(event)


class EventStream:
    """The token events of one submitted sequence, read on the event loop.

    Iterating yields events until the one that ends the sequence (a
    `finish_reason` or an `error`). `close` aborts the sequence in the engine if
    it has not ended; it is idempotent and safe to call from a `finally`.
    """

    def __init__(self, engine: Engine, request: EngineRequest) -> None:
        self.request_id = request.request_id
        self._engine = engine
        self._mailbox = _Mailbox.of(asyncio.get_running_loop())
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._ended = False
        engine.submit(request, self._sink)

    def _sink(self, event: TokenEvent) -> None:
        # Called on the engine thread: hop onto the event loop without blocking.
        self._mailbox.post(self._queue, event)

    def __aiter__(self) -> EventStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._ended:
            raise StopAsyncIteration
        event = await self._queue.get()
        if event.finish_reason is not None or event.error is not None:
            self._ended = True
        return event

    def close(self) -> None:
        """Abort the sequence unless it already ended."""
        if not self._ended:
            self._ended = True
            self._engine.abort(self.request_id)


@dataclass
class ServedModel:
    """A model the gateway serves, bound to the engine that runs it."""

    name: str
    model_id: str
    tokenizer: TextTokenizer
    engine: Engine
    engine_spec: EngineSpec
    info: ModelInfo
    limits: TokenLimits
    admission: Admission
    aliases: frozenset[str] = field(default_factory=frozenset)
    """More names clients may send (`aliases` in a config file); the registry adds the
    model id too, unless another model took it first."""
    healthy: bool = True
    """Last known state: false after a generation error, until a sequence or a
    health probe succeeds again (TGI's backend health flag)."""
    warmup: WarmupReport | None = None
    """What the engine's warmup measured (time, token capacity), for metrics."""
    vision: VisionProcessor | None = None
    """The model folder's image processor, for a model whose engine takes images
    (`ModelInfo.takes_images`); None for text-only models (`switchyard.media`)."""
    adapters: dict[str, str] = field(default_factory=dict)
    """The LoRA adapters served on this model: name -> folder (shared by its adapter views,
    so a runtime load or unload shows in all of them)."""
    adapter_id: str | None = None
    """On a view made by `for_adapter`: the adapter its requests run with."""
    parent: str | None = None
    """On a view made by `for_adapter`: the base model's name."""
    _probe_lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    def for_adapter(self, adapter: str) -> ServedModel:
        """This model as its adapter ``adapter``: replies name the adapter, requests run with it.

        The view shares the engine, tokenizer, limits and admission (an
        adapter's requests count against the base model's concurrency).
        """
        return replace(self, name=adapter, aliases=frozenset(), adapter_id=adapter,
                       parent=self.name)

    def check_available(self) -> None:
        """Raise a 503 `unhealthy` while the model's engine process is down or restarting.

        Only an engine in its own process (`--engine-process`) is ever
        unavailable this way; the gateway checks it when it resolves a request's model.
        """
        engine = self.engine
        if isinstance(engine, EngineProcess):
            down = engine.unavailable()
            if down is not None:
                raise ApiError(503, f"Model `{self.name}` is not available: {down}", "unhealthy")

    def submit(self, request: EngineRequest) -> EventStream:
        """Hand `request` to the engine now; read its events from the returned stream."""
        return EventStream(self.engine, request)

    async def check_health(self, timeout: float = HEALTH_PROBE_TIMEOUT_S) -> bool:
        """Whether the model can serve, probing the engine when the last state was bad.

        A healthy last state costs only the engine's non-blocking `healthy()`.
        After a failed generation the engine's `probe_liveness` (a real 1-token
        generation in engines that can run one, TGI's check) runs on a worker
        thread, one probe at a time, and its outcome becomes the new state.
        """
        if not self.engine.healthy():
            self.healthy = False
            return False
        if self.healthy:
            return True
        async with self._probe_lock:
            if not self.healthy:  # another caller's probe may have settled it meanwhile
                self.healthy = await asyncio.to_thread(self._probe, timeout)
        return self.healthy

    def _probe(self, timeout: float) -> bool:
        try:
            alive = bool(self.engine.probe_liveness(timeout))
        except Exception:  # an engine's probe that raises has answered "not alive"
            log.exception("health probe of %s raised", self.name)
            return False
        if alive:
            log.info("health probe of %s succeeded", self.name)
        else:
            log.warning("health probe of %s failed", self.name)
        return alive


def new_request_id(prefix: str) -> str:
    """A process-unique id for an engine sequence."""
    return f"{prefix}-{next(_request_counter)}"


__all__ = ["Admission", "EventStream", "FinishReason", "ServedModel", "new_request_id"]
