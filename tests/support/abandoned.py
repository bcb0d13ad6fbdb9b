"""Abandoned requests, for the tests: clients that time out, and what the server shows after.

A client sends a non-streamed request and gives up before the answer; the
server must abort its sequences at once. These helpers send such requests,
wait for the engine's batch and queue gauges to fall to zero, and read the
request log lines the server wrote for them.
"""

from __future__ import annotations

import re
import threading
import time

import httpx

from tests.conftest import LiveServer

MAX_NEW = 480
"""Long enough that no abandoned request can finish before its client leaves (0.5 s)."""
CHAT = {"messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0}
COMPLETION = {"prompt": "Once upon a time", "max_tokens": MAX_NEW, "ignore_eos": True,
              "temperature": 0}
TGI = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": MAX_NEW}}
"""Greedy decoding of this prompt runs to the limit (TGI has no `ignore_eos`)."""
_GAUGE = re.compile(r'^tgi_(?:batch_current|queue)_size\{model="(?P<model>[^"]*)"[^}]*\} (\S+)$',
                    re.M)


def abandon(url: str, path: str, body: dict[str, object], count: int,
            headers: dict[str, str] | None = None, wait: float = 0.5) -> None:
    """Send `count` requests at once, each from a client that gives up after `wait` seconds."""
    def one() -> None:
        try:
            r = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=wait)
        except httpx.TimeoutException:
            return
        raise AssertionError(f"answered before its client left: {r.status_code} {r.text[:200]}")

    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def sequences_in_engine(live: LiveServer, model: str) -> float:
    """Sequences running or waiting in `model`'s engine (its batch and queue gauges)."""
    text = httpx.get(f"{live.url}/metrics", timeout=30).text
    values = [float(m[2]) for m in _GAUGE.finditer(text) if m["model"] == model]
    assert len(values) == 2, text
    return sum(values)


def wait_until_idle(live: LiveServer, model: str, within: float) -> float:
    """Seconds until `model`'s engine holds no sequence; fails after `within`."""
    start = time.monotonic()
    while sequences_in_engine(live, model) > 0:
        elapsed = time.monotonic() - start
        assert elapsed < within, f"{model}: sequences still in the engine after {elapsed:.1f}s"
        time.sleep(0.05)
    return time.monotonic() - start


def dropped_lines(live: LiveServer, start: int, count: int, sequences: int = 1) -> list[str]:
    """The request log lines of `count` abandoned requests logged after offset `start`,
    each of `sequences` sequences."""
    lines = request_lines(live, start, count)
    assert len(lines) == count, live.log()[start:]
    for line in lines:
        assert " 499 " in line and "error=dropped" in line and "WARNING" in line, line
        generated = int(re.search(r"tokens=\d+\+(\d+)", line)[1])
        # Cut short: a request that ran on after its client left would log MAX_NEW each.
        assert generated < MAX_NEW * sequences, line
    return lines




def request_lines(live: LiveServer, start: int, count: int) -> list[str]:
    """Wait (30 s at most) for `count` request log lines after offset `start` of the log."""
    deadline = time.monotonic() + 30
    while True:
        lines = [line for line in live.log()[start:].splitlines() if "switchyard.request" in line]
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.1)
