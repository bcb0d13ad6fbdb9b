"""LoRA adapters through both APIs on a live server, with real clients, against PEFT.

The server (the `live` fixture of tests/lora/conftest.py) serves the test model
with two adapters from `--lora-adapters` (and runtime loading on, behind an API
key), its engine in a process of its own (`--engine-process`: adapters and
runtime loads cross the relay). The OpenAI SDK reaches an adapter by `model`,
`huggingface_hub.InferenceClient` by TGI's `parameters.adapter_id`; tokens and log-probabilities must be PEFT's
(`PeftModel`, unmerged) for the same adapter, the reply's `model` the
adapter's name; unknown names, bad folders and the runtime routes answer in
each API's error format.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient
from huggingface_hub.errors import ValidationError
from transformers import AutoTokenizer

from tests.support.live_server import RANDOM_MODEL
from tests.support.lora_adapters import SERVER_KEY, PeftReference, edit_config

KEY = SERVER_KEY
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The quick brown fox"
NEW = 6

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def prompt_ids(default_model_path: Path) -> list[int]:
    return AutoTokenizer.from_pretrained(default_model_path)(PROMPT).input_ids


@pytest.fixture
def oai(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=KEY, timeout=60)


def test_models_lists_each_adapter_with_its_parent(live, adapter_dirs) -> None:
    cards = {c["id"]: c for c in httpx.get(f"{live.url}/v1/models").json()["data"]}
    assert cards["attn"]["parent"] == RANDOM_MODEL
    assert cards["attn"]["root"] == str(adapter_dirs["attn-r4"].resolve())
    assert cards["mlp"]["parent"] == RANDOM_MODEL
    assert cards[RANDOM_MODEL]["parent"] is None


@pytest.mark.parametrize(("model", "adapter"), [("attn", "attn-r4"), ("mlp", "mlp-regex"),
                                                (RANDOM_MODEL, None)])
def test_openai_completions_give_peft_output(oai, peft_reference: PeftReference, prompt_ids,
                                             model: str, adapter: str | None) -> None:
    tokens, logprobs = peft_reference.greedy(prompt_ids, NEW, adapter)
    reply = oai.completions.create(model=model, prompt=prompt_ids, max_tokens=NEW,
                                   temperature=0, logprobs=1)
    assert reply.model == model  # the adapter's name, not the base's
    got = reply.choices[0].logprobs
    assert got.token_logprobs == pytest.approx(logprobs, abs=1e-4)
    tokenizer = oai_tokenizer(peft_reference)
    assert reply.choices[0].text == tokenizer.decode(tokens, skip_special_tokens=True)


def oai_tokenizer(reference: PeftReference):
    return AutoTokenizer.from_pretrained(reference.base.name_or_path)


@pytest.mark.parametrize(("adapter_id", "adapter"), [("attn", "attn-r4"), ("mlp", "mlp-regex"),
                                                     (None, None)])
def test_tgi_adapter_id_gives_peft_tokens(live, peft_reference: PeftReference, prompt_ids,
                                          adapter_id: str | None, adapter: str | None) -> None:
    hub = InferenceClient(base_url=live.url, api_key=KEY, timeout=60)
    out = hub.text_generation(PROMPT, max_new_tokens=NEW, details=True, adapter_id=adapter_id)
    tokens, logprobs = peft_reference.greedy(prompt_ids, NEW, adapter)
    assert [t.id for t in out.details.tokens] == tokens
    assert [t.logprob for t in out.details.tokens] == pytest.approx(logprobs, abs=1e-4)


def test_unknown_adapters_are_404_on_openai_and_422_on_tgi(live, oai) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        oai.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"
    r = httpx.post(f"{live.url}/generate", headers=AUTH, timeout=30,
                   json={"inputs": "hi", "parameters": {"adapter_id": "nope",
                                                        "max_new_tokens": 2}})
    assert r.status_code == 422
    body = r.json()
    assert body["error_type"] == "validation" and "nope" in body["error"]
    hub = InferenceClient(base_url=live.url, api_key=KEY, timeout=60)
    with pytest.raises(ValidationError, match="nope"):  # the client's class for TGI's 422
        hub.text_generation("hi", max_new_tokens=2, adapter_id="nope")


def test_runtime_load_and_unload(live, oai, adapter_dirs, peft_reference, prompt_ids,
                                 tmp_path: Path) -> None:
    load = f"{live.url}/v1/load_lora_adapter"
    body = {"lora_name": "r16", "lora_path": str(adapter_dirs["kv-o-r16"])}
    assert httpx.post(load, json=body, timeout=30).status_code == 401  # the API key guards it
    # A corrupt folder and a rank over the limit: 400 with the reason, OpenAI's shape.
    bad = Path(shutil.copytree(adapter_dirs["attn-r4"], tmp_path / "bad"))
    (bad / "adapter_model.safetensors").write_bytes(b"not safetensors")
    r = httpx.post(load, json={"lora_name": "bad", "lora_path": str(bad)}, headers=AUTH,
                   timeout=30)
    assert r.status_code == 400 and "corrupt" in r.json()["error"]["message"]
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    dora = Path(shutil.copytree(adapter_dirs["attn-r4"], tmp_path / "dora"))
    edit_config(dora, use_dora=True)
    r = httpx.post(load, json={"lora_name": "dora", "lora_path": str(dora)}, headers=AUTH,
                   timeout=30)
    assert r.status_code == 400 and "DoRA" in r.json()["error"]["message"]
    r = httpx.post(load, json={"lora_name": "x", "lora_path": str(tmp_path / "missing")},
                   headers=AUTH, timeout=30)
    assert r.status_code == 404
    r = httpx.post(load, json=body, headers=AUTH, timeout=30)
    assert r.status_code == 200 and "r16" in r.text
    reply = oai.completions.create(model="r16", prompt=prompt_ids, max_tokens=NEW,
                                   temperature=0, logprobs=1)
    want = peft_reference.greedy(prompt_ids, NEW, "kv-o-r16")[1]
    assert reply.choices[0].logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
    r = httpx.post(f"{live.url}/v1/unload_lora_adapter", json={"lora_name": "r16"},
                   headers=AUTH, timeout=30)
    assert r.status_code == 200
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="r16", prompt="hi", max_tokens=2)
    r = httpx.post(f"{live.url}/v1/unload_lora_adapter", json={"lora_name": "r16"},
                   headers=AUTH, timeout=30)
    assert r.status_code == 404


def test_chat_streams_name_the_adapter_and_give_peft_logprobs(
        oai, peft_reference: PeftReference, default_model_path: Path) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = AutoTokenizer.from_pretrained(default_model_path).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    want = peft_reference.greedy(list(ids), NEW, "mlp-regex")[1]
    chunks = list(oai.chat.completions.create(
        model="mlp", messages=messages, max_tokens=NEW, temperature=0, logprobs=True,
        stream=True, extra_body={"ignore_eos": True}))
    assert {c.model for c in chunks} == {"mlp"}
    got = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs
           for t in c.choices[0].logprobs.content]
    assert got == pytest.approx(want, abs=1e-4)
