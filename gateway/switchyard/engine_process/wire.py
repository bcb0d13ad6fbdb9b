"""What crosses the pipe between the gateway and an engine process: msgspec msgpack frames.

Each frame is a 4-byte little-endian length and one msgpack-encoded message.
The gateway sends `Start`, `Warmup`, `Submit`, `Abort`, `Probe`, `CheckHealth`
and `Shutdown`; the engine process answers calls (`Started`, `Warmed`,
`Probed`, `Closed`, or `Failed`) and pushes `Events` (the token events, step
reports and load of one engine step, in one frame), `Stats` and `Health`.
The payloads are the contract's own Structs (`switchyard_spec.types`), so an
event reaches the gateway's sink exactly as the engine built it.
"""

from __future__ import annotations

import socket
import struct
import threading

import msgspec

from switchyard_spec import (
    EngineConfig,
    EngineRequest,
    EngineStats,
    ModelInfo,
    StepReport,
    TokenEvent,
    WarmupReport,
)

_HEADER = struct.Struct("<I")
MAX_FRAME = 1 << 30
"""Largest frame accepted (a prompt with its logprobs fits many times over)."""


# ------------------------------------------------------------ gateway -> engine process
class Start(msgspec.Struct, tag="start", array_like=True):
    """Build the engine through the plugin manager and load the weights (`Engine.start`)."""

    call: int
    engine: str
    """The `EngineSpec.name` the gateway selected."""
    config: EngineConfig
    """Its `quantization` is None: the process looks the method up by `quantize` itself."""
    model: str
    """The served name, for log lines."""
    cpus: tuple[int, ...] | None = None
    """CPUs the process pins itself to (`os.sched_setaffinity`) before building the engine."""
    log_level: str = "info"
    json_logs: bool = False


class Warmup(msgspec.Struct, tag="warmup", array_like=True):
    call: int


class Submit(msgspec.Struct, tag="submit", array_like=True):
    request: EngineRequest


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_id: str


class Probe(msgspec.Struct, tag="probe", array_like=True):
    """Run `Engine.probe_liveness(timeout)` and answer `Probed`."""

    call: int
    timeout: float


class CheckHealth(msgspec.Struct, tag="health?", array_like=True):
    """Answer `Health` with `Engine.healthy()` (no reply awaited)."""


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    call: int


class AdapterCall(msgspec.Struct, tag="adapter", array_like=True):
    """Run `Engine.load_adapter(name, path)`, or `unload_adapter(name)` when `path` is None,
    and answer `AdapterDone` (or `Failed` with the `AdapterError`)."""

    call: int
    name: str
    path: str | None = None


ToChild = Start | Warmup | Submit | Abort | Probe | CheckHealth | Shutdown | AdapterCall


# ------------------------------------------------------------ engine process -> gateway
class Started(msgspec.Struct, tag="started", array_like=True):
    call: int
    info: ModelInfo


class Warmed(msgspec.Struct, tag="warmed", array_like=True):
    call: int
    report: WarmupReport


class Failed(msgspec.Struct, tag="failed", array_like=True):
    """A call raised: the exception's class name and message."""

    call: int
    error_type: str
    message: str


class Probed(msgspec.Struct, tag="probed", array_like=True):
    call: int
    ok: bool


class Closed(msgspec.Struct, tag="closed", array_like=True):
    call: int


class Events(msgspec.Struct, tag="events", array_like=True):
    """What the engine emitted since the last frame: usually one step's events and report."""

    events: list[TokenEvent]
    steps: list[StepReport]
    stats: EngineStats | None = None


class Stats(msgspec.Struct, tag="stats", array_like=True):
    """The engine's load once it went quiet (the last step's frame may predate it)."""

    stats: EngineStats


class Health(msgspec.Struct, tag="health", array_like=True):
    ok: bool


class AdapterDone(msgspec.Struct, tag="adapter_done", array_like=True):
    call: int


ToParent = Started | Warmed | Failed | Probed | Closed | Events | Stats | Health | AdapterDone


class Connection:
    """Framed msgpack messages over one end of a socket pair; `send` is thread-safe."""

    def __init__(self, sock: socket.socket, incoming: type) -> None:
        self.sock = sock
        self._reader = sock.makefile("rb", buffering=1 << 16)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(incoming)
        self._lock = threading.Lock()

    def send(self, message: msgspec.Struct) -> None:
        """Write one frame; raises OSError when the other end is gone."""
        payload = self._encoder.encode(message)
        frame = _HEADER.pack(len(payload)) + payload
        with self._lock:
            self.sock.sendall(frame)

    def recv(self) -> msgspec.Struct | None:
        """The next message; None at end of file (the other process closed or died)."""
        header = self._reader.read(4)
        if len(header) < 4:
            return None
        (size,) = _HEADER.unpack(header)
        if size > MAX_FRAME:
            raise ValueError(f"engine process frame of {size} bytes")
        payload = self._reader.read(size)
        if len(payload) < size:
            return None
        return self._decoder.decode(payload)

    def close(self) -> None:
        """Close both directions; a thread blocked in `recv` wakes up with end of file."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        for part in (self._reader, self.sock):
            try:
                part.close()
            except OSError:
                pass


def parse_cpus(text: str) -> tuple[int, ...]:
    """A Linux CPU list ("0-3,8,10-11") as sorted CPU numbers; ValueError when malformed."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"{text!r} is not a CPU list such as 0-3,8")
        first, last = int(low), int(high) if sep else int(low)
        if last < first:
            raise ValueError(f"{text!r}: range {part} runs backwards")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"{text!r} names no CPU")
    return tuple(sorted(cpus))
