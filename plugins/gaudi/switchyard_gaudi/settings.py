"""Every environment variable of tgi-gaudi's README, read once into one typed record.

The names, defaults and meanings are the seed's (``docker run -e NAME=value``
lines keep working unchanged), plus the exponential bucketing bases of TGI's
later Gaudi code, ``PT_HPU_LAZY_MODE`` and, for vision-language models, the
seed's Llava section's ``BASE_IMAGE_TOKENS``. :meth:`GaudiSettings.from_env`
parses them all at start-up: a value that does not parse is a start-up error
naming the variable and what it accepts, never a silent default.

Some variables ask for something only an HPU can do (FusedSDPA, lazy mode) or
that is not the engine's business (``SKIP_TOKENIZER_IN_TGI``: tokenization is
the gateway's). :func:`inapplicable` says which of the values given cannot be
honoured on a device, and why, so the engine logs each once instead of
ignoring it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

from switchyard_spec import EngineStartError


class SettingsError(EngineStartError):
    """An environment variable has a value the engine cannot use."""


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(name: str, raw: str) -> bool:
    """``raw`` as a flag (True/False, 1/0, yes/no, on/off; any case), else SettingsError."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SettingsError(f"{name}={raw!r} is not a flag: use true or false")


def _int_at_least(minimum: int) -> Callable[[str, str], int]:
    """A parser for integers of at least ``minimum``."""

    def parse(name: str, raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            raise SettingsError(f"{name}={raw!r} is not an integer") from None
        if value < minimum:
            raise SettingsError(f"{name}={raw!r} must be at least {minimum}")
        return value

    return parse


def _text(name: str, raw: str) -> str:
    return raw.strip()


def _ranks(name: str, raw: str) -> tuple[int, ...]:
    parts = [p.strip() for p in raw.split(",") if p.strip()]
    try:
        ranks = tuple(int(p) for p in parts)
    except ValueError:
        raise SettingsError(
            f"{name}={raw!r} is not a comma-separated list of ranks (e.g. 0,1)") from None
    if not ranks or min(ranks) < 0:
        raise SettingsError(f"{name}={raw!r} must name at least one rank, none negative")
    return ranks


@dataclass(frozen=True)
class Variable:
    """One environment variable: its name, the settings field it fills, how it parses."""

    name: str
    field: str
    parse: Callable[[str, str], object]
    meaning: str


VARIABLES: tuple[Variable, ...] = (
    Variable("ENABLE_HPU_GRAPH", "enable_hpu_graph", parse_bool,
             "capture the bucketed forward passes as graphs (HPU graphs; torch.compile on CPU)"),
    Variable("LIMIT_HPU_GRAPH", "limit_hpu_graph", parse_bool,
             "no graph for prefill, to save device memory"),
    Variable("BATCH_BUCKET_SIZE", "batch_bucket_size", _int_at_least(1),
             "decode batches are padded up to a multiple of this"),
    Variable("PREFILL_BATCH_BUCKET_SIZE", "prefill_batch_bucket_size", _int_at_least(1),
             "prefill batches are padded up to a multiple of this"),
    Variable("PAD_SEQUENCE_TO_MULTIPLE_OF", "pad_sequence_to_multiple_of", _int_at_least(1),
             "prompts are padded up to a multiple of this"),
    Variable("SKIP_TOKENIZER_IN_TGI", "skip_tokenizer_in_tgi", parse_bool,
             "token ids in and out instead of text"),
    Variable("WARMUP_ENABLED", "warmup_enabled", parse_bool,
             "run every planned shape before serving"),
    Variable("QUEUE_THRESHOLD_MS", "queue_threshold_ms", _int_at_least(0),
             "requests queued longer are overdue and served first; else shorter prompts first"),
    Variable("USE_FLASH_ATTENTION", "use_flash_attention", parse_bool,
             "Habana's fused scaled-dot-product attention (FusedSDPA)"),
    Variable("FLASH_ATTENTION_RECOMPUTE", "flash_attention_recompute", parse_bool,
             "FusedSDPA in recompute mode for prefill"),
    Variable("TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN", "ignore_eos_token", parse_bool,
             "never stop at an end-of-sequence token (benchmarking)"),
    Variable("QUANT_CONFIG", "quant_config", _text,
             "Intel Neural Compressor FP8 JSON config; non-empty turns FP8 on"),
    Variable("PROF_WAITSTEP", "prof_waitstep", _int_at_least(0), "profiler: steps to skip"),
    Variable("PROF_WARMUPSTEP", "prof_warmupstep", _int_at_least(0),
             "profiler: steps traced but discarded"),
    Variable("PROF_STEP", "prof_step", _int_at_least(0),
             "profiler: steps recorded; 0 turns the profiler off"),
    Variable("PROF_PATH", "prof_path", _text, "profiler: folder the trace is written to"),
    Variable("PROF_RANKS", "prof_ranks", _ranks, "profiler: ranks that profile"),
    Variable("PROF_RECORD_SHAPES", "prof_record_shapes", parse_bool,
             "profiler: record operator input shapes"),
    Variable("BATCH_SIZE_EXPONENT_BASE", "batch_size_exponent_base", _int_at_least(2),
             "when set, batch buckets are powers of this base instead of multiples"),
    Variable("SEQ_LEN_EXPONENT_BASE", "seq_len_exponent_base", _int_at_least(2),
             "when set, prompt buckets are PAD_SEQUENCE_TO_MULTIPLE_OF times powers of this base"),
    Variable("PT_HPU_LAZY_MODE", "pt_hpu_lazy_mode", parse_bool,
             "HPU lazy mode with HPU graphs (1) or eager mode with torch.compile (0)"),
    Variable("BASE_IMAGE_TOKENS", "base_image_tokens", _int_at_least(1),
             "vision-language models: the least --max-input-tokens, and the first prompt "
             "bucket (prefill graphs run from it to --max-input-tokens)"),
)


@dataclass(frozen=True)
class GaudiSettings:
    """The Gaudi engine's environment, parsed. Defaults are the seed's (tgi-gaudi 2.0.4)."""

    enable_hpu_graph: bool = True
    limit_hpu_graph: bool = False
    batch_bucket_size: int = 8
    prefill_batch_bucket_size: int = 4
    pad_sequence_to_multiple_of: int = 128
    skip_tokenizer_in_tgi: bool = False
    warmup_enabled: bool = True
    queue_threshold_ms: int = 120
    use_flash_attention: bool = False
    flash_attention_recompute: bool = False
    ignore_eos_token: bool = False
    quant_config: str = ""
    prof_waitstep: int = 0
    prof_warmupstep: int = 0
    prof_step: int = 0
    prof_path: str = "/tmp/hpu_profile"
    prof_ranks: tuple[int, ...] = (0,)
    prof_record_shapes: bool = False
    batch_size_exponent_base: int | None = None
    """None: linear batch buckets (the seed's); a base >= 2: exponential ones."""
    seq_len_exponent_base: int | None = None
    """None: linear prompt buckets (the seed's); a base >= 2: exponential ones."""
    pt_hpu_lazy_mode: bool = True
    base_image_tokens: int = 2048
    """Vision-language models only (Llava-Next's image tokens, the seed's default)."""
    given: frozenset[str] = field(default=frozenset(), compare=False)
    """Names of the variables the environment set (the rest are defaults)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> GaudiSettings:
        """Read every variable of :data:`VARIABLES` from ``env`` (default ``os.environ``).

        An empty value counts as unset. Raises :class:`SettingsError` naming the
        first variable whose value does not parse.
        """
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        given: set[str] = set()
        for var in VARIABLES:
            raw = env.get(var.name)
            if raw is None or not raw.strip():
                continue
            values[var.field] = var.parse(var.name, raw)
            given.add(var.name)
        settings = cls(**values, given=frozenset(given))  # type: ignore[arg-type]
        if settings.quant_config and not os.path.isfile(settings.quant_config):
            raise SettingsError(f"QUANT_CONFIG={settings.quant_config!r} is not a file")
        return settings

    def as_env(self) -> dict[str, str]:
        """The settings as the variables' names and values (for logs and the docs)."""
        by_field = {f.name: getattr(self, f.name) for f in fields(self)}
        out = {}
        for var in VARIABLES:
            value = by_field[var.field]
            if value is None:
                text = ""
            elif isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, tuple):
                text = ",".join(str(v) for v in value)
            else:
                text = str(value)
            out[var.name] = text
        return out


def inapplicable(settings: GaudiSettings, device_kind: str) -> list[str]:
    """Why each variable whose value cannot be honoured on ``device_kind`` ("hpu" or "cpu") is not.

    Only values that ask for something count: a flag left at a default that
    asks for nothing is not reported. One message per variable.
    """
    notes = []
    if settings.skip_tokenizer_in_tgi:
        notes.append("SKIP_TOKENIZER_IN_TGI=true is not applied: tokenization and "
                     "detokenization are the gateway's, and the gateway has no token-id mode yet")
    if device_kind == "hpu":
        return notes
    if settings.use_flash_attention:
        notes.append("USE_FLASH_ATTENTION=true is not applicable on cpu: Habana's FusedSDPA is "
                     "HPU-only, attention runs torch's scaled_dot_product_attention")
    if settings.flash_attention_recompute:
        notes.append("FLASH_ATTENTION_RECOMPUTE=true is not applicable on cpu: it is a mode "
                     "of Habana's FusedSDPA")
    if "PT_HPU_LAZY_MODE" in settings.given:
        notes.append(f"PT_HPU_LAZY_MODE={int(settings.pt_hpu_lazy_mode)} is not applicable on "
                     "cpu: graphs are torch.compile's (see ENABLE_HPU_GRAPH)")
    return notes
