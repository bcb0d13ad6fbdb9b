"""A model other servers serve: its names, its replicas, its permits and its settings.

Beside `ServedModel` (a model on a local engine) in the registry. The routes
forward a request for it with `remote/forward.py`; this type only holds what
that needs and keeps its replicas watched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import httpx

from switchyard.models.served import Admission
from switchyard.remote.affinity import PrefixAffinity
from switchyard.remote.balancer import pick
from switchyard.remote.config import RemoteEntry
from switchyard.remote.relay import RelayPool
from switchyard.remote.upstream import Replica, ReplicaMonitor

REMOTE_ENGINE = "remote"
"""The `engine` label of a remote model's requests in metrics and the request log."""


@dataclass(eq=False)
class RemoteModel:
    """A model served by `replicas`, watched through the gateway's pooled `client`; the
    requests it forwards go over its own keep-alive connections (`relay`)."""

    entry: RemoteEntry
    client: httpx.AsyncClient
    replicas: list[Replica] = field(default_factory=list)
    relay: RelayPool = field(default_factory=RelayPool)
    admission: Admission = field(init=False)
    affinity: PrefixAffinity = field(init=False)
    auth: dict[str, str] = field(init=False)
    """Headers every request to a replica carries (its API key, read once at start-up)."""
    _monitor: ReplicaMonitor = field(init=False)
    _turn: int = 0

    def __post_init__(self) -> None:
        if not self.replicas:
            self.replicas = [Replica(url) for url in self.entry.upstreams]
        self.admission = Admission(limit=self.entry.max_concurrent_requests)
        self.affinity = PrefixAffinity(max_spread=self.entry.affinity_max_spread)
        self.auth = self.entry.auth_headers()
        self._monitor = ReplicaMonitor(self.client, self.replicas, self.entry.metrics_interval_s,
                                       self.entry.cooldown_s, self.entry.max_failures,
                                       headers=self.auth)

    @property
    def name(self) -> str:
        """What clients send as `model`."""
        return self.entry.name

    @property
    def aliases(self) -> frozenset[str]:
        """More names clients may send."""
        return frozenset(self.entry.aliases) - {self.name}

    @property
    def speaks_tgi(self) -> bool:
        """Whether the upstreams have TGI's routes (`/generate`, ...), not only OpenAI's."""
        return self.entry.api == "tgi"

    @property
    def pools(self) -> bool:
        """Whether the upstreams serve an embedding or reranker model on TEI's routes."""
        return self.entry.api == "tei"

    def upstream_model(self, replica: Replica) -> str:
        """The `model` to send `replica`: configured, else what it lists first, else its default.

        "tgi" is the name TGI and Switchyard take for "the default model"; a
        replica that has not been asked yet (it was down at start-up) gets it.
        """
        return self.entry.upstream_model or replica.served_model or "tgi"

    def choose(self, tried: list[Replica], chain: list[int]) -> Replica | None:
        """The replica for the next attempt at a request (None: every one is out or tried).

        ``chain`` is the prompt's prefix hashes (``affinity.prefix_chain``; empty when
        the model does not balance on prefixes)."""
        if self.entry.balancing == "round-robin":
            candidates = [r for r in self.replicas if r.available and r not in tried]
            if not candidates:
                return None
            self._turn += 1
            return candidates[self._turn % len(candidates)]
        chosen = self.affinity.choose(self.replicas, tried, chain) if chain else False
        if chosen is False:  # no prefix seen before: the power of two choices on load
            chosen = pick(self.replicas, tried)
        if chosen is not None and chain:
            self.affinity.record(chosen, chain)
        return chosen

    def failed(self, replica: Replica, why: str) -> None:
        """A request to `replica` failed (logged with its address; enough take it out)."""
        replica.failed(why, self.entry.max_failures, self.entry.cooldown_s)

    async def start(self) -> None:
        """Learn each replica's model and load once, then keep watching in the background."""
        await self._monitor.refresh()
        self._monitor.start()

    async def stop(self) -> None:
        """Stop watching the replicas; close the idle relay connections."""
        await self._monitor.stop()
        await self.relay.aclose()
