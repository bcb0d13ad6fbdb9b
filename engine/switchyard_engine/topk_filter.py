"""Top-k and top-p filtering on a few hundred candidates instead of the whole vocabulary.

Sorting every sampled row's vocabulary (50k-250k entries, with their ids)
costs more than a small model's forward pass on a CPU. The entries top-k and
top-p keep are the highest-scoring ones, so :func:`filter_candidates` takes the
``K`` best (``K = max(top_k, CANDIDATES)``, capped at the vocabulary) and
filters those.

The result is the kept set of :func:`filter_exact`, the full sort this module
replaced (transformers' semantics: ties with the k-th value stay, the first
entry always stays, an entry goes when the probability mass strictly before it
reaches ``top_p``). A row whose candidates cannot prove their answer is
refiltered over its whole vocabulary:

* its top-p cut might lie beyond its ``K`` candidates (they hold less than
  ``top_p`` of the mass and top-k does not cut first),
* the mass before some candidate is within float32 rounding of ``top_p``: the
  candidates normalise their probabilities over the vocabulary in another order
  than the sorted row does, so a last-bit difference could flip a token,
* the cut falls inside a run of equal scores, where which of them stay depends on
  how the full sort orders ties.

The first two need only the sorted *values* of the row (:func:`_filter_sorted`):
the same values in the same order give the full sort's probabilities to the
last bit, and a value-only sort is several times cheaper than ``torch.sort``
on a CPU. The third needs the full sort itself, ids and all.

Every decision depends on the row's own scores and parameters (a row's ``K``
ignores its batch mates even though the batch shares one ``topk`` call), so a
row takes the same path, and keeps the same tokens, in any batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

CANDIDATES = 256
"""Candidates per row when top-k asks for fewer: enough for top-p on peaked distributions."""

_NEG_INF = float("-inf")


def top_p_margin(vocab: int) -> float:
    """How close to ``top_p`` the mass before a candidate may come before its row is refiltered.

    Only rows without top-k need it: their probabilities are normalised over the whole
    vocabulary, which the full sort sums in sorted order and the candidates in vocabulary
    order. Both float32 sums drift (adding ever smaller terms in sorted order rounds most),
    and they differ by up to about ``vocab * 3e-10`` (1.6e-5 measured at 49152, 6e-5 at
    262144, on Gaussian logits of many scales); the margin is about three times that.
    """
    return 4e-6 + vocab * 2.0**-30


@dataclass(frozen=True, slots=True)
class Filtered:
    """The outcome of :func:`filter_candidates` for ``n`` rows.

    ``scores`` ([n, vocab]) holds the kept scores and -inf elsewhere, for every
    row. ``cand_scores`` and ``cand_ids`` ([n, width]) list each row's
    candidates by descending score, ties by ascending id, with removed entries
    at -inf; ``kept`` ([n]) counts the kept ones, which come first. ``exact``
    ([n], bool) marks the rows refiltered over their whole vocabulary: their
    candidate lists do not describe their kept set. ``any_exact`` says on the
    host whether there is any.
    """

    scores: torch.Tensor
    cand_scores: torch.Tensor
    cand_ids: torch.Tensor
    kept: torch.Tensor
    exact: torch.Tensor
    any_exact: bool


def filter_candidates(
    scaled: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]
) -> Filtered:
    """Top-k then top-p on temperature-scaled ``scaled`` ([n, vocab]), one row per parameter.

    ``top_k`` 0 (or >= vocab) and ``top_p`` 1.0 switch a filter off; every row must
    have at least one of them on (a row with neither keeps everything, no filter needed).
    """
    vocab = scaled.shape[1]
    device = scaled.device
    ks = [k if 0 < k < vocab else 0 for k in top_k]
    if not all(k or p < 1.0 for k, p in zip(ks, top_p)):
        raise ValueError("every row given to filter_candidates must ask for top-k or top-p")
    row_k = [min(max(k, CANDIDATES), vocab) for k in ks]
    # One entry past the largest K, so that every row can see the entry after its last
    # candidate and tell whether a run of equal scores continues past its cut.
    width = min(max(row_k) + 1, vocab)
    vals, ids = scaled.topk(width, dim=-1)
    # topk orders equal scores as it pleases (and differently for different widths); one
    # order by (score desc, id asc) makes a row's list independent of its batch mates.
    ids, perm = ids.sort(dim=-1)
    vals, perm = vals.gather(1, perm).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, perm)

    col = torch.arange(width, device=device)
    outside = col >= torch.tensor(row_k, device=device)[:, None]
    k_t = torch.tensor(ks, device=device)
    kth = vals.gather(1, (k_t.clamp(min=1) - 1)[:, None])
    # Compare with the k-th value (not the rank) so ties with it stay, as in transformers.
    remove_k = outside | ((k_t > 0)[:, None] & (vals < kth))

    tp = scaled.new_tensor(list(top_p))[:, None]
    # With top-k (or with every entry a candidate), the softmax over the candidates sees
    # the same values in the same order as the full sort's softmax: the same probabilities
    # to the last bit. Without top-k the candidates hold only part of the vocabulary's mass.
    partial = [not k and p < 1.0 and k_r < vocab for k, p, k_r in zip(ks, top_p, row_k)]
    if all(partial):
        probs = torch.softmax(scaled, dim=-1).gather(1, ids).masked_fill(outside, 0.0)
    else:
        probs = torch.softmax(vals.masked_fill(remove_k, _NEG_INF), dim=-1)
        if any(partial):
            idx = torch.tensor([i for i, p in enumerate(partial) if p], device=device)
            full = torch.softmax(scaled[idx], dim=-1).gather(1, ids[idx])
            probs = probs.index_copy(0, idx, full.masked_fill(outside[idx], 0.0))
    before = probs.cumsum(dim=-1) - probs
    remove = remove_k | ((tp < 1.0) & (before >= tp))
    # The most likely token always stays, even when float32 rounds a tiny top_p to 0.
    remove[:, 0] = False
    kept = (~remove).sum(dim=-1)

    # The next entry after the last kept one has the same score: the cut splits a run of
    # ties, or (at the K-th candidate) the run goes on beyond the candidates.
    split_tie = _splits_a_tie(vals, kept)
    # Without top-k, entries beyond the K candidates stay unless the K hold top_p of the
    # mass; and a mass within rounding of top_p might compare the other way in the sort.
    margin = top_p_margin(vocab)
    short = probs.sum(dim=-1) < tp[:, 0] + margin
    close = ((col > 0) & ~outside & ((before - tp).abs() < margin)).any(dim=-1)
    exact = split_tie | (torch.tensor(partial, device=device) & (short | close))

    cand_scores = vals.masked_fill(remove, _NEG_INF)
    scores = torch.full_like(scaled, _NEG_INF).scatter_(1, ids, cand_scores)
    # A device-to-host sync, like warp's overflow check: refiltering is rare and worth it.
    any_exact = bool(exact.any())
    if any_exact:
        rows = exact.nonzero()[:, 0]
        scores.index_copy_(0, rows, _filter_sorted(scaled[rows], k_t[rows], tp[rows]))
    return Filtered(scores, cand_scores, ids, kept, exact, any_exact)


def _splits_a_tie(sorted_scores: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Whether each row's entry right after its ``kept`` first ones scores the same as the last."""
    width = sorted_scores.shape[1]
    last = sorted_scores.gather(1, (kept - 1)[:, None])[:, 0]
    after = sorted_scores.gather(1, kept.clamp(max=width - 1)[:, None])[:, 0]
    return (kept < width) & (last == after)


def _filter_sorted(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """:func:`filter_exact` from the sorted values alone, handing it the rows that split ties.

    Which values stay depends only on the sorted values; which ids carry them too,
    unless the cut splits a run of equal values.
    """
    sorted_scores = _sorted_values(scaled)
    kept = _kept_count(sorted_scores, top_k, top_p)
    lowest = sorted_scores.gather(1, (kept - 1)[:, None])
    out = scaled.masked_fill(scaled < lowest, _NEG_INF)
    split = _splits_a_tie(sorted_scores, kept)
    if bool(split.any()):
        rows = split.nonzero()[:, 0]
        out.index_copy_(0, rows, filter_exact(scaled[rows], top_k[rows], top_p[rows]))
    return out


def _sorted_values(scaled: torch.Tensor) -> torch.Tensor:
    """Each row's values in descending order (equal values are equal: their order is moot)."""
    if scaled.device.type != "cpu":
        return scaled.sort(dim=-1, descending=True).values
    # numpy sorts float32 values with SIMD, four to six times faster than torch.sort,
    # which also sorts the ids along.
    ascending = np.sort(scaled.detach().numpy(), axis=-1)
    return torch.from_numpy(np.ascontiguousarray(ascending[:, ::-1]))


def _kept_count(sorted_scores: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor) -> torch.Tensor:
    """How many first entries of descending ``sorted_scores`` top-k and top-p keep.

    :func:`_remove_sorted` as a count, in fewer passes over the rows: both filters
    remove a suffix (the probabilities fall along the sorted row, so the mass before
    each entry only grows), so each keeps a prefix, found by counting or by a search.
    """
    vocab = sorted_scores.shape[1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    kth = sorted_scores.gather(1, (k - 1)[:, None])
    below = sorted_scores < kth
    probs = torch.softmax(sorted_scores.masked_fill(below, _NEG_INF), dim=-1)
    before = probs.cumsum(dim=-1) - probs
    by_k = vocab - below.sum(dim=-1)
    by_p = torch.searchsorted(before, top_p.contiguous())[:, 0]
    by_p = torch.where(top_p[:, 0] < 1.0, by_p, vocab)
    # The most likely entry always stays.
    return torch.minimum(by_k, by_p).clamp(min=1)


def _remove_sorted(sorted_scores: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor) -> torch.Tensor:
    """Which entries of descending ``sorted_scores`` top-k and top-p remove (a suffix per row)."""
    vocab = sorted_scores.shape[1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    kth = sorted_scores.gather(1, (k - 1)[:, None])
    remove = sorted_scores < kth
    probs = torch.softmax(sorted_scores.masked_fill(remove, _NEG_INF), dim=-1)
    before = probs.cumsum(dim=-1) - probs
    # Only rows that ask for top-p: in float32 the mass before the last entries can round
    # to 1.0 or above, which would cut a top_p=1 row's tail.
    remove |= (top_p < 1.0) & (before >= top_p)
    remove[:, 0] = False
    return remove


def filter_exact(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k then top-p by sorting each row's whole vocabulary; removed entries become -inf.

    ``top_k`` ([n], 0 for none) and ``top_p`` ([n, 1], 1.0 for none) hold each row's values.
    """
    sorted_scores, order = scaled.sort(dim=-1, descending=True)
    remove = _remove_sorted(sorted_scores, top_k, top_p)
    return scaled.masked_fill(remove.scatter(1, order, remove), _NEG_INF)
