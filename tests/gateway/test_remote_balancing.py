"""Remote models' pieces without a network: the choice of replica, queue gauges, SSE cutting."""

from __future__ import annotations

import random

import pytest
from switchyard.models.balancer import pick
from switchyard.models.upstream import Replica, queue_depth
from switchyard.routes.remote_sse import EventCutter, Garbage, stream_ended


def test_two_choices_take_the_less_loaded_and_skip_out_and_tried_replicas():
    busy, idle, out = Replica("http://a", in_flight=5), Replica("http://b", queue=1), \
        Replica("http://c", out_until=1e18)
    rng = random.Random(0)
    assert {pick([busy, idle], rng=rng) for _ in range(50)} == {idle}
    assert pick([busy, idle, out], tried=[idle], rng=rng) is busy
    assert pick([out]) is None and pick([busy], tried=[busy]) is None
    # Equal loads share the requests.
    even = [Replica("http://x"), Replica("http://y")]
    assert {pick(even, rng=rng).url for _ in range(50)} == {"http://x", "http://y"}


def test_failures_in_a_row_take_a_replica_out_and_a_success_resets_them():
    r = Replica("http://a")
    r.failed("x", max_failures=2, cooldown_s=1)
    r.succeeded()
    r.failed("x", max_failures=2, cooldown_s=1)
    assert r.available
    r.failed("x", max_failures=2, cooldown_s=1)
    assert not r.available


def test_queue_depth_reads_tgis_ours_and_vllms_gauges():
    text = (b'# HELP tgi_queue_size x\n# TYPE tgi_queue_size gauge\n'
            b'tgi_queue_size{model="a",engine="xeon"} 3\ntgi_queue_size{model="b"} 2\n'
            b'tgi_queue_size_other 100\nvllm:num_requests_waiting{model_name="m"} 4.0\n'
            b'vllm:num_requests_running 7\n')
    assert queue_depth(text) == 9
    assert queue_depth(b"") == 0


def test_events_are_cut_whole_and_garbage_is_refused():
    cut = EventCutter()
    assert cut.feed(b"data: {\"a\"") == b""
    assert cut.feed(b": 1}\r\n\r\ndata: [DO") == b"data: {\"a\": 1}\r\n\r\n"
    assert cut.feed(b"NE]\n\n") == b"data: [DONE]\n\n"
    with pytest.raises(Garbage):
        EventCutter().feed(b"<html>\n\n")


@pytest.mark.parametrize(("api", "events", "ended"), [
    ("openai", b"data: {}\n\ndata: [DONE]\n\n", True),
    ("openai", b"data: {}\n\n", False),
    ("tgi", b'data: {"token":{},"generated_text":null}\n\n', False),
    ("tgi", b'data: {"token":{},"generated_text":"abc"}\n\n', True),
    ("tgi", b'data: {"error":"x","error_type":"generation"}\n\n', True),
])
def test_a_stream_ends_as_its_api_ends_it(api, events, ended):
    assert stream_ended(api, events) is ended
