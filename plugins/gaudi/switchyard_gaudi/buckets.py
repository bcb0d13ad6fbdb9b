"""Bucket sizes: the few values a dimension (batch rows, prompt length) is padded up to.

Static-shape devices compile one graph per shape, so every batch is padded to
one of a small set of sizes. Two ways to choose them:

- linear (the seed's ``BATCH_BUCKET_SIZE``, ``PREFILL_BATCH_BUCKET_SIZE``,
  ``PAD_SEQUENCE_TO_MULTIPLE_OF``): every multiple of a step;
- exponential (``BATCH_SIZE_EXPONENT_BASE``, ``SEQ_LEN_EXPONENT_BASE``, as
  TGI's later Gaudi code): a first size times powers of a base.

Either way the limit itself is the last bucket, so any limit works (no
power-of-two or multiple-of-step requirement: tgi-gaudi#256): with a step of
8 and a limit of 20, the buckets are 8, 16, 20, and nothing is ever padded
past what the limit allows. Pure Python, no torch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass


class BucketError(ValueError):
    """A size is larger than the last bucket, or buckets were asked for nonsense."""


@dataclass(frozen=True)
class Buckets:
    """Ascending sizes, the last being the limit; :meth:`round_up` pads to them."""

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.sizes or any(b <= a for a, b in zip(self.sizes, self.sizes[1:], strict=False)) \
                or self.sizes[0] < 1:
            raise BucketError(f"buckets must be positive and strictly ascending: {self.sizes}")

    @property
    def limit(self) -> int:
        """The largest size: nothing larger can be padded."""
        return self.sizes[-1]

    def round_up(self, n: int) -> int:
        """The smallest bucket that holds ``n`` (n >= 1); BucketError past the limit."""
        if n < 1:
            raise BucketError(f"cannot bucket {n}: sizes start at 1")
        i = bisect.bisect_left(self.sizes, n)
        if i == len(self.sizes):
            raise BucketError(f"{n} is larger than the last bucket {self.limit}")
        return self.sizes[i]

    def up_to(self, bound: int) -> Buckets:
        """The buckets not larger than ``bound`` (at least the first one)."""
        kept = tuple(s for s in self.sizes if s <= bound)
        return Buckets(kept or self.sizes[:1])

    def __len__(self) -> int:
        return len(self.sizes)

    def __iter__(self):
        return iter(self.sizes)


def linear(step: int, limit: int, start: int | None = None) -> Buckets:
    """``start``, ``start + step``, ... below ``limit``, then ``limit`` (``start``: ``step``).

    With the default start these are the multiples of ``step``. A start at or
    above the limit leaves one bucket, the limit.
    """
    start = step if start is None else start
    if step < 1 or limit < 1 or start < 1:
        raise BucketError(f"step ({step}), start ({start}) and limit ({limit}) must be at "
                          "least 1")
    return Buckets((*range(start, limit, step), limit))


def exponential(base: int, limit: int, first: int = 1) -> Buckets:
    """``first * base**k`` for every k below ``limit``, then ``limit``.

    ``first`` is 1 for batch sizes and ``PAD_SEQUENCE_TO_MULTIPLE_OF`` for
    prompt lengths (TGI's later Gaudi code grows both by powers of two).
    """
    if base < 2 or first < 1 or limit < 1:
        raise BucketError(f"base ({base}) must be at least 2, first ({first}) and limit "
                          f"({limit}) at least 1")
    sizes = []
    size = first
    while size < limit:
        sizes.append(size)
        size *= base
    return Buckets((*sizes, limit))


def choose(step: int, base: int | None, limit: int, first: int = 1,
           floor: int | None = None) -> Buckets:
    """Linear buckets of ``step``, or exponential ones when a ``base`` is set.

    ``floor`` (vision-language models' ``BASE_IMAGE_TOKENS``) is the first
    bucket: linear ones then go ``floor``, ``floor + step``, ..., exponential
    ones ``floor``, ``floor * base``, ..., each ending at ``limit``.
    """
    if floor is not None:
        return linear(step, limit, start=floor) if base is None \
            else exponential(base, limit, first=floor)
    return linear(step, limit) if base is None else exponential(base, limit, first)
