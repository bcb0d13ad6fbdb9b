"""One replica of a remote model: what this gateway knows of it, and how it is watched.

Each replica keeps its load (requests this gateway has in flight there, plus
the queue depth its own `/metrics` reported), its failures in a row, and
whether it is out for a cool-down. A `ReplicaMonitor` task per remote model
reads every replica's `/metrics` every `metrics_interval_s`, asks its
`/v1/models` which model it serves until it knows, and probes the `/health`
of a replica whose cool-down is over. Those go through one pooled
`httpx.AsyncClient` per gateway (`new_client`); the requests a model forwards go
over its own keep-alive connections (`remote/relay.py`), which cost far less
per request and per streamed event.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass

import httpx
import msgspec

log = logging.getLogger("switchyard.upstream")

CONNECT_TIMEOUT_S = 5.0
SCRAPE_TIMEOUT_S = 1.0
"""A replica whose `/metrics` or `/health` takes longer is skipped for this round."""

_QUEUE_GAUGES = re.compile(
    rb"^(?:tgi_queue_size|vllm:num_requests_waiting)(?:\{[^}\n]*\})?[ \t]+([-+0-9.eE]+|NaN)",
    re.MULTILINE)
"""Queue depth in Prometheus text: TGI's and Switchyard's gauge, and vLLM's."""


def new_client() -> httpx.AsyncClient:
    """The gateway's one pooled client for every replica's scrapes and probes.

    A few requests per replica per `metrics_interval_s`, one at a time each: no
    connection limit is needed. Forwarded requests do not use it (`RelayPool`).
    """
    # httpx logs every request at INFO: a line per scrape, every 50-500 ms per replica,
    # would drown the server's log. Failures are logged here, with the replica's address.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                            keepalive_expiry=30.0),
        timeout=httpx.Timeout(SCRAPE_TIMEOUT_S, connect=CONNECT_TIMEOUT_S, pool=None),
        follow_redirects=False,
        # Upstreams are named by address in the config; a proxy from the environment
        # would put another hop between the gateway and its replicas.
        trust_env=False,
    )


def queue_depth(metrics: bytes) -> int:
    """Requests waiting at a replica, summed over its models, from its `/metrics` text."""
    total = 0.0
    for match in _QUEUE_GAUGES.finditer(metrics):
        value = float(match[1])
        if value == value:  # NaN is not a depth
            total += value
    return int(total)


class _ModelList(msgspec.Struct):
    """The part of an OpenAI `/v1/models` answer needed: each model's id."""

    data: list[_ModelCard]


class _ModelCard(msgspec.Struct):
    id: str


@dataclass(eq=False)
class Replica:
    """One upstream server of a remote model, as this gateway sees it."""

    url: str
    in_flight: int = 0
    """Requests this gateway has sent there and not yet finished."""
    queue: int = 0
    """The replica's own queue depth at the last scrape (0 if it has no such gauge)."""
    failures: int = 0
    """Failures in a row; a success resets it."""
    out_until: float | None = None
    """While set, the replica is out; its `/health` is probed from this monotonic time on."""
    served_model: str | None = None
    """The first id of its `/v1/models` (what a forwarded `model` is rewritten to)."""

    @property
    def load(self) -> int:
        """What the balancer compares: this gateway's requests there plus its queue."""
        return self.in_flight + self.queue

    @property
    def available(self) -> bool:
        """Whether requests may go to it now."""
        return self.out_until is None

    def succeeded(self) -> None:
        """It answered: its failures in a row start again from 0."""
        self.failures = 0

    def failed(self, why: str, max_failures: int, cooldown_s: float) -> None:
        """It failed (logged with its address); the `max_failures`-th in a row takes it out."""
        self.failures += 1
        if self.out_until is None and self.failures >= max_failures:
            self.out_until = time.monotonic() + cooldown_s
            log.warning("replica %s taken out for %.1fs after %d failures in a row (last: %s)",
                        self.url, cooldown_s, self.failures, why)
        else:
            log.warning("replica %s failed (%d in a row): %s", self.url, self.failures, why)


class ReplicaMonitor:
    """The background task that keeps a model's replicas' load and health current."""

    def __init__(self, client: httpx.AsyncClient, replicas: list[Replica], interval_s: float,
                 cooldown_s: float, max_failures: int,
                 headers: dict[str, str] | None = None) -> None:
        self._client = client
        self._headers = headers or {}
        self._replicas = replicas
        self._interval = interval_s
        self._cooldown = cooldown_s
        self._max_failures = max_failures
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start watching (on the running event loop)."""
        self._task = asyncio.create_task(self._run(), name="replica-monitor")

    async def stop(self) -> None:
        """Stop watching and wait until the task is gone."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def refresh(self) -> None:
        """One round: every replica at once, so that a slow one delays no other."""
        await asyncio.gather(*(self._check(r) for r in self._replicas))

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # the monitor must outlive any one bad answer
                log.exception("watching replicas failed")
            await asyncio.sleep(self._interval)

    async def _check(self, replica: Replica) -> None:
        if replica.out_until is not None:
            if time.monotonic() >= replica.out_until:
                await self._probe(replica)
            return
        try:
            answer = await self._client.get(f"{replica.url}/metrics", headers=self._headers,
                                            timeout=SCRAPE_TIMEOUT_S)
        except httpx.TimeoutException:
            return  # busy rendering it, perhaps: the requests themselves tell if it is down
        except httpx.TransportError as exc:
            # A replica that refuses connections fails here before any request has to.
            replica.failed(f"/metrics: {exc!r}", self._max_failures, self._cooldown)
            return
        # A server without these gauges (or without /metrics) is balanced on in-flight alone.
        replica.queue = queue_depth(answer.content) if answer.status_code == 200 else 0
        if replica.served_model is None:
            await self._discover(replica)

    async def _probe(self, replica: Replica) -> None:
        try:
            ok = (await self._client.get(f"{replica.url}/health", headers=self._headers,
                                         timeout=SCRAPE_TIMEOUT_S)).status_code == 200
        except httpx.TransportError:
            ok = False
        if ok:
            replica.failures, replica.out_until, replica.queue = 0, None, 0
            replica.served_model = None  # it may have restarted with another model
            log.info("replica %s is back: /health answered 200", replica.url)
            await self._discover(replica)
        else:
            replica.out_until = time.monotonic() + self._cooldown

    async def _discover(self, replica: Replica) -> None:
        try:
            answer = await self._client.get(f"{replica.url}/v1/models", headers=self._headers,
                                          timeout=SCRAPE_TIMEOUT_S)
            if answer.status_code == 200:
                cards = msgspec.json.decode(answer.content, type=_ModelList).data
                if cards:
                    replica.served_model = cards[0].id
        except (httpx.TransportError, msgspec.DecodeError):
            log.debug("replica %s: /v1/models unreadable", replica.url, exc_info=True)
