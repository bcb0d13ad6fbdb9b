"""Row operations on transformers' ``DynamicCache`` for the fallback runner's padded batch.

The fallback runner (:mod:`switchyard_xeon.fallback`) decodes all its
sequences in one forward over one batched cache, *left*-padded: row ``i``
holds its ``n_i`` tokens in the last ``n_i`` of ``W`` columns (``W`` the
longest row), the padding columns are zeros and the attention mask hides
them. Left padding keeps every row's newest token in the last column, so the
distance between two of a row's tokens is the same in padded columns as in
the row's own positions: sliding windows (which transformers applies in
column space) and ALiBi biases taken relative to a key's column (MPT) stay
exact, and models that read positions from the mask (Bloom, Falcon's ALiBi)
or take ``position_ids`` (rotary models) get the row's own positions.

A layer's tensors are ``[rows, heads, columns, head_dim]``. A full layer
(``DynamicLayer``) holds ``W`` columns; a sliding-window layer
(``DynamicSlidingWindowLayer``) holds the last ``min(W, window - 1)`` and
counts ``W`` in ``cumulative_length``, which transformers reads for the
mask's offset. The helpers keep both invariants: :func:`concat` right-aligns
caches of different widths into one (a sequence joining the batch),
:func:`select` keeps some rows and trims the columns no kept row needs (a
sequence leaving it, or taken back out on its own). Any other layer kind
(quantized, static, KV-sharing, linear attention, offloaded) is refused by
:func:`unbatchable`, and the runner keeps per-sequence forwards for it.

They never change the caches they are given: the result is a new
``DynamicCache`` whose layers are shallow copies holding new tensors (or the
given cache itself where nothing changes).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

BATCHABLE_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer)
"""The layer classes (exactly these, not subclasses) a padded batch can hold."""


def unbatchable(cache: object) -> str:
    """'' when ``cache`` can be padded, merged and split by these helpers, else why not."""
    if type(cache) is not DynamicCache:
        return f"the model's cache is a {type(cache).__name__}, not a plain DynamicCache"
    if getattr(cache, "offloading", False):
        return "the model's cache offloads its layers"
    if not cache.layers:
        return "the model's cache has no layers"
    for i, layer in enumerate(cache.layers):
        if type(layer) not in BATCHABLE_LAYERS:
            return f"cache layer {i} is a {type(layer).__name__}"
        if not layer.is_initialized or layer.keys is None or layer.keys.dim() != 4:
            return f"cache layer {i} holds no keys of its own"
        if getattr(layer, "record_past", False):
            return f"cache layer {i} records past states"
    return ""


def width(cache: DynamicCache) -> int:
    """Columns of the cache in token positions: every row's length, padding included."""
    return max(_length(layer) for layer in cache.layers)


def layer_kinds(cache: DynamicCache) -> str:
    """The cache's layer kinds, for a log line: ``full`` and ``sliding window <w>``."""
    kinds = dict.fromkeys(
        f"sliding window {layer.sliding_window}" if isinstance(layer, DynamicSlidingWindowLayer)
        else "full" for layer in cache.layers)
    return " and ".join(kinds)


def concat(caches: Sequence[DynamicCache]) -> DynamicCache:
    """One cache holding every row of ``caches`` in order, right-aligned to the widest.

    Each cache may hold several rows (a batch) of one width; narrower ones are
    padded on the left with zero columns, which the caller's attention mask
    must hide. The caches must come from the same model (same layer kinds).
    """
    if not caches:
        raise ValueError("nothing to concatenate")
    if len(caches) == 1:
        return caches[0]
    total = max(width(c) for c in caches)
    layers = []
    for i, group in enumerate(zip(*(c.layers for c in caches), strict=True)):
        first = group[0]
        for other in group[1:]:
            window = getattr(first, "sliding_window", None)
            if type(other) is not type(first) or getattr(other, "sliding_window", None) != window:
                raise ValueError(f"cache layer {i}: {type(first).__name__} and "
                                 f"{type(other).__name__} do not batch")
        cols = max(layer.keys.shape[2] for layer in group)
        keys = torch.cat([_pad_left(layer.keys, cols) for layer in group])
        values = torch.cat([_pad_left(layer.values, cols) for layer in group])
        layers.append(_layer_like(first, keys, values, total))
    return _cache_like(caches[0], layers)


def select(cache: DynamicCache, rows: Sequence[int], new_width: int) -> DynamicCache:
    """The cache's ``rows``, in that order, trimmed on the left to ``new_width`` positions.

    ``new_width`` is the longest kept row's length (columns left of it are
    padding in every kept row). Returns ``cache`` itself when it keeps every
    row in order at its width.
    """
    batch = cache.layers[0].keys.shape[0]
    if not rows:
        raise ValueError("a cache keeps at least one row")
    if list(rows) == list(range(batch)) and new_width == width(cache):
        return cache
    if new_width > width(cache):
        raise ValueError(f"cannot widen a cache from {width(cache)} to {new_width} by selecting")
    index = torch.tensor(list(rows), dtype=torch.long, device=cache.layers[0].keys.device)
    layers = []
    for layer in cache.layers:
        held = layer.keys.shape[2]
        cols = min(held, _columns(layer, new_width))
        # Narrow first, then gather: the result holds only what is kept.
        keys = layer.keys[:, :, held - cols:].index_select(0, index)
        values = layer.values[:, :, held - cols:].index_select(0, index)
        layers.append(_layer_like(layer, keys, values, new_width))
    return _cache_like(cache, layers)


def row_mask(lengths: Sequence[int], new: int = 1,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """The attention mask ([rows, W + new], long) of a step feeding ``new`` tokens per row.

    Row ``i`` sees its last ``lengths[i] + new`` columns; ``W`` is the widest row.
    """
    total = max(lengths) + new
    cols = torch.arange(total, device=device)
    first = total - new - torch.as_tensor(list(lengths), device=device)
    return (cols[None, :] >= first[:, None]).long()


def _length(layer: DynamicLayer) -> int:
    if isinstance(layer, DynamicSlidingWindowLayer):
        return layer.cumulative_length
    return layer.keys.shape[2]


def _columns(layer: DynamicLayer, positions: int) -> int:
    """Columns ``layer`` holds for a row of ``positions`` tokens (what its ``update`` keeps)."""
    if isinstance(layer, DynamicSlidingWindowLayer):
        return min(positions, layer.sliding_window - 1)
    return positions


def _pad_left(t: torch.Tensor, cols: int) -> torch.Tensor:
    pad = cols - t.shape[2]
    return t if pad == 0 else torch.nn.functional.pad(t, (0, 0, pad, 0))


def _layer_like(layer: DynamicLayer, keys: torch.Tensor, values: torch.Tensor,
                positions: int) -> DynamicLayer:
    new = copy.copy(layer)
    new.keys, new.values = keys, values
    if isinstance(new, DynamicSlidingWindowLayer):
        new.cumulative_length = positions
    return new


def _cache_like(cache: DynamicCache, layers: list[DynamicLayer]) -> DynamicCache:
    new = copy.copy(cache)
    new.layers = layers
    return new
