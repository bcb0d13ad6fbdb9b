"""Abandoned requests, for the tests: clients that time out, and what the server shows after.

A client sends a non-streamed request and gives up before the answer; the
server must abort its sequences at once. These helpers send such requests,
wait for the engine's batch and queue gauges to fall to zero, count the
engine's decode steps meanwhile (fewer than one sequence run to its end
takes: the sequences were cut short), and read the request log lines the
server wrote for them.
"""

from __future__ import annotations

import re
import threading

import httpx

from tests.support.live_server import LiveServer
from tests.support.waiting import eventually

MAX_NEW = 480
"""Long enough that no abandoned request can finish before its client leaves (0.5 s)."""
CHAT = {"messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0}
COMPLETION = {"prompt": "Once upon a time", "max_tokens": MAX_NEW, "ignore_eos": True,
              "temperature": 0}
TGI = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": MAX_NEW}}
RESPONSES = {"input": "Tell me a long story.", "max_output_tokens": MAX_NEW, "temperature": 0}
"""Greedy decoding of this input runs to the limit, as TGI's does (the Responses API has no
`ignore_eos`)."""
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


def decode_steps(live: LiveServer, model: str) -> float:
    """The decode steps `model`'s engine has run (its `tgi_batch_inference_count`)."""
    text = httpx.get(f"{live.url}/metrics", timeout=30).text
    found = re.search(rf'^tgi_batch_inference_count\{{model="{re.escape(model)}",[^}}]*'
                      r'method="decode"\} (\S+)$', text, re.M)
    return float(found[1]) if found else 0.0


def wait_until_idle(live: LiveServer, model: str, steps_before: float,
                    timeout: float = 30.0) -> None:
    """Wait until `model`'s engine holds no sequence, and check that it got there by cutting
    the abandoned sequences short: fewer decode steps since `steps_before` (from
    :func:`decode_steps`) than one sequence of MAX_NEW tokens takes. (A count, not a clock:
    on a busy machine the engine may take seconds to go idle either way.)"""
    eventually(lambda: sequences_in_engine(live, model) == 0, timeout=timeout,
               what=f"{model}: no sequence left in the engine")
    steps = decode_steps(live, model) - steps_before
    assert steps < MAX_NEW - 1, f"{model}: {steps:.0f} decode steps: the sequences ran on"


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
    """The request log lines after offset `start` of the log, once there are `count` of them
    (fails after 30 s)."""
    def lines() -> list[str]:
        return [line for line in live.log()[start:].splitlines() if "switchyard.request" in line]

    eventually(lambda: len(lines()) >= count, timeout=30, interval=0.1,
               what=lambda: f"{count} request lines in:\n{live.log()[start:]}")
    return lines()
