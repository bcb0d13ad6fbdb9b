"""The engine's two forward passes over a packed batch: transformers' own, and a hand-written one.

Both are a :class:`PackedForward`: token ids and positions of the step's
packed row in, logits at the kept positions out. :class:`TransformersForward`
calls the model as transformers defines it (the engine's attention plugged in
through the attention interface): any architecture the engine accepts runs
there. :class:`LlamaFamilyDecoder` runs the same weights for Llama, Mistral,
Qwen2 and Phi-3 with the per-layer plumbing written out: per layer and step,
nine calls (norm, q|k|v, rotary + cache store, attention, o_proj, norm,
gate|up, SiLU·up, down) instead of ~140 small ops and transformers' module
machinery. At one token per step that plumbing, not arithmetic, is what a
step is made of beside the weight stream.

Transformers stays the source of the weights (its modules, packed or not, are
called as they are) and of the rotary frequencies (its rotary module handles
every rope scaling), so the decoder only re-states the layer's data flow.
:func:`decoder_unsupported` says why a model cannot take it; the engine then
uses :class:`TransformersForward`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from switchyard_xeon.attention import STEP_KWARG, DecodeRows, StepMetadata, attend_packed
from switchyard_xeon.kernels import FusedOps, NativeFusedOps
from switchyard_xeon.linears import PanelLinear, fused_module
from switchyard_xeon.native_lora import NativeLora

FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Phi3ForCausalLM")
"""Architectures whose layers the hand-written decoder reproduces exactly."""


class PackedForward(Protocol):
    """One forward pass over a packed batch."""

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                 step: StepMetadata) -> torch.Tensor:
        """Logits [len(keep), vocab] at packed positions ``keep``.

        ``ids`` and ``positions`` are int64 [T]; ``step`` says where every token
        lives in the paged cache (the pass stores the new keys and values there).
        """
        ...


class TransformersForward:
    """The model's own ``forward``, with the engine's attention and only kept rows projected."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                 step: StepMetadata) -> torch.Tensor:
        """See :class:`PackedForward`."""
        out = self.model(
            input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False,
            # Only the kept positions reach lm_head: no [T, vocab] logits for plain requests.
            logits_to_keep=keep, **{STEP_KWARG: step},
        )
        return out.logits[0]


Matmul = Callable[[torch.Tensor], torch.Tensor]
"""A linear layer applied to contiguous [tokens, in] rows."""


def _matmul(module: torch.nn.Module) -> Matmul:
    """The cheapest way to call ``module`` on 2-D rows: the op itself for panel linears.

    At one token per step the 121 linears' module plumbing (``__call__``,
    reshapes) is a few percent of the step.
    """
    return module.rows if isinstance(module, PanelLinear) else module


@dataclass(frozen=True)
class _NativeLayers:
    """The per-layer arguments of ``switchyard_xeon::decode_layers``, gathered once."""

    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    scalings: list[float]
    windows: list[int]
    eps: list[float]
    inner: int
    """The MLP's intermediate size (every layer's)."""


@dataclass(frozen=True)
class _Layer:
    """What one decoder layer needs, taken from transformers' modules."""

    index: int
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    qkv: Matmul
    o_proj: Matmul
    gate_up: Matmul
    down: Matmul
    scaling: float
    window: int | None

    @property
    def kernel_window(self) -> int:
        """The window as the paged decode kernel takes it: 0 for none."""
        return self.window if self.window is not None and self.window > 0 else 0


def decoder_unsupported(model: torch.nn.Module) -> str:
    """'' when :class:`LlamaFamilyDecoder` can run ``model``, else why not.

    Needs one of :data:`FAMILIES`, SiLU-gated MLPs, RMSNorms of the family's
    plain kind, and q|k|v and gate|up each as one module (checkpoints such as
    Phi-3's ship them fused; :func:`~switchyard_xeon.linears.pack_linears`
    fuses the others).
    """
    name = type(model).__name__
    if name not in FAMILIES:
        return f"{name} is not one of {', '.join(FAMILIES)}"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if _qkv(attn) is None or _gate_up(mlp) is None:
            return "projections are not fused"
        act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)  # Phi-3's name
        if type(act).__name__ not in ("SiLU", "SiLUActivation"):
            return f"activation {type(act).__name__} is not SiLU"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not type(norm).__name__.endswith("RMSNorm") or not hasattr(norm, "variance_epsilon"):
                return f"{type(norm).__name__} is not the family's RMSNorm"
    return ""


def _qkv(attn: torch.nn.Module) -> torch.nn.Module | None:
    return getattr(attn, "qkv_proj", None) or fused_module(attn, ("q_proj", "k_proj", "v_proj"))


def _gate_up(mlp: torch.nn.Module) -> torch.nn.Module | None:
    return getattr(mlp, "gate_up_proj", None) or fused_module(mlp, ("gate_proj", "up_proj"))


class LlamaFamilyDecoder:
    """A Llama-family forward written out over fused ops; see the module docstring.

    Call :func:`decoder_unsupported` first: the constructor assumes the model passed.
    Steps of decode rows only run every layer in one native call
    (``kernels/decode_layers.cpp``) where the fused ops are native and every
    projection is a :class:`~switchyard_xeon.linears.PanelLinear`, unless
    ``native_loop`` is False; other steps, and other set-ups, loop in Python.
    """

    def __init__(self, model: torch.nn.Module, ops: FusedOps, native_loop: bool = True) -> None:
        config = model.config
        self.ops = ops
        self.embed = model.model.embed_tokens
        self.rotary = model.model.rotary_emb
        self.final_norm = model.model.norm.weight
        self.final_eps = float(model.model.norm.variance_epsilon)
        self.lm_head = _matmul(model.lm_head)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.layers: list[_Layer] = []
        for index, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            # Qwen2 sets a window per layer; Mistral and Phi-3 read the config's.
            window = getattr(attn, "sliding_window", getattr(config, "sliding_window", None))
            self.layers.append(_Layer(
                index=index,
                input_norm=layer.input_layernorm.weight,
                post_norm=layer.post_attention_layernorm.weight,
                eps=float(layer.input_layernorm.variance_epsilon),
                qkv=_matmul(_qkv(attn)),  # type: ignore[arg-type]
                o_proj=_matmul(attn.o_proj),
                gate_up=_matmul(_gate_up(layer.mlp)),  # type: ignore[arg-type]
                down=_matmul(layer.mlp.down_proj),
                scaling=float(attn.scaling),
                window=window,
            ))
        self.head_dim = int(model.model.layers[0].self_attn.head_dim)
        # The one-call layer loop's arguments; None where it cannot run.
        self.native = _native_layers(model, self.layers, ops) if native_loop else None

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                 step: StepMetadata) -> torch.Tensor:
        """See :class:`PackedForward`."""
        ops = self.ops
        tokens = ids.shape[0]
        residual = self.embed(ids)
        cos, sin = self.rotary(residual.unsqueeze(0), positions.unsqueeze(0))
        cos, sin = cos[0].contiguous(), sin[0].contiguous()
        h = ops.rms_norm(residual, self.layers[0].input_norm, self.layers[0].eps)
        # A step of decode rows only (the steady state) needs no per-sequence
        # routing: the paged kernel takes every query at once.
        decode = step.decode if step.decode is not None and step.decode.rows is None else None
        native, lora = self.native, step.lora
        # Adapter rows stay on the one-call loop when their deltas are native ones.
        if decode is not None and native is not None and (
                lora is None or isinstance(lora, NativeLora)):
            args = (residual, h, cos, sin, step.slots, decode.tables, decode.lens,
                    native.weights, native.biases, step.cache.keys, step.cache.values,
                    native.scalings, native.windows, native.eps, self.heads, self.kv_heads,
                    native.inner)
            if lora is None:
                h = torch.ops.switchyard_xeon.decode_layers.default(*args)
            else:
                h = torch.ops.switchyard_xeon.decode_layers_lora.default(
                    *args, lora.rows, lora.starts, lora.weights, lora.tables)
        else:
            h = self._layers(h, residual, cos, sin, step, decode)
        # Only the kept rows need the final norm and the vocabulary projection.
        if tokens == keep.shape[0]:  # every row is kept (a decode step): no gathers
            return self.lm_head(ops.rms_norm(residual.add_(h), self.final_norm, self.final_eps))
        last = (residual.index_select(0, keep) + h.index_select(0, keep)).contiguous()
        return self.lm_head(ops.rms_norm(last, self.final_norm, self.final_eps))

    def _layers(self, h: torch.Tensor, residual: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, step: StepMetadata, decode: DecodeRows | None) -> torch.Tensor:
        """The layer loop in Python; ``decode`` is set when every row decodes."""
        ops, heads, kv_heads, dim = self.ops, self.heads, self.kv_heads, self.head_dim
        tokens = h.shape[0]
        q_end, k_end = heads * dim, (heads + kv_heads) * dim
        keys, values = step.cache.keys, step.cache.values
        blocks = row_blocks(tokens)  # [None] (all rows at once) for all but big steps
        lora = step.lora  # each row's adapter delta, added right after each projection
        for i, layer in enumerate(self.layers):
            # Up to attention, row block by row block (see ROW_BLOCK).
            parts = []
            for rows in blocks:
                h_rows = _rows(h, rows)
                if i:
                    ops.add_rms_norm_(h_rows, _rows(residual, rows), layer.input_norm, layer.eps)
                qkv_rows = layer.qkv(h_rows)
                if lora is not None:  # before rotary: the adapter changes q and k too
                    lora.add_(i, "qkv", h_rows, qkv_rows, rows)
                ops.rotary_store_(qkv_rows, _rows(cos, rows), _rows(sin, rows), keys[i],
                                  values[i], _rows(step.slots, rows), heads, kv_heads)
                parts.append(qkv_rows)
            qkv = parts[0] if len(parts) == 1 else torch.cat(parts)
            if decode is not None:  # the kernel reads the queries in place
                attended = decode.kernel(qkv[:, :q_end].view(tokens, heads, dim), keys[i],
                                         values[i], decode.tables, decode.lens, layer.scaling,
                                         layer.kernel_window)
            else:
                q = qkv[:, :q_end].view(tokens, heads, dim).transpose(0, 1)
                k = qkv[:, q_end:k_end].view(tokens, kv_heads, dim).transpose(0, 1)
                v = qkv[:, k_end:].view(tokens, kv_heads, dim).transpose(0, 1)
                attended = attend_packed(i, q, k, v, step, layer.scaling, layer.window)
            attended = attended.reshape(tokens, q_end)
            # From attention's output to the MLP's, row block by row block.
            parts = []
            for rows in blocks:
                a_rows = _rows(attended, rows).contiguous()
                h_rows = layer.o_proj(a_rows)
                if lora is not None:
                    lora.add_(i, "o", a_rows, h_rows, rows)
                ops.add_rms_norm_(h_rows, _rows(residual, rows), layer.post_norm, layer.eps)
                if lora is None:
                    parts.append(layer.down(ops.silu_and_mul(layer.gate_up(h_rows))))
                    continue
                gate_up = layer.gate_up(h_rows)
                lora.add_(i, "gate_up", h_rows, gate_up, rows)
                act = ops.silu_and_mul(gate_up)
                down = layer.down(act)
                lora.add_(i, "down", act, down, rows)
                parts.append(down)
            h = parts[0] if len(parts) == 1 else torch.cat(parts)
        return h


ROW_BLOCK = 1024
"""Rows per pass of a layer's row-wise work (norms, projections, MLP) in big steps.

A 4,096-token prefill step run whole writes [4096, 2 * intermediate] fp32
activations (50 MB for the 135M shape), past the L3 cache: its gate|up matmul
ran at 95-130 GFLOP/s where 1,024-row calls ran at ~160, and the whole step
took 10.2-10.5 s where blocks of 512-2048 rows took 8.3-8.9 s (2-core EPYC,
32 prompts of 128 tokens). Attention still sees every row at once.
"""


def row_blocks(tokens: int, block: int | None = None) -> list[slice | None]:
    """``[0, tokens)`` as consecutive slices of at most ``block`` rows, nearly equal.

    ``block`` defaults to :data:`ROW_BLOCK`; ``[None]`` stands for all rows at
    once (no slicing at all) when they fit one block.
    """
    block = block or ROW_BLOCK
    if tokens <= block:
        return [None]
    count = -(-tokens // block)
    size = -(-tokens // count)
    return [slice(start, min(start + size, tokens)) for start in range(0, tokens, size)]


def _rows(tensor: torch.Tensor, rows: slice | None) -> torch.Tensor:
    """``tensor``'s rows ``rows`` (a view), or ``tensor`` itself for None."""
    return tensor if rows is None else tensor[rows]


def _native_layers(model: torch.nn.Module, layers: list[_Layer],
                   ops: FusedOps) -> _NativeLayers | None:
    """The one-call layer loop's arguments, when every piece it chains is native.

    It needs the native fused ops and every projection on the panel kernel
    (fp32 activations), and one MLP width for every layer (passed to the
    native loop, since quantized panels do not record it exactly); otherwise
    the decoder stays on its Python loop.
    """
    if not isinstance(ops, NativeFusedOps):
        return None
    weights: list[torch.Tensor] = []
    biases: list[torch.Tensor | None] = []
    inners: set[int] = set()
    for spec, layer in zip(layers, model.model.layers, strict=True):
        linears = (_qkv(layer.self_attn), layer.self_attn.o_proj, _gate_up(layer.mlp),
                   layer.mlp.down_proj)
        if not all(isinstance(m, PanelLinear) for m in linears):
            return None
        inners.add(layer.mlp.down_proj.in_features)
        weights += [spec.input_norm, spec.post_norm]
        weights += [m.packed_weight for m in linears]  # type: ignore[union-attr]
        biases += [m.bias for m in linears]  # type: ignore[union-attr]
    if len(inners) != 1:
        return None
    return _NativeLayers(weights=weights, biases=biases,
                         scalings=[spec.scaling for spec in layers],
                         windows=[spec.kernel_window for spec in layers],
                         eps=[spec.eps for spec in layers], inner=inners.pop())
