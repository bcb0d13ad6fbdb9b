"""Load a transformers causal language model from a local folder.

Shared by hardware engines: it resolves the dtype for the machine, checks the
folder before transformers does (so the error says what is missing), loads the
safetensors weights and reports a :class:`switchyard_spec.ModelInfo`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from switchyard_spec import EngineStartError, ModelInfo

logger = logging.getLogger("switchyard.engine")

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """Feature flags of the first CPU in ``/proc/cpuinfo`` (empty when unreadable)."""
    try:
        with open(cpuinfo, encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_bf16(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU computes bfloat16 natively (AVX512_BF16 or AMX)."""
    flags = cpu_flags() if flags is None else flags
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, flags: frozenset[str] | None = None) -> torch.dtype:
    """Map a dtype name to a torch dtype; "auto" picks bfloat16 where the CPU has it."""
    if name == "auto":
        return torch.bfloat16 if cpu_has_bf16(flags) else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise EngineStartError(
            f"unknown dtype {name!r}: use auto, {', '.join(_DTYPES)}"
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of a torch dtype ("bfloat16")."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class LoadedModel:
    """A loaded model in eval mode with what the engine reports about it."""

    model: torch.nn.Module
    info: ModelInfo
    seconds: float


def load_causal_lm(
    model_path: str | Path,
    dtype: str = "auto",
    device: str = "cpu",
    attn_implementation: str | None = None,
) -> LoadedModel:
    """Load the causal LM in ``model_path`` (config.json + safetensors) onto ``device``.

    Raises :class:`EngineStartError` with a readable message when the folder or
    its files are missing, the architecture is unknown to transformers, or the
    weights cannot be read.
    """
    import transformers  # heavy; only engines that load a model pay for it

    path = Path(model_path)
    config = checked_config(path)
    model_type = config.model_type
    torch_dtype = resolve_dtype(dtype)

    logger.info("loading %s (%s) as %s on %s", path, model_type, dtype_name(torch_dtype), device)
    start = time.perf_counter()
    kwargs: dict[str, object] = {"dtype": torch_dtype, "use_safetensors": True}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError, RuntimeError) as exc:
        raise EngineStartError(f"cannot load weights from {str(path)!r}: {exc}") from exc
    model = model.to(device).eval()
    seconds = time.perf_counter() - start
    logger.info("loaded %s in %.2fs", path, seconds)
    return LoadedModel(model=model, info=model_info(model, config, torch_dtype, device),
                       seconds=seconds)


def checked_config(path: Path):  # -> transformers.PretrainedConfig
    """The folder's transformers config, after checking the folder has what a model needs.

    Raises :class:`EngineStartError` naming what is missing (the folder,
    config.json, safetensors) or an architecture transformers does not know
    as a causal LM.
    """
    import transformers

    if not path.is_dir():
        raise EngineStartError(f"model folder {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise EngineStartError(f"model folder {str(path)!r} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise EngineStartError(f"model folder {str(path)!r} has no .safetensors weights")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EngineStartError(f"cannot read {config_file}: {exc}") from exc
    model_type = raw.get("model_type")
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as exc:
        raise EngineStartError(
            f"unknown model architecture {model_type!r} in {config_file}: {exc}"
        ) from exc
    if type(config) not in transformers.AutoModelForCausalLM._model_mapping:
        if getattr(config, "is_encoder_decoder", False):
            architectures = ", ".join(getattr(config, "architectures", None) or ()) or model_type
            raise EngineStartError(
                f"model type {model_type!r} ({architectures}) is an encoder-decoder model; "
                "the engines serve decoder-only causal language models (transformers' "
                "*ForCausalLM architectures)")
        raise EngineStartError(
            f"model type {model_type!r} is not a causal language model known to transformers"
        )
    return config


def model_info(model: torch.nn.Module, config: object, dtype: torch.dtype,
               device: str) -> ModelInfo:
    """What an engine reports about a loaded ``model``."""
    head = model.get_output_embeddings()
    vocab = getattr(head, "out_features", None) or head.weight.shape[0]  # quantized: no .weight
    return ModelInfo(
        model_type=str(getattr(config, "model_type", "")),
        dtype=dtype_name(dtype),
        vocab_size=int(vocab),
        max_position_embeddings=int(getattr(config, "max_position_embeddings", 0) or 0),
        eos_token_ids=eos_token_ids(model),
        device=device,
    )


def eos_token_ids(model: torch.nn.Module) -> tuple[int, ...]:
    """End-of-sequence ids from the generation config, falling back to the model config."""
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(cfg, "eos_token_id", None)
        if value is None:
            continue
        ids = [value] if isinstance(value, int) else list(value)
        return tuple(int(i) for i in ids)
    return ()
