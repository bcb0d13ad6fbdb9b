"""A config entry for a model other servers serve: `[[models]]` with `upstreams` instead of `model_id`.

```toml
[[models]]
name = "far"
aliases = ["remote"]
upstreams = ["http://10.0.0.5:8080", "http://10.0.0.6:8080"]
api = "openai"          # what the upstreams speak: "tgi" (TGI, Switchyard) or "openai" (vLLM...)
api_key_env = "FAR_KEY" # the upstreams' API key is in this environment variable
```

Only the keys below apply to such an entry; a local model's key (`engine`,
`dtype`, ...) there is a mistake, named like every other.
"""

from __future__ import annotations

import os
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec


class ConfigError(ValueError):
    """A config file that cannot be served: the message names the file, entry and field."""


Balancing = Literal["prefix", "load", "round-robin"]
"""How a remote model's replica is chosen: "prefix" (affinity, then load), "load" (the
power of two choices on load alone) or "round-robin" (in turn, for comparison)."""
UpstreamApi = Literal["tgi", "openai", "tei"]
"""What a remote model's upstreams speak: "tgi" is TGI's routes and OpenAI's (TGI,
Switchyard); "openai" is OpenAI's only (vLLM, llama.cpp's server, other compatible ones);
"tei" is text-embeddings-inference's (an embedding or reranker model: `/embed`, `/rerank`,
`/v1/embeddings`, ...; see docs/embeddings.md)."""


class RemoteEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A model served by other servers: requests for it are forwarded to one of `upstreams`."""

    served_model_name: str
    """What clients send as `model` (`name` in the file); required: there is no model id."""
    aliases: tuple[str, ...] = ()
    upstreams: tuple[str, ...]
    """Each replica's root URL, `http://host:port` (a path prefix is kept)."""
    api: UpstreamApi = "tgi"
    upstream_model: str | None = None
    """The `model` the upstreams serve it as; None: the first id of each one's `/v1/models`."""
    max_concurrent_requests: int
    """This gateway's permits for the model, over all its replicas (then 429)."""
    max_failures: int = 3
    """Failures in a row (connection errors, 5xx, broken answers) that take a replica out."""
    cooldown_s: float = 5.0
    """How long a replica stays out before its `/health` is probed."""
    metrics_interval_s: float = 0.5
    """How often each replica's `/metrics` is read for its queue depth (0.05 to 0.5)."""
    timeout_s: float = 300.0
    """Longest wait for the next byte from a replica (connecting: at most 5 s)."""
    balancing: Balancing = "prefix"
    """How the replica is chosen (remote/balancer.py, remote/affinity.py)."""
    affinity_max_spread: int = 8
    """Prefix affinity is followed while the replicas' loads differ by at most this."""
    api_key_env: str | None = None
    """The environment variable holding the upstreams' API key, sent to them as
    `Authorization: Bearer <key>` (the key itself never goes in the file)."""

    @property
    def name(self) -> str:
        """What clients send as `model`."""
        return self.served_model_name

    def auth_headers(self) -> dict[str, str]:
        """What every request to an upstream carries: its API key, if one is configured."""
        if self.api_key_env is None:
            return {}
        return {"authorization": f"Bearer {os.environ[self.api_key_env]}"}


REMOTE_FIELDS = ("aliases", "name", *(f for f in RemoteEntry.__struct_fields__
                                      if f not in ("aliases", "served_model_name")))
"""What an error about an unknown field of a remote model's entry lists."""


def remote_entry(where: str, values: dict[str, Any], max_concurrent_requests: int) -> RemoteEntry:
    """Check and build a remote entry (``values`` with `name` already as `served_model_name`)."""
    if "served_model_name" not in values:
        raise ConfigError(f"{where}: field `name` is required for a model with `upstreams`")
    local = sorted(set(values) - set(RemoteEntry.__struct_fields__))
    if local:
        raise ConfigError(f"{where}: field `{local[0]}` does not apply to a model served by "
                          f"`upstreams` (known: {', '.join(REMOTE_FIELDS)})")
    if values.get("balancing", "prefix") not in ("prefix", "load", "round-robin"):
        raise ConfigError(f"{where}: field `balancing` must be one of prefix, load or "
                          f"round-robin, not {values['balancing']!r}")
    if values.get("api", "tgi") not in ("tgi", "openai", "tei"):
        raise ConfigError(f"{where}: field `api` must be one of tgi (TGI's and OpenAI's routes: "
                          f"TGI, Switchyard), openai (OpenAI's only: vLLM...) or tei "
                          f"(text-embeddings-inference), not {values['api']!r}")
    values = {"max_concurrent_requests": max_concurrent_requests, **values}
    try:
        entry = msgspec.convert(values, RemoteEntry)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {field_message(exc, REMOTE_FIELDS)}") from None
    if not entry.upstreams:
        raise ConfigError(f"{where}: field `upstreams` lists no URL")
    if entry.api_key_env is not None and not os.environ.get(entry.api_key_env):
        raise ConfigError(f"{where}: field `api_key_env`: the environment variable "
                          f"{entry.api_key_env} is not set (or empty)")
    urls = tuple(_url(where, i, url) for i, url in enumerate(entry.upstreams))
    if len(set(urls)) != len(urls):
        raise ConfigError(f"{where}: field `upstreams` lists a URL twice")
    checks = (("max_concurrent_requests", 1, None), ("max_failures", 1, None),
              ("cooldown_s", 0, None), ("metrics_interval_s", 0.05, 0.5), ("timeout_s", 0.01, None),
              ("affinity_max_spread", 0, None))
    for field, low, high in checks:
        value = getattr(entry, field)
        if value < low or (high is not None and value > high):
            bounds = f"[{low}, {high}]" if high is not None else f">= {low}"
            raise ConfigError(f"{where}: field `{field}` is out of range (must be {bounds})")
    return msgspec.structs.replace(entry, upstreams=urls)


def _url(where: str, index: int, url: str) -> str:
    """A replica's root URL without a trailing slash; http(s) with a host, nothing else."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query \
            or parts.fragment:
        raise ConfigError(f"{where}: field `upstreams[{index}]`: {url!r} is not an http(s) URL "
                          "of a server's root, such as http://10.0.0.5:8080")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise ConfigError(f"{where}: field `upstreams[{index}]`: {url!r} has an invalid "
                          "port") from None
    return url.rstrip("/")


def field_message(exc: msgspec.ValidationError, known: tuple[str, ...]) -> str:
    """msgspec's "Expected `int`, got `str` - at `$.max_total_tokens`" as "field `...`: ..."."""
    text = str(exc)
    message, _, at = text.partition(" - at `$")
    if at:
        return f"field `{at.rstrip('`').lstrip('.')}`: {message}"
    if "unknown field" in message:
        return message.replace("Object contains unknown field", "unknown field") + \
            f" (known: {', '.join(known)})"
    return message
