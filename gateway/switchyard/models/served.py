"""One served model: its tokenizer, its engine, its limits and its admission control.

`ServedModel.stream` is the only way the HTTP side talks to an engine: it hands
a request to the engine's own thread and turns the engine's callbacks into an
async iterator on the event loop, aborting the sequence if the consumer stops
early (a client that disconnects, a stop string that matched).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from switchyard.errors import overloaded_error
from switchyard.settings import TokenLimits
from switchyard.text import TextTokenizer
from switchyard_spec import Engine, EngineRequest, EngineSpec, FinishReason, ModelInfo, TokenEvent

log = logging.getLogger("switchyard.models")

_request_counter = itertools.count()


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

    async def stream(self, request: EngineRequest) -> AsyncIterator[TokenEvent]:
        """Submit a request and yield its token events until the one that ends it.

        Closing the iterator early aborts the sequence in the engine.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

        def sink(event: TokenEvent) -> None:
            # Called on the engine thread: hop onto the event loop without blocking.
            loop.call_soon_threadsafe(queue.put_nowait, event)

        self.engine.submit(request, sink)
        ended = False
        try:
            while True:
                event = await queue.get()
                if event.finish_reason is not None or event.error is not None:
                    ended = True
                yield event
                if ended:
                    return
        finally:
            if not ended:
                self.engine.abort(request.request_id)


def new_request_id(prefix: str) -> str:
    """A process-unique id for an engine sequence."""
    return f"{prefix}-{next(_request_counter)}"


__all__ = ["Admission", "FinishReason", "ServedModel", "new_request_id"]
