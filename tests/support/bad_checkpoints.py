"""Model folders no engine may serve, built locally: their loading would invent weights.

- ``bert``: a small BERT encoder (``BertModel``, random weights from a fixed seed):
  transformers would load it as ``BertLMHeadModel``, a head of random weights;
- ``no-lm-head``: a copy of the random-weight Llama (untied embeddings) whose
  safetensors lack ``lm_head.weight``;
- ``truncated``: a copy whose ``model.safetensors`` is cut to half its bytes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

BAD_CHECKPOINTS = ("bert", "no-lm-head", "truncated")
EXPECTED = {
    "bert": "holds an encoder model (bert: BertModel)",
    "no-lm-head": "1 weight the checkpoint does not have (served, they would be newly "
                  "initialized: random): lm_head.weight",
    "truncated": "model.safetensors in",
}
"""A piece of each folder's refusal."""


def build_bad_checkpoint(kind: str, llama: Path, out: Path) -> Path:
    """Write the folder ``kind`` names into ``out`` (created); ``llama`` is the random model."""
    import torch
    from safetensors.torch import load_file, save_file

    if kind == "bert":
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        config = BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2,
                            num_attention_heads=2, intermediate_size=64,
                            max_position_embeddings=128)
        BertModel(config).save_pretrained(out)
        return out
    shutil.copytree(llama, out)
    weights = out / "model.safetensors"
    if kind == "no-lm-head":
        tensors = load_file(weights)
        del tensors["lm_head.weight"]
        save_file(tensors, weights, metadata={"format": "pt"})
    elif kind == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    else:
        raise ValueError(kind)
    return out
