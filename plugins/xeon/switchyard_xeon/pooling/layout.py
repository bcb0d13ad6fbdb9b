"""What a model folder says about pooling, read from its JSON files (no torch).

A sentence-transformers folder lists its modules in `modules.json`: the
backbone (a Transformer module at the folder root or in a subfolder), a
Pooling module (`1_Pooling/config.json`), optional Dense layers and a
Normalize. Both spellings of the pooling rule are read: sentence-transformers
6's `pooling_mode` (one name or a list) and the older `pooling_mode_*_tokens`
booleans. A folder without `modules.json` is a cross-encoder when its
architecture is `*ForSequenceClassification`, and otherwise an encoder
(mean pooling, sentence-transformers' default for a bare model) or a decoder
(last-token pooling, as decoder embedders do).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
ENCODER_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "camembert", "distilbert",
                           "mpnet", "electra", "deberta", "deberta-v2", "nomic_bert",
                           "modernbert", "new"})
"""Model types pooled like BERT when a bare folder names no pooling (others: last token)."""


class LayoutError(ValueError):
    """The folder's pooling description cannot be served (says what is wrong)."""


@dataclass(frozen=True)
class DenseLayer:
    """One sentence-transformers Dense module: a linear layer and its activation."""

    folder: Path
    in_features: int
    out_features: int
    bias: bool
    activation: str
    """The dotted name of a torch module class, e.g. "torch.nn.modules.activation.Tanh"."""


@dataclass(frozen=True)
class PoolingLayout:
    """How to turn the backbone's hidden states into the model's output."""

    backbone: Path
    """The folder of the transformers model (config.json and weights)."""
    reranker: bool
    modes: tuple[str, ...] = ("mean",)
    dense: tuple[DenseLayer, ...] = field(default=())


def read_layout(folder: Path) -> PoolingLayout:
    """The pooling layout of `folder`; `LayoutError` for a module this engine cannot run."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        config = _json(folder / "config.json")
        if any(a.endswith("ForSequenceClassification") for a in config.get("architectures", [])):
            return PoolingLayout(backbone=folder, reranker=True, modes=())
        mode = "mean" if config.get("model_type") in ENCODER_TYPES else "lasttoken"
        return PoolingLayout(backbone=folder, reranker=False, modes=(mode,))
    backbone: Path | None = None
    modes: tuple[str, ...] = ()
    dense: list[DenseLayer] = []
    for module in _json(modules_file):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = folder / module.get("path", "")
        if kind == "Transformer":
            backbone = path
        elif kind == "Pooling":
            modes = _pooling_modes(_json(path / "config.json"))
        elif kind == "Dense":
            cfg = _json(path / "config.json")
            dense.append(DenseLayer(folder=path, in_features=int(cfg["in_features"]),
                                    out_features=int(cfg["out_features"]),
                                    bias=bool(cfg.get("bias", True)),
                                    activation=str(cfg.get("activation_function",
                                                           "torch.nn.modules.linear.Identity"))))
        elif kind == "Normalize":
            pass  # the gateway normalizes (the TEI routes let a client turn it off)
        else:
            raise LayoutError(f"{modules_file}: module type {module.get('type')!r} is not "
                              "supported (Transformer, Pooling, Dense and Normalize are)")
    if backbone is None:
        raise LayoutError(f"{modules_file}: no Transformer module")
    if not modes:
        raise LayoutError(f"{modules_file}: no Pooling module")
    return PoolingLayout(backbone=backbone, reranker=False, modes=modes, dense=tuple(dense))


def _pooling_modes(config: dict) -> tuple[str, ...]:
    raw = config.get("pooling_mode")
    if raw is None:
        modes = tuple(mode for key, mode in _LEGACY_KEYS.items() if config.get(key))
    else:
        modes = (raw,) if isinstance(raw, str) else tuple(raw)
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown or not modes:
        raise LayoutError(f"pooling mode {unknown or modes!r} is not one of {POOLING_MODES}")
    if config.get("include_prompt", True) is False:
        raise LayoutError("Pooling with include_prompt=false is not supported")
    return modes


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LayoutError(f"{path} is missing") from None
    except (OSError, ValueError) as exc:
        raise LayoutError(f"{path} is not readable JSON: {exc}") from None
