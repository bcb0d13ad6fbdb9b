"""Prefix affinity: send a prompt to the replica that has most of it in its prefix cache.

A replica's prefix cache only pays if prompts sharing a prefix (a system
prompt, a few-shot preamble, a conversation so far) reach the same replica.
This gateway cannot see the replicas' caches, so it remembers where it sent
what: the prompt's leading bytes, cut into blocks of :data:`BLOCK_BYTES`, each
block's hash chained to the one before (block ``i`` names the whole prefix up
to it, as a paged KV cache names its blocks), and one bounded LRU per replica
of the chains sent there.

Bytes, not tokens: a remote model has no tokenizer here, and equal byte
prefixes are what make equal token prefixes. The last partial block is not
hashed (only whole blocks can match, as only whole KV blocks are shared).

Affinity gives way to load: among the replicas that may take the request,
when the spread of their loads (in flight from this gateway plus their queue)
is above ``max_spread`` the least loaded is taken, whatever it has cached; a
hot prefix must not pile its requests onto one replica while another idles.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from switchyard.remote.upstream import Replica

BLOCK_BYTES = 256
"""Bytes per hashed block: about 64 tokens of English or code, a few KV blocks."""
MAX_BLOCKS = 256
"""Blocks hashed per prompt (64 KiB): a prefix that long already picks one replica."""


def prefix_chain(text: bytes, block: int = BLOCK_BYTES) -> list[int]:
    """Chained hashes of ``text``'s whole blocks: entry ``i`` stands for ``text[: (i+1)*block]``."""
    chain: list[int] = []
    previous = 0
    whole = min(len(text) // block, MAX_BLOCKS)
    for i in range(whole):
        previous = hash((previous, text[i * block:(i + 1) * block]))
        chain.append(previous)
    return chain


class PrefixAffinity:
    """Where each prefix was sent, per replica, and the choice it leads to for the next prompt."""

    def __init__(self, entries_per_replica: int = 65536, max_spread: int = 8) -> None:
        self.entries_per_replica = entries_per_replica
        self.max_spread = max_spread
        self._sent: dict[str, OrderedDict[int, None]] = {}

    def matched(self, replica: Replica, chain: Sequence[int]) -> int:
        """How many leading blocks of ``chain`` were sent to ``replica`` and not forgotten."""
        seen = self._sent.get(replica.url)
        if not seen:
            return 0
        for length in range(len(chain), 0, -1):
            if chain[length - 1] in seen:
                return length
        return 0

    def choose(self, replicas: Sequence[Replica], tried: Collection[Replica],
               chain: Sequence[int]) -> Replica | None | bool:
        """The replica affinity picks, None if none may take the request, or False when
        affinity has no opinion (no block matches anywhere): the caller balances on load."""
        candidates = [r for r in replicas if r.available and r not in tried]
        if not candidates:
            return None
        loads = [r.load for r in candidates]
        if max(loads) - min(loads) > self.max_spread:
            return min(candidates, key=lambda r: r.load)
        best, best_len = None, 0
        for replica in candidates:
            length = self.matched(replica, chain)
            if length > best_len or (length == best_len and best is not None
                                     and length and replica.load < best.load):
                best, best_len = replica, length
        return best if best is not None else False

    def record(self, replica: Replica, chain: Sequence[int]) -> None:
        """``chain`` was sent to ``replica``: remember it there (most recent last)."""
        if not chain:
            return
        seen = self._sent.setdefault(replica.url, OrderedDict())
        # Longest prefix first, so that the shortest is the most recent and forgotten last:
        # a remembered block then implies every block before it, as in a paged prefix cache.
        for key in reversed(chain):
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self.entries_per_replica:
            seen.popitem(last=False)
