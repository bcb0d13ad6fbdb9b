"""Find stop strings in streamed text.

The matcher sees text deltas, not tokens, so a stop string is found wherever
the deltas split it. The first stop string to be *completed* wins (smallest end
position; on a tie the one that starts first), which makes the result the same
however the text was cut into deltas.

Whether the stop string itself is shown differs by API: TGI keeps it at the end
of `generated_text`, OpenAI drops it. Only when it is dropped does text that
could begin a stop string have to be held back; when it is kept, everything up
to a possible match is shown anyway, so text streams without delay.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class StopStep(NamedTuple):
    """What one delta gives the client: `text` to show now, and whether a stop matched."""

    text: str
    matched: bool


class StopMatcher:
    """Match stop strings across text deltas of one sequence.

    `feed(delta)` returns a `StopStep`. Once a stop string matches, the text
    ends: that step's text ends at the stop string (inclusive when
    `include_stop`, TGI's behaviour; exclusive otherwise, OpenAI's) and later
    feeds return ("", True). Call `flush()` when the sequence ends without a
    match to release held-back text. Empty stop strings are ignored.
    """

    def __init__(self, stop_strings: Iterable[str], *, include_stop: bool = True) -> None:
        self._stops = tuple(dict.fromkeys(stop for stop in stop_strings if stop))
        self._include_stop = include_stop
        self._longest = max((len(stop) for stop in self._stops), default=0)
        # include_stop: the last few characters already shown, kept only so a
        # stop string that straddles deltas is recognised.
        # exclude: the characters not yet shown because they could begin one.
        self._tail = ""
        self._matched_stop: str | None = None

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The non-empty stop strings, deduplicated, in the given order."""
        return self._stops

    @property
    def matched(self) -> bool:
        """Whether a stop string has matched."""
        return self._matched_stop is not None

    @property
    def matched_stop(self) -> str | None:
        """The stop string that matched, if any."""
        return self._matched_stop

    @property
    def pending(self) -> str:
        """Text held back because it could begin a stop string (exclusive mode only)."""
        return "" if self._include_stop else self._tail

    def feed(self, delta: str, *, armed: bool = True) -> StopStep:
        """Add the next piece of generated text; return what to show now.

        A stop string counts only if it ends in a delta fed `armed` (OpenAI's
        `min_tokens`: no stop string before that many tokens); text fed unarmed
        is still held back where it could begin one that ends later.
        """
        if self._matched_stop is not None:
            return StopStep("", True)
        if not self._stops:
            return StopStep(delta, False)
        window = self._tail + delta
        found = self._earliest_match(window, len(self._tail)) if armed else None
        if found is not None:
            start, stop = found
            self._matched_stop = stop
            self._tail = ""
            if self._include_stop:
                # The window's tail part was shown already; cut the delta.
                return StopStep(delta[: start + len(stop) - (len(window) - len(delta))], True)
            return StopStep(window[:start], True)
        if self._include_stop:
            self._tail = window[-(self._longest - 1):] if self._longest > 1 else ""
            return StopStep(delta, False)
        hold = self._held_suffix_length(window)
        self._tail = window[len(window) - hold:] if hold else ""
        return StopStep(window[: len(window) - hold], False)

    def flush(self) -> str:
        """Release held-back text at the end of a sequence that did not match."""
        if self._matched_stop is not None or self._include_stop:
            return ""
        held, self._tail = self._tail, ""
        return held

    def _earliest_match(self, window: str, ended_before: int) -> tuple[int, str] | None:
        """The stop string completed first in `window`, among those that end past
        `ended_before` (the text before it was searched already, or fed unarmed)."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = window.find(stop, max(ended_before - len(stop) + 1, 0))
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _held_suffix_length(self, window: str) -> int:
        # Longest suffix of the window that is a proper prefix of a stop string.
        limit = min(len(window), self._longest - 1)
        for length in range(limit, 0, -1):
            suffix = window[len(window) - length:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return length
        return 0
