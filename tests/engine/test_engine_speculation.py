"""Speculative decoding's drafting and acceptance rules, against their definitions.

The n-gram index is checked against a brute-force search written here. The
acceptance rules are checked by what they promise: greedy output token for
token equal to the target alone, and sampled output with the target's
distribution, measured on a small vocabulary as the joint distribution of
the first two tokens of many short generations (a chi-square test at
significance 1e-6 with fixed seeds, so a run is reproducible and a correct
rule fails it for one seed in a million); a rule that keeps every draft,
which has the draft model's distribution instead, fails the same test.
"""

from __future__ import annotations

import random

import pytest
import torch
from switchyard_engine.speculation.acceptance import accept_matching, accept_rejection
from switchyard_engine.speculation.ngram import NgramIndex

ALPHA = 1e-6


def _brute_draft(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition: the longest tail n-gram's latest earlier occurrence's continuation."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = tokens[length - n:]
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n:end] == tail:
                return tokens[end:min(end + k, length)]
    return []


def test_a_repeated_run_is_drafted_from_its_last_occurrence():
    index = NgramIndex(min_n=1, max_n=3)
    text = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert index.draft(text, 4) == [8, 9, 1, 2]
    assert index.draft([*text, 8, 9], 2) == [1, 2]  # the index catches up as the list grows
    assert NgramIndex(2, 2).draft([1, 2, 3, 4], 3) == []  # the tail never occurred before
    assert index.draft([3], 4) == [] and index.draft(text, 0) == []


def test_the_longest_ngram_wins_over_a_more_recent_shorter_one():
    # Tail (1, 2, 3): its 3-gram occurred at the start (continuation 4); its 1-gram (3)
    # occurred more recently (continuation 9).
    tokens = [1, 2, 3, 4, 0, 3, 9, 1, 2, 3]
    assert NgramIndex(1, 3).draft(tokens, 1) == [4]
    assert NgramIndex(1, 1).draft(tokens, 1) == [9]


@pytest.mark.parametrize("seed", range(20))
def test_the_incremental_index_drafts_what_the_definition_says(seed):
    rnd = random.Random(seed)
    vocab = rnd.choice([2, 3, 5, 50])
    min_n, max_n = sorted(rnd.sample(range(1, 5), 2)) if rnd.random() < 0.8 else (2, 2)
    index = NgramIndex(min_n, max_n)
    tokens: list[int] = []
    for _ in range(120):
        tokens.extend(rnd.randrange(vocab) for _ in range(rnd.choice([1, 1, 2, 4])))
        k = rnd.randrange(1, 6)
        assert index.draft(tokens, k) == _brute_draft(tokens, k, min_n, max_n), tokens


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(0, 2)
    with pytest.raises(ValueError, match="min_n"):
        NgramIndex(3, 2)


# ------------------------------------------------------------------ acceptance

def _chain(seed: int, vocab: int, sharp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A first-token distribution [vocab] and a transition matrix [vocab, vocab]."""
    gen = torch.Generator().manual_seed(seed)
    first = torch.softmax(torch.randn(vocab, generator=gen, dtype=torch.float64) * sharp, 0)
    step = torch.softmax(torch.randn(vocab, vocab, generator=gen, dtype=torch.float64) * sharp,
                         1)
    return first, step


def _dist(chain: tuple[torch.Tensor, torch.Tensor], context: list[int]) -> torch.Tensor:
    first, step = chain
    return first if not context else step[context[-1]]


def _chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """The p-value of Pearson's chi-square statistic (cells of expected count > 0)."""
    live = expected > 0
    stat = float(((counts[live] - expected[live]) ** 2 / expected[live]).sum())
    df = int(live.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _joint_counts(generate: object, vocab: int, trials: int) -> torch.Tensor:
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    for _ in range(trials):
        a, b = generate()  # type: ignore[operator]
        counts[a * vocab + b] += 1
    return counts


def _target_joint(chain: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    first, step = chain
    return (first[:, None] * step).flatten()


def _two_tokens(step_fn) -> tuple[int, int]:
    """Run speculative steps until two tokens are out; the first two."""
    out: list[int] = []
    while len(out) < 2:
        out.extend(step_fn(out))
    return out[0], out[1]


VOCAB, TRIALS = 4, 20_000


def test_greedy_matching_is_the_targets_greedy_output():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 9, generator=gen)  # the target's logits after context length i

    def greedy(context: list[int]) -> int:
        return int(logits[len(context)].argmax())

    want = []
    for _ in range(30):
        want.append(greedy(want))
    rnd = random.Random(1)
    out: list[int] = []
    while len(out) < 30:
        drafts = [rnd.randrange(9) if rnd.random() < 0.4 else want[len(out) + j]
                  for j in range(min(4, 30 - len(out)))]
        out.extend(accept_matching(drafts, lambda j, kept: greedy(out + kept)))
    assert out[:30] == want


def test_matching_deterministic_drafts_keeps_the_target_distribution():
    target = _chain(3, VOCAB, 1.5)
    gen = torch.Generator().manual_seed(11)

    def step(out: list[int]) -> list[int]:
        drafts = [(len(out) + 1) % VOCAB, 2]  # any deterministic guess
        return accept_matching(drafts, lambda j, kept: int(torch.multinomial(
            _dist(target, out + kept), 1, generator=gen)))

    counts = _joint_counts(lambda: _two_tokens(step), VOCAB, TRIALS)
    assert _chi_square_p(counts, _target_joint(target) * TRIALS) > ALPHA


def _rejection_counts(accept, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    target, draft_model = _chain(5, VOCAB, 1.5), _chain(6, VOCAB, 1.5)
    gen = torch.Generator().manual_seed(seed)

    def step(out: list[int]) -> list[int]:
        drafts: list[int] = []
        q_rows = []
        for _ in range(3):  # three drafts from a model that often disagrees
            q = _dist(draft_model, out + drafts)
            q_rows.append(q)
            drafts.append(int(torch.multinomial(q, 1, generator=gen)))
        p_rows = [_dist(target, out + drafts[:j]) for j in range(4)]
        return accept(torch.stack(p_rows), torch.stack(q_rows), drafts, gen)

    counts = _joint_counts(lambda: _two_tokens(step), VOCAB, TRIALS)
    return counts, _target_joint(target) * TRIALS


def test_rejection_sampling_keeps_the_target_distribution_with_a_disagreeing_draft():
    counts, expected = _rejection_counts(accept_rejection, seed=21)
    assert _chi_square_p(counts, expected) > ALPHA


def test_the_test_fails_a_rule_that_keeps_every_draft():
    def keep_all(target, draft, drafts, gen):
        return [*drafts, int(torch.multinomial(target[len(drafts)], 1, generator=gen))]

    counts, expected = _rejection_counts(keep_all, seed=21)
    assert _chi_square_p(counts, expected) < ALPHA


def test_rejection_needs_one_more_target_row_than_drafts():
    with pytest.raises(ValueError, match="2 drafts need 3 target rows"):
        accept_rejection(torch.ones(2, 4) / 4, torch.ones(2, 4) / 4, [0, 1])
