"""Bucketing is pure: any step, any limit, linear or exponential, no model."""

from __future__ import annotations

import pytest
from switchyard_gaudi.buckets import BucketError, Buckets, choose, exponential, linear


def test_linear_steps_end_at_any_limit():
    assert linear(8, 20).sizes == (8, 16, 20)  # 20 is no multiple of 8: still the last bucket
    assert linear(8, 24).sizes == (8, 16, 24)
    assert linear(128, 1000).sizes == (128, 256, 384, 512, 640, 768, 896, 1000)
    assert linear(4, 3).sizes == (3,)  # a step past the limit leaves the limit alone
    assert linear(1, 3).sizes == (1, 2, 3)


def test_round_up_pads_to_the_smallest_bucket_that_holds():
    b = linear(8, 20)
    assert [b.round_up(n) for n in (1, 8, 9, 16, 17, 20)] == [8, 8, 16, 16, 20, 20]
    with pytest.raises(BucketError, match="larger than the last bucket 20"):
        b.round_up(21)
    with pytest.raises(BucketError):
        b.round_up(0)


def test_exponential_buckets_grow_by_the_base_and_end_at_the_limit():
    assert exponential(2, 40).sizes == (1, 2, 4, 8, 16, 32, 40)
    assert exponential(2, 1000, first=128).sizes == (128, 256, 512, 1000)
    assert exponential(3, 27).sizes == (1, 3, 9, 27)
    assert exponential(2, 100, first=128).sizes == (100,)


def test_choose_picks_linear_unless_a_base_is_set():
    assert choose(8, None, 20).sizes == (8, 16, 20)
    assert choose(8, 2, 20).sizes == (1, 2, 4, 8, 16, 20)
    assert choose(128, 2, 1000, first=128).sizes == (128, 256, 512, 1000)


def test_up_to_keeps_at_least_one_bucket():
    b = linear(4, 16)
    assert b.up_to(9).sizes == (4, 8)
    assert b.up_to(2).sizes == (4,)


@pytest.mark.parametrize("sizes", [(), (0, 1), (4, 4), (8, 4)])
def test_buckets_must_be_positive_and_ascending(sizes):
    with pytest.raises(BucketError):
        Buckets(sizes)


@pytest.mark.parametrize("args", [(0, 8), (8, 0)])
def test_nonsense_steps_are_refused(args):
    with pytest.raises(BucketError):
        linear(*args)
    with pytest.raises(BucketError):
        exponential(1, 8)
