"""One model's constrained rows, handled the same way by every engine.

An engine holds one :class:`GrammarRows` per model. It builds the model's
:class:`~switchyard_engine.grammar.GrammarSupport` (tokenizer wrap, compiler,
cache) on first use from the folder the model was loaded from, starts each
constrained sequence's compile, and, at warmup, wraps the tokenizer before
the engine reports warm. One failure policy: when the folder is unknown, a
constrained sequence gets a grammar that fails its row alone with the reason
(never a row left unconstrained, which would answer free text to a request
that asked for a schema).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from switchyard_engine.grammar import GrammarSupport, failed_state
from switchyard_engine.sequence import BaseSequence

UNKNOWN_FOLDER = "constrained decoding: the folder the model was loaded from is unknown"
"""The error a constrained row fails with when no tokenizer can be found for it."""
WRAP_TIMEOUT_S = 300.0
"""How long warmup waits for the tokenizer's wrap before it reports warm anyway."""


class GrammarRows:
    """Grammar compiles for one model's sequences.

    ``folder`` returns the model's folder (None when unknown); it is asked
    once, when the support is first needed. ``mask`` (optional) returns the
    function that writes bitmasks onto logits (a native kernel, where one
    loaded). The support is sized to the logits' width (the samplers'
    ``vocab_size``), so the padded columns of a padded vocabulary are masked too.
    """

    def __init__(self, folder: Callable[[], str | None],
                 mask: Callable[[], Any] | None = None) -> None:
        self._folder = folder
        self._mask = mask
        self.support: GrammarSupport | None = None
        """The model's grammar support, once built (None before, or without a folder)."""

    def _ensure(self, vocab_size: int) -> GrammarSupport | None:
        if self.support is None:
            folder = self._folder()
            if folder is None:
                return None
            mask = self._mask() if self._mask is not None else None
            self.support = GrammarSupport(folder, vocab_size, mask=mask)
        return self.support

    def start(self, seq: BaseSequence) -> None:
        """Start compiling ``seq``'s grammar in the worker, unless it has one already."""
        if seq.request.constraint is None or seq.sampler.grammar is not None:
            return
        support = self._ensure(seq.sampler.vocab_size)
        if support is None:  # the row fails alone (GrammarState.error), not the step
            seq.sampler.grammar = failed_state(UNKNOWN_FOLDER)
            return
        seq.sampler.grammar = support.start(seq.request)

    def prepare(self, vocab_size: int, log: logging.Logger) -> None:
        """Wrap the tokenizer now and wait for it (at warmup, before requests arrive;
        ``vocab_size`` is the logits' width).

        Otherwise a model's first constrained request waits for the wrap, and
        done in the background after warmup it takes CPU from the first
        requests served. A failure is logged here and reported by the first
        constrained request, not fatal: unconstrained requests need no wrap.
        """
        support = self._ensure(vocab_size)
        if support is None:
            return
        begin = time.perf_counter()
        try:
            support.prepare().result(timeout=WRAP_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - reported again by the first constrained request
            log.warning("constrained decoding: the tokenizer's wrap failed (%s)", exc)
            return
        log.info("constrained decoding: tokenizer wrapped in %.2fs", time.perf_counter() - begin)
