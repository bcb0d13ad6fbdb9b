"""The ranks of a sharded engine: their processes, their process group, and the ops they follow.

Rank 0 is the engine's compute thread in the server process. Ranks 1 .. N-1
("followers") are child processes (``python -m switchyard_gaudi.rank``), each
loading the same model, split by AutoTP (:mod:`~switchyard_gaudi.tensor_parallel`),
with a static cache of its own share of the key/value heads. Every device
operation rank 0 runs (a prefill, a decode, a cache row move, each warmup
shape) is first sent to every follower as one small message, the op's name and
its host tensors, and the followers run the same captured function on the same
inputs, so the all-reduces inside the forward pass meet. Sampling, prompt
scoring and scheduling happen on rank 0 alone.

The messages go over a pipe per follower, not a collective: between steps the
server may idle for hours, and a follower waiting for its next op in a
collective would hit the process group's timeout, where a pipe has none and
ends with EOF the moment rank 0's process is gone. The collectives of the
forward pass keep a timeout (``shard_timeout``, seconds), which only a peer that
hangs reaches: one that dies closes its sockets and gloo raises at once.

Failure: a watchdog thread polls the followers' processes. One that exits
while the group runs fails the group: an error line names the rank, its pid
and how it ended, the other followers are ended, and the engine is woken to
fail its sequences and report unhealthy. A step whose send or local run raises
(a peer gone mid all-reduce) fails the group the same way: the ranks are no
longer in lockstep, so nothing more can run.
"""

from __future__ import annotations

import logging
import multiprocessing.connection as mpc
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from switchyard_spec import EngineConfig, EngineStartError

from switchyard_gaudi.model_dims import ModelDims
from switchyard_gaudi.settings import GaudiSettings
from switchyard_gaudi.warmup_plan import WarmupPlan

if TYPE_CHECKING:
    import torch

    from switchyard_gaudi.device import Device
    from switchyard_gaudi.limits import EngineOptions

logger = logging.getLogger("switchyard.gaudi")

PREFILL, DECODE, SCORE, MOVE = "prefill", "decode", "score", "move"
"""The device ops rank 0 sends: the two captured steps, the LM head over prompt positions
(prompt scores), a cache row move."""
REPORT, STOP = "report", "stop"
"""Control messages: a follower's compile count, and the end."""
HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 600.0
"""How long rank 0 waits for the followers to start, load and split the model."""
STOP_TIMEOUT_S = 10.0
_WATCH_INTERVAL_S = 0.2


class ShardFailure(RuntimeError):
    """The ranks can no longer run in lockstep (a follower died, or a step failed midway)."""


@dataclass(frozen=True)
class RankSpec:
    """What a follower needs to build the same model, cache and captured steps as rank 0."""

    rank: int
    ranks: int
    port: int
    """Rank 0's TCPStore on loopback: the process group's rendezvous."""
    timeout_s: float
    """The collectives' timeout."""
    config: EngineConfig
    settings: GaudiSettings
    options: EngineOptions
    dims: ModelDims
    dtype: str
    plan: WarmupPlan
    device: dict[str, Any]
    """Keyword arguments of rank 0's :class:`~switchyard_gaudi.device.Device`."""


def device_arguments(device: Device) -> dict[str, Any]:
    """The arguments that build a :class:`Device` configured as ``device`` is."""
    return {"kind": device.kind, "graphs": device.graphs, "lazy": device.lazy,
            "cpu_compile": device.cpu_compile, "fused_attention": device.fused_attention,
            "recompute": device.recompute}


def join_process_group(backend: str, rank: int, ranks: int, store: torch.distributed.Store,
                       timeout_s: float) -> None:
    """Join the default process group of ``ranks`` ranks through ``store``."""
    import torch.distributed as dist

    dist.init_process_group(backend, store=store, rank=rank, world_size=ranks,
                            timeout=timedelta(seconds=timeout_s))


def leave_process_group() -> None:
    """Tear down this process's default process group, if it has one."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a group whose peers are gone may fail to close cleanly
            logger.debug("destroying the process group failed", exc_info=True)


def pack(args: tuple[object, ...]) -> tuple[object, ...]:
    """An op's arguments for the pipe: tensors as numpy arrays (a plain pickle of the values)."""
    import torch

    return tuple(a.numpy() if isinstance(a, torch.Tensor) else a for a in args)


def unpack(args: tuple[object, ...]) -> tuple[object, ...]:
    """The inverse of :func:`pack`."""
    import numpy as np
    import torch

    return tuple(torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in args)


def _ended(code: int) -> str:
    """How a process ended, from its return code."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


class ShardGroup:
    """Rank 0's side of a sharded engine: its followers, and the ops it sends them.

    Built by :meth:`launch`; ``on_failure`` is called (from any thread, once)
    when the group fails, to wake the engine's loop.
    """

    def __init__(self, ranks: int, timeout_s: float, on_failure: Callable[[], None]) -> None:
        self.ranks = ranks
        self.timeout_s = timeout_s
        self._on_failure = on_failure
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[mpc.Connection] = []
        self._lock = threading.Lock()
        """Serializes sends (and a report's send and reply) across threads."""
        self._state = threading.Lock()
        self._stopping = False
        self.failure: str | None = None
        """Why the group failed; None while it can run."""
        self._watchdog: threading.Thread | None = None

    @property
    def pids(self) -> list[int]:
        """The followers' process ids, rank 1 first."""
        return [p.pid for p in self._procs]

    # ------------------------------------------------------------ start-up
    @classmethod
    def launch(cls, config: EngineConfig, ranks: int, device: Device, settings: GaudiSettings,
               options: EngineOptions, dims: ModelDims, dtype: torch.dtype, plan: WarmupPlan,
               on_failure: Callable[[], None]) -> ShardGroup:
        """Start ranks 1 .. ``ranks`` - 1 and join the process group with them as rank 0.

        The followers start loading the model as soon as the group is up, while
        rank 0 loads its own copy. Call :meth:`wait_ready` after rank 0 has built
        its runner; :meth:`stop` on any failure.
        """
        import torch.distributed as dist

        if dist.is_initialized():
            raise EngineStartError("gaudi engine: this process already serves a sharded model "
                                   "(one sharded model per server)")
        group = cls(ranks, options.shard_timeout, on_failure)
        store = dist.TCPStore(HOST, 0, ranks, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
        try:
            for rank in range(1, ranks):
                spec = RankSpec(rank=rank, ranks=ranks, port=store.port,
                                timeout_s=options.shard_timeout, config=config,
                                settings=settings, options=options, dims=dims,
                                dtype=str(dtype).removeprefix("torch."), plan=plan,
                                device=device_arguments(device))
                group._spawn(spec)
            group._await_all("joining")
            join_process_group(device.collective_backend(), 0, ranks, store, group.timeout_s)
        except BaseException:
            group.stop(graceful=False)
            raise
        group._watchdog = threading.Thread(target=group._watch, name="switchyard-gaudi-ranks",
                                           daemon=True)
        group._watchdog.start()
        return group

    def _spawn(self, spec: RankSpec) -> None:
        ours, theirs = mpc.Pipe(duplex=True)
        env = {**os.environ, "RANK": str(spec.rank), "LOCAL_RANK": str(spec.rank),
               "WORLD_SIZE": str(spec.ranks), "LOCAL_SIZE": str(spec.ranks),
               "MASTER_ADDR": HOST, "MASTER_PORT": str(spec.port)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "switchyard_gaudi.rank", "--fd", str(theirs.fileno()),
             "--parent", str(os.getpid())], pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self._procs.append(proc)
        self._conns.append(ours)
        logger.info("gaudi: shard rank %d started (pid %d)", spec.rank, proc.pid)
        ours.send(spec)

    def _await_all(self, what: str, timeout: float = STARTUP_TIMEOUT_S) -> list[object]:
        """Wait for every follower's ``what`` message; EngineStartError if one fails or dies."""
        replies: list[object] = []
        deadline = time.monotonic() + timeout
        for rank, (proc, conn) in enumerate(zip(self._procs, self._conns, strict=True), 1):
            while not conn.poll(0.2):
                if proc.poll() is not None:
                    raise EngineStartError(f"gaudi shard rank {rank} (pid {proc.pid}) "
                                           f"{_ended(proc.returncode)} while starting")
                if time.monotonic() > deadline:
                    raise EngineStartError(f"gaudi shard rank {rank} did not get {what} in "
                                           f"{timeout:.0f}s")
            try:
                message = conn.recv()
            except (EOFError, OSError):
                proc.wait(timeout=STOP_TIMEOUT_S)
                raise EngineStartError(f"gaudi shard rank {rank} (pid {proc.pid}) "
                                       f"{_ended(proc.returncode)} while starting") from None
            if message[0] == "error":
                raise EngineStartError(f"gaudi shard rank {rank}: {message[1]}")
            replies.append(message[1] if len(message) > 1 else None)
        return replies

    def wait_ready(self) -> None:
        """Wait until every follower has loaded and split the model and built its runner."""
        self._await_all("ready")
        logger.info("gaudi: %d ranks ready", self.ranks)

    # --------------------------------------------------------------- ops
    def send(self, op: str, *args: object) -> None:
        """Send ``op`` to every follower; ShardFailure if the group cannot take it."""
        if self.failure is not None:
            raise ShardFailure(self.failure)
        message = (op, *pack(args))
        try:
            with self._lock:
                for conn in self._conns:
                    conn.send(message)
        except (OSError, ValueError) as exc:
            raise ShardFailure(self.fail(f"sending {op} to a follower failed: {exc}")) from exc

    @contextmanager
    def step(self, op: str, *args: object) -> Iterator[None]:
        """Send ``op`` to the followers, then run rank 0's part of it inside the block.

        Anything the block raises fails the group (the followers may be left
        mid all-reduce) and is raised as ShardFailure.
        """
        self.send(op, *args)
        try:
            yield
        except Exception as exc:
            raise ShardFailure(self.fail(f"{op} failed on rank 0: {type(exc).__name__}: {exc}")
                               ) from exc

    def report(self) -> list[int]:
        """Graphs each follower has compiled (rank 1 first), asked after the ops before it."""
        if self.failure is not None:
            raise ShardFailure(self.failure)
        counts = []
        try:
            with self._lock:
                for conn in self._conns:
                    conn.send((REPORT,))
                for conn in self._conns:
                    if not conn.poll(self.timeout_s):
                        raise ShardFailure(self.fail("a follower did not answer a report"))
                    counts.append(int(conn.recv()[1]))
        except (OSError, EOFError) as exc:
            raise ShardFailure(self.fail(f"asking the followers failed: {exc}")) from exc
        return counts

    # ----------------------------------------------------------- failure
    def fail(self, reason: str) -> str:
        """Fail the group (once): log, end the followers, wake the engine. Returns the reason.

        A follower that has exited, or exits within a second, is named in the
        reason: the collective error rank 0 sees is only the echo of its end.
        """
        with self._state:
            if self.failure is not None or self._stopping:
                return self.failure or reason
            dead = self._dead(wait=1.0)
            self.failure = f"{dead}; {reason}" if dead and dead not in reason else reason
        logger.error("gaudi: sharded engine failed, it cannot serve and reports unhealthy: %s",
                     self.failure)
        self._end_followers(graceful=False)
        try:
            self._on_failure()
        except Exception:
            logger.exception("gaudi: waking the engine after a shard failure failed")
        return self.failure

    def _dead(self, wait: float) -> str:
        """The followers that have exited (waiting up to ``wait`` seconds for one), described."""
        deadline = time.monotonic() + wait
        while True:
            gone = [f"shard rank {rank} (pid {p.pid}) {_ended(p.returncode)}"
                    for rank, p in enumerate(self._procs, 1) if p.poll() is not None]
            if gone or time.monotonic() >= deadline:
                return ", ".join(gone)
            time.sleep(0.05)

    def _watch(self) -> None:
        """Poll the followers until the group stops; one that exits fails the group."""
        while not self._stopping and self.failure is None:
            for rank, proc in enumerate(self._procs, 1):
                if proc.poll() is not None and not self._stopping:
                    self.fail(f"shard rank {rank} (pid {proc.pid}) {_ended(proc.returncode)}")
                    return
            time.sleep(_WATCH_INTERVAL_S)

    # ---------------------------------------------------------- shutdown
    def stop(self, graceful: bool = True) -> None:
        """Ask the followers to exit (``graceful``), end those that do not, leave the group."""
        with self._state:
            already, self._stopping = self._stopping, True
        if already:
            return
        self._end_followers(graceful=graceful and self.failure is None)
        leave_process_group()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=2)

    def _end_followers(self, graceful: bool) -> None:
        """Stop message (``graceful``), then SIGTERM, then SIGKILL; every follower reaped."""
        if graceful:
            for conn in self._conns:
                try:
                    conn.send((STOP,))
                except (OSError, ValueError):
                    pass
        deadline = time.monotonic() + (STOP_TIMEOUT_S if graceful else 0.0)
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self._conns:
            conn.close()
        self._conns = []
