"""`--max-concurrent-requests`: over it is a 429 at once; a disconnect frees the permit."""

from __future__ import annotations

import httpx
import pytest

from tests.support.live_server import start_server, stop_server
from tests.support.waiting import eventually


@pytest.fixture(scope="module")
def one_slot_server(model_cache, default_model_path, tmp_path_factory):
    live = start_server(model_cache, tmp_path_factory.mktemp("logs"), "--dtype", "float32",
                        "--max-concurrent-requests", "1",
                        env={"TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"})
    yield live
    stop_server(live)


LONG = {"inputs": "tell me everything:", "parameters": {"max_new_tokens": 1000}}


def test_overload_and_disconnect(one_slot_server):
    url = one_slot_server.url
    with httpx.stream("POST", f"{url}/generate_stream", json=LONG, timeout=120) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # it is running
        tgi = httpx.post(f"{url}/generate", json={"inputs": "hi"}, timeout=30)
        assert tgi.status_code == 429
        assert tgi.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
        oai = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                         json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert oai.status_code == 429
        assert oai.json()["error"]["message"] == "Model is overloaded"
        oai_stream = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                                json={"messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2, "stream": True})
        assert oai_stream.status_code == 429
        for body in ({"input": "hi", "max_output_tokens": 2},
                     {"input": "hi", "max_output_tokens": 2, "stream": True},
                     {"input": "hi", "max_output_tokens": 2, "background": True}):
            responses = httpx.post(f"{url}/v1/responses", json=body, timeout=30)
            assert responses.status_code == 429, (body, responses.text)
            assert responses.json()["error"]["message"] == "Model is overloaded"
        in_stream = httpx.post(f"{url}/generate_stream", json={"inputs": "hi"}, timeout=30)
        assert '"error_type":"overloaded"' in in_stream.text

    # The client went away after one token of 1000: its permit and its engine slot are freed.
    def admitted() -> httpx.Response | None:
        short = {"inputs": "hi", "parameters": {"max_new_tokens": 2}}
        r = httpx.post(f"{url}/generate", json=short, timeout=60)
        assert r.status_code in (200, 429), r.text
        return r if r.status_code == 200 else None

    eventually(admitted, timeout=20, what="a request admitted after the stream's client left")
