"""Engine-owned key/value cache: token accounting in blocks, storage per sequence.

Accounting is block-based already (``block_size`` tokens per block, a fixed
pool of blocks for the whole engine), so the scheduler's admission rules will
not change when storage becomes paged. Storage today is one tensor per
sequence, sized to the sequence's reservation when it is admitted;
``torch.empty`` leaves the pages untouched, so the memory the OS commits grows
only as tokens are written. Paging will replace ``_Slot`` and the two
accessors ``write`` / ``read`` without touching the callers' view of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


BLOCK_SIZE = 16


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
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return CacheShape(int(text.num_hidden_layers), kv_heads, int(head_dim))


def blocks_for(tokens: int, block_size: int) -> int:
    """How many blocks hold ``tokens`` tokens."""
    return -(-tokens // block_size)


@dataclass
class _Slot:
    """One sequence's storage: [layers, 2 (k, v), kv_heads, capacity, head_dim]."""

    kv: torch.Tensor
    blocks: int
    length: int = 0


class KVCache:
    """K/V storage for every layer of every running sequence, within a block budget."""

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
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free_blocks = num_blocks
        self._slots: dict[int, _Slot] = {}

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole budget can hold."""
        return self.num_blocks * self.block_size

    @property
    def free_blocks(self) -> int:
        """Blocks not reserved by any sequence."""
        return self._free_blocks

    @property
    def used_tokens(self) -> int:
        """Tokens actually written by live sequences."""
        return sum(slot.length for slot in self._slots.values())

    def bytes_per_token(self) -> int:
        """Cache bytes one token costs across all layers."""
        return self.shape.bytes_per_token(self.dtype)

    def can_reserve(self, tokens: int) -> bool:
        """Whether ``tokens`` more tokens fit in the free blocks."""
        return blocks_for(tokens, self.block_size) <= self._free_blocks

    def reserve(self, seq_id: int, tokens: int) -> None:
        """Set aside room for ``tokens`` tokens of sequence ``seq_id``."""
        if seq_id in self._slots:
            raise KeyError(f"sequence {seq_id} already holds cache")
        blocks = blocks_for(tokens, self.block_size)
        if blocks > self._free_blocks:
            raise MemoryError(f"{tokens} tokens do not fit in {self._free_blocks} free blocks")
        geo = self.shape
        size = (geo.num_layers, 2, geo.num_kv_heads, blocks * self.block_size, geo.head_dim)
        kv = torch.empty(size, dtype=self.dtype, device=self.device)
        self._slots[seq_id] = _Slot(kv=kv, blocks=blocks)
        self._free_blocks -= blocks

    def release(self, seq_id: int) -> None:
        """Free the storage and blocks of ``seq_id``; unknown ids are ignored."""
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self._free_blocks += slot.blocks

    def length(self, seq_id: int) -> int:
        """Tokens whose K/V are stored for ``seq_id``."""
        return self._slots[seq_id].length

    def commit(self, seq_id: int, length: int) -> None:
        """Record that positions ``[0, length)`` of ``seq_id`` are now valid in every layer."""
        self._slots[seq_id].length = length

    def write(self, layer: int, seq_id: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys/values ([kv_heads, n, head_dim]) at positions ``start..start+n``."""
        kv = self._slots[seq_id].kv
        end = start + k.shape[1]
        if end > kv.shape[3]:
            raise IndexError(f"sequence {seq_id} grew past its reservation ({end} > {kv.shape[3]})")
        kv[layer, 0, :, start:end] = k
        kv[layer, 1, :, start:end] = v

    def read(self, layer: int, seq_id: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of positions ``[0, length)`` as [kv_heads, length, head_dim] views."""
        kv = self._slots[seq_id].kv
        return kv[layer, 0, :, :length], kv[layer, 1, :, :length]
