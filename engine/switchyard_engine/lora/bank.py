"""The adapters an engine serves: names, the ones held in memory (an LRU), their stacks.

A name is bound to a :class:`Handle` (the folder, and a load number so a
name loaded again is a different adapter to the prefix cache). A sequence
keeps the handle it was submitted with, so unloading a name lets the
sequences already holding it finish: the folder is read again if the
matrices were dropped meanwhile.

At most ``max_loras`` adapters are held in memory. :meth:`AdapterBank.acquire`
brings one in (reading its folder when it was dropped), dropping the least
recently used adapter that no running sequence holds; when every held one is
in use it answers None and the engine keeps the sequence waiting.

Thread-safe: the gateway's workers register and unregister while the
compute loop acquires.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from switchyard_spec import UnknownAdapterError

from switchyard_engine.lora.folder import LoraAdapter, read_adapter
from switchyard_engine.lora.grouped import Grouped, Layout, Stacked

_loads = itertools.count(1)

DEFAULT_MAX_LORAS = 8
DEFAULT_MAX_RANK = 64


@dataclass(frozen=True, eq=False)
class Handle:
    """One load of an adapter: its name, folder and load number (compared by identity)."""

    name: str
    path: str
    load: int

    @property
    def cache_key(self) -> bytes:
        """What the prefix cache adds to a sequence's first block for this adapter."""
        return f"lora:{self.load}:{self.name}".encode()


class AdapterBank:
    """Named adapters of one engine, at most ``max_loras`` of them in memory; see the module."""

    def __init__(self, shapes: Mapping[str, tuple[int, int]], layouts: Mapping[tuple[int, str], Layout],
                 max_loras: int = 0, max_rank: int = 0) -> None:
        self.shapes = dict(shapes)
        self.layouts = dict(layouts)
        self.max_loras = max_loras or DEFAULT_MAX_LORAS
        self.max_rank = max_rank or DEFAULT_MAX_RANK
        self._names: dict[str, Handle] = {}
        self._held: OrderedDict[Handle, LoraAdapter] = OrderedDict()
        self._stacks: OrderedDict[tuple[Handle, ...], dict[tuple[int, str], Grouped | Stacked | None]] = (
            OrderedDict())
        self._lock = threading.Lock()
        self.loads_from_disk = 0
        """Folder reads since start (first loads and reloads after eviction)."""

    def read(self, name: str, path: str) -> LoraAdapter:
        """Read and check an adapter folder (no state changes); raises AdapterError."""
        return read_adapter(name, path, self.shapes, self.max_rank)

    def register(self, name: str, path: str) -> Handle:
        """Serve the folder ``path`` as ``name`` (replacing an earlier one for new sequences).

        The folder is read and checked first: on failure nothing changes.
        """
        adapter = self.read(name, path)
        handle = Handle(name=name, path=str(path), load=next(_loads))
        with self._lock:
            self.loads_from_disk += 1
            self._names[name] = handle
            self._held[handle] = adapter
            self._trim(set())
        return handle

    def unregister(self, name: str) -> None:
        """Stop serving ``name`` to new sequences; running ones keep their handle."""
        with self._lock:
            if self._names.pop(name, None) is None:
                raise UnknownAdapterError(f"no LoRA adapter named {name!r} is loaded")

    def handle(self, name: str) -> Handle:
        """The current handle of ``name``; UnknownAdapterError when none."""
        with self._lock:
            handle = self._names.get(name)
        if handle is None:
            raise UnknownAdapterError(f"no LoRA adapter named {name!r} is loaded")
        return handle

    def names(self) -> dict[str, str]:
        """Served names and their folders."""
        with self._lock:
            return {name: h.path for name, h in self._names.items()}

    def held(self) -> list[str]:
        """Names of the adapters in memory, least recently used first."""
        with self._lock:
            return [h.name for h in self._held]

    def acquire(self, handle: Handle, in_use: Collection[Handle]) -> LoraAdapter | None:
        """``handle``'s matrices, brought into memory if needed; None if no room (see module).

        ``in_use`` are the handles running sequences hold: they are never dropped.
        """
        with self._lock:
            adapter = self._held.get(handle)
            if adapter is not None:
                self._held.move_to_end(handle)
                return adapter
            busy = set(in_use)
            if len(busy - {handle}) >= self.max_loras:
                return None
        adapter = self.read(handle.name, handle.path)  # outside the lock: a folder read
        with self._lock:
            self.loads_from_disk += 1
            self._held[handle] = adapter
            self._trim(busy | {handle})
        return adapter

    def stacks(self, handles: tuple[Handle, ...]) -> dict[tuple[int, str], Grouped | Stacked | None]:
        """The stacked matrices of a step whose groups are ``handles``, in that order (memoized).

        Filled lazily, projection by projection, by
        :class:`~switchyard_engine.lora.grouped.StepLora`; the few most recent
        group orders are kept, so steady decoding re-stacks nothing.
        """
        with self._lock:
            found = self._stacks.get(handles)
            if found is None:
                found = self._stacks[handles] = {}
                while len(self._stacks) > 4:
                    self._stacks.popitem(last=False)
            else:
                self._stacks.move_to_end(handles)
            return found

    def _trim(self, keep: set[Handle]) -> None:
        """Drop least recently used adapters (not in ``keep``) down to ``max_loras``."""
        for handle in list(self._held):
            if len(self._held) <= self.max_loras:
                break
            if handle not in keep:
                del self._held[handle]
                for order in [k for k in self._stacks if handle in k]:
                    del self._stacks[order]
