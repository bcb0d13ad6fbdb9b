"""Abandoned requests, for the tests: clients that leave while their work runs, and what the
server shows after.

A client sends a non-streamed request and gives up before the answer; the
server must abort its sequences at once. :func:`abandon` sends such requests
on raw connections and closes them once the engine's batch and queue gauges
hold every one of their sequences: the clients leave on that event, not after
a guessed time, so their work is still running when they go on any machine,
however fast. The other helpers wait for those gauges to fall to zero, count
the engine's decode steps meanwhile (fewer than one sequence run to its end
takes: the sequences were cut short), and read the request log lines the
server wrote for them.
"""

from __future__ import annotations

import json
import re
import socket
from contextlib import ExitStack

import httpx

from tests.support.live_server import LiveServer
from tests.support.waiting import eventually

MAX_NEW = 480
"""Tokens each abandoned request asks for: hundreds of decode steps after its client leaves,
which the server notices in milliseconds."""
CHAT = {"messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0}
COMPLETION = {"prompt": "Once upon a time", "max_tokens": MAX_NEW, "ignore_eos": True,
              "temperature": 0}
TGI = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": MAX_NEW}}
"""Greedy decoding of this prompt runs to the limit (TGI has no `ignore_eos`)."""
RESPONSES = {"input": "Tell me a long story.", "max_output_tokens": MAX_NEW, "temperature": 0}
"""Greedy decoding of this input runs to the limit, as TGI's does (the Responses API has no
`ignore_eos`)."""
_GAUGE = re.compile(r'^tgi_(?:batch_current|queue)_size\{model="(?P<model>[^"]*)"[^}]*\} (\S+)$',
                    re.M)


def abandon(live: LiveServer, path: str, body: dict[str, object], count: int, model: str,
            engine_server: LiveServer | None = None, sequences: int = 1,
            headers: dict[str, str] | None = None) -> None:
    """Send `count` requests at once to `live`, and close their connections once `model`'s
    engine (on `engine_server`, `live` by default: another server where `live` forwards the
    model) holds all their sequences (`sequences` each) in its batch or queue.

    It first waits for the engine to be idle (its gauges at zero), so that every sequence
    the gauges then show is one of these. An answer, or a closed connection, before the
    clients leave fails the test: the work did not outlast its client.
    """
    engine_server = engine_server or live
    eventually(lambda: sequences_in_engine(engine_server, model) == 0, timeout=30,
               what=f"{model}: an idle engine before the requests")
    host, port = live.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    request = (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
               f"{head}Content-Length: {len(payload)}\r\n\r\n").encode() + payload
    with ExitStack() as clients:
        socks = [clients.enter_context(socket.create_connection((host, int(port)), timeout=30))
                 for _ in range(count)]
        for sock in socks:
            sock.sendall(request)

        def all_running() -> bool:
            for sock in socks:
                if _answered(sock):
                    raise AssertionError("answered before its client left: "
                                         f"{sock.recv(300)!r}")
            return sequences_in_engine(engine_server, model) >= count * sequences

        eventually(all_running, timeout=60, interval=0.01,
                   what=f"{model}: {count * sequences} sequences in the engine")
    # Leaving the block closed every connection: the clients are gone.


def _answered(sock: socket.socket) -> bool:
    """Whether the server has sent anything on `sock`, or closed it (nothing is consumed)."""
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        sock.recv(1, socket.MSG_PEEK)  # b"" when the server closed the connection
    except BlockingIOError:
        return False
    else:
        return True
    finally:
        sock.settimeout(timeout)


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
