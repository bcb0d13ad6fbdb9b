"""Scoring through `/v1/completions` with the `openai` SDK: echoed prompt logprobs, token prompts.

Every number is checked against `transformers` on the same model and tokens in
float32 (`log_softmax` of its logits): the prompt tokens' log-probabilities, their
top alternatives, and the log-likelihood lm-evaluation-harness computes from
them. Servers run in float32; the same checks run with prefix caching on (the
same prompt sent twice), off, and with a prefill chunk of 16 tokens, so
prompts span several chunks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM

from switchyard.text import TextTokenizer, load_tokenizer
from tests.support.live_server import LiveServer, start_server, stop_server

TOL = 1e-4
SERVER_ARGS = ("--dtype", "float32", "--max-total-tokens", "512", "--max-input-tokens", "400")
PROMPT = ("def fibonacci(n):\n    if n < 2:\n        return n\n"
          "    return fibonacci(n - 1) + fibonacci(n - 2)  # naïve café, 日本 🙂\n")
MULTIBYTE = "é 日本 🙂 naïve — Ελληνικά"


@dataclass
class Reference:
    """`transformers` on the served model: log_softmax over the vocabulary per position."""

    model: torch.nn.Module
    tokenizer: TextTokenizer

    def scores(self, ids: list[int]) -> torch.Tensor:
        """[len(ids) - 1, vocab] float32: row i scores what follows token i."""
        with torch.inference_mode():
            logits = self.model(torch.tensor([ids])).logits[0, :-1]
        return torch.log_softmax(logits.float(), dim=-1)

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """The log-probability of every token after the first."""
        return self.scores(ids).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()

    def top(self, ids: list[int], n: int) -> list[dict[str, float]]:
        """The legacy `top_logprobs` entries of prompt tokens 1..: top `n` plus the actual token.

        Alternatives are keyed by their text alone; the actual token by `texts[i]`.
        """
        scores = self.scores(ids)
        values, top_ids = scores.topk(n, dim=-1)
        out = []
        for row in range(scores.shape[0]):
            entry: dict[str, float] = {}
            for token_id, value in zip(top_ids[row].tolist(), values[row].tolist(), strict=True):
                entry.setdefault(self.tokenizer.token_text(token_id), value)
            out.append(entry)
        return out


@pytest.fixture(scope="module")
def reference(default_model_path: Path) -> Reference:
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    return Reference(model, load_tokenizer(default_model_path))


@pytest.fixture(scope="module")
def extra_servers(model_cache: Path, tmp_path_factory: pytest.TempPathFactory,
                  default_model_path: Path) -> Iterator[dict[str, LiveServer]]:
    """Servers started on first use: prefix caching off, and a 16-token prefill chunk."""
    started: dict[str, LiveServer] = {}
    yield started
    for live in started.values():
        stop_server(live)


EXTRA_ARGS = {
    "no_prefix_cache": ("--engine-option", "prefix_caching=false"),
    "chunked_prefill": ("--max-batch-prefill-tokens", "16"),
}


def _client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="-", timeout=120, max_retries=0)


@pytest.fixture(params=["prefix_cache", "no_prefix_cache", "chunked_prefill"])
def scoring_client(request: pytest.FixtureRequest, server: LiveServer,
                   extra_servers: dict[str, LiveServer], model_cache: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> openai.OpenAI:
    """A client of the default server (prefix caching on) or of one of the extra servers."""
    kind = request.param
    if kind == "prefix_cache":
        return _client(server)
    if kind not in extra_servers:
        extra_servers[kind] = start_server(model_cache, tmp_path_factory.mktemp("logs"),
                                           *SERVER_ARGS, *EXTRA_ARGS[kind])
    return _client(extra_servers[kind])


@pytest.fixture()
def client(server: LiveServer) -> openai.OpenAI:
    return _client(server)


def _check_echo(choice, ids: list[int], reference: Reference, generated: int) -> None:
    """The choice's logprobs: one entry per prompt token (as transformers scores it), then
    `generated` entries."""
    lp = choice.logprobs
    n_prompt = len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n_prompt + generated
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = reference.prompt_logprobs(ids)
    assert lp.token_logprobs[1:n_prompt] == pytest.approx(expected, abs=TOL)


@pytest.mark.parametrize("max_tokens", [0, 3])
@pytest.mark.parametrize("form", ["text", "ids"])
def test_echoed_prompt_logprobs_match_transformers(scoring_client, reference, form, max_tokens):
    ids = reference.tokenizer.encode(PROMPT)
    assert len(ids) > 2 * 16  # several prefill chunks on the chunked server
    prompt = PROMPT if form == "text" else ids
    for _ in range(2):  # the second time, a prefix cache would have the whole prompt
        r = scoring_client.completions.create(model="tgi", prompt=prompt, max_tokens=max_tokens,
                                              echo=True, logprobs=1, temperature=0)
        choice = r.choices[0]
        _check_echo(choice, ids, reference, generated=max_tokens)
        assert r.usage.prompt_tokens == len(ids)
        assert r.usage.completion_tokens == max_tokens
        assert choice.text.startswith(PROMPT)
        if max_tokens == 0:
            assert choice.text == PROMPT and choice.finish_reason == "length"


def test_top_logprobs_are_transformers_top_n(scoring_client, reference):
    ids = reference.tokenizer.encode(PROMPT)
    r = scoring_client.completions.create(model="tgi", prompt=ids, max_tokens=0, echo=True,
                                          logprobs=3, temperature=0)
    lp = r.choices[0].logprobs
    for i, expected in enumerate(reference.top(ids, 3), start=1):
        got = lp.top_logprobs[i]
        actual = lp.tokens[i]
        # The actual token is always there, with exactly its token_logprob.
        assert got[actual] == lp.token_logprobs[i]
        alternatives = {k: v for k, v in got.items() if k != actual or k in expected}
        assert set(alternatives) == set(expected), i
        for text, value in expected.items():
            assert alternatives[text] == pytest.approx(value, abs=TOL)


def test_a_batch_of_prompts_in_each_form(scoring_client, reference):
    texts = ["import os\n", "class Foo(object):\n    pass", "x = [1, 2, 3]"]
    id_lists = [reference.tokenizer.encode(t) for t in texts]
    for prompt in (texts, id_lists):
        r = scoring_client.completions.create(model="tgi", prompt=prompt, max_tokens=2, n=2, echo=True,
                                      logprobs=0, temperature=0)
        assert [c.index for c in r.choices] == list(range(6))
        for index, choice in enumerate(r.choices):
            ids = id_lists[index // 2]
            _check_echo(choice, ids, reference, generated=2)
            assert choice.text.startswith(texts[index // 2])
        assert r.usage.prompt_tokens == sum(len(ids) for ids in id_lists)
        assert r.usage.completion_tokens == 12


@pytest.mark.parametrize("form", ["text", "ids"])
def test_text_offsets_index_the_echoed_text(client, reference, form):
    ids = reference.tokenizer.encode(MULTIBYTE)
    assert len(ids) > len(MULTIBYTE)  # some characters span several tokens
    prompt = MULTIBYTE if form == "text" else ids
    r = client.completions.create(model="tgi", prompt=prompt, max_tokens=4, echo=True,
                                  logprobs=1, temperature=0)
    choice = r.choices[0]
    lp = choice.logprobs
    prompt_tokens = lp.tokens[: len(ids)]
    assert "".join(prompt_tokens) == MULTIBYTE
    assert choice.text.startswith(MULTIBYTE)
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        assert choice.text[offset:].startswith(token)
    # A character split over byte-level tokens belongs to the token that completes it.
    assert "" in prompt_tokens and "日" in prompt_tokens and "🙂" in prompt_tokens
    assert lp.text_offset[: len(ids)] == sorted(lp.text_offset[: len(ids)])
    _check_echo(choice, ids, reference, generated=4)


def test_streamed_echo_chunk_carries_the_prompt_logprobs(client, reference):
    prompts = [PROMPT, "import os\n"]
    kw = dict(model="tgi", prompt=prompts, n=2, max_tokens=3, echo=True, logprobs=2,
              temperature=0)
    whole = client.completions.create(**kw).choices
    chunks = [c for chunk in client.completions.create(stream=True, **kw) for c in chunk.choices]
    for index, expected in enumerate(whole):
        mine = [c for c in chunks if c.index == index]
        first, prompt = mine[0], prompts[index // 2]
        assert first.text == prompt  # the echo chunk comes first, with the prompt's scores
        ids = reference.tokenizer.encode(prompt)
        assert first.logprobs.token_logprobs[0] is None
        assert first.logprobs.token_logprobs[1:] == pytest.approx(
            reference.prompt_logprobs(ids), abs=TOL)
        tokens = [t for c in mine if c.logprobs for t in c.logprobs.tokens]
        offsets = [o for c in mine if c.logprobs for o in c.logprobs.text_offset]
        assert tokens == expected.logprobs.tokens and offsets == expected.logprobs.text_offset
        assert "".join(c.text for c in mine) == expected.text
    kw = dict(model="tgi", prompt=PROMPT, echo=True, logprobs=2, temperature=0)
    scored = list(client.completions.create(stream=True, max_tokens=0, **kw))
    texts = [c.text for chunk in scored for c in chunk.choices]
    assert texts == [PROMPT, ""] and scored[-1].choices[0].finish_reason == "length"


def _loglikelihood(choice, ctxlen: int, end: int | None) -> tuple[float, bool]:
    """What lm-evaluation-harness's local-completions computes from one choice."""
    lp = choice.logprobs
    values = lp.token_logprobs[ctxlen:end]
    tops = lp.top_logprobs[ctxlen:end]
    greedy = all(value == max(top.values()) for value, top in zip(values, tops, strict=True))
    return sum(values), greedy


def test_lm_eval_loglikelihood(client, reference):
    """lm-eval's request: token ids of context + continuation, echo, logprobs 1, greedy."""
    tok = reference.tokenizer
    pairs = [("The capital of France is", " Paris"), ("def add(a, b):\n    return", " a + b"),
             ("日本", "語のテキスト"), ("x", " = 1")]
    # As lm-eval's _encode_pair: the context's tokens, then the whole text's tokens after them.
    requests = []
    for context_text, continuation in pairs:
        context = tok.encode(context_text)
        requests.append((context, context + tok.encode(context_text + continuation)[len(context):]))
    prompts = [whole for _, whole in requests]
    # max_tokens 0 scores only the prompt; lm-eval itself asks for 1 token and drops it.
    for max_tokens, end in ((0, None), (1, -1)):
        r = client.completions.create(model="tgi", prompt=prompts, max_tokens=max_tokens,
                                      echo=True, logprobs=1, temperature=0, seed=1234)
        for choice, (context, whole) in zip(r.choices, requests, strict=True):
            got, greedy = _loglikelihood(choice, len(context), end)
            scores = reference.scores(whole)[len(context) - 1:]
            targets = torch.tensor(whole[len(context):])
            expected = scores.gather(1, targets[:, None]).sum().item()
            assert got == pytest.approx(expected, abs=1e-3)
            assert greedy == bool((scores.argmax(-1) == targets).all())
    # A greedy continuation must come out greedy: the model's own argmax tokens.
    context = tok.encode("import os\n")
    scores = reference.scores(context + [0])
    whole = context + [int(scores[-1].argmax())]
    r = client.completions.create(model="tgi", prompt=whole, max_tokens=0, echo=True, logprobs=1)
    assert _loglikelihood(r.choices[0], len(context), None)[1] is True


def test_stop_n_and_best_of(client, reference):
    ids = reference.tokenizer.encode(PROMPT)
    plain = client.completions.create(model="tgi", prompt=PROMPT, max_tokens=6, temperature=0)
    stop = plain.choices[0].text[2:4]
    cut = client.completions.create(model="tgi", prompt=ids, max_tokens=6, temperature=0,
                                    echo=True, logprobs=0, stop=[stop]).choices[0]
    assert cut.text == PROMPT + plain.choices[0].text.split(stop)[0]
    assert cut.finish_reason == "stop"
    _check_echo(cut, ids, reference, generated=len(cut.logprobs.tokens) - len(ids))
    best = client.completions.create(model="tgi", prompt=[ids, ids[:5]], max_tokens=4, n=2,
                                     best_of=3, temperature=1.0, seed=3, logprobs=0, echo=True)
    assert [c.index for c in best.choices] == [0, 1, 2, 3]
    means = [sum(c.logprobs.token_logprobs[-4:]) / 4 for c in best.choices]
    assert means[0] >= means[1] and means[2] >= means[3]  # the best candidates, best first
    assert best.usage.prompt_tokens == len(ids) + 5
    assert 16 <= best.usage.completion_tokens <= 24  # every candidate is counted
    for choice, prompt in zip(best.choices, [ids, ids, ids[:5], ids[:5]], strict=True):
        _check_echo(choice, prompt, reference, generated=4)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [[1, 2], 3]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [-1, 5]}, "prompt"),
    ({"prompt": [[5], [2048]]}, "prompt"),
    ({"prompt": [[5]] * 5}, "prompt"),
    ({"prompt": [5] * 401}, "prompt"),
    ({"prompt": [5, 6], "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens"),
    ({"prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
    ({"prompt": "hi", "n": 1, "best_of": 2, "stream": True}, "best_of"),
])
def test_bad_prompts_are_400(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tgi", **{"max_tokens": 2, **body})
    error = err.value.body
    assert error["param"] == param
    if "Number of prompts" not in error["message"]:  # TGI's own type for that one
        assert error["type"] == "invalid_request_error"
        assert not error["message"].startswith("Input validation error")  # TGI's words


def _metric_sums(live: LiveServer) -> dict[str, float]:
    """Every sample of the server's metrics, summed over labels, by sample name."""
    sums: dict[str, float] = {}
    text = httpx.get(f"{live.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.labels.get("le"):
                sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def test_scoring_counts_no_generated_token_in_metrics(server, client, reference):
    """`max_tokens: 0` generates nothing a client sees, so the metrics count nothing either."""
    ids = reference.tokenizer.encode("def fib(n):")
    before = _metric_sums(server)
    client.completions.create(model="tgi", prompt=ids, max_tokens=0, echo=True, logprobs=1)
    after = _metric_sums(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("tgi_request_generated_tokens_count") == 1
    assert delta("tgi_request_generated_tokens_sum") == 0
    assert delta("tgi_request_max_new_tokens_sum") == 0
    assert delta("tgi_request_input_length_sum") == len(ids)
