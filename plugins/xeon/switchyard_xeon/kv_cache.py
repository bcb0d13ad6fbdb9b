"""Paged key/value storage: one pool of fixed-size blocks per layer, shared by all sequences.

Per layer, keys and values are each a tensor of shape
``[kv_heads, num_blocks, block_size, head_dim]``. Which blocks belong to which
sequence is the :class:`~switchyard_xeon.block_manager.BlockManager`'s
business; this module only moves numbers in and out of slots:

- ``write`` stores a step's new keys/values at their *slots* (a slot is
  ``block * block_size + offset``, see ``BlockManager.slots``), for the whole
  packed batch in one copy;
- ``gather`` copies the blocks of every sequence that has cached context
  into one tensor per layer, and :func:`context` views one sequence's part as
  ``[kv_heads, length, head_dim]``, the layout attention wants. Head-major
  blocks make that a single ``index_select`` with no transpose.

The pool is allocated once with ``torch.empty``: the operating system commits
pages only when tokens are first written, and the block manager reuses the
most recently freed blocks first, so resident memory tracks real use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_SIZE = 16
"""Default tokens per block."""

@dataclass(frozen=True)
class CacheShape:
    """What one token's cache entry looks like for a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        """Cache bytes one token costs across all layers (keys and values)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def cache_shape(config: object) -> CacheShape:
    """Read the K/V geometry from a transformers config (text part for multimodal ones)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if getattr(text, "model_type", None) == "falcon":  # its own names: one K/V head under MQA
        kv_heads = (int(text.num_kv_heads) if text.new_decoder_architecture
                    else 1 if text.multi_query else heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return CacheShape(int(text.num_hidden_layers), kv_heads, int(head_dim))


class PagedKVCache:
    """Block-pool storage of keys and values for every layer."""

    def __init__(
        self,
        shape: CacheShape,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int = BLOCK_SIZE,
        device: torch.device | str = "cpu",
    ) -> None:
        self.shape = shape
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        size = (shape.num_kv_heads, num_blocks, block_size, shape.head_dim)
        self.keys = [torch.empty(size, dtype=dtype, device=self.device)
                     for _ in range(shape.num_layers)]
        self.values = [torch.empty(size, dtype=dtype, device=self.device)
                       for _ in range(shape.num_layers)]

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool can hold."""
        return self.num_blocks * self.block_size

    def bytes_per_token(self) -> int:
        """Cache bytes one token costs across all layers."""
        return self.shape.bytes_per_token(self.dtype)

    @property
    def nbytes(self) -> int:
        """Size of the whole pool in bytes."""
        return self.capacity_tokens * self.bytes_per_token()

    # ---------------------------------------------------------- access
    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys/values ``[kv_heads, n, head_dim]`` at the ``n`` slots given."""
        heads, _, _, dim = self.keys[layer].shape
        flat = (heads, self.num_blocks * self.block_size, dim)
        # A bf16 cache under fp32 activations stores them rounded.
        self.keys[layer].view(flat).index_copy_(1, slots, k.to(self.dtype))
        self.values[layer].view(flat).index_copy_(1, slots, v.to(self.dtype))

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``blocks``, each ``[kv_heads, len(blocks), block_size, head_dim]``.

        One copy per layer for the whole step: every sequence's blocks, back to back.
        """
        return self.keys[layer].index_select(1, blocks), self.values[layer].index_select(1, blocks)


def context(gathered: torch.Tensor, first: int, count: int, length: int) -> torch.Tensor:
    """One sequence's first ``length`` tokens, ``[kv_heads, length, head_dim]``, as a view of
    the ``count`` gathered blocks that start at ``first``."""
    heads, _, size, dim = gathered.shape
    return gathered[:, first : first + count].reshape(heads, count * size, dim)[:, :length]
