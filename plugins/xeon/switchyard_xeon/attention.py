"""The attention function the engine plugs into transformers' model definitions.

The model runs on a packed batch: one row of T tokens holding every sequence's
new tokens back to back. Transformers computes projections and rotary
embeddings for all T tokens at once, then calls :func:`packed_attention` once
per layer with the metadata of the step (passed through the forward kwargs as
``switchyard_step``). For each sequence it stores the new keys/values in the
engine's :class:`PagedKVCache` (at slots the runner worked out from the block
tables) and attends over that sequence's whole context, gathered from its
blocks (or, for a fresh prompt, straight from the new keys), so sequences
never see each other and no padding is needed.

The name is registered with ``AttentionInterface`` only: because it is absent
from ``AttentionMaskInterface``, transformers skips building masks entirely.

Two extra score terms ride along every path (native kernels and SDPA alike):
logit soft-capping (Gemma 2's ``softcap``, passed by transformers) and ALiBi
slopes (Bloom, MPT, Falcon, whose attention modules
:mod:`switchyard_xeon.alibi_attention` replaces, since they do not call the
attention interface).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from switchyard_engine.lora.grouped import StepLora

from switchyard_xeon.kernels import PagedDecodeFn, PagedPrefillFn
from switchyard_xeon.kernels.reference import biased_attention
from switchyard_xeon.kv_cache import PagedKVCache, context
from switchyard_xeon.native_lora import NativeLora

ATTN_NAME = "switchyard_xeon"
STEP_KWARG = "switchyard_step"


@dataclass
class DecodeRows:
    """The step's decode rows, handed to the paged decode kernel together.

    ``rows`` are their packed positions (None when every position of the step
    is one: a pure decode step needs no index), ``tables`` their block tables
    padded to the longest (int32 [B, n]) and ``lens`` their context lengths
    after this step (int32 [B]).
    """

    kernel: PagedDecodeFn
    rows: torch.Tensor | None
    tables: torch.Tensor
    lens: torch.Tensor


@dataclass
class PrefillRows:
    """The step's other sequences as the paged prefill kernel takes them (int32 tensors).

    Sequence ``i`` owns packed rows ``starts[i] .. starts[i] + counts[i]``, and
    ``lens[i]`` tokens are cached after this step, read through ``tables[i]``
    (padded to the longest).
    """

    kernel: PagedPrefillFn
    tables: torch.Tensor
    lens: torch.Tensor
    starts: torch.Tensor
    counts: torch.Tensor


@dataclass(frozen=True)
class LongPrefill:
    """Which prefill sequences leave the native kernel for SDPA, and in what dtype.

    The native prefill kernel computes each query row's scores one key at a
    time: fast for the short prompts of a busy batch (it takes them all in one
    call), slow for long ones, whose work grows as query rows x context. There
    PyTorch's SDPA (a tiled flash kernel over BLAS-style block products, AMX
    tiles in bf16 where the CPU has them) wins: on the 135M shape's heads
    (2-core Sapphire Rapids VM) 1,024 queries over 6,000 keys took 250 ms in
    the kernel, 181 ms in fp32 SDPA, 56 ms in bf16 SDPA; 512 over 512 took 4.9,
    3.1 and 1.9 ms; 128 over 128, 0.3 and 0.2.
    """

    pairs: int
    """A sequence with at least this many query-key pairs (new tokens x context) takes SDPA."""
    dtype: torch.dtype
    """SDPA's dtype: bf16 under bf16 matmuls (queries rounded as every matmul input is;
    the cache holds bf16 keys and values), else fp32."""


PREFILL_HEAD_DIMS = (64, 128)
"""Head sizes the native prefill kernel is built for (fp32 queries only): the
engine hands the runner that kernel only for such models; others take SDPA."""


@dataclass
class StepMetadata:
    """Where each sequence's tokens sit in the packed row and in the paged cache.

    Sequences in ``decode`` (a :class:`DecodeRows`) are attended by the paged
    decode kernel in one call; the lists describe the others. Sequence ``i``
    of those owns packed positions ``offsets[i] .. offsets[i] + query_lens[i]``;
    after this step its first ``context_lens[i]`` tokens are in the cache.
    ``slots[t]`` is the cache slot of packed token ``t``. A sequence with
    context cached before this step reads it from ``blocks`` (every such
    sequence's blocks, back to back): ``spans[i]`` is (first, count) there; a
    sequence with none (``spans[i]`` None) attends over its new tokens alone. A
    sequence the prefill kernel takes reads its context in place: its span is None.
    """

    cache: PagedKVCache
    slots: torch.Tensor
    blocks: torch.Tensor
    spans: list[tuple[int, int] | None]
    context_lens: list[int]
    query_lens: list[int]
    offsets: list[int]
    decode: DecodeRows | None = None
    prefill: PrefillRows | None = None
    """Set when the engine runs the native prefill kernel: the lists' sequences it
    takes (all of them unless ``by_kernel`` says otherwise)."""
    lora: StepLora | NativeLora | None = None
    """Set when any row of the step runs with a LoRA adapter: each row's group and the
    adapters' matrices (the decoder adds their deltas after each projection)."""
    by_kernel: list[bool] | None = None
    """Per sequence of the lists: whether ``prefill`` computes it; the others take SDPA
    in ``sdpa_dtype`` (:class:`LongPrefill`). None: the kernel, if any, takes them all."""
    sdpa_dtype: torch.dtype | None = None
    """The dtype SDPA runs the lists' sequences in; None: the queries' own."""


def register() -> str:
    """Register :func:`packed_attention` with transformers under ``ATTN_NAME``; idempotent."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, packed_attention)
    return ATTN_NAME


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention over the engine's cache for a packed batch, in transformers' calling convention.

    ``query`` is [1, heads, T, head_dim]; ``key``/``value`` are [1, kv_heads, T,
    head_dim] for the new tokens only. Returns [1, T, heads, head_dim].
    """
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, StepMetadata):
        raise RuntimeError(f"{ATTN_NAME} attention needs {STEP_KWARG}= in the forward call")
    if s_aux is not None:
        # model_paths sends models with sinks to the fallback path; reaching here means a
        # model asked for them without its modules showing it: fail, never ignore.
        raise RuntimeError(f"{ATTN_NAME} attention was asked for attention sinks, which the "
                           "paged kernels do not compute; serve this model with "
                           "--engine-option forward=fallback")
    layer = int(module.layer_idx)
    step.cache.write(layer, step.slots, key[0], value[0])  # the step's new keys/values, one copy
    out = attend_packed(layer, query[0], key[0], value[0], step, scaling, sliding_window,
                        softcap=softcap)
    return out.unsqueeze(0), None


def attend_packed(
    layer: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    step: StepMetadata,
    scaling: float | None,
    sliding_window: int | None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of layer ``layer`` for a packed batch whose new keys/values are already cached.

    ``q`` is [heads, T, head_dim], ``k``/``v`` [kv_heads, T, head_dim] (the new
    tokens; views of wider buffers are fine). ``softcap`` soft-caps the scaled
    scores (``softcap * tanh(s / softcap)``, Gemma 2); ``alibi_slopes`` (fp32
    [heads]) adds ``slope[h] * (j - i)`` to the score of the query at position
    ``i`` and the key at ``j``. Returns [T, heads, head_dim].
    """
    cache = step.cache
    dec = step.decode
    cap = float(softcap) if softcap else 0.0
    if dec is not None:
        window = sliding_window if sliding_window is not None and sliding_window > 0 else 0
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        if dec.rows is None:  # every token decodes: the kernel's output is the whole answer
            return dec.kernel(_dense_heads(q.transpose(0, 1)), cache.keys[layer],
                              cache.values[layer], dec.tables, dec.lens, scale, window,
                              cap, alibi_slopes)
        qd = q.index_select(1, dec.rows).transpose(0, 1).contiguous()
        o = dec.kernel(qd, cache.keys[layer], cache.values[layer], dec.tables, dec.lens,
                       scale, window, cap, alibi_slopes)
    pre = step.prefill
    routed = step.by_kernel
    if pre is not None:
        # The kernel's sequences in one call over the cache, which holds their new keys too.
        window = sliding_window if sliding_window is not None and sliding_window > 0 else 0
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        out = pre.kernel(_dense_heads(q.transpose(0, 1)), cache.keys[layer], cache.values[layer],
                         pre.tables, pre.lens, pre.starts, pre.counts, scale, window,
                         cap, alibi_slopes)
        if dec is not None:
            out.index_copy_(0, dec.rows, o)
        if routed is None or all(routed):
            return out
    else:
        out = torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device)
        if dec is not None:
            out.index_copy_(0, dec.rows, o)
    # Gathered straight into the dtype SDPA runs in: a bf16 cache feeds bf16 SDPA as it is.
    work = step.sdpa_dtype or q.dtype
    if len(step.blocks):
        cached_k, cached_v = (t.to(work) for t in cache.gather(layer, step.blocks))
    for i, (span, length, n, off) in enumerate(zip(
        step.spans, step.context_lens, step.query_lens, step.offsets, strict=True
    )):
        if pre is not None and (routed is None or routed[i]):
            continue  # the kernel's
        if span is None:  # nothing cached before: its own new keys are its whole context
            keys, values = k[:, off : off + n], v[:, off : off + n]
            if cache.dtype != q.dtype:  # as the cache holds them, as later steps read them
                keys, values = (t.to(cache.dtype).to(work) for t in (keys, values))
        else:
            keys = context(cached_k, span[0], span[1], length)
            values = context(cached_v, span[0], span[1], length)
        result = _attend(q[:, off : off + n], keys, values, scaling, sliding_window,
                         cap, alibi_slopes, step.sdpa_dtype)
        out[off : off + n] = result.transpose(0, 1)
    return out


def _dense_heads(q: torch.Tensor) -> torch.Tensor:
    """``q`` [T, heads, D] as the kernel takes it: heads dense, any row stride (no copy if so)."""
    if q.stride(2) == 1 and q.stride(1) == q.shape[2]:
        return q
    return q.contiguous()


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    window: int | None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One sequence: q [heads, n, d] over k/v [kv_heads, L, d] whose last n rows are q's own.

    ``softcap`` > 0 and ``alibi_slopes`` as :func:`attend_packed` takes them.
    ``dtype``: the prefill SDPA calls run in it (the result comes back in q's).
    """
    if dtype is not None and dtype != q.dtype:
        if softcap > 0 or alibi_slopes is not None:  # written-out scores: in q's dtype
            k, v = k.to(q.dtype), v.to(q.dtype)
        else:
            return _attend(q.to(dtype), k.to(dtype), v.to(dtype), scale, window).to(q.dtype)
    heads, n, dim = q.shape
    kv_heads, length, _ = k.shape
    if window is not None and window > 0 and length > window and n == 1:
        k, v, length = k[:, -window:], v[:, -window:], window
    if softcap > 0 or alibi_slopes is not None:
        # SDPA cannot soft-cap, and a per-head bias would be a float mask as large as the
        # scores anyway: write the scores out (fp32), as the native kernels compute them.
        qpos = torch.arange(length - n, length, device=q.device)[:, None]
        kpos = torch.arange(length, device=q.device)[None, :]
        mask = kpos <= qpos
        if window is not None and window > 0:
            mask &= kpos > qpos - window
        return biased_attention(q, k, v, mask, kpos - qpos,
                                scale if scale is not None else dim**-0.5, softcap, alibi_slopes)
    if n == 1:
        # Decode: the one query sees every key, so no mask; folding the query
        # heads of a group into the sequence axis shares each K/V head without
        # copying it, and takes a much faster CPU kernel than enable_gqa for bf16.
        group = heads // kv_heads
        o = F.scaled_dot_product_attention(
            q.reshape(kv_heads, group, dim).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale=scale
        )
        return o.reshape(heads, 1, dim)
    gqa = heads != kv_heads
    if n == length and not (window is not None and 0 < window < length):
        o = F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
            is_causal=True, scale=scale, enable_gqa=gqa,
        )
        return o[0]
    if (_FLASH_WITH_LSE is not None and q.device.type == "cpu"
            and n * (length - n) >= SPLIT_FROM_PAIRS
            and not (window is not None and 0 < window < length)):
        return _prefix_then_own(q, k, v, scale)
    # Queries that start after cached context (chunked prefill) or a sliding
    # window need an explicit mask aligned to the bottom-right corner.
    qpos = torch.arange(length - n, length, device=q.device)[:, None]
    kpos = torch.arange(length, device=q.device)[None, :]
    mask = kpos <= qpos
    if window is not None and window > 0:
        mask &= kpos > qpos - window
    o = F.scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=gqa
    )
    return o[0]


SPLIT_FROM_PAIRS = 1 << 20
"""Queries x cached prefix from which a chunk takes :func:`_prefix_then_own`. Below it
the one masked call is faster (2-core Sapphire Rapids VM, 9 heads of 64: masked
against split 0.11/0.25 ms at 16 over 200 keys, 2.0/2.5 at 128 over 1,000, 4.7/4.9
at 512 over 600; 40.2/35.8 at 1,024 over 3,000 in fp32, 18.0/14.6 in bf16)."""
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
"""PyTorch's CPU flash attention that also returns each row's log-sum-exp (private, so
looked up once: without it chunks take the masked call)."""


def _prefix_then_own(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float | None) -> torch.Tensor:
    """A chunk after cached context: q [heads, n, d] over k/v [kv_heads, L, d], L > n.

    Two flash calls without a mask, merged by their log-sum-exps: every query over
    the cached prefix (no mask needed), then causally over the chunk's own keys. A
    masked call over the whole context computes the same softmax but runs slower
    for big chunks (:data:`SPLIT_FROM_PAIRS`).
    """
    heads, n, _ = q.shape
    kv_heads, length, _ = k.shape
    if heads != kv_heads:  # the flash op takes one key head per query head
        k = k.repeat_interleave(heads // kv_heads, dim=0)
        v = v.repeat_interleave(heads // kv_heads, dim=0)
    split = length - n
    assert _FLASH_WITH_LSE is not None
    o1, l1 = _FLASH_WITH_LSE(q[None], k[None, :, :split], v[None, :, :split], 0.0, False,
                             scale=scale)
    o2, l2 = _FLASH_WITH_LSE(q[None], k[None, :, split:], v[None, :, split:], 0.0, True,
                             scale=scale)
    total = torch.logaddexp(l1, l2)
    o = (o1.float() * (l1 - total).exp().unsqueeze(-1)
         + o2.float() * (l2 - total).exp().unsqueeze(-1))
    return o[0].to(q.dtype)
