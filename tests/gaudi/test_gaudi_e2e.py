"""``switchyard serve --engine gaudi --engine-option device=cpu`` with the real clients.

One server for the module, on the default model in float32, with the seed's
bucket variables set small (prompts padded to 128s, prefill batches to 2s,
decode batches to 4s: 10 shapes, all warmed before it reports healthy), and
`--max-concurrent-requests 4` so that overload is reachable. Every token and
log-probability a client reads is checked against transformers.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import re

import httpx
import openai
import pytest
import torch
from huggingface_hub import InferenceClient
from text_generation import Client
from transformers import AutoTokenizer

from tests.support.greedy import generate_greedy
from tests.support.live_server import LiveServer, start_server, stop_server
from tests.support.waiting import eventually

pytestmark = pytest.mark.e2e  # every test here runs against `switchyard serve --engine gaudi`

PROMPTS = ["def fibonacci(n):", "x", "import sys\nimport os\n\nclass Config:\n" * 3]
PERMITS = 4
LONG = 2000


@pytest.fixture(scope="module")
def gaudi_server(model_cache: Path, default_model_path: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_server(
        model_cache, tmp_path_factory.mktemp("logs"), "--engine", "gaudi",
        "--engine-option", "device=cpu", "--engine-option", "num_threads=1",
        "--dtype", "float32",
        "--max-total-tokens", "2048", "--max-input-tokens", "400", "--max-batch-size", "8",
        "--max-batch-prefill-tokens", "1024", "--max-concurrent-requests", str(PERMITS),
        env={"PREFILL_BATCH_BUCKET_SIZE": "2", "BATCH_BUCKET_SIZE": "4"}, timeout=300)
    yield live
    stop_server(live)


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path):
    return AutoTokenizer.from_pretrained(default_model_path)


def test_the_server_warmed_every_planned_shape_on_the_gaudi_engine(gaudi_server):
    log = gaudi_server.log()
    assert "engine gaudi" in log
    assert "gaudi warmup: 10 shapes" in log and "(10 graphs compiled)" in log
    info = httpx.get(f"{gaudi_server.url}/info", timeout=30).json()
    assert info["max_total_tokens"] == 2048


def test_greedy_tokens_and_logprobs_are_transformers(gaudi_server, reference_llama, tokenizer):
    """Three prompts of different lengths, concurrently, so they share padded batches."""
    n = 12

    def ours(prompt: str):
        return Client(gaudi_server.url, timeout=120).generate(
            prompt, max_new_tokens=n, decoder_input_details=True, top_n_tokens=2)

    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(ours, PROMPTS))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        prompt_ids = tokenizer(prompt)["input_ids"]
        # The gateway lists the prompt only when it has scores: not for a one-token prompt.
        assert [t.id for t in out.details.prefill] == (prompt_ids if len(prompt_ids) > 1 else [])
        ids = [t.id for t in out.details.tokens]
        want = generate_greedy(reference_llama, prompt_ids, n)
        assert ids == want[: len(ids)]
        assert len(ids) == n or out.details.finish_reason.value == "eos_token"
        with torch.inference_mode():
            logits = reference_llama(torch.tensor([prompt_ids + ids])).logits[0].float()
        scores = torch.log_softmax(logits, dim=-1)
        for step, token in enumerate(out.details.tokens):
            row = scores[len(prompt_ids) - 1 + step]
            assert abs(token.logprob - float(row[token.id])) < 1e-4
            top = out.details.top_tokens[step]
            assert [t.id for t in top] == row.topk(2).indices.tolist()
        for i, token in enumerate(out.details.prefill[1:]):
            assert abs(token.logprob - float(scores[i, token.id])) < 1e-4
        assert out.generated_text == tokenizer.decode(ids, skip_special_tokens=True)


def test_streaming_equals_the_whole_answer(gaudi_server):
    client = Client(gaudi_server.url, timeout=120)
    events = list(client.generate_stream(PROMPTS[0], max_new_tokens=8))
    whole = client.generate(PROMPTS[0], max_new_tokens=8)
    assert [e.token.id for e in events] == [t.id for t in whole.details.tokens]
    assert events[-1].generated_text == whole.generated_text
    assert all(e.generated_text is None for e in events[:-1])


def test_stop_sequences_end_the_text(gaudi_server):
    client = Client(gaudi_server.url, timeout=120)
    base = client.generate(PROMPTS[0], max_new_tokens=12).generated_text
    assert len(base) >= 4
    stop = base[2:4]
    out = client.generate(PROMPTS[0], max_new_tokens=12, stop_sequences=[stop])
    assert out.details.finish_reason.value == "stop_sequence"
    assert out.generated_text.endswith(stop) and base.startswith(out.generated_text)


def test_seeded_sampling_is_reproducible(gaudi_server):
    client = Client(gaudi_server.url, timeout=120)
    kw = dict(max_new_tokens=10, do_sample=True, temperature=0.9, top_k=50, top_p=0.9, seed=42)
    a, b = client.generate(PROMPTS[0], **kw), client.generate(PROMPTS[0], **kw)
    assert a.generated_text == b.generated_text and a.details.seed == 42
    other = client.generate(PROMPTS[0], **{**kw, "seed": 7})
    assert [t.id for t in other.details.tokens] != [t.id for t in a.details.tokens]


def test_openai_sdk_chat_and_completions(gaudi_server):
    client = openai.OpenAI(base_url=f"{gaudi_server.url}/v1", api_key="-", timeout=120)
    messages = [{"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model="tgi", messages=messages, max_tokens=8,
                                           temperature=0, logprobs=True, top_logprobs=2)
    chunks = client.chat.completions.create(model="tgi", messages=messages, max_tokens=8,
                                            temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    entries = whole.choices[0].logprobs.content
    assert entries and all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)
    assert all(e.logprob == e.top_logprobs[0].logprob for e in entries)  # greedy: the best
    # Completions read the same engine: the tokens and log-probs TGI's route reports.
    done = client.completions.create(model="tgi", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                     logprobs=1)
    tgi = Client(gaudi_server.url, timeout=120).generate(PROMPTS[0], max_new_tokens=6)
    assert done.choices[0].text == tgi.generated_text
    for ours, theirs in zip(done.choices[0].logprobs.token_logprobs, tgi.details.tokens,
                            strict=True):
        assert abs(ours - theirs.logprob) < 1e-6


def test_huggingface_hub_clients_read_the_same_tokens(gaudi_server):
    hub = InferenceClient(base_url=gaudi_server.url, timeout=120)
    tgi = Client(gaudi_server.url, timeout=120).generate(PROMPTS[0], max_new_tokens=6)
    detailed = hub.text_generation(PROMPTS[0], max_new_tokens=6, details=True)
    assert [t.id for t in detailed.details.tokens] == [t.id for t in tgi.details.tokens]
    assert detailed.generated_text == tgi.generated_text
    assert "".join(hub.text_generation(PROMPTS[0], max_new_tokens=6, stream=True)) \
        == tgi.generated_text
    messages = [{"role": "user", "content": "Hello"}]
    chat = hub.chat_completion(messages, max_tokens=6, temperature=0)
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in hub.chat_completion(messages, max_tokens=6, temperature=0,
                                                    stream=True) if c.choices)
    assert streamed == chat.choices[0].message.content


_GAUGE = r"^{name}(?:\{{[^}}]*\}})? (?P<value>\S+)$"


def _gauge(live: LiveServer, name: str) -> float:
    text = httpx.get(f"{live.url}/metrics", timeout=30).text
    match = re.search(_GAUGE.format(name=name), text, re.M)
    assert match is not None, name
    return float(match["value"])


def test_overload_is_a_429_and_disconnects_abort_the_sequences(gaudi_server, tokenizer):
    """Fill every permit with long streams: the next request is TGI's and OpenAI's 429;
    closing the streams aborts their sequences, so the engine's batch empties at once."""
    # 2,000 tokens take several seconds here; a bias against EOS keeps each stream running.
    body = {"prompt": "tell me everything:", "max_tokens": LONG, "stream": True,
            "logit_bias": {str(tokenizer.eos_token_id): -100}}
    start = len(gaudi_server.log())
    streams, readers = [], []
    try:
        for _ in range(PERMITS):
            cm = httpx.stream("POST", f"{gaudi_server.url}/v1/completions", json=body,
                              timeout=120)
            streams.append(cm)
            # Held open: a line iterator that is dropped closes its response.
            readers.append(cm.__enter__().iter_lines())
            next(line for line in readers[-1] if line.startswith("data:"))
        tgi = httpx.post(f"{gaudi_server.url}/generate", json={"inputs": "hi",
                         "parameters": {"max_new_tokens": 2}}, timeout=30)
        assert tgi.status_code == 429
        assert tgi.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
        oai = httpx.post(f"{gaudi_server.url}/v1/completions", timeout=30,
                         json={"prompt": "hi", "max_tokens": 2})
        assert oai.status_code == 429
        assert oai.json()["error"]["message"] == "Model is overloaded"
        assert _gauge(gaudi_server, "tgi_batch_current_size") == PERMITS
    finally:
        for cm in streams:
            cm.__exit__(None, None, None)
    eventually(lambda: _gauge(gaudi_server, "tgi_batch_current_size") == 0, timeout=20,
               what="an empty batch after the streams closed")
    lines = [line for line in gaudi_server.log()[start:].splitlines()
             if "switchyard.request" in line and "error=dropped" in line]
    assert len(lines) == PERMITS, gaudi_server.log()[start:]
    for line in lines:  # each ended when its client left, far short of its length
        generated = int(re.search(r"tokens=\d+\+(\d+)", line)[1])
        assert 1 <= generated < LONG // 2, line
    assert httpx.post(f"{gaudi_server.url}/generate", timeout=60, json={
        "inputs": "hi", "parameters": {"max_new_tokens": 2}}).status_code == 200


def test_grammars_constrain_the_gaudi_engine(gaudi_server):
    """TGI's regex and JSON-schema grammars and OpenAI's json_schema, on the static-shape
    engine: the random model's output parses only because the grammar held it."""
    import json
    import re

    import jsonschema
    from text_generation.types import Grammar, GrammarType

    # Bounded, so that a random model's answer fits its max_new_tokens.
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                    "maximum": 999},
                                              "pet": {"enum": ["cat", "dog"]}},
              "required": ["n", "pet"], "additionalProperties": False}
    client = Client(gaudi_server.url, timeout=120)
    regex = r"[a-c]{3}-\d{2,4}"
    out = client.generate("hello", max_new_tokens=20,
                          grammar=Grammar(type=GrammarType.Regex, value=regex))
    assert re.fullmatch(regex, out.generated_text), out.generated_text
    for seed in (1, 2):
        out = client.generate("hello", max_new_tokens=40, do_sample=True, temperature=1.5,
                              seed=seed, grammar=Grammar(type=GrammarType.Json, value=schema))
        jsonschema.validate(json.loads(out.generated_text), schema)
        assert out.details.finish_reason.value == "eos_token"
    chat = openai.OpenAI(base_url=f"{gaudi_server.url}/v1", api_key="-", timeout=120)
    answer = chat.chat.completions.create(
        model="tgi", messages=[{"role": "user", "content": "hi"}], max_tokens=40,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "p", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
