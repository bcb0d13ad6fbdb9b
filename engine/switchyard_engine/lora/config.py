"""``adapter_config.json``: PEFT's LoRA settings, read and checked before any weight is.

What an engine cannot serve exactly is refused here with the reason, never
served wrong: another PEFT method, DoRA (``use_dora``: a per-column
magnitude the low-rank product does not carry), ``modules_to_save`` (whole
replaced modules), a trained bias (``bias`` other than "none", or
``lora_bias``), a rank over the engine's limit.

Scaling is PEFT's: ``lora_alpha / r`` per module, or ``lora_alpha / sqrt(r)``
with ``use_rslora``, where ``rank_pattern`` and ``alpha_pattern`` override
``r`` and ``lora_alpha`` for the modules whose names they match.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from switchyard_spec import AdapterError

CONFIG_FILE = "adapter_config.json"


@dataclass(frozen=True)
class AdapterConfig:
    """The LoRA settings of one adapter folder, as PEFT wrote them."""

    rank: int
    """``r``: the rank of every module not matched by ``rank_pattern``."""
    alpha: float
    """``lora_alpha``: the scale numerator of every module not matched by ``alpha_pattern``."""
    target_modules: tuple[str, ...] | str
    """Module names (matched on their last dotted parts) or one regular expression (full match)."""
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    """PEFT's flag for Conv1D-style weights stored [in, out]. It changes only how PEFT
    *merges* the delta into such a weight: ``lora_A`` [r, in] and ``lora_B`` [out, r]
    and the unmerged product are the same either way, so it needs nothing here."""
    base_model: str = ""

    def rank_of(self, module: str) -> int:
        """The rank PEFT gives ``module`` (a dotted path such as ``model.layers.0.mlp.up_proj``)."""
        key = _pattern_key(self.rank_pattern, module)
        return int(self.rank_pattern[key]) if key is not None else self.rank

    def alpha_of(self, module: str) -> float:
        """The ``lora_alpha`` PEFT gives ``module``."""
        key = _pattern_key(self.alpha_pattern, module)
        return float(self.alpha_pattern[key]) if key is not None else self.alpha

    def scaling(self, module: str, rank: int) -> float:
        """PEFT's factor on ``module``'s product: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        alpha = self.alpha_of(module)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def targets(self, module: str) -> bool:
        """Whether ``target_modules`` names ``module`` (PEFT's ``check_target_module_exists``)."""
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module) is not None
        return any(module == t or module.endswith("." + t) for t in self.target_modules)


def _pattern_key(patterns: dict[str, object], module: str) -> str | None:
    """The ``rank_pattern``/``alpha_pattern`` key that matches ``module``, as PEFT picks it.

    PEFT matches a key as a regular expression against the module's dotted
    name, anchored at a dot boundary on the left and at the end on the right.
    """
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return None


def read_config(name: str, folder: Path, max_rank: int) -> AdapterConfig:
    """``folder``'s ``adapter_config.json``, checked; :class:`AdapterError` names what is wrong."""
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise AdapterError(f"adapter {name!r}: {folder} is not a folder")
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise AdapterError(f"adapter {name!r}: {folder} has no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} is not readable JSON ({exc})"
                           ) from None
    if not isinstance(raw, dict):
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} is not a JSON object")
    fail = _refusal(raw)
    if fail:
        raise AdapterError(f"adapter {name!r}: {fail}")
    try:
        config = AdapterConfig(
            rank=int(raw.get("r", 8)),
            alpha=float(raw.get("lora_alpha", 8)),
            target_modules=_targets(raw.get("target_modules")),
            rank_pattern={str(k): int(v) for k, v in (raw.get("rank_pattern") or {}).items()},
            alpha_pattern={str(k): float(v) for k, v in (raw.get("alpha_pattern") or {}).items()},
            use_rslora=bool(raw.get("use_rslora", False)),
            fan_in_fan_out=bool(raw.get("fan_in_fan_out", False)),
            base_model=str(raw.get("base_model_name_or_path") or ""),
        )
    except (TypeError, ValueError, AttributeError) as exc:
        raise AdapterError(f"adapter {name!r}: {CONFIG_FILE} has a malformed field ({exc})"
                           ) from None
    ranks = [config.rank, *config.rank_pattern.values()]
    if min(ranks) < 1:
        raise AdapterError(f"adapter {name!r}: rank {min(ranks)} is not positive")
    if max_rank and max(ranks) > max_rank:
        raise AdapterError(f"adapter {name!r}: rank {max(ranks)} is greater than max_lora_rank "
                           f"{max_rank} (raise --max-lora-rank to serve it)")
    return config


def _refusal(raw: dict[str, object]) -> str:
    """Why an engine cannot serve this config exactly; '' when it can."""
    peft_type = str(raw.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        return f"peft_type {peft_type} is not LoRA"
    if raw.get("use_dora"):
        return "DoRA (use_dora) is not supported: its magnitude vector is not a low-rank product"
    if raw.get("modules_to_save"):
        return (f"modules_to_save {raw['modules_to_save']} is not supported: only "
                "modules_to_save being None (whole replaced modules are not served)")
    bias = raw.get("bias", "none") or "none"
    if bias != "none" or raw.get("lora_bias"):
        return f"bias={bias!r} is not supported: the adapter must train no bias (bias='none')"
    if raw.get("target_parameters"):
        return "target_parameters (LoRA on raw parameters) is not supported"
    return ""


def _targets(value: object) -> tuple[str, ...] | str:
    if isinstance(value, str):
        return value
    if isinstance(value, list | tuple):
        return tuple(str(v) for v in value)
    raise ValueError(f"target_modules {value!r} is neither a list nor a regular expression")
