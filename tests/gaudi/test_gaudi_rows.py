"""Cache rows: lowest first, and compaction keeps live rows under the decode bucket."""

from __future__ import annotations

import random

import pytest
from switchyard_gaudi.buckets import linear
from switchyard_gaudi.rows import RowTable


def test_rows_are_taken_lowest_first_and_given_back():
    table = RowTable(6)
    assert [table.take() for _ in range(4)] == [0, 1, 2, 3]
    table.release(1)
    assert table.take() == 1
    assert table.live == [0, 1, 2, 3] and table.free_count == 2


def test_compaction_moves_only_rows_at_or_above_the_bound():
    table = RowTable(16)
    rows = [table.take() for _ in range(12)]
    for r in rows[:9]:  # 0..8 leave; 9, 10, 11 stay
        table.release(r)
    moves = table.compact(4)
    assert moves == [(11, 0), (10, 1), (9, 2)]
    assert table.live == [0, 1, 2]
    assert table.compact(4) == []  # already below


def test_compaction_refuses_more_live_rows_than_the_bound():
    table = RowTable(8)
    for _ in range(5):
        table.take()
    with pytest.raises(ValueError, match="cannot fit below 4"):
        table.compact(4)


def test_live_rows_stay_under_the_bucket_of_their_count():
    """Take lowest first, compact after leaving: every live row is below bucket(live count)."""
    bucket = linear(4, 32).round_up
    table = RowTable(32)
    rng = random.Random(0)
    for _ in range(500):
        if table.live and (rng.random() < 0.45 or table.free_count == 0):
            table.release(rng.choice(table.live))
            if table.live:
                table.compact(bucket(len(table.live)))
        else:
            table.take()
        if table.live:
            assert max(table.live) < bucket(len(table.live))
