"""Which rows of the static KV cache are taken, kept low so decode batches stay small.

A decode step runs over cache rows ``0 .. B - 1``, with ``B`` the decode
bucket of the live count, so every live row must sit below that bucket. New
sequences take the lowest free rows, which keeps that true as the batch
grows; when sequences finish, :meth:`RowTable.compact` moves the few live
rows at or above the new, smaller bucket into free rows below it (tgi-gaudi
moves rows the same way when its batch shrinks). Pure Python.
"""

from __future__ import annotations

import bisect


class RowTable:
    """Free and live rows of a cache with ``rows`` rows."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._free = list(range(rows))  # ascending
        self._live: set[int] = set()

    @property
    def live(self) -> list[int]:
        """Rows held by sequences, ascending."""
        return sorted(self._live)

    @property
    def free_count(self) -> int:
        """Rows no sequence holds."""
        return len(self._free)

    def take(self) -> int:
        """The lowest free row, now live; IndexError when none is free."""
        row = self._free.pop(0)
        self._live.add(row)
        return row

    def release(self, row: int) -> None:
        """Give a live row back."""
        self._live.remove(row)
        bisect.insort(self._free, row)

    def compact(self, bound: int) -> list[tuple[int, int]]:
        """Move live rows so that all are below ``bound``; returns the (from, to) moves made.

        Only rows at or above ``bound`` move, the highest first, each into the
        lowest free row. ValueError when more rows are live than ``bound``.
        """
        if len(self._live) > bound:
            raise ValueError(f"{len(self._live)} live rows cannot fit below {bound}")
        moves = []
        for row in sorted((r for r in self._live if r >= bound), reverse=True):
            target = self._free.pop(0)
            self._live.remove(row)
            self._live.add(target)
            bisect.insort(self._free, row)
            moves.append((row, target))
        return moves
