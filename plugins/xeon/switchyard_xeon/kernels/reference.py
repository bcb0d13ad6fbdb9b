"""Portable paged attention (decode and prefill): the native kernels' contracts, in PyTorch.

The engine's fallback when no kernel could be built, and the reference the
kernel is checked against. Decode rows of the step are handled in one call:
one gather of every row's blocks (tables padded to the longest), then one
SDPA with a key mask, the query heads of a GQA group folded into the query
axis so each K/V head is shared without a copy. Soft-capped (Gemma 2) or
ALiBi (Bloom, MPT, Falcon) attention takes :func:`biased_attention`, which
writes the scores out, since SDPA can neither cap nor bias per head cheaply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def biased_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    distance: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention with the scores written out: ``q`` [..., H, n, D] over ``k``/``v`` [..., KVH, L, D].

    Scores are ``q·k * scale``, then soft-capped (``softcap`` > 0:
    ``softcap * tanh(s / softcap)``), then biased by ``alibi_slopes[h] *
    distance`` (fp32 [H]; ``distance`` [n, L] or broadcastable, key position
    minus query position), then masked (``mask`` bool, True where a key is
    seen) and softmaxed, all in fp32. The query heads of a group share their
    K/V head (GQA). Returns [..., H, n, D] in ``q``'s dtype.
    """
    heads, kv_heads = q.shape[-3], k.shape[-3]
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=-3)
        v = v.repeat_interleave(heads // kv_heads, dim=-3)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_slopes.float()[:, None, None] * distance.float()
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v.float()).to(q.dtype)


def paged_decode_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention: ``q`` [B, H, D] over the first ``context_lens[b]`` cached tokens.

    ``k_pool``/``v_pool`` are [kv_heads, num_blocks, block_size, D];
    ``block_tables`` [B, n] lists each row's blocks (padding entries are never
    read past its length). With ``window`` > 0 only the last ``window`` keys
    count; ``softcap`` and ``alibi_slopes`` as :func:`biased_attention` takes
    them (the query sits at position ``context_lens[b] - 1``). Returns [B, H,
    D] in ``q``'s dtype.
    """
    batch, heads, dim = q.shape
    kv_heads, _, block_size, _ = k_pool.shape
    tables = block_tables.long()
    width = tables.shape[1]
    length = width * block_size
    flat = tables.reshape(-1)
    # [kv_heads, B * width, block, D] -> [B, kv_heads, width * block, D]
    keys = k_pool.index_select(1, flat).view(kv_heads, batch, length, dim).transpose(0, 1)
    values = v_pool.index_select(1, flat).view(kv_heads, batch, length, dim).transpose(0, 1)
    keys, values = keys.to(q.dtype), values.to(q.dtype)  # bf16 pools under an fp32 q
    pos = torch.arange(length, device=q.device)[None, :]
    lens = context_lens.long()[:, None]
    mask = pos < lens
    if window > 0:
        mask &= pos >= lens - window
    group = heads // kv_heads
    if softcap > 0 or alibi_slopes is not None:
        distance = (pos - (lens - 1))[:, None, None, :]  # [B, 1, 1, L]
        out = biased_attention(q[:, :, None, :], keys, values, mask[:, None, None, :], distance,
                               scale, softcap, alibi_slopes)
        return out.reshape(batch, heads, dim)
    out = F.scaled_dot_product_attention(
        q.view(batch, kv_heads, group, dim), keys, values,
        attn_mask=mask[:, None, None, :], scale=scale,
    )
    return out.reshape(batch, heads, dim)


def paged_prefill_reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_starts: torch.Tensor,
    query_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill attention, the native ``paged_prefill_attention``'s contract, one sequence at a time.

    Sequence ``s`` owns rows ``query_starts[s] .. + query_lens[s]`` of ``q``
    [T, H, D]; row ``r`` sits at position ``context_lens[s] - query_lens[s] + r``
    and attends causally (within ``window`` when > 0) over the sequence's
    cached keys and values (its new ones included), read through its block
    table; ``softcap`` and ``alibi_slopes`` as :func:`biased_attention` takes
    them. Rows no sequence owns come back as zeros. Returns [T, H, D].
    """
    out = torch.zeros_like(q)
    _, heads, dim = q.shape
    kv_heads, _, block_size, _ = k_pool.shape
    for s in range(block_tables.shape[0]):
        length, start, n = (int(t[s]) for t in (context_lens, query_starts, query_lens))
        blocks = block_tables[s, : -(-length // block_size)].long()
        keys = k_pool.index_select(1, blocks).reshape(kv_heads, -1, dim)[:, :length].to(q.dtype)
        values = v_pool.index_select(1, blocks).reshape(kv_heads, -1, dim)[:, :length].to(q.dtype)
        qpos = torch.arange(length - n, length)[:, None]
        kpos = torch.arange(length)[None, :]
        mask = kpos <= qpos
        if window > 0:
            mask &= kpos > qpos - window
        rows = q[start : start + n].transpose(0, 1)  # [H, n, D]
        if softcap > 0 or alibi_slopes is not None:
            out[start : start + n] = biased_attention(
                rows, keys, values, mask, kpos - qpos, scale, softcap, alibi_slopes
            ).transpose(0, 1)
            continue
        o = F.scaled_dot_product_attention(rows.unsqueeze(0), keys.unsqueeze(0),
                                           values.unsqueeze(0), attn_mask=mask, scale=scale,
                                           enable_gqa=heads != kv_heads)
        out[start : start + n] = o[0].transpose(0, 1)
    return out


class TorchFusedOps:
    """The fused decoder-layer steps written as plain PyTorch ops (:class:`FusedOps`).

    The hand-written decoder's fallback where no kernel could be built, and the
    reference the native ones are checked against. Each follows transformers'
    own op sequence (and so its bf16 rounding).
    """

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * x / rms(x)``, computed in fp32 and rounded to ``x``'s dtype before the scale."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype)

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> None:
        """In place: ``residual += x``, then ``x = rms_norm(residual)``."""
        residual.add_(x)
        x.copy_(self.rms_norm(residual, weight, eps))

    def rotary_store_(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                      heads: int, kv_heads: int) -> None:
        """Rotate the q and k heads of ``qkv`` in place; store k and v at ``slots`` of the pools."""
        tokens = qkv.shape[0]
        dim = qkv.shape[1] // (heads + 2 * kv_heads)
        rot = cos.shape[1]
        qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)
        part = qk[..., :rot]
        c, s = cos[:, None, :], sin[:, None, :]
        half = rot // 2
        rotated = torch.cat((-part[..., half:], part[..., :half]), dim=-1)
        part.copy_(part * c + rotated * s)
        flat = (kv_heads, k_pool.shape[1] * k_pool.shape[2], dim)
        k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
        v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
        # Pools may be bf16 under fp32 activations: the stored copy is rounded.
        k_pool.view(flat).index_copy_(1, slots, k.transpose(0, 1).to(k_pool.dtype))
        v_pool.view(flat).index_copy_(1, slots, v.transpose(0, 1).to(v_pool.dtype))

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``x`` = gate | up along the last axis."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
