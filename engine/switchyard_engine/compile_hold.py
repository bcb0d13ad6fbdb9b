"""Constrained sequences held out of an engine's queue while their grammar compiles.

A grammar compiles in a worker thread (:mod:`switchyard_engine.grammar`). Had
its sequence entered a step before the compile finished, that step, and every
sequence in it, would wait. So an engine admits a constrained sequence into
this hold, starts its compile, and moves it to its scheduler once the
grammar has compiled or failed (a failed row then ends with the error at its
first step). Owned by the engine's compute thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from switchyard_engine.grammar import grammar_settled
from switchyard_engine.sequence import BaseSequence

S = TypeVar("S", bound=BaseSequence)

COMPILE_POLL_S = 0.002
"""How long an otherwise idle loop waits for commands while a compile is pending."""


class CompileHold(Generic[S]):
    """The sequences whose grammar is still compiling, in admission order."""

    def __init__(self) -> None:
        self._held: list[S] = []

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[S]:
        return iter(list(self._held))

    def hold(self, seq: S) -> bool:
        """Keep ``seq`` here if its grammar is still compiling; False when it may be scheduled."""
        if grammar_settled(seq.sampler.grammar):
            return False
        self._held.append(seq)
        return True

    def release(self) -> list[S]:
        """Take out the sequences whose grammar has compiled or failed."""
        ready = [s for s in self._held if grammar_settled(s.sampler.grammar)]
        self._held = [s for s in self._held if s not in ready]
        return ready

    def remove(self, seq: S) -> bool:
        """Take ``seq`` out (an abort, a failure); whether it was here."""
        if seq in self._held:
            self._held.remove(seq)
            return True
        return False

    def idle_wait(self, idle_s: float) -> float:
        """How long an idle loop may block on its inbox: briefly while a compile is pending."""
        return COMPILE_POLL_S if self._held else idle_s
