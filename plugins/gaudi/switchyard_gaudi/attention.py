"""The attention function the engine plugs into transformers' models: static shapes only.

Transformers computes each layer's projections and rotary embeddings, then
calls :func:`static_attention` with the step's :class:`StepInputs` (passed
through the forward kwargs as ``gaudi_step``). It writes the new keys and
values into the :class:`~switchyard_gaudi.kv_cache.StaticKVCache` and attends:

- prefill, ``[P, S]`` tokens: row ``p``'s keys go to columns ``0 .. S - 1`` of
  cache row ``rows[p]``; attention is causal over the row's own S tokens.
  Prompts are right-padded, so a real token never sees padding (it lies
  after it), positions are exactly 0..n-1 as in an unpadded run, and the
  padding's keys are overwritten by the decode steps that follow;
- decode, ``[B, 1]`` tokens for cache rows ``0 .. B - 1``: row ``b`` writes its
  key at column ``positions[b]`` and attends over columns ``0 ..
  positions[b]`` of its row, a mask over the whole row keeping every shape
  independent of the sequences' lengths.

Sliding windows (Mistral, Qwen2) narrow both masks to the window.
Every value that changes from step to step is a tensor, so a captured graph
(``torch.compile``, HPU graphs) depends on the shape alone.

The name is registered with ``AttentionInterface`` only: because it is absent
from ``AttentionMaskInterface``, transformers builds no mask of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from switchyard_gaudi.device import Device
from switchyard_gaudi.kv_cache import StaticKVCache

ATTN_NAME = "switchyard_gaudi"
STEP_KWARG = "gaudi_step"


@dataclass
class StepInputs:
    """What one forward step's attention needs besides the layer's tensors."""

    cache: StaticKVCache
    device: Device
    prefill: bool
    rows: torch.Tensor | None = None
    """Prefill: the cache row of each batch row, [P] (padding rows: the scratch row)."""
    positions: torch.Tensor | None = None
    """Decode: the position of each row's fed token, [B]."""


def register() -> str:
    """Register :func:`static_attention` with transformers under ``ATTN_NAME``; idempotent."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, static_attention)
    return ATTN_NAME


def static_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention over the static cache, in transformers' calling convention.

    ``query`` is [batch, heads, q_len, head_dim], ``key``/``value`` [batch,
    kv_heads, q_len, head_dim] for the new tokens. Returns [batch, q_len,
    heads, head_dim].
    """
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, StepInputs):
        raise RuntimeError(f"{ATTN_NAME} attention needs {STEP_KWARG}= in the forward call")
    layer = int(module.layer_idx)
    window = sliding_window if sliding_window is not None and sliding_window > 0 else None
    keys, values = step.cache.keys[layer], step.cache.values[layer]
    key, value = key.to(keys.dtype), value.to(values.dtype)
    if step.prefill:
        assert step.rows is not None
        length = query.shape[2]
        keys[:, :, :length].index_copy_(0, step.rows, key)
        values[:, :, :length].index_copy_(0, step.rows, value)
        mask = None
        if window is not None and window < length:
            pos = torch.arange(length, device=query.device)
            mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
        out = step.device.attention(query, key.to(query.dtype), value.to(query.dtype), mask,
                                    causal=mask is None, scale=scaling, prefill=True)
    else:
        assert step.positions is not None
        rows = query.shape[0]
        row_keys, row_values = keys[:rows], values[:rows]
        at = step.positions.view(rows, 1, 1, 1).expand(rows, key.shape[1], 1, key.shape[3])
        row_keys.scatter_(2, at, key)
        row_values.scatter_(2, at, value)
        cols = torch.arange(row_keys.shape[2], device=query.device)[None, :]
        pos = step.positions[:, None]
        mask = cols <= pos
        if window is not None:
            mask = mask & (cols > pos - window)
        out = step.device.attention(query, row_keys.to(query.dtype), row_values.to(query.dtype),
                                    mask[:, None, None, :], causal=False, scale=scaling,
                                    prefill=False)
    return out.transpose(1, 2), None
