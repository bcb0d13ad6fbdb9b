"""A PEFT LoRA folder's weights, read into fp32 A and B matrices per adapted module.

PEFT saves ``base_model.model.<module>.lora_A.weight`` [r, in] and
``.lora_B.weight`` [out, r] in ``adapter_model.safetensors``. The engine
says which modules it can adapt and their (in, out) sizes; a key naming any
other module (an embedding, ``lm_head``, a norm), a missing half, a shape
that does not fit, a rank that disagrees with the config or a value that is
not finite refuses the adapter with the reason. Everything is read and
checked before anything is handed back, so a bad folder changes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from switchyard_spec import AdapterError

from switchyard_engine.lora.config import AdapterConfig, read_config

WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<half>A|B)\.weight")


@dataclass(frozen=True)
class LoraModule:
    """One adapted module: its delta is ``scaling * (x @ a.T) @ b.T``."""

    a: torch.Tensor
    """fp32 [rank, in]."""
    b: torch.Tensor
    """fp32 [out, rank]."""
    scaling: float

    @property
    def rank(self) -> int:
        """The module's rank."""
        return int(self.a.shape[0])


@dataclass(frozen=True)
class LoraAdapter:
    """An adapter read from its folder: per module path (``model.layers.0.self_attn.q_proj``)."""

    name: str
    path: str
    modules: dict[str, LoraModule]
    config: AdapterConfig
    derived: dict[object, object] = field(default_factory=dict, compare=False, repr=False)
    """Forms an engine derives from the matrices (a native kernel's flat buffer), keyed by
    the engine: they live as long as the adapter stays in memory."""

    @property
    def rank(self) -> int:
        """The largest rank of any of its modules."""
        return max(m.rank for m in self.modules.values())

    @property
    def nbytes(self) -> int:
        """Bytes its matrices take in memory."""
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def read_adapter(name: str, folder: str | Path, shapes: Mapping[str, tuple[int, int]],
                 max_rank: int = 0) -> LoraAdapter:
    """Read and check the adapter in ``folder`` against the modules an engine can adapt.

    ``shapes`` maps each adaptable module path to its (in_features,
    out_features). Raises :class:`~switchyard_spec.AdapterError` naming the
    adapter and the reason.
    """
    root = Path(folder).expanduser()
    config = read_config(name, root, max_rank)
    weights = _load(name, root)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in weights.items():
        inner = key.removeprefix(PREFIX)
        match = _KEY.fullmatch(inner)
        if match is None:
            raise AdapterError(f"adapter {name!r}: weight {key} is not a LoRA A/B matrix the "
                               "engine can apply (embedding adapters, biases and magnitudes "
                               "are not supported)")
        halves.setdefault(match["module"], {})[match["half"]] = tensor
    if not halves:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    _check_targets(name, config, shapes)
    modules: dict[str, LoraModule] = {}
    for module, pair in sorted(halves.items()):
        modules[module] = _module(name, config, module, pair, shapes, max_rank)
    return LoraAdapter(name=name, path=str(root), modules=modules, config=config)


def _load(name: str, root: Path) -> dict[str, torch.Tensor]:
    path = root / WEIGHTS_FILE
    if not path.is_file():
        other = " (adapter_model.bin, a pickle, is not read: save with safe_serialization)" \
            if (root / "adapter_model.bin").is_file() else ""
        raise AdapterError(f"adapter {name!r}: {root} has no {WEIGHTS_FILE}{other}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS_FILE} is corrupt ({exc})") from None


def _check_targets(name: str, config: AdapterConfig, shapes: Mapping[str, tuple[int, int]]
                   ) -> None:
    """Refuse listed target modules the engine cannot adapt (a regex is judged by the weights)."""
    if isinstance(config.target_modules, str):
        return
    leaves = {path.rsplit(".", 1)[-1] for path in shapes}
    for target in config.target_modules:
        if target == "all-linear":
            continue  # PEFT resolves it to the linears; the weights say which
        if target.rsplit(".", 1)[-1] not in leaves and not any(
                p == target or p.endswith("." + target) for p in shapes):
            raise AdapterError(f"adapter {name!r}: target module {target!r} cannot be adapted "
                               f"by this engine (it adapts {', '.join(sorted(leaves))})")


def _module(name: str, config: AdapterConfig, module: str, pair: dict[str, torch.Tensor],
            shapes: Mapping[str, tuple[int, int]], max_rank: int) -> LoraModule:
    if module not in shapes:
        raise AdapterError(f"adapter {name!r}: module {module} cannot be adapted by this engine")
    if set(pair) != {"A", "B"}:
        missing = "lora_B" if "A" in pair else "lora_A"
        raise AdapterError(f"adapter {name!r}: {module} has no {missing} weight (corrupt folder)")
    a, b = pair["A"], pair["B"]
    fan_in, fan_out = shapes[module]
    rank = int(a.shape[0]) if a.dim() == 2 else -1
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or tuple(b.shape) != (fan_out, rank):
        raise AdapterError(
            f"adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
            f"{tuple(b.shape)}, which do not fit its {fan_in} -> {fan_out} projection "
            "(an adapter for another base model?)")
    if rank != config.rank_of(module):
        raise AdapterError(f"adapter {name!r}: {module} has rank {rank} where its config says "
                           f"{config.rank_of(module)} (corrupt folder)")
    if max_rank and rank > max_rank:
        raise AdapterError(f"adapter {name!r}: rank {rank} of {module} is greater than "
                           f"max_lora_rank {max_rank}")
    a, b = a.float().contiguous(), b.float().contiguous()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise AdapterError(f"adapter {name!r}: {module} holds values that are not finite")
    return LoraModule(a=a, b=b, scaling=config.scaling(module, rank))
