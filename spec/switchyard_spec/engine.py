"""The engine interface: what every hardware plugin's engine must do.

The gateway drives an engine through exactly these methods, in this order:
``start`` (load weights) then ``warmup`` then any number of ``submit`` /
``abort`` / ``stats`` calls from the HTTP side, then ``shutdown``. The engine's
compute loop runs on its own thread or process, never on the caller's.
"""

from __future__ import annotations

import abc

from switchyard_spec.errors import AdapterError
from switchyard_spec.types import (
    EngineRequest,
    EngineStats,
    EventSink,
    ModelInfo,
    StepObserver,
    WarmupReport,
)


class Engine(abc.ABC):
    """A batching engine serving one model on one device.

    Thread contract: ``start``, ``warmup`` and ``shutdown`` may block and are
    called from a worker thread. ``submit``, ``abort`` and ``stats`` are called
    from the gateway's event loop and must return at once: they only hand work
    to the engine's loop.
    """

    @abc.abstractmethod
    def start(self) -> ModelInfo:
        """Load the weights onto the device and start the compute loop.

        Raise ``switchyard_spec.EngineStartError`` with a readable message when
        the model cannot be served (unknown architecture, missing files).
        """

    @abc.abstractmethod
    def warmup(self) -> WarmupReport:
        """Run representative shapes once so the first request is not slow.

        Called after ``start`` and before the gateway reports ready.
        """

    @abc.abstractmethod
    def submit(self, request: EngineRequest, sink: EventSink) -> None:
        """Queue a sequence. Its events go to ``sink``, in order, from the engine thread.

        The sequence joins the running batch at the next step boundary. The
        engine must end every submitted sequence with exactly one event that
        has ``finish_reason`` or ``error`` set (an aborted one ends with
        ``FinishReason.ABORTED``).
        """

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Stop a sequence at the next step boundary and free its cache.

        Unknown or finished ids are ignored.
        """

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """Return the current load without waiting for the compute loop."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the loop, end live sequences with ``ABORTED``, release the device."""

    def healthy(self) -> bool:
        """Whether the engine is fit to serve, answered at once (never blocks).

        Called from the event loop on every `/health`; engines override it to
        report a dead loop or a failed probe.
        """
        return True

    def set_step_observer(self, observer: StepObserver | None) -> None:
        """Report every forward step to ``observer`` (None stops reporting).

        The gateway installs one for its metrics before ``warmup``. Engines that
        do not report steps may leave this default, which ignores it.
        """
        return None

    def probe_liveness(self, timeout: float = 30.0) -> bool:
        """Prove the engine can still generate; may block up to ``timeout`` seconds.

        The gateway calls it from a worker thread when the last known state was
        unhealthy (TGI runs a real one-token prefill then). Engines that can run
        a real generation should override it; the default trusts ``healthy``.
        """
        return self.healthy()

    def load_adapter(self, name: str, path: str) -> None:
        """Make the LoRA adapter in folder ``path`` servable as ``name``; may block.

        Called from a worker thread (``POST /v1/load_lora_adapter``). The engine
        reads and checks the folder (PEFT's format) before it touches anything,
        so a failed load leaves running sequences and loaded adapters as they
        were; loading a name again replaces it for sequences submitted later.
        Raise ``AdapterError`` with the reason. The default refuses: an engine
        that serves adapters overrides it.
        """
        raise AdapterError(f"this engine does not serve LoRA adapters (cannot load {name!r})")

    def unload_adapter(self, name: str) -> None:
        """Stop serving the adapter ``name``; sequences already running with it finish.

        Called from a worker thread. Raise ``UnknownAdapterError`` when no
        adapter has that name. The default refuses like ``load_adapter``.
        """
        raise AdapterError(f"this engine does not serve LoRA adapters (cannot unload {name!r})")
