"""Every decoder-only family of issue 25's list, served end to end and checked against
transformers.

One `switchyard serve --config` server serves all the families as named models
(`tests/support/family_models.py`: tiny random models, 2 layers, hidden 64, with
the default model's tokenizer), in float32 with EOS ignored, so every request
makes exactly its ``max_new_tokens`` and greedy tokens compare exactly. For
each family:

- three prompts of different lengths, sent together to `/generate` (so they
  share decode steps; the longest is prefilled in several chunks), give
  transformers ``generate(do_sample=False)``'s 16 tokens on the same folder,
  and the prompt ids the server scored are the tokenizer's;
- `text_generation.Client.generate_stream` yields the same tokens;
- an OpenAI SDK chat completion answers with usage counting the chat template's
  rendering and 16 completion tokens, and the text transformers gives for it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from text_generation import Client

from tests.support.family_models import FAMILIES, MAX_POSITIONS, ensure_family
from tests.support.live_server import LiveServer, start_server, stop_server

NEW = 16
PROMPTS = [
    "def f(x):",
    "import os\nimport sys\n\nclass Config:\n    \"\"\"Settings read from the environment.\"\"\"\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, computed iteratively so that "
    "large values of n do not exhaust the stack.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    return a\n\n\nif __name__ == \"__main__\":\n    print(",
]
MESSAGES = [{"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Write a function that reverses a list."}]
STREAM_PROMPT = 1
"""The prompt whose tokens the streamed call must repeat."""


@pytest.fixture(scope="module")
def folders(default_model_path: Path, model_cache: Path) -> dict[str, Path]:
    return {name: ensure_family(name, default_model_path, model_cache) for name in FAMILIES}


@pytest.fixture(scope="module")
def matrix(folders: dict[str, Path], model_cache: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """One server with every family as a named model (the first, llama, is the default)."""
    folder = tmp_path_factory.mktemp("family-matrix")
    config = folder / "models.toml"
    config.write_text("".join(f"""
[[models]]
name = "{name}"
model_id = "{path}"
engine = "xeon"
engine_options = {{ num_threads = 1 }}
max_total_tokens = {MAX_POSITIONS}
max_input_tokens = {MAX_POSITIONS - 2 * NEW}
max_batch_total_tokens = 1024
max_batch_prefill_tokens = 32
""" for name, path in folders.items()))
    live = start_server(model_cache, folder, "--config", str(config), "--dtype", "float32",
                        env={"TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"}, timeout=600)
    yield live
    stop_server(live)


@functools.cache
def _reference(folder: Path):  # -> (tokenizer, model)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return tokenizer, model


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@functools.cache
def _greedy(folder: Path, prompt: tuple[int, ...]) -> list[int]:
    """transformers ``generate``'s 16 greedy tokens after ``prompt``, EOS ignored."""
    _, model = _reference(folder)
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=NEW, eos_token_id=None,
                             pad_token_id=0)
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == NEW
    return tokens


def _want(folder: Path, prompt: str) -> list[int]:
    tokenizer, _ = _reference(folder)
    return _greedy(folder, tuple(_ids(tokenizer, prompt)))


PATHS = {
    "bloom": "path: paged attention, the model's ALiBi attention modules replaced "
             "(BloomForCausalLM: ALiBi biases in the paged kernels)",
    "mpt": "path: paged attention, the model's ALiBi attention modules replaced "
           "(MptForCausalLM: ALiBi biases in the paged kernels)",
    "gemma2": "path: paged attention through transformers' attention interface "
              "(Gemma2ForCausalLM: logit soft-capping in the paged kernels)",
    "falcon": "path: fallback: the model's own attention over transformers' cache "
              "(FalconForCausalLM does not use transformers' attention interface",
}
"""The start-up log's path line for the families whose path is not plain transformers'
attention interface (Falcon here is rotary, without ALiBi)."""


@pytest.mark.parametrize("name", sorted(PATHS))
def test_start_up_logs_the_path_each_family_takes(name, matrix):
    assert PATHS[name] in matrix.log()


@pytest.mark.parametrize("name", FAMILIES)
def test_generate_three_prompts_equal_transformers(name, matrix, folders):
    folder = folders[name]
    tokenizer, _ = _reference(folder)

    def generate(prompt: str) -> dict:
        r = httpx.post(f"{matrix.url}/generate", headers={"X-Model": name}, timeout=300,
                       json={"inputs": prompt, "parameters": {
                           "max_new_tokens": NEW, "details": True,
                           "decoder_input_details": True}})
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # together: they share decode steps
        bodies = list(pool.map(generate, PROMPTS))
    for prompt, body in zip(PROMPTS, bodies, strict=True):
        details = body["details"]
        assert details["finish_reason"] == "length"
        assert [t["id"] for t in details["prefill"]] == _ids(tokenizer, prompt)
        assert [t["id"] for t in details["tokens"]] == _want(folder, prompt), prompt


@pytest.mark.parametrize("name", FAMILIES)
def test_generate_stream_yields_the_same_tokens(name, matrix, folders):
    client = Client(matrix.url, headers={"X-Model": name}, timeout=300)
    prompt = PROMPTS[STREAM_PROMPT]
    events = list(client.generate_stream(prompt, max_new_tokens=NEW))
    assert [e.token.id for e in events] == _want(folders[name], prompt)
    last = events[-1]
    assert last.details is not None and last.details.generated_tokens == NEW
    assert last.generated_text == "".join(e.token.text for e in events if not e.token.special)


@pytest.mark.parametrize("name", FAMILIES)
def test_chat_completion_counts_the_template(name, matrix, folders):
    folder = folders[name]
    tokenizer, _ = _reference(folder)
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False,
                                             add_generation_prompt=True)
    prompt_ids = _ids(tokenizer, rendered)
    client = openai.OpenAI(base_url=f"{matrix.url}/v1", api_key="unused", timeout=300,
                           max_retries=0)
    out = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=NEW,
                                         temperature=0)
    assert out.model == name
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == NEW
    assert out.usage.total_tokens == len(prompt_ids) + NEW
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    want = _greedy(folder, tuple(prompt_ids))
    assert choice.message.content == tokenizer.decode(want, skip_special_tokens=True)
