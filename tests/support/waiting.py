"""Waiting on a condition instead of sleeping a fixed time: :func:`eventually`."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(condition: Callable[[], T], timeout: float = 30.0, interval: float = 0.05,
               what: str | Callable[[], str] = "the condition",
               ignoring: tuple[type[BaseException], ...] = ()) -> T:
    """Call ``condition`` until it returns a true value, and return that value.

    It is called at once, then every ``interval`` seconds; after ``timeout``
    seconds without a true value the test fails with an ``AssertionError``
    naming ``what`` (a string, or a callable called then, such as a server's
    log) and the last value. Exceptions of the types in ``ignoring`` (a server
    not listening yet) count as a false value; any other propagates.

    ``timeout`` bounds a wait for an event that happens in far less time; it
    is not a measurement, so it is generous (a busy 2-core machine runs many
    times slower than an idle one).
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except ignoring as error:
            value = error  # type: ignore[assignment]
        else:
            if value:
                return value
        if time.monotonic() >= deadline:
            detail = what() if callable(what) else what
            raise AssertionError(f"{detail}: still not so after {timeout:g} s "
                                 f"(last: {value!r})"[:4000])
        time.sleep(interval)  # the polling interval between two looks at the condition
