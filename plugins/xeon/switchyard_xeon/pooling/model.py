"""One padded forward of a batch through a pooling model, and the pooling after it.

The backbone is transformers' own model class for the folder (`AutoModel`, or
`AutoModelForSequenceClassification` for a cross-encoder), so every
architecture transformers knows is served, in eager mode with its SDPA
attention; pooling and the Dense layers run in float32 whatever the backbone's
dtype, so a bf16 backbone loses precision only inside the transformer.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from pathlib import Path

import torch
from switchyard_spec import EngineStartError, PoolingRequest

from switchyard_xeon.pooling.layout import DenseLayer, PoolingLayout

ROBERTA_LIKE = frozenset({"roberta", "xlm-roberta", "camembert"})
"""Models whose position ids start after the padding id (their usable length is shorter)."""


class PooledModel:
    """A loaded pooling model: `forward` maps a batch of requests to float32 outputs."""

    def __init__(self, layout: PoolingLayout, dtype: torch.dtype, pack: bool = True) -> None:
        from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

        self.layout = layout
        self.dtype = dtype
        config = AutoConfig.from_pretrained(layout.backbone)
        loader = AutoModelForSequenceClassification if layout.reranker else AutoModel
        try:
            self.backbone = loader.from_pretrained(layout.backbone, dtype=dtype).eval()
        except (OSError, ValueError, KeyError) as exc:
            raise EngineStartError(f"{layout.backbone}: cannot load a pooling model: "
                                   f"{exc}") from exc
        if layout.reranker and getattr(config, "num_labels", 1) != 1:
            raise EngineStartError(f"{layout.backbone}: a reranker has one label, this "
                                   f"classifier has {config.num_labels}")
        self.config = config
        self.packing = "stock"
        if pack:
            # The generation engine's oneDNN-packed linears: measured on a MiniLM-shaped
            # BERT, 64 x 128 tokens, 2-core Xeon with AMX: 66 against 40 sentences/s in
            # bf16, 19 against 17 in fp32 (every matmul skips the weight reorder).
            from switchyard_xeon.linears import pack_linears

            report = pack_linears(self.backbone, fuse=False)
            self.packing = report.layout if not report.reason else f"stock ({report.reason})"
        self.model_type = str(config.model_type)
        # Padding takes the model's own id: RoBERTa's position ids count the non-padding.
        pad = getattr(config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        self.takes_token_types = "token_type_ids" in inspect.signature(
            self.backbone.forward).parameters
        self.dense = [_dense(layer) for layer in layout.dense]
        self.hidden_size = int(config.hidden_size)
        pooled = self.hidden_size * max(1, len(layout.modes))
        self.dimensions = 1 if layout.reranker else (
            layout.dense[-1].out_features if layout.dense else pooled)
        positions = int(getattr(config, "max_position_embeddings", 512))
        if self.model_type in ROBERTA_LIKE:
            positions -= self.pad_id + 1
        self.max_positions = positions

    @torch.inference_mode()
    def forward(self, batch: Sequence[PoolingRequest]) -> list[torch.Tensor]:
        """One float32 tensor per request: pooled vector, score of shape (1,), or per token."""
        lengths = [len(r.token_ids) for r in batch]
        width = max(lengths)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        types = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, request in enumerate(batch):
            n = lengths[row]
            ids[row, :n] = torch.tensor(request.token_ids, dtype=torch.long)
            if request.token_type_ids:
                types[row, :n] = torch.tensor(request.token_type_ids, dtype=torch.long)
            mask[row, :n] = 1
        inputs = {"input_ids": ids, "attention_mask": mask}
        if self.takes_token_types:
            inputs["token_type_ids"] = types
        out = self.backbone(**inputs)
        if self.layout.reranker:
            return list(out.logits[:, :1].float())
        hidden = out.last_hidden_state.float()
        results: list[torch.Tensor | None] = [None] * len(batch)
        pooled_rows = [i for i, r in enumerate(batch) if not r.all_tokens]
        for i, request in enumerate(batch):
            if request.all_tokens:
                results[i] = hidden[i, :lengths[i]]
        if pooled_rows:
            index = torch.tensor(pooled_rows)
            vectors = self._pool(hidden[index], mask[index])
            for layer in self.dense:
                vectors = layer(vectors)
            for k, i in enumerate(pooled_rows):
                results[i] = vectors[k]
        return [r for r in results if r is not None]

    def _pool(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """sentence-transformers' Pooling module on right-padded rows, modes concatenated."""
        m = mask.unsqueeze(-1).to(hidden.dtype)
        counts = m.sum(dim=1).clamp(min=1e-9)
        parts = []
        for mode in self.layout.modes:
            if mode == "cls":
                parts.append(hidden[:, 0])
            elif mode == "lasttoken":
                last = mask.sum(dim=1) - 1
                parts.append(hidden[torch.arange(hidden.shape[0]), last])
            elif mode == "max":
                parts.append(hidden.masked_fill(m == 0, -1e9).max(dim=1).values)
            elif mode in ("mean", "mean_sqrt_len_tokens"):
                total = (hidden * m).sum(dim=1)
                parts.append(total / (counts.sqrt() if mode == "mean_sqrt_len_tokens"
                                      else counts))
            elif mode == "weightedmean":
                weights = torch.cumsum(mask, dim=1).to(hidden.dtype).unsqueeze(-1) * m
                parts.append((hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9))
        return torch.cat(parts, dim=-1)


def _dense(layer: DenseLayer) -> torch.nn.Module:
    """A Dense module's linear layer and activation, in float32."""
    linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias)
    linear.load_state_dict(_state(layer.folder), strict=True)
    module_name, _, class_name = layer.activation.rpartition(".")
    try:
        activation = getattr(importlib.import_module(module_name), class_name)()
    except (ImportError, AttributeError) as exc:
        raise EngineStartError(f"{layer.folder}: unknown activation {layer.activation!r}") \
            from exc
    return torch.nn.Sequential(linear, activation).float().eval()


def _state(folder: Path) -> dict[str, torch.Tensor]:
    """The Dense weights under their linear layer's own names (`weight`, `bias`)."""
    if (folder / "model.safetensors").is_file():
        from safetensors.torch import load_file

        raw = load_file(folder / "model.safetensors")
    elif (folder / "pytorch_model.bin").is_file():
        raw = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise EngineStartError(f"{folder}: no Dense weights (model.safetensors)")
    return {key.removeprefix("linear."): value.float() for key, value in raw.items()}


def padded_tokens(lengths: Sequence[int]) -> int:
    """What a batch of these lengths costs padded to its longest row."""
    return max(lengths) * len(lengths) if lengths else 0


__all__ = ["PooledModel", "padded_tokens"]
