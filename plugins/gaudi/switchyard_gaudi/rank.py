"""A follower rank of a sharded engine: ``python -m switchyard_gaudi.rank --fd FD --parent PID``.

Started by rank 0 (:class:`~switchyard_gaudi.shard_group.ShardGroup`), never by
hand. Over the pipe ``FD`` it receives a
:class:`~switchyard_gaudi.shard_group.RankSpec`, then:

1. opens the device as rank 0 configured it and joins the process group;
2. loads the model, splits it with AutoTP exactly as rank 0 does, and builds
   its static cache (its share of the key/value heads) and the captured
   prefill and decode functions, then says "ready";
3. runs every op rank 0 sends, in order, on the same inputs, until "stop";
   the results are thrown away (rank 0 samples).

It exits when rank 0's process is gone (EOF on the pipe, a closed socket in a
collective, or, on Linux, the parent-death signal), so a server that is
killed leaves no follower behind. An error is logged with the rank and ends
the process, which rank 0's watchdog turns into an unhealthy engine.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import multiprocessing.connection as mpc
import os
import signal
import sys
from datetime import timedelta

logger = logging.getLogger("switchyard.gaudi")

_PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> None:
    """Have the kernel end this process when its parent does (Linux); exit if it already has."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        sys.exit(0)


def serve(conn: mpc.Connection) -> int:
    """Build this rank from the spec rank 0 sends, then follow its ops; the exit status."""
    spec = conn.recv()
    rank = spec.rank
    import torch

    if spec.options.num_threads:
        torch.set_num_threads(spec.options.num_threads)
    from switchyard_engine.loading import load_causal_lm

    from switchyard_gaudi import attention
    from switchyard_gaudi.device import Device
    from switchyard_gaudi.kv_cache import StaticKVCache
    from switchyard_gaudi.runner import StaticRunner
    from switchyard_gaudi.shard_group import (
        DECODE,
        HOST,
        MOVE,
        PREFILL,
        REPORT,
        SCORE,
        STARTUP_TIMEOUT_S,
        STOP,
        join_process_group,
        leave_process_group,
        unpack,
    )
    from switchyard_gaudi.tensor_parallel import shard_model

    device = Device(**spec.device)
    conn.send(("joining",))
    store = torch.distributed.TCPStore(HOST, spec.port, spec.ranks, is_master=False,
                                       timeout=timedelta(seconds=STARTUP_TIMEOUT_S))
    join_process_group(device.collective_backend(), rank, spec.ranks, store, spec.timeout_s)
    # On the host: AutoTP moves only this rank's slices to the device (as on rank 0).
    loaded = load_causal_lm(spec.config.model_path, dtype=spec.dtype, device="cpu",
                            attn_implementation=attention.register())
    dtype = getattr(torch, spec.dtype)
    model = shard_model(loaded.model, device, spec.ranks, dtype)
    plan, dims = spec.plan, spec.dims
    cache = StaticKVCache(dims.num_layers, plan.grid.decode_batch.limit,
                          dims.num_kv_heads // spec.ranks, plan.limits.max_total_tokens,
                          dims.head_dim, dtype, device.torch_device)
    runner = StaticRunner(model, cache, device, len(plan.shapes),
                          capture_prefill=not spec.settings.limit_hpu_graph)
    runner.keep_hidden = True
    conn.send(("ready",))
    logger.info("ready: KV cache %.1f MiB", cache.nbytes / 2**20)
    with torch.inference_mode():
        while True:
            try:
                op, *args = conn.recv()
            except (EOFError, OSError):
                logger.warning("rank 0 is gone; exiting")
                return 0
            args = list(unpack(tuple(args)))
            if op == PREFILL:
                runner.forward_prefill(*args)
            elif op == DECODE:
                runner.forward_decode(*args)
            elif op == SCORE:
                assert runner.last_hidden is not None
                runner.project(runner.last_hidden, *args)
            elif op == MOVE:
                runner.move_row(*args)
            elif op == REPORT:
                conn.send((REPORT, device.compiles))
            elif op == STOP:
                break
            else:
                raise RuntimeError(f"unknown op {op!r}")
    leave_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, connect to rank 0 and serve; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m switchyard_gaudi.rank")
    parser.add_argument("--fd", type=int, required=True, help="the pipe from rank 0")
    parser.add_argument("--parent", type=int, required=True, help="rank 0's process id")
    args = parser.parse_args(argv)
    _die_with(args.parent)
    # Ctrl-C in a terminal reaches the whole process group: rank 0 shuts the ranks down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    rank = os.environ.get("RANK", "?")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s gaudi rank {rank}: %(message)s")
    conn = mpc.Connection(args.fd)
    try:
        return serve(conn)
    except Exception as exc:
        logger.exception("failed")
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except (OSError, ValueError):
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
