"""Server settings: one typed record built from the command line and environment.

Flag names and defaults follow TGI's launcher, so a TGI command line carries
over; limits of 0 mean "derive from the model" and are resolved once the model
is loaded (see `resolve_token_limits`).
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from switchyard.planning.defaults import GenerationDefaults


class ServeSettings(msgspec.Struct, kw_only=True):
    """Everything `switchyard serve` can be told."""

    config: str | None = None
    """A TOML file listing the models to serve (`[[models]]`); None: the one model of the flags."""
    model_id: str | None = None
    """Local folder, GGUF file or hub id (resolved through the local cache), or a built-in
    name; None = the default model (`switchyard.models.default_model`)."""
    served_model_name: str | None = None
    """Name clients use in `model`; defaults to the model id."""
    revision: str | None = None
    gguf_file: str | None = None
    """The GGUF file to serve among several in the `model_id` folder (`switchyard.models.gguf`)."""
    engine: str | None = None
    """Engine name from a plugin; None picks the available engine with the highest priority."""
    hostname: str = "0.0.0.0"
    port: int = 8080
    dtype: str = "auto"
    quantize: str | None = None
    max_input_tokens: int = 0
    max_total_tokens: int = 0
    sharded: bool | None = None
    """TGI's `--sharded`: None = as `num_shard` implies."""
    num_shard: int | None = None
    """TGI's `--num-shard`: ranks for tensor parallelism; None with `sharded` = all devices."""
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_client_batch_size: int = 4
    max_batch_size: int = 0
    max_batch_prefill_tokens: int = 0
    max_batch_total_tokens: int = 0
    max_waiting_tokens: int = 20
    """Decode steps before waiting requests are forced into the running batch (TGI)."""
    waiting_served_ratio: float = 0.3
    """Waiting/running ratio below which newcomers wait for company (TGI)."""
    engine_options: dict[str, str] = {}
    """Engine-specific settings (`--engine-option KEY=VALUE`), passed through as given."""
    engine_process: bool = False
    """Run each local model's engine in a process of its own (`switchyard.engine_process`)."""
    cpus: str | None = None
    """CPUs (a Linux CPU list, "0-3,8") the engine process is pinned to; needs `engine_process`."""
    payload_limit: int = 2_000_000
    """Largest request body in bytes; larger ones get a 413."""
    lora_adapters: dict[str, str] = {}
    """LoRA adapters served on the model (`--lora-adapters name=PATH,...`): name -> folder,
    hub id or `id@revision` (`switchyard.models.lora`)."""
    max_loras: int = 0
    """Adapters held in memory at once, least recently used out first; 0: the engine's default."""
    max_lora_rank: int = 0
    """The largest adapter rank accepted; 0: the engine's default."""
    allow_runtime_lora: bool = False
    """Serve `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` (guarded by the API key)."""
    api_key: str | None = None
    """When set, generation routes require `Authorization: Bearer <api_key>`."""
    log_level: str = "info"
    json_output: bool = False
    """Log JSON lines instead of text (TGI's `--json-output`)."""
    otlp_endpoint: str | None = None
    """OTLP/HTTP collector to export traces to (TGI's `--otlp-endpoint`); None: no tracing."""
    otlp_service_name: str = "switchyard"
    """`service.name` of the exported traces."""
    disable_telemetry: bool = False
    """Record no request or step telemetry (only to measure what telemetry costs)."""
    drain_timeout: float = 30.0
    """Seconds a SIGTERM waits for requests in flight before the server exits; 0: no drain."""
    image_hosts: str = ""
    """Hosts images may be fetched from over http(s), comma-separated (`switchyard.media.hosts`);
    empty: none, `data:` URLs only."""
    image_max_bytes: int = 10_000_000
    """The most bytes one image may have, encoded."""
    image_max_pixels: int = 4096 * 4096
    """The most pixels (width x height) one image may have."""
    image_fetch_timeout: float = 10.0
    """Seconds one http(s) image fetch may take, redirects included."""
    max_images: int = 8
    """The most images one request may carry."""
    responses_store_max_entries: int = 1000
    """Responses kept for `GET /v1/responses/{id}` and chaining; 0 turns the store off."""
    responses_store_max_bytes: int = 256 * 2**20
    """Bytes the kept responses may take (least recently used out first)."""
    generation_defaults: GenerationDefaults = GenerationDefaults()
    """Sampling defaults for fields an OpenAI request leaves out
    (`--override-generation-config`, `switchyard.planning.defaults`)."""
    strict_hosted_tools: bool = False
    """Refuse Responses requests that offer hosted tools instead of leaving them out."""


class TokenLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The per-request token limits actually enforced."""

    max_input_tokens: int
    max_total_tokens: int
    source: str = ""
    """Why max_total_tokens is what it is, for the start-up log."""


# For an engine that does not say what it serves (ModelInfo.max_total_tokens 0): the
# model's context, capped here. The bundled engines report theirs (the xeon engine the
# model's whole context where its KV cache holds it, as TGI 3 and vLLM default to).
DEFAULT_MAX_TOTAL_TOKENS = 4096


class ModelLimits(Protocol):
    """The per-model flags token limits and sharding are resolved from (ServeSettings, or
    one entry of a config file)."""

    @property
    def max_input_tokens(self) -> int: ...

    @property
    def max_total_tokens(self) -> int: ...

    @property
    def sharded(self) -> bool | None: ...

    @property
    def num_shard(self) -> int | None: ...


def resolve_token_limits(settings: ModelLimits, max_position_embeddings: int,
                         engine_max_total: int = 0, engine_reason: str = "") -> TokenLimits:
    """Fill unset limits from the engine and the model, as TGI does, and check they are coherent.

    ``engine_max_total`` is the longest sequence the engine resolved it serves
    (``ModelInfo.max_total_tokens``, and why: ``engine_reason``): the default where
    ``--max-total-tokens`` is unset; 0 (an engine that does not say) falls back to the
    model's context capped at DEFAULT_MAX_TOTAL_TOKENS. ``max_position_embeddings`` 0 means the model's
    config states no limit (Bloom's ALiBi biases have none, MPT names it otherwise).
    """
    known = max_position_embeddings > 0
    if settings.max_total_tokens:
        total, source = settings.max_total_tokens, "--max-total-tokens"
    elif engine_max_total:
        total, source = engine_max_total, engine_reason or "the engine's choice"
    else:
        total = (min(max_position_embeddings, DEFAULT_MAX_TOTAL_TOKENS) if known
                 else DEFAULT_MAX_TOTAL_TOKENS)
        source = f"the model's context, at most {DEFAULT_MAX_TOTAL_TOKENS}"
    inputs = settings.max_input_tokens or total - 1
    if inputs >= total:
        raise ValueError(
            f"--max-input-tokens ({inputs}) must be < --max-total-tokens ({total})"
        )
    if known and total > max_position_embeddings:
        raise ValueError(
            f"--max-total-tokens ({total}) exceeds the model's max_position_embeddings "
            f"({max_position_embeddings})"
        )
    return TokenLimits(max_input_tokens=inputs, max_total_tokens=total, source=source)


def resolve_num_shard(settings: ModelLimits) -> int:
    """The ranks to ask of the engine, by TGI's rules for `--sharded` and `--num-shard`.

    0 means "every device the engine has" (`--sharded true` alone).
    """
    if settings.sharded is False and (settings.num_shard or 1) > 1:
        raise ValueError(f"--sharded false contradicts --num-shard {settings.num_shard}")
    if settings.sharded is True and settings.num_shard == 1:
        raise ValueError("--sharded true needs --num-shard of at least 2 (got 1)")
    if settings.num_shard is not None:
        return settings.num_shard
    return 0 if settings.sharded else 1
