"""vLLM's request extensions on the OpenAI routes, each checked against an independent reference.

The session server serves the random-weight model in fp32, so greedy decoding
is transformers' `generate` token for token and log-probabilities are
transformers' `log_softmax` on the same ids. Token ids come from the
tokenizer itself; structured outputs are checked against the grammar's own
definition (the regex, the choice list, the JSON schema, the EBNF's language);
chat template fields against transformers' `apply_chat_template` with the same
arguments. Each field's bad values are a 400 naming it (`test_openai_exact`).
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.greedy import generate_greedy

PROMPT = "def fibonacci(n):"
MESSAGES = [{"role": "user", "content": "Write a haiku about trains."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120,
                         max_retries=0)


@pytest.fixture(scope="module")
def hf(default_model_path):
    tok = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path,
                                                 dtype=torch.float32).eval()
    return tok, model


def _completion(server, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                   json={"model": "tgi", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _chat(server, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                   json={"model": "tgi", "temperature": 0, "messages": MESSAGES, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _chat_ids(hf, messages, **kwargs) -> list[int]:
    tok, _ = hf
    text = tok.apply_chat_template(messages, tokenize=False, **kwargs)
    return tok.encode(text, add_special_tokens=False)


# ----------------------------------------------------------------- ids and stops

def test_return_token_ids_are_the_tokenizers_and_generates(server, hf):
    tok, model = hf
    body = _completion(server, prompt=PROMPT, max_tokens=6, ignore_eos=True,
                       return_token_ids=True)
    ids = tok.encode(PROMPT)
    (choice,) = body["choices"]
    assert choice["prompt_token_ids"] == ids
    assert choice["token_ids"] == generate_greedy(model, ids, 6)
    chat = _chat(server, max_tokens=6, ignore_eos=True, return_token_ids=True)
    prompt = _chat_ids(hf, MESSAGES, add_generation_prompt=True)
    assert chat["prompt_token_ids"] == prompt
    assert chat["choices"][0]["token_ids"] == generate_greedy(model, prompt, 6)
    assert "prompt_token_ids" not in _chat(server, max_tokens=2)  # only when asked


def test_streamed_token_ids_add_up_to_the_unstreamed(server):
    body = {"model": "tgi", "temperature": 0, "messages": MESSAGES, "max_tokens": 6,
            "ignore_eos": True, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body,
                      timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    full = _chat(server, max_tokens=6, ignore_eos=True, return_token_ids=True)
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    streamed = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids", [])]
    assert streamed == full["choices"][0]["token_ids"]
    # continuous_usage_stats: every chunk counts the prompt and the tokens so far.
    counted = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counted == sorted(counted) and counted[-1] == 6
    assert all(c["usage"]["prompt_tokens"] == len(full["prompt_token_ids"]) for c in chunks)


def test_a_streamed_completion_carries_its_prompt_ids_once_and_its_token_ids(server):
    body = {"model": "tgi", "temperature": 0, "prompt": PROMPT, "max_tokens": 5,
            "ignore_eos": True, "return_token_ids": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        choices = [c for line in r.iter_lines()
                   if line.startswith("data: ") and line != "data: [DONE]"
                   for c in json.loads(line[6:])["choices"]]
    full = _completion(server, prompt=PROMPT, max_tokens=5, ignore_eos=True,
                       return_token_ids=True)["choices"][0]
    assert [c["prompt_token_ids"] for c in choices if "prompt_token_ids" in c] == [
        full["prompt_token_ids"]]
    assert [i for c in choices for i in c.get("token_ids", [])] == full["token_ids"]


def test_stop_token_ids_end_the_text_before_the_token(server, hf):
    tok, model = hf
    ids = tok.encode(PROMPT)
    greedy = generate_greedy(model, ids, 8)
    stop = next(t for i, t in enumerate(greedy) if i >= 2 and t not in greedy[:i])
    at = greedy.index(stop)
    body = _completion(server, prompt=PROMPT, max_tokens=8, stop_token_ids=[stop],
                       return_token_ids=True)
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] == greedy[:at + 1]  # the stop token is generated...
    assert choice["text"] == tok.decode(greedy[:at])  # ...and left out of the text
    kept = _completion(server, prompt=PROMPT, max_tokens=8, stop_token_ids=[stop],
                       include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == tok.decode(greedy[:at + 1])


def test_min_p_one_keeps_only_the_most_likely_token(server, hf):
    """`min_p: 1` at temperature 1 leaves each step only its most likely token: greedy
    decoding, whatever the seed (the filter is transformers' MinPLogitsWarper, checked
    against it in tests/engine/test_engine_sampling.py)."""
    tok, model = hf
    greedy = generate_greedy(model, tok.encode(PROMPT), 8)
    for seed in (1, 2):
        body = _completion(server, prompt=PROMPT, max_tokens=8, ignore_eos=True,
                           temperature=1.0, seed=seed, min_p=1.0, return_token_ids=True)
        assert body["choices"][0]["token_ids"] == greedy


def test_include_stop_str_in_output_keeps_the_stop_string(server, hf):
    tok, model = hf
    text = tok.decode(generate_greedy(model, tok.encode(PROMPT), 8))
    stop = text[3:6]
    cut = _completion(server, prompt=PROMPT, max_tokens=8, ignore_eos=True,
                      stop=[stop])["choices"][0]["text"]
    kept = _completion(server, prompt=PROMPT, max_tokens=8, ignore_eos=True, stop=[stop],
                       include_stop_str_in_output=True)["choices"][0]["text"]
    assert cut == text[:text.index(stop)]
    assert kept == text[:text.index(stop) + len(stop)]


def test_skip_special_tokens_false_keeps_their_text(server, hf):
    tok, _ = hf
    eos = tok.eos_token_id
    body = dict(prompt=PROMPT, max_tokens=3, ignore_eos=True, logit_bias={str(eos): 100})
    skipped = _completion(server, **body)["choices"][0]["text"]
    kept = _completion(server, **body, skip_special_tokens=False)["choices"][0]["text"]
    assert skipped == tok.decode([eos] * 3, skip_special_tokens=True) == ""
    assert kept == tok.decode([eos] * 3, skip_special_tokens=False)


def test_truncate_prompt_tokens_keeps_the_last_tokens(server, hf):
    tok, model = hf
    prompt = "one two three four five six seven eight nine ten"
    ids = tok.encode(prompt)
    body = _completion(server, prompt=prompt, max_tokens=4, ignore_eos=True,
                       truncate_prompt_tokens=5, return_token_ids=True)
    (choice,) = body["choices"]
    assert body["usage"]["prompt_tokens"] == 5
    assert choice["prompt_token_ids"] == ids[-5:]
    assert choice["token_ids"] == generate_greedy(model, ids[-5:], 4)


# ----------------------------------------------------------------- logprobs

def _reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_are_transformers(server, hf, k):
    tok, model = hf
    body = _completion(server, prompt=PROMPT, max_tokens=1, prompt_logprobs=k)
    ids = tok.encode(PROMPT)
    ref = _reference_logprobs(model, ids)
    got = body["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for pos, entry in enumerate(got[1:], 1):
        row = ref[pos - 1]
        actual = ids[pos]
        assert entry[str(actual)]["logprob"] == pytest.approx(row[actual].item(), abs=1e-4)
        top = torch.topk(row, k).indices.tolist() if k else []
        assert set(entry) == {str(actual), *map(str, top)}
        for rank, token in enumerate(top, 1):
            assert entry[str(token)]["rank"] == rank
            assert entry[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[str(token)]["decoded_token"] == tok.decode([token])
        if actual not in top:
            assert entry[str(actual)]["rank"] is None


def test_chat_prompt_logprobs_cover_the_templated_prompt(server, hf):
    _, model = hf
    body = _chat(server, max_tokens=1, prompt_logprobs=1, logprobs=True)
    ids = _chat_ids(hf, MESSAGES, add_generation_prompt=True)
    ref = _reference_logprobs(model, ids)
    got = body["prompt_logprobs"]
    assert len(got) == len(ids)
    for pos in (1, len(ids) // 2, len(ids) - 1):
        assert got[pos][str(ids[pos])]["logprob"] == pytest.approx(
            ref[pos - 1][ids[pos]].item(), abs=1e-4)
    # `logprobs` without `top_logprobs` keeps no alternatives, whatever the prompt asked.
    assert body["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server):
    plain = _chat(server, max_tokens=3, logprobs=True, top_logprobs=2, return_token_ids=True)
    named = _chat(server, max_tokens=3, logprobs=True, top_logprobs=2,
                  return_tokens_as_token_ids=True)
    ids = plain["choices"][0]["token_ids"]
    content = named["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{i}" for i in ids]
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])
    completion = _completion(server, prompt=PROMPT, max_tokens=3, logprobs=1,
                             return_tokens_as_token_ids=True, return_token_ids=True)
    choice = completion["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{i}" for i in choice["token_ids"]]


# ----------------------------------------------------------------- structured outputs

def test_guided_choice_is_one_of_the_choices(server):
    choices = ["yes", "no", "maybe (later)"]
    for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        text = _chat(server, max_tokens=10, **body)["choices"][0]["message"]["content"]
        assert text in choices


def test_guided_regex_matches(server):
    pattern = r"[a-c]{2}-\d{3}"
    for body in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        text = _completion(server, prompt=PROMPT, max_tokens=12, **body)["choices"][0]["text"]
        assert re.fullmatch(pattern, text), text


def test_guided_json_validates(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    for body in ({"guided_json": schema}, {"guided_json": json.dumps(schema)},
                 {"structured_outputs": {"json": schema}}):
        text = _chat(server, max_tokens=40, **body)["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(text), schema)


def test_guided_grammar_is_a_sentence_of_the_grammar(server):
    grammar = 'root ::= "x" digit digit\ndigit ::= [0-9]'
    for body in ({"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
        text = _completion(server, prompt=PROMPT, max_tokens=8, **body)["choices"][0]["text"]
        assert re.fullmatch(r"x[0-9]{2}", text), text


# ----------------------------------------------------------------- chat template fields

def test_add_generation_prompt_false_and_continue_final_message_render_as_transformers(
        server, hf):
    bare = _chat(server, max_tokens=1, add_generation_prompt=False, return_token_ids=True)
    assert bare["prompt_token_ids"] == _chat_ids(hf, MESSAGES, add_generation_prompt=False)
    partial = [*MESSAGES, {"role": "assistant", "content": "Steel wheels"}]
    cont = _chat(server, messages=partial, max_tokens=1, add_generation_prompt=False,
                 continue_final_message=True, return_token_ids=True)
    assert cont["prompt_token_ids"] == _chat_ids(hf, partial, continue_final_message=True)


def test_chat_template_kwargs_reach_the_template(server, hf):
    kwargs = {"custom_note": "unused by this template"}
    got = _chat(server, max_tokens=1, chat_template_kwargs=kwargs, return_token_ids=True)
    assert got["prompt_token_ids"] == _chat_ids(hf, MESSAGES, add_generation_prompt=True,
                                                **kwargs)


def test_chat_echo_starts_the_answer_with_the_last_assistant_message(server):
    partial = [*MESSAGES, {"role": "assistant", "content": "Steel wheels"}]
    plain = _chat(server, messages=partial, max_tokens=4)["choices"][0]["message"]["content"]
    echoed = _chat(server, messages=partial, max_tokens=4, echo=True)
    assert echoed["choices"][0]["message"]["content"] == "Steel wheels" + plain


# ----------------------------------------------------------------- routes

def test_vllm_tokenize_and_detokenize_are_the_tokenizers(server, hf):
    tok, _ = hf
    text = "Hello tokenizer, twice: hello"
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "return_token_strs": True},
                   timeout=30).json()
    ids = tok.encode(text)
    assert r["tokens"] == ids and r["count"] == len(ids) and r["max_model_len"] == 512
    assert r["token_strs"] == tok.convert_ids_to_tokens(ids)
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}, timeout=30).json()
    assert chat["tokens"] == _chat_ids(hf, MESSAGES, add_generation_prompt=True)
    tgi = httpx.post(f"{server.url}/tokenize", json={"inputs": text}, timeout=30).json()
    assert [t["id"] for t in tgi] == ids  # TGI's shape for TGI's body
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=30).json()
    assert back == {"prompt": tok.decode(ids)}
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_version(server):
    from switchyard import __version__

    assert httpx.get(f"{server.url}/version", timeout=30).json() == {"version": __version__}


def test_bad_values_are_refused_by_name(client):
    for extra, param in (({"prompt_logprobs": 21}, "prompt_logprobs"),
                         ({"prompt_logprobs": -1}, "prompt_logprobs"),
                         ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                         ({"echo": True, "tools": [{"type": "function", "function": {
                             "name": "f", "parameters": {"type": "object"}}}]}, "echo")):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="tgi", messages=MESSAGES, max_tokens=2,
                                           extra_body=extra)
        assert err.value.body["param"] == param, err.value.body
