"""StopMatcher: stop strings across deltas, hold-back, inclusion, earliest match."""

from __future__ import annotations

import random

import pytest

from switchyard.text import StopMatcher, StopStep


def run(matcher: StopMatcher, deltas: list[str]) -> tuple[list[str], bool]:
    shown: list[str] = []
    matched = False
    for delta in deltas:
        text, matched = matcher.feed(delta)
        shown.append(text)
        if matched:
            break
    if not matched:
        shown.append(matcher.flush())
    return shown, matched


def test_no_stop_strings_pass_through() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("abc") == StopStep("abc", False)
    assert matcher.flush() == ""


def test_empty_stop_strings_are_ignored() -> None:
    matcher = StopMatcher(["", "x", "x"])
    assert matcher.stop_strings == ("x",)
    assert StopMatcher([""]).feed("text") == ("text", False)


@pytest.mark.parametrize(("include", "expected"), [(True, "Hello World"), (False, "Hello ")])
def test_match_inside_one_delta_drops_the_rest(include: bool, expected: str) -> None:
    matcher = StopMatcher(["World"], include_stop=include)
    assert matcher.feed("Hello World and more") == (expected, True)
    assert matcher.matched and matcher.matched_stop == "World"
    assert matcher.feed("later") == ("", True)
    assert matcher.flush() == ""


def test_included_stop_streams_without_delay() -> None:
    # TGI keeps the stop string, so nothing needs holding back.
    matcher = StopMatcher(["World"], include_stop=True)
    shown, matched = run(matcher, ["Hel", "lo W", "or", "ld!", "x"])
    assert matched
    assert shown == ["Hel", "lo W", "or", "ld"]


def test_excluded_stop_is_held_back_across_deltas() -> None:
    matcher = StopMatcher(["World"], include_stop=False)
    assert matcher.feed("Hel") == ("Hel", False)
    assert matcher.feed("lo W") == ("lo ", False)
    assert matcher.pending == "W"
    assert matcher.feed("or") == ("", False)
    assert matcher.pending == "Wor"
    assert matcher.feed("ld!") == ("", True)


def test_held_text_is_released_when_it_diverges() -> None:
    matcher = StopMatcher(["</s>"], include_stop=False)
    assert matcher.feed("a<") == ("a", False)
    assert matcher.feed("/") == ("", False)
    assert matcher.feed("b") == ("</b", False)
    assert matcher.feed("<") == ("", False)
    assert matcher.flush() == "<"
    assert matcher.pending == ""


def test_overlapping_prefix() -> None:
    matcher = StopMatcher(["aab"], include_stop=False)
    shown, matched = run(matcher, ["a", "a", "a", "b", "c"])
    assert matched and "".join(shown) == "a"


@pytest.mark.parametrize(("include", "expected"), [(True, "hello w"), (False, "hel")])
def test_first_completed_stop_wins(include: bool, expected: str) -> None:
    # "lo w" is complete before "world" is, whatever the list order.
    for stops in (["world", "lo w"], ["lo w", "world"]):
        matcher = StopMatcher(stops, include_stop=include)
        assert matcher.feed("hello world") == (expected, True)
        assert matcher.matched_stop == "lo w"


def test_tie_on_end_prefers_the_longer_stop() -> None:
    matcher = StopMatcher(["bc", "abc"], include_stop=False)
    assert matcher.feed("xabcd") == ("x", True)
    assert matcher.matched_stop == "abc"


def test_unicode_stop_strings() -> None:
    matcher = StopMatcher(["。", "😀!"], include_stop=False)
    shown, matched = run(matcher, ["你好", "😀", "!", "。"])
    assert matched and "".join(shown) == "你好"
    assert matcher.matched_stop == "😀!"


def test_unmatched_stream_is_returned_whole() -> None:
    for include in (True, False):
        matcher = StopMatcher(["STOP"], include_stop=include)
        shown, matched = run(matcher, ["no ", "ST", "O", "P", "e"][:3])
        assert not matched and "".join(shown) == "no STO"


def _reference(text: str, stops: list[str], include: bool) -> tuple[str, bool]:
    """Whole-text answer: cut at the first-completed stop string."""
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s and s in text]
    if not found:
        return text, False
    end, start, _ = min(found)
    return (text[:end] if include else text[:start]), True


@pytest.mark.parametrize("include", [True, False])
def test_any_split_gives_the_same_result(include: bool) -> None:
    rng = random.Random(11)
    alphabet = "ab<>/ 😀"
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 25)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 5))) for _ in range(3)
        ]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randrange(0, 6))))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        shown, matched = run(StopMatcher(stops, include_stop=include), deltas)
        assert ("".join(shown), matched) == _reference(text, stops, include), (text, stops, deltas)
