"""Which cache blocks each sequence holds: a block allocator with prefix caching.

The KV cache is a pool of ``num_blocks`` blocks of ``block_size`` token slots.
A sequence holds a *block table*, the list of blocks that store its tokens in
order: token ``p`` lives in slot ``p % block_size`` of block ``table[p //
block_size]``. A table grows as its sequence does (``ceil(len / block_size)``
blocks, never the worst case up front).

Prefix caching: once a block is full and computed, it is named by a chained
hash, ``H(parent hash, its token ids, its extra key)``, so equal hashes mean
equal *prefixes*, not merely equal blocks. The extra key is empty for plain
text (the hash is then ``H(parent hash, its token ids)``); it carries what
the token ids do not say about a block's keys and values: for a block that
covers an image's placeholder tokens, the image's content hash and place
(:meth:`~switchyard_xeon.sequence.Sequence.block_keys`), so two prompts whose
text is equal and whose images differ part at the first block of the image.
A new sequence whose leading full blocks hash to cached ones shares them
(their reference count goes up) and computes only the rest. When the last
holder of a hashed block lets go, the block is not wiped: it joins an LRU of
evictable blocks and keeps its hash until the pool runs out of never-hashed
blocks and it is reused.

Three kinds of block, and where they live:

- free: no holder, no hash; on ``_free`` (a stack: the most recently freed is
  reused first, so the memory in use stays small and warm);
- cached: no holder, valid hash; in ``_evictable`` (oldest first);
- in use: ``_refs[block] > 0``; hashed or not.

Pure Python: no torch, no model. The storage itself is :mod:`kv_cache`.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ROOT_HASH = b""
"""The parent hash of a sequence's first block."""


def blocks_for(tokens: int, block_size: int) -> int:
    """How many blocks hold ``tokens`` tokens."""
    return -(-tokens // block_size)


BlockKeys = Callable[[int], bytes]
"""The extra key of a sequence's full block ``i`` (``b""`` for none): see :func:`chain_hash`."""


def rooted_keys(keys: BlockKeys | None, root: bytes) -> BlockKeys:
    """``keys`` with ``root`` prepended to the first block's extra key.

    Every later block's name chains on the first one's, so two sequences with
    different roots (a LoRA adapter's, or none) share no cached block even
    for the same tokens, and sequences with the same root share as before.
    """
    tagged = root + b"|"

    def key(index: int) -> bytes:
        extra = keys(index) if keys is not None else b""
        return tagged + extra if index == 0 else extra

    return key


def chain_hash(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """The name of a full block: SHA-256 of its parent's name, its token ids and ``extra``.

    ``extra`` is what else the block's keys and values depend on (an image's
    content hash); empty, the name is that of the token ids alone.
    """
    return hashlib.sha256(parent + array("q", tokens).tobytes() + extra).digest()


@dataclass(frozen=True)
class PrefixHit:
    """Cached blocks that hold the leading full blocks of some tokens (see ``lookup``)."""

    blocks: tuple[int, ...] = ()
    hashes: tuple[bytes, ...] = ()
    evictable: int = 0
    """How many of ``blocks`` have no holder (taking them uses up free capacity)."""
    block_size: int = 0

    @property
    def tokens(self) -> int:
        """Tokens whose keys and values need not be computed."""
        return len(self.blocks) * self.block_size


class BlockManager:
    """Allocates blocks to sequences (by ``seq_id``), counts references, caches prefixes."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("a block manager needs at least one block of at least one token")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # block 0 on top
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._tables: dict[int, list[int]] = {}
        self._chains: dict[int, list[bytes]] = {}
        """Per sequence: the chained hashes of its computed full blocks, in order."""

    # ------------------------------------------------------------ capacity
    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can be given now: the free ones plus the evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with no holder that still hold a reusable prefix."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    def table(self, seq_id: int) -> list[int]:
        """The blocks of ``seq_id`` in token order (empty when it holds none)."""
        return self._tables.get(seq_id, [])

    def slots(self, seq_id: int, start: int, count: int) -> list[int]:
        """Cache slots (``block * block_size + offset``) of positions ``start .. start + count``."""
        table, bs = self._tables[seq_id], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, start + count)]

    def room(self, seq_id: int, hit: PrefixHit | None = None) -> int:
        """The most tokens ``seq_id`` could hold if it took every free block.

        For a sequence not yet allocated, pass the ``hit`` it would start from.
        """
        if hit is not None:
            return (len(hit.blocks) + self.num_free_blocks - hit.evictable) * self.block_size
        return (len(self.table(seq_id)) + self.num_free_blocks) * self.block_size

    # ------------------------------------------------------ prefix caching
    def lookup(self, tokens: Sequence[int], keys: BlockKeys | None = None) -> PrefixHit:
        """The cached blocks holding the longest full-block prefix of ``tokens``.

        ``keys`` gives each full block's extra key (see :func:`chain_hash`);
        None for plain text. At least the last token is always left to compute
        (a forward pass must produce the logits of the next token), so a prompt
        that is entirely cached reuses all but its last block.
        """
        if not self.prefix_caching:
            return PrefixHit(block_size=self.block_size)
        bs = self.block_size
        blocks: list[int] = []
        hashes: list[bytes] = []
        parent = ROOT_HASH
        for i in range((len(tokens) - 1) // bs):
            digest = chain_hash(parent, tokens[i * bs : (i + 1) * bs],
                                keys(i) if keys is not None else b"")
            block = self._block_of.get(digest)
            if block is None:
                break
            blocks.append(block)
            hashes.append(digest)
            parent = digest
        evictable = sum(1 for b in blocks if self._refs[b] == 0)
        return PrefixHit(tuple(blocks), tuple(hashes), evictable, bs)

    # ---------------------------------------------------------- allocation
    def allocate(self, seq_id: int, hit: PrefixHit, num_tokens: int) -> bool:
        """Give a new sequence the ``hit`` blocks, then fresh ones up to ``num_tokens`` tokens.

        Returns False, changing nothing, when the free blocks do not suffice.
        """
        if seq_id in self._tables:
            raise KeyError(f"sequence {seq_id} already holds blocks")
        if num_tokens > self.room(seq_id, hit):
            return False
        for block in hit.blocks:  # take the hits first: a fresh take could evict one
            self._hold(block)
        self._tables[seq_id] = list(hit.blocks)
        self._chains[seq_id] = list(hit.hashes)
        return self.grow(seq_id, num_tokens)

    def grow(self, seq_id: int, num_tokens: int) -> bool:
        """Extend the table of ``seq_id`` to hold ``num_tokens`` tokens.

        Returns False, changing nothing, when the free blocks do not suffice.
        """
        table = self._tables.setdefault(seq_id, [])
        self._chains.setdefault(seq_id, [])
        more = blocks_for(num_tokens, self.block_size) - len(table)
        if more > self.num_free_blocks:
            return False
        table.extend(self._take() for _ in range(more))
        return True

    def commit(self, seq_id: int, tokens: Sequence[int], num_computed: int,
               keys: BlockKeys | None = None) -> None:
        """Record that ``tokens[:num_computed]`` of ``seq_id`` are now in the cache.

        Blocks that became full are named (with their extra ``keys``, as in
        :meth:`lookup`), so later sequences can share them.
        """
        chain = self._chains.get(seq_id)
        if chain is None or not self.prefix_caching:
            return
        table = self._tables[seq_id]
        bs = self.block_size
        for i in range(len(chain), num_computed // bs):
            parent = chain[-1] if chain else ROOT_HASH
            digest = chain_hash(parent, tokens[i * bs : (i + 1) * bs],
                                keys(i) if keys is not None else b"")
            chain.append(digest)
            block = table[i]
            # The same prefix computed twice at once: the first copy keeps the name.
            if digest not in self._block_of and block not in self._hash_of:
                self._block_of[digest] = block
                self._hash_of[block] = digest

    def free(self, seq_id: int) -> None:
        """Let go of every block of ``seq_id``; unknown ids are ignored.

        Hashed blocks whose last holder this was become evictable, tail first,
        so the end of a prefix is evicted before its beginning.
        """
        self._chains.pop(seq_id, None)
        for block in reversed(self._tables.pop(seq_id, [])):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._hash_of:
                self._evictable[block] = None
            else:
                self._free.append(block)

    # ------------------------------------------------------------ internal
    def _hold(self, block: int) -> None:
        """Add a holder to a cached block (taking it off the evictable list if idle)."""
        if self._refs[block] == 0:
            del self._evictable[block]
        self._refs[block] += 1

    def _take(self) -> int:
        """A block for new tokens: a free one, else the least recently used cached one."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._evictable.popitem(last=False)
            del self._block_of[self._hash_of.pop(block)]
        self._refs[block] = 1
        return block
