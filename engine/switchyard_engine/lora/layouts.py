"""Which modules of a Llama-family model an adapter may target, and where they land.

The engine's decoder runs q|k|v and gate|up each as one fused matmul, so an
adapter's ``q_proj`` delta lands in the first ``heads * head_dim`` columns
of the fused output, ``k_proj``'s in the next ``kv_heads * head_dim``, and
so on. Phi-3 checkpoints ship ``qkv_proj`` and ``gate_up_proj`` fused
already; PEFT then adapts those as single modules.

Embeddings, ``lm_head`` and norms are not adaptable here: an adapter that
targets them is refused at load.
"""

from __future__ import annotations

from dataclasses import dataclass

from switchyard_engine.lora.grouped import Layout, Part

PROJECTIONS = ("qkv", "o", "gate_up", "down")
"""The projections a decoder layer runs, in order; each has a :data:`Layout`."""


@dataclass(frozen=True)
class ModelLayouts:
    """Every adaptable module's (in, out) size, and each projection's layout per layer."""

    shapes: dict[str, tuple[int, int]]
    layouts: dict[tuple[int, str], Layout]


def llama_family(config: object) -> ModelLayouts:
    """The layouts of a Llama, Mistral, Qwen2 or Phi-3 model, from its transformers config."""
    hidden = int(config.hidden_size)  # type: ignore[attr-defined]
    heads = int(config.num_attention_heads)  # type: ignore[attr-defined]
    kv = int(getattr(config, "num_key_value_heads", None) or heads)
    dim = int(getattr(config, "head_dim", None) or hidden // heads)
    inner = int(config.intermediate_size)  # type: ignore[attr-defined]
    fused = getattr(config, "model_type", "") == "phi3"
    q, k = heads * dim, kv * dim
    shapes: dict[str, tuple[int, int]] = {}
    layouts: dict[tuple[int, str], Layout] = {}
    for i in range(int(config.num_hidden_layers)):  # type: ignore[attr-defined]
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        if fused:
            qkv_parts = ((f"{attn}.qkv_proj", 0, q + 2 * k),)
            gate_up_parts = ((f"{mlp}.gate_up_proj", 0, 2 * inner),)
        else:
            qkv_parts = ((f"{attn}.q_proj", 0, q), (f"{attn}.k_proj", q, q + k),
                         (f"{attn}.v_proj", q + k, q + 2 * k))
            gate_up_parts = ((f"{mlp}.gate_proj", 0, inner), (f"{mlp}.up_proj", inner, 2 * inner))
        parts = {
            "qkv": (hidden, qkv_parts),
            "o": (q, ((f"{attn}.o_proj", 0, hidden),)),
            "gate_up": (hidden, gate_up_parts),
            "down": (inner, ((f"{mlp}.down_proj", 0, hidden),)),
        }
        for projection, (fan_in, items) in parts.items():
            layouts[(i, projection)] = tuple(Part(m, s, e) for m, s, e in items)
            for module, start, end in items:
                shapes[module] = (fan_in, end - start)
    return ModelLayouts(shapes=shapes, layouts=layouts)
