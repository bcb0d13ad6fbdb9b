"""N-gram speculative decoding on the Xeon engine: its settings, drafts and load gate.

With ``--engine-option speculate=K`` (TGI's ``--speculate K``) a decoding
sequence may feed, after its newest token, up to K tokens drafted from its
own prompt and output (:class:`~switchyard_engine.speculation.ngram.NgramIndex`).
The step scores all of them in one forward pass: each fed position is a
decode row over the sequence's block table, attending up to itself (so a
step of verifying and decoding rows stays on the decode kernel's one-call
layer loop), and the runner keeps the drafts the target model samples
itself (:func:`~switchyard_engine.speculation.acceptance.accept_matching`),
plus one more token: greedy output is token for token the output without
speculation, sampled output has its distribution. Keys and values written
for rejected drafts are left where they are: the sequence's cache length
stops before them, and the next step overwrites them.

The gate: a step speculates only when every sequence in it decodes, none
waits to join, and at most ``speculate_max_batch`` (default 4) sequences
run. Decoding a few rows reads every weight once per step whatever the row
count, so verifying K more positions costs little; a full batch is bound by
compute, where drafts would slow it down. Constrained rows (grammars) and
rows that score their prompt do not draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from switchyard_engine.speculation.ngram import NgramIndex
from switchyard_spec import EngineStartError

from switchyard_xeon.options import number
from switchyard_xeon.sequence import Sequence

MAX_SPECULATE = 16
"""The most tokens one step may draft for a sequence."""


@dataclass(frozen=True)
class SpeculationConfig:
    """The engine's n-gram speculation settings (``tokens == 0``: off)."""

    tokens: int = 0
    """Drafted tokens per sequence and step, at most (TGI's ``--speculate``)."""
    min_n: int = 2
    max_n: int = 4
    """The n-gram sizes looked up, longest first (vLLM's ``prompt_lookup_min/max``). A
    single-token match is too weak a guess: on the default model its drafts were kept
    about half as often (``benchmarks/speculation.py``)."""
    max_batch: int = 4
    """Sequences a step may hold and still speculate (the load gate)."""
    verify_rows: int = 0
    """The most positions a verifying sequence feeds (its newest token and its drafts);
    0: no bound but ``tokens``. The engine sets it to its linear kernels' row tile
    (:attr:`~switchyard_xeon.linears.PanelLinear.row_tile`): on the default model in
    bf16 the layers' panel linears took 10.8 ms for 1 row, 13.2 ms for 6 and 17.4 ms
    for 7 (2-core Xeon, AVX512_BF16), so a seventh row costs a third of a step for at
    most one more token."""

    @property
    def enabled(self) -> bool:
        """Whether any step may draft."""
        return self.tokens > 0

    @classmethod
    def from_options(cls, options: dict[str, str]) -> SpeculationConfig:
        """Read ``speculate``, ``speculate_ngram_min``, ``speculate_ngram_max`` and
        ``speculate_max_batch``; a bad value stops start-up naming the option."""
        def count(key: str, default: int, low: int, high: int) -> int:
            return int(number(options, key, int, default, low, high))

        config = cls(tokens=count("speculate", 0, 0, MAX_SPECULATE),
                     min_n=count("speculate_ngram_min", 2, 1, 16),
                     max_n=count("speculate_ngram_max", 4, 1, 16),
                     max_batch=count("speculate_max_batch", 4, 1, 1024))
        if config.min_n > config.max_n:
            raise EngineStartError(
                f"engine options speculate_ngram_min={config.min_n} and speculate_ngram_max="
                f"{config.max_n}: the smallest n-gram is larger than the largest")
        return config


def adapt(seq: Sequence, config: SpeculationConfig, drafted: int, kept: int) -> None:
    """Tune ``seq``'s draft limit to how its drafts fare: two more after a step that kept
    every draft, one fewer (at least one) after a step that did not (the schedule of
    transformers' assisted generation). Drafts that fail cost a verified row each; a text
    that stops repeating its input soon drafts one token a step."""
    limit = seq.draft_limit or config.tokens
    if kept == drafted:
        seq.draft_limit = min(config.tokens, limit + 2)
    else:
        seq.draft_limit = max(1, limit - 1)


def can_draft(seq: Sequence) -> bool:
    """Whether a sequence may draft at all: not constrained, not scoring its prompt."""
    return seq.request.constraint is None and not seq.wants_prompt_logprobs


def room(seq: Sequence, config: SpeculationConfig) -> int:
    """How many drafts ``seq``'s next step may feed: at most its draft limit, the row
    bound less one, and what it may still generate less one (the step always adds a
    token of its own)."""
    limit = seq.draft_limit or config.tokens
    if config.verify_rows:
        limit = min(limit, config.verify_rows - 1)
    return max(0, min(limit, seq.max_length - len(seq.tokens) - 1))


class Drafter(Protocol):
    """Where a step's drafts come from: the sequence's own text, or a draft model."""

    method: str
    """The method's name on ``/metrics`` (``ngram``, ``draft_model``)."""

    def draft(self, seq: Sequence, room: int) -> list[int]:
        """Up to ``room`` (at least 1) tokens guessed to follow ``seq.tokens``. A drafter
        that samples its drafts leaves their probabilities in ``seq.draft_probs``."""
        ...

    def settle(self, seq: Sequence, cached: int) -> None:
        """After a verifying step: ``seq``'s first ``cached`` tokens are now final."""
        ...

    def forget(self, seq: Sequence) -> None:
        """``seq`` ended: drop whatever the drafter keeps for it."""
        ...


@dataclass(frozen=True)
class NgramDrafter:
    """Prompt-lookup drafts: what followed the latest earlier occurrence of the
    sequence's last n tokens, n from ``max_n`` down to ``min_n``."""

    min_n: int
    max_n: int
    method: str = "ngram"

    def draft(self, seq: Sequence, room: int) -> list[int]:
        """See :class:`Drafter`."""
        if seq.ngrams is None:
            seq.ngrams = NgramIndex(self.min_n, self.max_n)
        return seq.ngrams.draft(seq.tokens, room)

    def settle(self, seq: Sequence, cached: int) -> None:
        """Nothing to do: the index grows with the sequence's tokens."""

    def forget(self, seq: Sequence) -> None:
        """Nothing to do: the index lives on the sequence."""
