"""What one generation request did and when: the record metrics, traces and logs are made from.

The request middleware (`telemetry.middleware`) opens a `RequestRecord` when a
generation request arrives and puts it in a context variable; the code that
knows a fact notes it there, each in one place:

- `Gateway.model` notes which model (and engine) serves the request;
- `generation.SequenceRun` notes each sequence it submits, its first event
  (with the engine's queue time) and how it ended;
- the error formatters (`routes/errors.py`, TGI's in-stream error event) note
  the error a client was answered with.

When the response is complete the middleware hands the record to metrics,
tracing and the request log at once. Outside a generation request there is no
record and every `note_*` call is a no-op, so engines, warmup and tests that
drive `generation` directly pay nothing.

Times are `time.perf_counter()` seconds; `arrival_ns` anchors them to the wall
clock for trace timestamps. TGI's definitions: validation = enqueue - arrival,
queue = batch start - enqueue, inference = end - batch start, time per token
= inference / generated tokens.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

import msgspec

from switchyard.errors import ApiError


CLIENT_CLOSED_STATUS = 499
"""nginx's "client closed request": the status logged for a request whose client left."""


class SequenceRecord(msgspec.Struct, kw_only=True):
    """One engine sequence of a request (a request has several with `n` or `best_of`)."""

    index: int
    prompt: tuple[int, ...]
    """The prompt's ids: copies of one prompt (`n`, `best_of`) share the tuple."""
    max_new_tokens: int
    submitted: float
    queue_seconds: float | None = None
    """Engine-reported time from submit to its first forward step (None: not reported)."""
    first_event: float | None = None
    ended: float | None = None
    generated_tokens: int = 0
    finish_reason: str | None = None

    @property
    def batch_start(self) -> float:
        """When the engine first ran this sequence (its submit time if the engine did not say)."""
        return self.submitted + (self.queue_seconds or 0.0)

    def first(self, queue_seconds: float | None) -> None:
        """The sequence's first event arrived."""
        self.first_event = time.perf_counter()
        self.queue_seconds = queue_seconds

    def end(self, generated_tokens: int, finish_reason: str | None) -> None:
        """The sequence ended (finish_reason None: it failed or was cut short)."""
        self.ended = time.perf_counter()
        self.generated_tokens = generated_tokens
        self.finish_reason = finish_reason


class RequestRecord(msgspec.Struct, kw_only=True):
    """One HTTP generation request, from arrival to its last byte."""

    method: str
    route: str
    arrival: float
    arrival_ns: int
    """Wall clock (ns since the epoch) at `arrival`."""
    model: str = ""
    engine: str = ""
    sequences: list[SequenceRecord] = msgspec.field(default_factory=list)
    error: ApiError | None = None
    status: int = 0
    completed: bool = False
    """The response's last byte was handed to the server (False: the client went away)."""
    crashed: bool = False
    end: float = 0.0
    trace_id: str | None = None
    """Set by tracing when the request was traced (for the log line)."""

    @classmethod
    def begin(cls, method: str, route: str) -> RequestRecord:
        """A record for a request arriving now."""
        return cls(method=method, route=route, arrival=time.perf_counter(),
                   arrival_ns=time.time_ns())

    def wall_ns(self, t: float) -> int:
        """A `perf_counter` time as wall-clock nanoseconds since the epoch."""
        return self.arrival_ns + int((t - self.arrival) * 1e9)

    @property
    def failure(self) -> str | None:
        """Why the request failed, as `tgi_request_failure`'s `err` label; None if it succeeded."""
        if self.error is not None:
            return failure_kind(self.error)
        if self.crashed:
            return "internal"
        if self.status >= 400:
            return "unauthorized" if self.status == 401 else f"http_{self.status}"
        if not self.completed:
            return "dropped"
        return None

    @property
    def logged_status(self) -> int:
        """The status the log and the trace name: 499 (nginx's "client closed request") for
        every request whose client left before the answer was whole, whether or not its
        status line had gone out, so that one event reads one way."""
        return CLIENT_CLOSED_STATUS if self.failure == "dropped" else self.status

    @property
    def enqueued(self) -> float | None:
        """When the first sequence was submitted (validation ends here)."""
        return self.sequences[0].submitted if self.sequences else None

    @property
    def input_tokens(self) -> int:
        """Prompt tokens, each prompt once however many sequences share it."""
        seen: dict[int, int] = {}
        for seq in self.sequences:
            seen[id(seq.prompt)] = len(seq.prompt)
        return sum(seen.values())

    @property
    def generated_tokens(self) -> int:
        """Tokens generated by all sequences."""
        return sum(seq.generated_tokens for seq in self.sequences)

    @property
    def max_new_tokens(self) -> int:
        """The request's `max_new_tokens` (the same for all its sequences)."""
        return self.sequences[0].max_new_tokens if self.sequences else 0

    def timings(self) -> Timings | None:
        """TGI's request timings, or None if no sequence ran to its end."""
        seqs = self.sequences
        if not seqs or any(s.ended is None for s in seqs):
            return None
        enqueued = seqs[0].submitted
        batch_start = min(s.batch_start for s in seqs)
        inference_end = max(s.ended or 0.0 for s in seqs)
        inference = max(inference_end - batch_start, 0.0)
        # With several sequences in parallel, a client waits per token as long as
        # the longest one takes per token: divide by its length, not the sum.
        longest = max(s.generated_tokens for s in seqs)
        return Timings(
            total=self.end - self.arrival,
            validation=enqueued - self.arrival,
            queue=max(batch_start - enqueued, 0.0),
            inference=inference,
            time_per_token=inference / longest if longest else 0.0,
        )


class Timings(msgspec.Struct, frozen=True, kw_only=True):
    """A finished request's durations, in seconds."""

    total: float
    validation: float
    queue: float
    inference: float
    time_per_token: float


# TGI's `err` label values for the error types both servers share; our own
# types keep their names, so the label set stays small and fixed.
_TGI_ERR = {
    "validation": "validation",
    "batch size exceeded": "validation",
    "suffix not supported": "validation",
    "overloaded": "overloaded",
    "generation": "generation",
    "incomplete_generation": "incomplete",
    "incomplete_generation_stream": "incomplete",
    "template_error": "template",
}


def failure_kind(err: ApiError) -> str:
    """The `err` label of an error: TGI's name where TGI has one, else our error type."""
    if err.code == "model_not_found":
        return "model_not_found"
    return _TGI_ERR.get(err.error_type, err.error_type)


_current: ContextVar[RequestRecord | None] = ContextVar("switchyard_request", default=None)


def current() -> RequestRecord | None:
    """The record of the generation request being served, if any."""
    return _current.get()


def activate(record: RequestRecord) -> object:
    """Make `record` current; returns the token `deactivate` needs."""
    return _current.set(record)


def deactivate(token: object) -> None:
    """Undo `activate`."""
    _current.reset(token)  # type: ignore[arg-type]


def note_model(name: str, engine: str) -> None:
    """The request is served by model `name` on engine `engine`."""
    record = _current.get()
    if record is not None:
        record.model = name
        record.engine = engine


def note_error(err: ApiError) -> None:
    """The client is answered with `err` (the first error noted wins)."""
    record = _current.get()
    if record is not None and record.error is None:
        record.error = err


def note_sequence(prompt: tuple[int, ...], max_new_tokens: int) -> SequenceRecord | None:
    """A sequence is submitted to the engine now; None outside a generation request."""
    record = _current.get()
    if record is None:
        return None
    seq = SequenceRecord(index=len(record.sequences), prompt=prompt,
                         max_new_tokens=max_new_tokens, submitted=time.perf_counter())
    record.sequences.append(seq)
    return seq
