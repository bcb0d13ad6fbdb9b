"""Which models one server serves: from the flags (one model) or a `--config` file (several).

A config file is TOML with one `[[models]]` table per served model. Its
fields are `switchyard serve`'s per-model flags with dashes written as
underscores (`model_id`, `engine`, `engine_options`, `dtype`, `quantize`,
`max_total_tokens`, `max_concurrent_requests`, ...), plus `aliases`; a field
left out takes the flag's value, so `switchyard serve --config models.toml
--dtype float32` sets every model's default dtype. An entry with `upstreams`
instead of a `model_id` is a model other servers serve (`RemoteEntry`, read by
`remote/config.py`). A mistake names the file, the entry and the field,
and stops start-up.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import msgspec

__all__ = ["ConfigError", "ModelEntry", "RemoteEntry", "entries_from_settings", "read_config"]

from switchyard.remote.config import (
    ConfigError,
    RemoteEntry,
    field_message,
    remote_entry,
)
from switchyard.engine_process.wire import parse_cpus
from switchyard.settings import ServeSettings


class ModelEntry(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One served model: its source, the engine that runs it, and its own limits.

    Every field but ``aliases`` is the `switchyard serve` flag of the same
    name (see docs/configuration.md); ``served_model_name`` is the name clients
    send as `model`, the model id when unset.
    """

    model_id: str | None
    """Local folder, GGUF file or hub id (resolved through the local cache), or a built-in
    name; None = the default model."""
    served_model_name: str | None
    aliases: tuple[str, ...] = ()
    """More names clients may send as `model` for this model."""
    revision: str | None
    gguf_file: str | None = None
    """The GGUF file to serve among several in the `model_id` folder."""
    engine: str | None
    engine_options: dict[str, str]
    dtype: str
    quantize: str | None
    max_input_tokens: int
    max_total_tokens: int
    sharded: bool | None
    num_shard: int | None
    max_concurrent_requests: int
    max_batch_size: int
    max_batch_prefill_tokens: int
    max_batch_total_tokens: int
    max_waiting_tokens: int
    waiting_served_ratio: float
    engine_process: bool = False
    """Run this model's engine in a process of its own."""
    cpus: str | None = None
    """The CPUs its engine process is pinned to, as a Linux CPU list ("0-3,8")."""
    lora_adapters: dict[str, str] = {}
    """LoRA adapters served on this model: name -> folder, hub id or `id@revision`."""
    max_loras: int = 0
    max_lora_rank: int = 0

    @property
    def name(self) -> str:
        """What clients send as `model` (before the model is resolved: its id as given)."""
        return self.served_model_name or self.model_id or "the default model"


PER_MODEL_FIELDS = tuple(f for f in ModelEntry.__struct_fields__ if f != "aliases")
"""The flags a config entry may set for its own model."""
DTYPES = ("auto", "float32", "bfloat16", "float16")
KNOWN_FIELDS = ("aliases", "name", *PER_MODEL_FIELDS)
"""What an error about an unknown field of a local model's entry lists."""


def _flag_values(settings: ServeSettings) -> dict[str, Any]:
    return {f: getattr(settings, f) for f in PER_MODEL_FIELDS}


def entries_from_settings(settings: ServeSettings) -> list[ModelEntry | RemoteEntry]:
    """The served models: the `--config` file's entries, or the one model the flags name."""
    if settings.config is None:
        entry = msgspec.convert(_flag_values(settings), ModelEntry)
        _check_cpus("--cpus", entry, flags=True)
        return [entry]
    return read_config(settings.config, settings)


def read_config(path: str | Path, settings: ServeSettings) -> list[ModelEntry | RemoteEntry]:
    """Parse and check a TOML config file; ConfigError naming what is wrong."""
    path = Path(path)
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"{path}: not a readable TOML file: {exc}") from None
    unknown = sorted(set(document) - {"models"})
    if unknown:
        raise ConfigError(f"{path}: unknown top-level key {', '.join(unknown)} (expected "
                          "[[models]] tables)")
    tables = document.get("models")
    if not isinstance(tables, list) or not tables:
        raise ConfigError(f"{path}: no [[models]] table: list at least one model")
    entries = [_entry(path, i, table, settings) for i, table in enumerate(tables)]
    _check_names(path, entries)
    return entries


def _entry(path: Path, index: int, table: object,
           settings: ServeSettings) -> ModelEntry | RemoteEntry:
    where = f"{path}: models[{index}]"
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table of settings")
    if "name" in table:
        where += f" ({table['name']!r})"
    elif "served_model_name" in table or "model_id" in table:
        where += f" ({table.get('served_model_name') or table.get('model_id')!r})"
    values = dict(table)
    if "name" in values:  # the short spelling of served_model_name
        values["served_model_name"] = values.pop("name")
    if "upstreams" in values:
        return remote_entry(where, values, settings.max_concurrent_requests)
    if isinstance(values.get("engine_options"), dict):
        values["engine_options"] = _option_strings(where, values["engine_options"])
    try:
        entry = msgspec.convert({**_flag_values(settings), **values}, ModelEntry)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {field_message(exc, KNOWN_FIELDS)}") from None
    if entry.dtype not in DTYPES:
        raise ConfigError(f"{where}: field `dtype` must be one of {', '.join(DTYPES)}, "
                          f"not {entry.dtype!r}")
    for field in ("max_concurrent_requests", "max_waiting_tokens"):
        if getattr(entry, field) < (1 if field == "max_concurrent_requests" else 0):
            raise ConfigError(f"{where}: field `{field}` is out of range")
    _check_cpus(where, entry)
    return entry


def _check_cpus(where: str, entry: ModelEntry, flags: bool = False) -> None:
    """`cpus` is a CPU list, and pins an engine process (an engine in the server's own
    process shares the server's CPUs)."""
    if entry.cpus is None:
        return
    field, needs = ("--cpus", "--engine-process") if flags else ("field `cpus`",
                                                                 "`engine_process = true`")
    prefix = "" if flags else f"{where}: "
    try:
        parse_cpus(entry.cpus)
    except ValueError as exc:
        raise ConfigError(f"{prefix}{field}: {exc}") from None
    if not entry.engine_process:
        raise ConfigError(f"{prefix}{field} pins an engine process: it needs {needs}")


def _option_strings(where: str, options: dict[str, object]) -> dict[str, str]:
    """Engine options as the strings `--engine-option KEY=VALUE` gives (TOML may type them)."""
    out = {}
    for key, value in options.items():
        if isinstance(value, bool):
            out[key] = "true" if value else "false"
        elif isinstance(value, (str, int, float)):
            out[key] = str(value)
        else:
            raise ConfigError(f"{where}: field `engine_options.{key}` must be a string, number "
                              f"or boolean, not {type(value).__name__}")
    return out


def _check_names(path: Path, entries: list[ModelEntry | RemoteEntry]) -> None:
    """Every name and alias reaches one model; only one entry may use the built-in model."""
    seen: dict[str, int] = {}
    for i, entry in enumerate(entries):
        adapters = tuple(entry.lora_adapters) if isinstance(entry, ModelEntry) else ()
        for name in (entry.name, *entry.aliases, *adapters):
            if name in seen:
                raise ConfigError(f"{path}: models[{i}]: the name {name!r} is already used by "
                                  f"models[{seen[name]}]")
            seen[name] = i
