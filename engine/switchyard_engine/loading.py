"""Load a transformers causal language model from a local folder.

Shared by hardware engines: it resolves the dtype for the machine, checks the
folder before transformers does (so the error says what is missing), loads the
safetensors weights and reports a :class:`switchyard_spec.ModelInfo`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
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
    kwargs: dict[str, object] = {"dtype": torch_dtype, "use_safetensors": True,
                                 "output_loading_info": True}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError, RuntimeError) as exc:
        raise EngineStartError(f"cannot load weights from {str(path)!r}: {exc}") from exc
    check_loading_info(path, type(model).__name__, info)
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
    causal = type(config) in transformers.AutoModelForCausalLM._model_mapping
    architectures = ", ".join(getattr(config, "architectures", None) or ()) or model_type
    if getattr(config, "is_encoder_decoder", False) and not causal:
        raise EngineStartError(
            f"model type {model_type!r} ({architectures}) is an encoder-decoder model; "
            "the engines serve decoder-only causal language models (transformers' "
            "*ForCausalLM architectures)")
    if is_encoder(config):
        raise EngineStartError(_encoder_message(path, model_type, architectures, causal))
    if not causal:
        raise EngineStartError(
            f"model type {model_type!r} is not a causal language model known to transformers"
        )
    check_weight_files(path)
    return config


def is_encoder(config: object) -> bool:
    """Whether ``config`` is an encoder-only model's (BERT, RoBERTa, ELECTRA, DistilBERT...).

    Those are the model types transformers has a masked-LM class for that are
    neither encoder-decoder models nor configured as decoders (``is_decoder``).
    """
    import transformers

    return (type(config) in transformers.AutoModelForMaskedLM._model_mapping
            and not getattr(config, "is_encoder_decoder", False)
            and not getattr(config, "is_decoder", False))


def _encoder_message(path: Path, model_type: str, architectures: str, causal: bool) -> str:
    """What an encoder model is for, and the weights a causal LM head would lack in it."""
    message = (
        f"{str(path)!r} holds an encoder model ({model_type}: {architectures}). An encoder "
        "reads a whole text at once and turns it into vectors: it is for embeddings and "
        "search, classification, or filling in masked words, and it does not generate text. "
        "The engines serve text generators (decoder-only causal language models, such as "
        "Llama, Qwen2, Mistral or Phi-3)")
    if causal:  # transformers has a causal LM head class for it: what would it lack?
        import transformers

        try:
            check_weight_files(path)
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                path, use_safetensors=True, output_loading_info=True)
        except (OSError, ValueError, RuntimeError, EngineStartError):
            model, info = None, None
        problem = loading_problem(info) if info is not None else ""
        if problem:
            message += f". Loaded as one ({type(model).__name__}), it would have {problem}"
    return message + "."


def check_weight_files(path: Path) -> None:
    """EngineStartError naming a weight file that is cut short or a shard that is missing.

    Each ``*.safetensors`` file's header (an 8-byte length and a JSON table of
    tensors with their byte ranges) must parse, and the file must be as long as
    the header says; each file ``model.safetensors.index.json`` names must exist.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise EngineStartError(f"cannot read {index}: {exc}") from exc
        missing = sorted(name for name in shards if not (path / name).is_file())
        if missing:
            raise EngineStartError(
                f"{index.name} in {str(path)!r} names weight files that are not there: "
                f"{', '.join(missing)} (an interrupted download or copy?)")
    for file in sorted(path.glob("*.safetensors")):
        _check_safetensors(file)


def _check_safetensors(file: Path) -> None:
    size = file.stat().st_size
    cut = f"{file.name} in {str(file.parent)!r} is cut short or damaged"
    if size < 8:
        raise EngineStartError(f"{cut}: {size} bytes, less than a safetensors header")
    with open(file, "rb") as fh:
        header_size = int.from_bytes(fh.read(8), "little")
        if 8 + header_size > size:
            raise EngineStartError(f"{cut}: its header says {header_size} bytes of tensor "
                                   f"table, the file has {size} bytes in all")
        try:
            header = json.loads(fh.read(header_size))
            end = max((int(t["data_offsets"][1]) for k, t in header.items()
                       if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise EngineStartError(f"{cut}: its header does not parse ({exc})") from None
    expected = 8 + header_size + end
    if size < expected:
        raise EngineStartError(
            f"{cut}: it has {size} bytes, its header describes {expected} "
            f"({expected - size} missing: an interrupted download or copy?)")


def loading_problem(info: Mapping[str, object], shown: int = 8) -> str:
    """What transformers' loading report (``output_loading_info=True``) says is wrong, or ""."""
    parts = []
    for key, what in (("missing_keys", "the checkpoint does not have (served, they would be "
                                       "newly initialized: random)"),
                      ("unexpected_keys", "in the checkpoint that the model does not use"),
                      ("mismatched_keys", "of another shape in the checkpoint than in the model")):
        raw = info.get(key) or ()
        names = sorted(str(k[0] if isinstance(k, (tuple, list)) else k) for k in raw)
        if names:
            listed = ", ".join(names[:shown]) + (f" and {len(names) - shown} more"
                                                 if len(names) > shown else "")
            parts.append(f"{len(names)} weight{'s' if len(names) != 1 else ''} {what}: {listed}")
    errors = [str(e) for e in info.get("error_msgs") or ()]
    if errors:
        parts.append("errors: " + "; ".join(errors))
    return "; ".join(parts)


def check_loading_info(source: str | Path, class_name: str, info: Mapping[str, object]) -> None:
    """EngineStartError when the loading report shows weights missing, unused or mis-shaped.

    A model whose checkpoint does not give every weight it has, or gives weights
    it does not use, is not the model the checkpoint was trained as: serving it
    would answer with random weights in some layers.
    """
    problem = loading_problem(info)
    if problem:
        raise EngineStartError(
            f"refusing to serve {str(source)!r}: loaded as {class_name}, it has {problem}. "
            "The checkpoint does not match the architecture its config names (weights saved "
            "from another model class or task, or an incomplete download?)")


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
