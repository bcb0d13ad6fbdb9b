"""`--config`: one server, two models on two engines (xeon and gaudi on the CPU), one that fails.

The same weights serve as `tiny` (xeon, the default, alias `small`) and
`static` (the gaudi engine on the CPU device, one permit), so each answer is
checked against transformers and the request log says which engine ran it;
`broken` names a folder that does not exist.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient
from text_generation import Client
from transformers import AutoTokenizer

from tests.support.greedy import generate_greedy
from tests.support.live_server import LiveServer, start_server, stop_server
from tests.support.waiting import eventually

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def multi(model_cache: Path, default_model_path: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = tmp_path_factory.mktemp("config")
    config = folder / "models.toml"
    config.write_text(f"""
[[models]]
name = "tiny"
aliases = ["small"]
model_id = "{default_model_path}"
engine = "xeon"
engine_options = {{ num_threads = 1 }}

[[models]]
name = "broken"
model_id = "{folder / 'no-such-model'}"

[[models]]
name = "static"
model_id = "{default_model_path}"
engine = "gaudi"
engine_options = {{ device = "cpu", num_threads = 1 }}
max_total_tokens = 2048
max_input_tokens = 400
max_batch_size = 4
max_batch_prefill_tokens = 1024
max_concurrent_requests = 1
""")
    live = start_server(model_cache, folder, "--config", str(config), "--dtype", "float32",
                        env={"PREFILL_BATCH_BUCKET_SIZE": "2", "BATCH_BUCKET_SIZE": "4",
                             "PAD_SEQUENCE_TO_MULTIPLE_OF": "128"}, timeout=300)
    yield live
    stop_server(live)


@pytest.fixture(scope="module")
def reference(default_model_path: Path):
    from transformers import AutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype="float32").eval()
    return tokenizer, model


def _engine_of_last_request(live: LiveServer, start: int) -> str:
    lines = eventually(lambda: [ln for ln in live.log()[start:].splitlines()
                                if "switchyard.request" in ln], timeout=10, what="a request line")
    return re.search(r"engine=(\S+)", lines[-1])[1]


def test_models_lists_every_served_name_and_health_names_the_failure(multi):
    ids = [m["id"] for m in httpx.get(f"{multi.url}/v1/models", timeout=30).json()["data"]]
    assert ids == ["tiny", "small", "static"]
    health = httpx.get(f"{multi.url}/health", timeout=30)
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "degraded" and list(body["failed"]) == ["broken"]
    assert "no-such-model" in body["failed"]["broken"]
    assert httpx.get(f"{multi.url}/info", timeout=30).json()["max_total_tokens"] != 2048


def test_openai_reaches_each_model_by_name_and_alias(multi, reference):
    tokenizer, model = reference
    want = generate_greedy(model, tokenizer(PROMPT)["input_ids"], 8)
    client = openai.OpenAI(base_url=f"{multi.url}/v1", api_key="-", timeout=120)
    for name, served, engine in (("tiny", "tiny", "xeon"), ("small", "tiny", "xeon"),
                                 ("static", "static", "gaudi")):
        start = len(multi.log())
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.model == served  # an alias is answered under the model's name
        assert out.choices[0].text == tokenizer.decode(want[: out.usage.completion_tokens],
                                                       skip_special_tokens=True)
        assert _engine_of_last_request(multi, start) == engine, name
    chunks = client.chat.completions.create(
        model="static", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_tgi_routes_pick_a_model_by_header(multi):
    start = len(multi.log())
    default = Client(multi.url, timeout=120).generate(PROMPT, max_new_tokens=6)
    assert _engine_of_last_request(multi, start) == "xeon"
    start = len(multi.log())
    static = Client(multi.url, headers={"X-Model": "static"}, timeout=120).generate(
        PROMPT, max_new_tokens=6)
    assert _engine_of_last_request(multi, start) == "gaudi"
    assert [t.id for t in static.details.tokens] == [t.id for t in default.details.tokens]
    hub = InferenceClient(base_url=multi.url, headers={"X-Model": "small"}, timeout=120)
    assert hub.text_generation(PROMPT, max_new_tokens=6) == default.generated_text


def test_unknown_and_failed_models_answer_in_each_apis_format(multi):
    oai = httpx.post(f"{multi.url}/v1/completions", timeout=30,
                     json={"model": "nope", "prompt": "x", "max_tokens": 2})
    assert oai.status_code == 404 and oai.json()["error"]["code"] == "model_not_found"
    tgi = httpx.post(f"{multi.url}/generate", headers={"X-Model": "nope"}, timeout=30,
                     json={"inputs": "x", "parameters": {"max_new_tokens": 2}})
    assert tgi.status_code == 422 and tgi.json()["error_type"] == "validation"
    assert "served: tiny, small, static" in tgi.json()["error"]
    for response in (
            httpx.post(f"{multi.url}/v1/completions", timeout=30,
                       json={"model": "broken", "prompt": "x", "max_tokens": 2}),
            httpx.post(f"{multi.url}/generate", headers={"X-Model": "broken"}, timeout=30,
                       json={"inputs": "x", "parameters": {"max_new_tokens": 2}})):
        assert response.status_code == 503
        assert "failed to load" in response.text and "no-such-model" in response.text


def test_each_model_has_its_own_permits(multi):
    """`static` has one permit: held by a stream, its next request is a 429; `tiny`'s is not."""
    body = {"model": "static", "prompt": "tell me everything:", "max_tokens": 1500,
            "stream": True, "logit_bias": {"1": -100}}
    with httpx.stream("POST", f"{multi.url}/v1/completions", json=body, timeout=120) as held:
        lines = held.iter_lines()
        next(line for line in lines if line.startswith("data:"))
        second = httpx.post(f"{multi.url}/v1/completions", timeout=30,
                            json={"model": "static", "prompt": "x", "max_tokens": 2})
        assert second.status_code == 429
        other = httpx.post(f"{multi.url}/v1/completions", timeout=60,
                           json={"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert other.status_code == 200
