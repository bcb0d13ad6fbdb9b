"""What the gateway reads from a pooling model's folder: JSON only, no weights, no torch.

- whether the folder is a pooling model at all (`is_pooling_folder`): a
  sentence-transformers folder (`modules.json`), or a transformers folder whose
  architecture is `*ForSequenceClassification` (a cross-encoder), or a bare
  encoder (`BertModel`, `XLMRobertaModel`, ...);
- the text side of sentence-transformers' modules: `prompts` and
  `default_prompt_name`, whether a Normalize module ends the pipeline, the
  Transformer's `max_seq_length`;
- Matryoshka dimensions (`matryoshka_dimensions` or `is_matryoshka` in
  config.json, as vLLM reads them): the only models `dimensions` may shorten;
- a cross-encoder's activation (`sentence_transformers.activation_fn` in
  config.json; sigmoid for one label, as CrossEncoder and TEI apply it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENCODER_ARCHITECTURES = frozenset({
    "BertModel", "RobertaModel", "XLMRobertaModel", "DistilBertModel", "MPNetModel",
    "CamembertModel", "ElectraModel", "DebertaV2Model", "ModernBertModel", "NomicBertModel",
})
"""Architectures that only embed: served as pooling models without a modules.json."""
IDENTITY = "torch.nn.modules.linear.Identity"


@dataclass(frozen=True)
class PoolingFolder:
    """The text-side settings of a pooling model."""

    reranker: bool
    backbone: Path
    """The Transformer module's folder (its config.json, weights and tokenizer): the root,
    or a subfolder such as `0_Transformer` in older sentence-transformers folders."""
    normalize: bool = False
    """A Normalize module ends the pipeline: OpenAI's route returns unit vectors then."""
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    max_seq_length: int | None = None
    matryoshka_dimensions: tuple[int, ...] | None = None
    """Sizes `dimensions` may ask for; () means any size up to the full one; None: not a
    Matryoshka model."""
    activation: str = "sigmoid"
    """A reranker's score function: "sigmoid" or "identity"."""


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def is_pooling_folder(folder: Path) -> bool:
    """Whether `folder` holds an embedding or reranker model rather than a generation model."""
    if (folder / "modules.json").is_file():
        return True
    architectures = _json(folder / "config.json").get("architectures") or []
    return any(a.endswith("ForSequenceClassification") or a in ENCODER_ARCHITECTURES
               for a in architectures)


def read_pooling_folder(folder: Path) -> PoolingFolder:
    """The settings of the pooling model in `folder` (see the module docstring)."""
    modules = _json(folder / "modules.json") if (folder / "modules.json").is_file() else []
    backbone = _backbone(folder, modules)
    config = {**_json(backbone / "config.json"), **_json(folder / "config.json")}
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules]
    st_config = _json(folder / "config_sentence_transformers.json")
    matryoshka: tuple[int, ...] | None = None
    if config.get("matryoshka_dimensions"):
        matryoshka = tuple(int(d) for d in config["matryoshka_dimensions"])
    elif config.get("is_matryoshka"):
        matryoshka = ()
    activation = "sigmoid"
    fn = (config.get("sentence_transformers") or {}).get("activation_fn")
    if fn == IDENTITY:
        activation = "identity"
    return PoolingFolder(
        reranker=not modules and any(a.endswith("ForSequenceClassification")
                                     for a in config.get("architectures") or []),
        backbone=backbone,
        normalize="Normalize" in kinds,
        prompts={k: v for k, v in (st_config.get("prompts") or {}).items() if v},
        default_prompt_name=st_config.get("default_prompt_name"),
        max_seq_length=_max_seq_length(backbone, bool(modules)),
        matryoshka_dimensions=matryoshka,
        activation=activation,
    )


def _backbone(folder: Path, modules: list[dict[str, Any]]) -> Path:
    """The folder of the Transformer module (the root when there is none)."""
    return next((folder / m.get("path", "") for m in modules
                 if str(m.get("type", "")).endswith("Transformer")), folder)


def _max_seq_length(path: Path, st_folder: bool) -> int | None:
    """The Transformer module's limit: sentence_bert_config.json's `max_seq_length`, or
    (sentence-transformers 6) its tokenizer's `model_max_length`."""
    value = _json(path / "sentence_bert_config.json").get("max_seq_length")
    if value is None and st_folder:
        value = _json(path / "tokenizer_config.json").get("model_max_length")
    # Tokenizers without a limit store a huge sentinel (1e30).
    return int(value) if isinstance(value, int | float) and value < 1_000_000 else None
