"""Calibration for quantization methods that must see activations, shared by engines.

A method with a ``Calibration`` (``switchyard_spec.Calibration``) names its
prompts; :func:`calibrate` tokenizes them with the model's tokenizer, runs
each through the unquantized model with a forward pre-hook on every
``nn.Linear`` and records, per layer, the largest ``|x|`` of each input
feature (``ActivationStatistics``). The statistics depend on the model's
files, the texts and the token limit only, so they are cached on disk under
a key of those three: a model calibrates once, whatever ``alpha`` or other
options its method applies to the statistics later.

The cache is one safetensors file per key in ``calibration_cache`` (an
engine option) or ``$SWITCHYARD_CACHE/calibration`` (default
``~/.cache/switchyard/calibration``). A cache file that cannot be read, or
holds other layers than the model has, stops start-up with its path: delete
it to calibrate again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from switchyard_spec import ActivationStatistics, Calibration, EngineStartError

logger = logging.getLogger("switchyard.engine")

CACHE_VERSION = "1"
"""Bumped when what is recorded, or how, changes: old cache files are then not read."""
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")


def default_cache_dir() -> Path:
    """``$SWITCHYARD_CACHE/calibration``, else ``$XDG_CACHE_HOME`` (or ``~/.cache``)/switchyard/calibration."""
    root = os.environ.get("SWITCHYARD_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "switchyard")
    return Path(root) / "calibration"


def model_content_hash(model_path: str | os.PathLike[str]) -> str:
    """sha256 over a model folder's config and weight files (names and bytes), hex."""
    folder = Path(model_path)
    digest = hashlib.sha256()
    files = sorted(p for p in folder.iterdir() if p.is_file() and (
        p.name == "config.json" or p.suffix in _WEIGHT_SUFFIXES))
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def cache_key(model_hash: str, texts: tuple[str, ...], max_tokens: int) -> str:
    """The name of a calibration's cache file: model, texts and token limit."""
    digest = hashlib.sha256()
    digest.update(json.dumps([CACHE_VERSION, model_hash, max_tokens, list(texts)]).encode())
    return digest.hexdigest()[:32]


def collect_statistics(model: torch.nn.Module, prompts: list[list[int]],
                       ) -> dict[str, ActivationStatistics]:
    """Run ``prompts`` (token ids) through ``model``; per ``nn.Linear`` its inputs' absmax per feature.

    Keys are the layers' qualified names in ``model``. Each prompt runs alone
    (no padding enters the statistics), in inference mode, with transformers'
    SDPA attention (an engine's own attention, set on the model for serving,
    is put back afterwards).
    """
    absmax: dict[str, torch.Tensor] = {}
    tokens: dict[str, int] = {}
    hooks = []

    def hook(name: str):
        def record(_module: torch.nn.Module, args: tuple) -> None:
            x = args[0].detach()
            flat = x.reshape(-1, x.shape[-1]).float()
            top = flat.abs().amax(0)
            absmax[name] = top if name not in absmax else torch.maximum(absmax[name], top)
            tokens[name] = tokens.get(name, 0) + flat.shape[0]
        return record

    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear:
            hooks.append(module.register_forward_pre_hook(hook(name)))
    config = getattr(model, "config", None)
    serving = getattr(config, "_attn_implementation", None)
    if serving not in (None, "sdpa", "eager"):
        model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            for ids in prompts:
                model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for handle in hooks:
            handle.remove()
        if serving not in (None, "sdpa", "eager"):
            model.set_attn_implementation(serving)
    return {name: ActivationStatistics(absmax=absmax[name].contiguous(), tokens=tokens[name])
            for name in absmax}


def calibrate(model: torch.nn.Module, model_path: str, calibration: Calibration,
              options: Mapping[str, str], method: str = "",
              ) -> tuple[dict[str, ActivationStatistics], str]:
    """The statistics ``calibration`` asks for: from the cache, or measured and cached.

    Returns them and a line for the start-up log. Raises ``EngineStartError``
    for a bad calibration file (the method's ``ValueError``), a corrupt cache
    file, or a cache directory that cannot be written.
    """
    label = f"--quantize {method}: " if method else ""
    try:
        texts = tuple(calibration.prompts(options))
    except ValueError as exc:
        raise EngineStartError(f"{label}{exc}") from None
    if not texts:
        raise EngineStartError(f"{label}calibration has no prompts")
    folder = Path(options.get("calibration_cache") or default_cache_dir())
    key = cache_key(model_content_hash(model_path), texts, calibration.max_tokens)
    path = folder / f"{key}.safetensors"
    linears = {n: m.in_features for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    if path.exists():
        stats = _read_cache(path, linears)
        return stats, f"calibration statistics from {path} ({len(texts)} prompts)"
    from transformers import AutoTokenizer

    begin = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = [tokenizer(text).input_ids[: calibration.max_tokens] for text in texts]
    prompts = [p for p in prompts if p]
    if not prompts:
        raise EngineStartError(f"{label}the calibration prompts tokenize to nothing")
    stats = collect_statistics(model, prompts)
    took = time.perf_counter() - begin
    _write_cache(path, stats, method)
    tokens = sum(len(p) for p in prompts)
    return stats, (f"calibrated on {len(prompts)} prompts ({tokens} tokens) in {took:.1f}s, "
                   f"statistics cached in {path}")


def _write_cache(path: Path, stats: dict[str, ActivationStatistics], method: str) -> None:
    from safetensors.torch import save_file

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({name: s.absmax for name, s in stats.items()}, str(tmp), metadata={
            "version": CACHE_VERSION, "method": method,
            "tokens": json.dumps({name: s.tokens for name, s in stats.items()})})
        os.replace(tmp, path)  # whole or not at all, for a concurrent reader
    except OSError as exc:
        raise EngineStartError(f"calibration cache {path}: cannot be written ({exc}); set "
                               "--engine-option calibration_cache=DIR") from None


def _read_cache(path: Path, linears: dict[str, int]) -> dict[str, ActivationStatistics]:
    from safetensors import safe_open

    def corrupt(why: str) -> EngineStartError:
        return EngineStartError(f"calibration cache {path} is corrupt ({why}); delete it to "
                                "calibrate again")

    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            counts = json.loads(meta.get("tokens", "null"))
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}  # noqa: SIM118
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise corrupt(f"{type(exc).__name__}: {str(exc)[:200]}") from None
    if meta.get("version") != CACHE_VERSION or not isinstance(counts, dict):
        raise corrupt("no version or token counts")
    if set(tensors) != set(linears) or set(counts) != set(linears):
        raise corrupt(f"{len(tensors)} layers recorded, the model has {len(linears)}")
    stats = {}
    for name, absmax in tensors.items():
        if absmax.shape != (linears[name],) or absmax.dtype != torch.float32 or not bool(
                torch.isfinite(absmax).all()) or bool((absmax < 0).any()):
            raise corrupt(f"{name}: not {linears[name]} finite, non-negative float32 values")
        stats[name] = ActivationStatistics(absmax=absmax, tokens=int(counts[name]))
    return stats
