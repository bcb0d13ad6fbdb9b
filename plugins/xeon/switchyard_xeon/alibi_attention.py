"""ALiBi models (Bloom, MPT, Falcon with ``alibi=True``) on the paged path.

These classes do not call transformers' attention interface: each attention
module builds its scores itself, with an ALiBi bias tensor and a mask the
model rebuilds every forward. :func:`install` replaces the ``forward`` of
each attention module with one that makes the same q/k/v projections (the
module's own fused linear, split in the family's layout), stores the new
keys/values in the engine's paged cache and calls
:func:`~switchyard_xeon.attention.attend_packed` with the model's slopes,
then applies the module's output projection (and, for Bloom, the residual
add its attention module does itself). :class:`AlibiForward` then runs the
model as transformers does (embeddings, the model's own blocks, final norm,
``lm_head`` on the kept rows only) but without building the alibi tensor,
the causal mask or Falcon's rotary tables, none of which the paged
attention reads. The blocks do not pass extra keyword arguments to their
attention, so the step's metadata reaches the replaced modules through a
slot the forward fills before each pass.

The bias of the key at position ``j`` for the query at ``i`` is taken as
``slope * (j - i)`` (the kernels compute ``j - i`` as an exact integer); the
models' own tensors use ``slope * j`` (Bloom, Falcon) or ``slope * (j -
newest)`` (MPT), which differ from it by a constant per query row, and
softmax ignores that constant.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from switchyard_xeon.attention import StepMetadata, attend_packed

FAMILIES = ("BloomForCausalLM", "MptForCausalLM", "FalconForCausalLM")
"""The ALiBi architectures :func:`install` knows."""

_MARK = "_switchyard_alibi"


def unsupported(model_class: type, config: object) -> str | None:
    """Whether ``model_class`` with ``config`` can take the paged path through this module.

    None: not an ALiBi model this module knows (the caller decides); '': it
    can; otherwise why not, for the start-up log (the model takes the fallback).
    """
    name = model_class.__name__
    if name not in FAMILIES:
        return None
    if name == "FalconForCausalLM" and not getattr(config, "alibi", False):
        return None  # rotary Falcon: not an ALiBi model
    if name == "BloomForCausalLM" and getattr(config, "slow_but_exact", False) and \
            getattr(config, "pretraining_tp", 1) > 1:
        return (f"{name} with slow_but_exact and pretraining_tp > 1 sums its output "
                "projection in slices, which the engine's ALiBi attention does not")
    if name == "MptForCausalLM":
        attn = getattr(config, "attn_config", None)
        if getattr(attn, "attn_type", "multihead_attention") != "multihead_attention":
            return f"{name} with attn_type={attn.attn_type} is not multi-head attention"
    return ""


def installed(model: torch.nn.Module) -> bool:
    """Whether :func:`install` replaced ``model``'s attention."""
    return bool(getattr(model, _MARK, False))


def alibi_slopes(model: torch.nn.Module) -> torch.Tensor:
    """The model's per-head ALiBi slopes as the paged kernels take them (fp32 [heads], contiguous).

    Taken from transformers' own functions, so they are the model's exactly;
    Falcon's fold in the ``1/sqrt(head_dim)`` its attention applies to the
    bias (it scales ``q·k + alibi`` together) and the bf16 rounding its
    ``build_alibi_tensor`` applies to the slopes.
    """
    name = type(model).__name__
    config = model.config
    if name == "BloomForCausalLM":
        from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

        return _get_alibi_slopes(config.n_head, torch.device("cpu")).float().contiguous()
    if name == "MptForCausalLM":
        # The model's own tensor (MptModel.forward calls it with its default
        # alibi_bias_max) over two positions: arange(-1, 1) * slope, so column 0
        # is -slope.
        bias = model.transformer.build_mpt_alibi_tensor(config.n_heads, 2, device="cpu")
        return (-bias[:, 0, 0]).float().contiguous()
    if name == "FalconForCausalLM":
        from transformers.models.falcon.modeling_falcon import build_alibi_tensor

        heads = config.num_attention_heads
        # Position 1 of a two-token mask holds bf16(slope) * 1, as the model rounds it.
        bias = build_alibi_tensor(torch.ones(1, 2, dtype=torch.long), heads, torch.float32)
        head_dim = config.hidden_size // heads
        return (bias[:, 0, 1] / math.sqrt(head_dim)).float().contiguous()
    raise ValueError(f"{name} is not one of {', '.join(FAMILIES)}")


@dataclass
class _Slot:
    """The running step's metadata, shared by a model's replaced attention modules."""

    step: StepMetadata | None = None

    def get(self) -> StepMetadata:
        if self.step is None:
            raise RuntimeError("ALiBi attention called outside AlibiForward (no step metadata)")
        return self.step


def _attend(module: torch.nn.Module, slot: _Slot, slopes: torch.Tensor, q: torch.Tensor,
            k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Store the step's keys/values, attend; q [T, H, D], k/v [T, KVH, D] -> [1, T, H * D]."""
    step = slot.get()
    layer = int(module.layer_idx)
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    step.cache.write(layer, step.slots, kh, vh)
    out = attend_packed(layer, qh, kh, vh, step, scale, None, alibi_slopes=slopes)
    return out.reshape(1, q.shape[0], -1)


def _bloom(slot: _Slot, slopes: torch.Tensor) -> Callable[..., tuple[torch.Tensor, None]]:
    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, residual: torch.Tensor,
                *args: object, **kwargs: object) -> tuple[torch.Tensor, None]:
        tokens = hidden_states.shape[1]
        # Bloom's fused layout: per head, its query, key and value rows in turn.
        qkv = self.query_key_value(hidden_states).view(tokens, self.num_heads, 3, self.head_dim)
        out = _attend(self, slot, slopes, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2],
                      self.inv_norm_factor)
        # The module's own residual add (dropout_add outside training).
        return self.dense(out.to(hidden_states.dtype)) + residual, None

    return forward


def _mpt(slot: _Slot, slopes: torch.Tensor) -> Callable[..., tuple[torch.Tensor, None]]:
    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: object,
                **kwargs: object) -> tuple[torch.Tensor, None]:
        tokens = hidden_states.shape[1]
        qkv = self.Wqkv(hidden_states)
        if self.clip_qkv:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        # Queries, keys, values one after another, each [heads, head_dim] per token.
        qkv = qkv.view(tokens, 3, self.n_heads, self.head_dim)
        out = _attend(self, slot, slopes, qkv[:, 0], qkv[:, 1], qkv[:, 2], self.softmax_scale)
        return self.out_proj(out.to(hidden_states.dtype)), None

    return forward


def _falcon(slot: _Slot, slopes: torch.Tensor) -> Callable[..., tuple[torch.Tensor, None]]:
    def forward(self: torch.nn.Module, hidden_states: torch.Tensor, *args: object,
                **kwargs: object) -> tuple[torch.Tensor, None]:
        tokens = hidden_states.shape[1]
        heads, dim = self.num_heads, self.head_dim
        fused = self.query_key_value(hidden_states)
        if self.new_decoder_architecture:
            # Per KV head: its group's queries, then its key, then its value. Query head h
            # shares KV head h // group, which is how the kernels pair GQA heads.
            qkv = fused.view(tokens, self.num_kv_heads, heads // self.num_kv_heads + 2, dim)
            q, k, v = qkv[:, :, :-2].reshape(tokens, heads, dim), qkv[:, :, -2], qkv[:, :, -1]
        elif not self.multi_query:
            qkv = fused.view(tokens, heads, 3, dim)  # Bloom's layout
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        else:  # every query head, then the one key and value head
            qkv = fused.view(tokens, heads + 2, dim)
            q, k, v = qkv[:, :heads], qkv[:, heads : heads + 1], qkv[:, heads + 1 :]
        out = _attend(self, slot, slopes, q, k, v, self.inv_norm_factor)
        return self.dense(out.to(hidden_states.dtype)), None

    return forward


_ATTENTION = {
    "BloomForCausalLM": ("self_attention", _bloom),
    "MptForCausalLM": ("attn", _mpt),
    "FalconForCausalLM": ("self_attention", _falcon),
}


def kv_heads(model: torch.nn.Module) -> int:
    """How many key/value heads the replaced attention stores per layer."""
    name, config = type(model).__name__, model.config
    if name == "FalconForCausalLM":
        if config.new_decoder_architecture:
            return int(config.num_kv_heads)
        return 1 if config.multi_query else int(config.num_attention_heads)
    return int(config.num_attention_heads)


class AlibiForward:
    """A :class:`~switchyard_xeon.decoder.PackedForward` for a model :func:`install` adapted."""

    def __init__(self, model: torch.nn.Module, slot: _Slot) -> None:
        self.model = model
        self._slot = slot
        name = type(model).__name__
        body = model.transformer
        self._embed: Callable[[torch.Tensor], torch.Tensor]
        if name == "BloomForCausalLM":
            self._embed = lambda ids: body.word_embeddings_layernorm(body.word_embeddings(ids))
            self._blocks, self._norm = body.h, body.ln_f
        elif name == "MptForCausalLM":
            self._embed, self._blocks, self._norm = body.wte, body.blocks, body.norm_f
        else:
            self._embed, self._blocks, self._norm = body.word_embeddings, body.h, body.ln_f

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor,
                 step: StepMetadata) -> torch.Tensor:
        """See :class:`~switchyard_xeon.decoder.PackedForward`."""
        self._slot.step = step
        try:
            hidden = self._embed(ids.unsqueeze(0))
            for block in self._blocks:
                # No alibi tensor and no mask: the replaced attention needs neither.
                hidden = block(hidden, None, None)[0]
            hidden = self._norm(hidden[:, keep])
            return self.model.lm_head(hidden)[0]
        finally:
            self._slot.step = None


def install(model: torch.nn.Module) -> AlibiForward:
    """Replace the attention of an ALiBi ``model`` (one :data:`FAMILIES`) for the paged path.

    Returns the forward pass that runs it. Raises ValueError for a model that
    :func:`unsupported` does not accept.
    """
    name = type(model).__name__
    why = unsupported(type(model), model.config)
    if why is None or why:
        raise ValueError(why or f"{name} is not an ALiBi model of {', '.join(FAMILIES)}")
    attr, make = _ATTENTION[name]
    slot = _Slot()
    forward = make(slot, alibi_slopes(model))
    for block in AlibiForward(model, slot)._blocks:
        module = getattr(block, attr)
        module.forward = types.MethodType(forward, module)
    setattr(model, _MARK, True)
    return AlibiForward(model, slot)
