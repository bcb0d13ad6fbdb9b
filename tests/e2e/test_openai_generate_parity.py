"""Greedy output of the OpenAI routes against transformers' ``generate`` on the same prompt.

The session server honours EOS, and so does the reference: ``generate`` runs with the
model's own generation config (its ``eos_token_id``), on the prompt the chat template
makes of the messages (transformers' ``apply_chat_template`` with the generation
prompt). One conversation was picked because greedy decoding ends it with EOS before
``max_tokens``, the other runs into ``max_tokens``; a completion is sent the
chat-templated text itself and must answer what the chat route answers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MAX_TOKENS = 40
ENDS_WITH_EOS = [{"role": "user", "content": "Name a color."}]
"""Greedy decoding of this conversation emits EOS as its 35th token."""
RUNS_TO_THE_LIMIT = [{"role": "system", "content": "You are terse."},
                     {"role": "user", "content": "Say something about Python."}]


@dataclass
class Reference:
    """transformers' greedy continuation: the generated ids (EOS included, as generate
    returns it), each one's log-probability, and whether it stopped at EOS."""

    ids: list[int]
    logprobs: list[float]
    stopped_at_eos: bool
    text: str


@pytest.fixture(scope="module")
def hf(default_model_path: Path):
    tok = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    return tok, model


def _reference(hf, prompt_ids: list[int]) -> Reference:
    tok, model = hf
    eos = model.generation_config.eos_token_id
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]),
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=MAX_TOKENS, output_logits=True,
                             return_dict_in_generate=True)
    ids = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[i])
                for step, i in zip(out.logits, ids, strict=True)]
    stopped = bool(ids) and ids[-1] == eos
    text = tok.decode(ids[:-1] if stopped else ids, skip_special_tokens=True)
    return Reference(ids, logprobs, stopped, text)


def _chat_prompt(hf, messages: list[dict[str, str]]) -> list[int]:
    tok, _ = hf
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120)


@pytest.mark.parametrize("messages", [ENDS_WITH_EOS, RUNS_TO_THE_LIMIT],
                         ids=["ends-with-eos", "runs-to-max-tokens"])
def test_chat_is_generate_on_the_templated_prompt(client, hf, messages):
    prompt = _chat_prompt(hf, messages)
    want = _reference(hf, prompt)
    assert want.stopped_at_eos == (messages is ENDS_WITH_EOS)  # the cases are what they say
    r = client.chat.completions.create(model="tgi", messages=messages, max_tokens=MAX_TOKENS,
                                       temperature=0, logprobs=True)
    choice = r.choices[0]
    assert choice.message.content == want.text
    assert choice.finish_reason == ("stop" if want.stopped_at_eos else "length")
    assert r.usage.prompt_tokens == len(prompt)
    # EOS is a generated token, as in TGI (its `generated_tokens` counts it).
    assert r.usage.completion_tokens == len(want.ids)
    # One log-probability per generated token (EOS's too), transformers' to float32 noise.
    got = [c.logprob for c in choice.logprobs.content]
    assert got == pytest.approx(want.logprobs, abs=1e-4)


@pytest.mark.parametrize("messages", [ENDS_WITH_EOS, RUNS_TO_THE_LIMIT],
                         ids=["ends-with-eos", "runs-to-max-tokens"])
def test_completion_of_the_templated_text_is_generate(client, hf, messages):
    tok, _ = hf
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tok(text)["input_ids"]
    assert prompt == _chat_prompt(hf, messages)  # the text reads back as the same ids
    want = _reference(hf, prompt)
    r = client.completions.create(model="tgi", prompt=text, max_tokens=MAX_TOKENS,
                                  temperature=0, logprobs=1)
    choice = r.choices[0]
    assert choice.text == want.text
    assert choice.finish_reason == ("stop" if want.stopped_at_eos else "length")
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len(want.ids)
    assert choice.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_min_tokens_is_generate_with_min_new_tokens(client, hf):
    """`min_tokens` holds EOS back as transformers' `min_new_tokens` does: the greedy
    conversation that ends with EOS at its 35th token goes on to the 38th, and its
    log-probabilities are those of the masked distribution (EOS at -inf)."""
    tok, model = hf
    prompt = _chat_prompt(hf, ENDS_WITH_EOS)
    plain = _reference(hf, prompt)
    min_tokens = 38
    assert plain.stopped_at_eos and len(plain.ids) < min_tokens  # the hold matters
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=MAX_TOKENS,
                             min_new_tokens=min_tokens, output_scores=True,
                             return_dict_in_generate=True)
    ids = out.sequences[0, len(prompt):].tolist()
    want = [float(torch.log_softmax(step[0].float(), -1)[i])
            for step, i in zip(out.scores, ids, strict=True)]
    eos = model.generation_config.eos_token_id
    assert len(ids) > min_tokens and eos not in ids[:min_tokens]
    r = client.chat.completions.create(model="tgi", messages=ENDS_WITH_EOS, max_tokens=MAX_TOKENS,
                                       temperature=0, logprobs=True,
                                       extra_body={"min_tokens": min_tokens})
    choice = r.choices[0]
    stopped = ids[-1] == eos
    assert choice.message.content == tok.decode(ids[:-1] if stopped else ids,
                                                skip_special_tokens=True)
    assert r.usage.completion_tokens == len(ids)
    assert [c.logprob for c in choice.logprobs.content] == pytest.approx(want, abs=1e-4)


def test_twenty_top_logprobs_are_transformers_top_twenty(client, hf):
    """Chat allows `top_logprobs` up to 20 (OpenAI's range), past TGI's `--max-top-n-tokens`
    of 5: the 20 alternatives at each step are transformers' 20 most likely tokens."""
    tok, model = hf
    prompt = _chat_prompt(hf, RUNS_TO_THE_LIMIT)
    steps = 4
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=steps, output_logits=True,
                             return_dict_in_generate=True)
    r = client.chat.completions.create(model="tgi", messages=RUNS_TO_THE_LIMIT, max_tokens=steps,
                                       temperature=0, logprobs=True, top_logprobs=20)
    content = r.choices[0].logprobs.content
    assert len(content) == steps
    for entry, logits in zip(content, out.logits, strict=True):
        top = torch.log_softmax(logits[0].float(), -1).topk(20)
        assert len(entry.top_logprobs) == 20
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            top.values.tolist(), abs=1e-4)
        # The same tokens (their texts; ties aside, which these random logits do not have).
        assert [t.token for t in entry.top_logprobs] == [
            tok.convert_tokens_to_string([tok.convert_ids_to_tokens(i)])
            for i in top.indices.tolist()]
