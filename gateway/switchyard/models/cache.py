"""The model cache: the folder prepared models live in, and how one is prepared safely.

Models the gateway makes itself (the default model, the random-weight test
model, safetensors folders converted from GGUF files) are prepared once into
``$SWITCHYARD_CACHE`` (default ``$XDG_CACHE_HOME/switchyard``, else
``~/.cache/switchyard``) and reused by every later start.

A preparation is atomic: it writes into a temporary sibling folder
(``.NAME.tmp-*``) and renames that to ``NAME`` when it is complete, so an
interrupted one never leaves a folder the next start would take for a
model; the next preparation deletes such leftovers. Two processes preparing
the same folder at once take turns on an ``flock`` of ``.NAME.lock``: the
kernel releases it when its holder exits, however it exits, so a dead
process never holds it. The second one logs what it waits for, waits up to
a timeout, and then finds the folder ready.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from switchyard_spec import EngineStartError

log = logging.getLogger("switchyard.models")

PREPARE_TIMEOUT = 1800.0
"""Seconds a start waits for another process preparing the same folder (a large GGUF
conversion takes minutes)."""


def cache_root() -> Path:
    """Where prepared models live: $SWITCHYARD_CACHE, else $XDG_CACHE_HOME/switchyard
    (``~/.cache/switchyard`` when XDG_CACHE_HOME is unset)."""
    root = os.environ.get("SWITCHYARD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "switchyard")
    return Path(root)


@contextlib.contextmanager
def file_lock(path: Path, what: str, timeout: float = PREPARE_TIMEOUT,
              poll: float = 0.2) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) while the block runs.

    When another process holds it, one log line says what is waited for (``what``)
    and by whom; after ``timeout`` seconds an EngineStartError names the lock file.
    The holder's pid is written into the file, for that message only.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout
        logged = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            if not logged:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                log.info("waiting for process %s, which is preparing %s (lock %s), up to %.0fs",
                         holder, what, path, timeout)
                logged = True
            if time.monotonic() >= deadline:
                raise EngineStartError(
                    f"waited {timeout:.0f}s for another process preparing {what} (it holds "
                    f"the lock {path}); try again when it is done, or stop it")
            time.sleep(poll)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def prepare_folder(target: Path, build: Callable[[Path], None], what: str,
                   timeout: float = PREPARE_TIMEOUT) -> Path:
    """Return ``target``, calling ``build(tmp)`` to make it first if it does not exist.

    ``build`` writes into an empty temporary folder next to ``target``, which is
    renamed to ``target`` only once ``build`` returns; on any error it is deleted.
    Concurrent callers take turns on ``.NAME.lock`` (see the module's docstring).
    """
    if target.is_dir():
        return target
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".{target.name}.lock", what, timeout):
        if target.is_dir():  # another process prepared it while this one waited
            return target
        for leftover in root.glob(f".{target.name}.tmp-*"):  # from an interrupted preparation
            shutil.rmtree(leftover, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
        try:
            build(tmp)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
