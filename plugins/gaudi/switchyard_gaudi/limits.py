"""The engine's options and limits: what ``--engine-option`` and the launcher flags resolve to.

Limits left at 0 by the gateway are chosen here, before any weight is
loaded, and the result is checked by the warmup plan:

- ``--max-total-tokens``: the model's context, at most 4,096 (every bucket up
  to it compiles at warmup); reported in ``ModelInfo.max_total_tokens``, which
  the gateway enforces; ``--max-input-tokens`` defaults to one less;
- ``--max-batch-size``: as given; else ``--max-batch-total-tokens`` divided by
  ``--max-total-tokens`` (the seed: "set it as bs * max-total-tokens"); else
  the largest batch up to 64 whose cache fits the device memory;
- ``--max-batch-prefill-tokens``: as given; else 4,096, raised if need be to
  one padded prefill of the longest prompt.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields, replace

from switchyard_spec import EngineConfig, EngineStartError

from switchyard_gaudi.device import CPU_COMPILE_BACKENDS
from switchyard_gaudi.model_dims import ModelDims
from switchyard_gaudi.scheduler import DEFAULT_MAX_WAITING_TOKENS, DEFAULT_WAITING_SERVED_RATIO
from switchyard_gaudi.warmup_plan import (
    BucketSettings,
    Limits,
    Memory,
    WarmupPlan,
    largest_batch_that_fits,
    plan_warmup,
)

DEFAULT_MAX_TOTAL_TOKENS = 4096
DEFAULT_MAX_BATCH_SIZE = 64
DEFAULT_PREFILL_TOKENS = 4096
DEFAULT_SHARD_TIMEOUT_S = 120.0
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "ki": 2**10, "mi": 2**20, "gi": 2**30}


def parse_bytes(name: str, raw: str) -> int:
    """``raw`` ("2GiB", "512M", "1000000") as bytes; EngineStartError if it is not a size."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]i?)?b?\s*", raw.lower())
    if match is None:
        raise EngineStartError(f"gaudi option {name}={raw!r} is not a size (e.g. 2GiB, 512MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def _int(options: dict[str, str], name: str, minimum: int) -> int | None:
    raw = str(options.get(name, "")).strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise EngineStartError(f"gaudi option {name}={raw!r} is not an integer") from None
    if value < minimum:
        raise EngineStartError(f"gaudi option {name}={raw!r} must be at least {minimum}")
    return value


@dataclass(frozen=True)
class EngineOptions:
    """The ``--engine-option`` settings the Gaudi engine reads (see docs/gaudi.md)."""

    device: str = "auto"
    """"auto" (an HPU, else a start-up error), "hpu" or "cpu" (tests, no HPU needed)."""
    cpu_compile: str = "eager"
    """The dynamo backend standing in for HPU graphs on the CPU."""
    device_memory: int | None = None
    """Bytes of device memory to plan for, instead of what is free (sizing, tests)."""
    num_threads: int | None = None
    max_waiting_tokens: int = DEFAULT_MAX_WAITING_TOKENS
    waiting_served_ratio: float = DEFAULT_WAITING_SERVED_RATIO
    shard_timeout: float = DEFAULT_SHARD_TIMEOUT_S
    """Sharded: seconds a rank waits in a collective for a peer that hangs (a dead one
    fails it at once)."""

    @classmethod
    def parse(cls, options: dict[str, str]) -> EngineOptions:
        """Read the options; EngineStartError for an unknown one or a value that does not parse."""
        for name, flag in (("speculate", "--speculate"),
                           ("speculative_model", "--speculative-model")):
            if name in options:
                raise EngineStartError(
                    f"gaudi engine: speculative decoding (engine option {name}, {flag}) is "
                    f"not built for its static-shape batches; serve this model without it")
        unknown = sorted(set(options) - KNOWN_OPTIONS)
        if unknown:
            raise EngineStartError(f"gaudi engine: unknown option {', '.join(unknown)} (it "
                                   f"reads {', '.join(sorted(KNOWN_OPTIONS))})")
        cpu_compile = str(options.get("cpu_compile", "eager")).strip().lower()
        if cpu_compile not in CPU_COMPILE_BACKENDS:
            raise EngineStartError(f"gaudi option cpu_compile must be one of "
                                   f"{', '.join(CPU_COMPILE_BACKENDS)}, not {cpu_compile!r}")
        raw_memory = str(options.get("device_memory", "")).strip()
        raw_ratio = str(options.get("waiting_served_ratio", "")).strip()
        try:
            ratio = float(raw_ratio) if raw_ratio else DEFAULT_WAITING_SERVED_RATIO
        except ValueError:
            raise EngineStartError(
                f"gaudi option waiting_served_ratio={raw_ratio!r} is not a number") from None
        if ratio < 0:
            raise EngineStartError("gaudi option waiting_served_ratio must not be negative")
        waiting = _int(options, "max_waiting_tokens", 0)
        raw_timeout = str(options.get("shard_timeout", "")).strip()
        try:
            shard_timeout = float(raw_timeout) if raw_timeout else DEFAULT_SHARD_TIMEOUT_S
        except ValueError:
            raise EngineStartError(
                f"gaudi option shard_timeout={raw_timeout!r} is not a number") from None
        if shard_timeout <= 0:
            raise EngineStartError("gaudi option shard_timeout must be positive (seconds)")
        return cls(
            device=str(options.get("device", "auto")).strip().lower(),
            cpu_compile=cpu_compile,
            device_memory=parse_bytes("device_memory", raw_memory) if raw_memory else None,
            num_threads=_int(options, "num_threads", 1),
            max_waiting_tokens=DEFAULT_MAX_WAITING_TOKENS if waiting is None else waiting,
            waiting_served_ratio=ratio,
            shard_timeout=shard_timeout,
        )


KNOWN_OPTIONS = frozenset(f.name for f in fields(EngineOptions))


def default_prefill_tokens(buckets: BucketSettings, max_input: int, batch: int) -> int:
    """4,096 tokens, or one padded prefill of the longest prompt if that is more."""
    least_rows = 1 if buckets.batch_base is not None else min(buckets.prefill_batch_step, batch)
    return max(DEFAULT_PREFILL_TOKENS, least_rows * max_input)


def max_total_reason(config: EngineConfig, dims: ModelDims) -> str:
    """Why the longest sequence is what :func:`resolve_plan` chose, for the start-up log."""
    if config.max_total_tokens:
        return "--max-total-tokens"
    if dims.max_position_embeddings and dims.max_position_embeddings <= DEFAULT_MAX_TOTAL_TOKENS:
        return "the model's context"
    return (f"the model's context ({dims.max_position_embeddings or 'not stated'}) capped at "
            f"{DEFAULT_MAX_TOTAL_TOKENS}: every bucket up to it is compiled at warmup")


def resolve_plan(config: EngineConfig, options: EngineOptions, dims: ModelDims,
                 buckets: BucketSettings, dtype_bytes: int, memory: Memory) -> WarmupPlan:
    """Fill the limits the gateway left at 0, and plan warmup; EngineStartError if none fits."""
    max_total = config.max_total_tokens or min(
        dims.max_position_embeddings or DEFAULT_MAX_TOTAL_TOKENS, DEFAULT_MAX_TOTAL_TOKENS)
    max_input = config.max_input_tokens or max_total - 1
    if max_input >= max_total:
        raise EngineStartError(f"--max-input-tokens ({max_input}) must be less than "
                               f"--max-total-tokens ({max_total})")
    if config.max_batch_total_tokens and config.max_batch_total_tokens < max_total:
        raise EngineStartError(
            f"--max-batch-total-tokens ({config.max_batch_total_tokens}) must be at least "
            f"--max-total-tokens ({max_total}): the cache holds whole sequences")
    by_tokens = config.max_batch_total_tokens // max_total if config.max_batch_total_tokens else 0
    explicit = min(v for v in (config.max_batch_size, by_tokens, 10**9) if v)
    batch = explicit if explicit < 10**9 else DEFAULT_MAX_BATCH_SIZE
    prefill = config.max_batch_prefill_tokens or default_prefill_tokens(buckets, max_input, batch)
    limits = Limits(max_input_tokens=max_input, max_total_tokens=max_total, max_batch_size=batch,
                    max_batch_prefill_tokens=prefill)
    if explicit == 10**9:
        fitting = largest_batch_that_fits(limits, buckets, dims, dtype_bytes, memory)
        if fitting is not None:
            limits = replace(limits, max_batch_size=fitting)
    return plan_warmup(limits, buckets, dims, dtype_bytes, memory)
