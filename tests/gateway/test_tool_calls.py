"""Tool calling without a server: formats, the text-to-calls parser, the grammar, stream deltas.

The end-to-end tests (tests/e2e/test_tool_calls.py) run a random model, whose
calls are whatever the grammar lets it write; here the text is written by
hand, so the parser and the stream shape are pinned on cases a random model
rarely produces: text before a call, two calls in one message, a call cut off,
markers split across tokens in every possible place.
"""

from __future__ import annotations

import json
import random
import re
from types import SimpleNamespace

import msgspec
import pytest

xgr = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string as accepts  # noqa: E402

from switchyard.constraints import ConstraintError, tool_function, tools_constraint  # noqa: E402
from switchyard.generation import Finished, GeneratedToken, Step  # noqa: E402
from switchyard.protocol import openai as oai  # noqa: E402
from switchyard.tools.openai import (  # noqa: E402
    ToolSetup,
    ToolStreamer,
    chat_messages,
    tool_message,
)
from switchyard.tools.calls import (  # noqa: E402
    HERMES,
    JSON_FALLBACK,
    LLAMA3_JSON,
    ToolCallParser,
    new_call_id,
    parse_tool_calls,
    tool_format,
)
from switchyard_spec import ConstraintKind, FinishReason  # noqa: E402

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
UNIT = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"],
        "additionalProperties": False}
CALL_ID = re.compile(r"^call_[A-Za-z0-9]{24}$")

HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city":"a}\\"{b","days":2}}\n</tool_call>\n<tool_call>\n'
               '{"name": "set_unit", "arguments": {"unit":"c"}}\n</tool_call>')


def _chunkings(text: str, seed: int) -> list[str]:
    """``text`` cut at random places (every marker gets split somewhere over the seeds)."""
    rng = random.Random(seed)
    pieces, i = [], 0
    while i < len(text):
        size = rng.randint(1, 6)
        pieces.append(text[i:i + size])
        i += size
    return pieces


def test_format_follows_the_template():
    from tests.support.hermes_model import QWEN_TOOLS_TEMPLATE

    assert tool_format(QWEN_TOOLS_TEMPLATE) is HERMES
    llama = ('Respond in the format {"name": function name, "parameters": dictionary of '
             'argument name and its value}. Do not use variables.')
    assert tool_format(llama) is LLAMA3_JSON
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") is JSON_FALLBACK
    assert tool_format(None) is JSON_FALLBACK
    assert tool_format({"default": "x", "tool_use": QWEN_TOOLS_TEMPLATE}) is HERMES
    assert HERMES.render("f", {"a": 1}) == '<tool_call>\n{"name": "f", "arguments": {"a":1}}\n</tool_call>'


def test_call_ids_are_openai_shaped_and_distinct():
    ids = {new_call_id() for _ in range(200)}
    assert len(ids) == 200 and all(CALL_ID.match(i) for i in ids)


@pytest.mark.parametrize("seed", range(8))
def test_parser_reads_content_and_two_calls_however_the_text_is_cut(seed):
    parser = ToolCallParser(HERMES, ["get_weather", "set_unit"])
    events = []
    for piece in _chunkings(HERMES_TEXT, seed):
        events += parser.feed(piece)
    events += parser.finish()
    assert parser.content == "Let me check."
    assert [(c.name, c.arguments, c.complete) for c in parser.calls] == [
        ("get_weather", '{"city":"a}\\"{b","days":2}', True), ("set_unit", '{"unit":"c"}', True)]
    starts = [e for e in events if e.kind == "call"]
    assert [e.index for e in starts] == [0, 1]
    assert len({e.call_id for e in starts}) == 2
    for index, call in enumerate(parser.calls):
        fragments = [e.text for e in events if e.kind == "arguments" and e.index == index]
        assert "".join(fragments) == call.arguments
    # Content comes before the first call's start, and nothing but arguments after it.
    first_call = events.index(starts[0])
    assert all(e.kind == "content" for e in events[:first_call])
    assert all(e.kind != "content" for e in events[first_call:])


def test_parser_other_families_and_separators():
    p = parse_tool_calls(LLAMA3_JSON, ["f", "g"],
                        '{"name": "f", "parameters": {"x":[1,{"y":"}"}]}}; '
                        '{"name": "g", "parameters": {}}')
    assert p.content is None
    assert [(c.name, c.arguments) for c in p.calls] == [("f", '{"x":[1,{"y":"}"}]}'), ("g", "{}")]
    p = parse_tool_calls(JSON_FALLBACK, ["f"], '{"name": "f", "arguments": {"a":1}}\n'
                                              '{"name": "f", "arguments": {"a":2}}')
    assert [c.arguments for c in p.calls] == ['{"a":1}', '{"a":2}']


def test_parser_holds_back_what_may_start_a_call_and_releases_it_at_the_end():
    parser = ToolCallParser(HERMES, ["f"])
    assert [e.text for e in parser.feed("It is <tool")] == ["It is"]
    assert [e.text for e in parser.finish()] == [" <tool"]
    assert parser.content == "It is <tool" and parser.calls == []


def test_parser_blank_text_between_and_around_calls_is_nobodys():
    p = parse_tool_calls(JSON_FALLBACK, ["f"], '\n {"name": "f", "arguments": {}}\n\n')
    assert p.content is None and len(p.calls) == 1
    p = parse_tool_calls(JSON_FALLBACK, ["f"], "  just text \n")
    assert p.content == "  just text \n" and p.calls == []


def test_parser_keeps_a_call_cut_in_its_arguments_and_drops_one_cut_in_its_name():
    p = parse_tool_calls(HERMES, ["get_weather"],
                         '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Pa')
    assert [(c.name, c.arguments, c.complete) for c in p.calls] == [
        ("get_weather", '{"city":"Pa', False)]
    p = parse_tool_calls(HERMES, ["get_weather"], '<tool_call>\n{"name": "get_we')
    assert p.calls == [] and p.content is None


def test_parser_treats_an_unknown_function_as_text():
    """Only unconstrained text can do this; it stays text rather than being lost."""
    text = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    p = parse_tool_calls(HERMES, ["f"], text)
    assert p.calls == [] and p.content == text


# ---------------------------------------------------------------- the grammar

def _grammar(fmt, *, required, parallel, names=("get_weather", "set_unit")):
    schemas = {"get_weather": WEATHER, "set_unit": UNIT}
    functions = [tool_function(n, schemas[n]) for n in names]
    constraint = tools_constraint(functions, fmt, required=required, parallel=parallel)
    assert constraint.kind is ConstraintKind.STRUCTURAL_TAG
    return xgr.Grammar.from_structural_tag(constraint.spec)


W = HERMES.render("get_weather", '{"city":"Rome","days":3}')
U = HERMES.render("set_unit", '{"unit":"f"}')


def test_required_grammar_is_calls_and_nothing_else():
    parallel = _grammar(HERMES, required=True, parallel=True)
    assert accepts(parallel, W) and accepts(parallel, f"{W}\n{U}")
    assert not accepts(parallel, "") and not accepts(parallel, f"hi {W}")
    assert not accepts(parallel, HERMES.render("get_weather", '{"city": "Rome", "days": 3}'))
    assert not accepts(parallel, HERMES.render("get_weather", '{"city":"Rome","days":9}'))
    assert not accepts(parallel, HERMES.render("get_weather", '{"city":"a\tb","days":3}'))
    assert not accepts(parallel, HERMES.render("other", "{}"))
    single = _grammar(HERMES, required=True, parallel=False)
    assert accepts(single, U) and not accepts(single, f"{W}\n{U}")
    named = _grammar(HERMES, required=True, parallel=False, names=("set_unit",))
    assert accepts(named, U) and not accepts(named, W)


def test_auto_grammar_is_free_text_until_the_trigger():
    parallel = _grammar(HERMES, required=False, parallel=True)
    for text in ("", "plain words", f"Sure. {W}", f"{W}\n{U}", f"{W} and text"):
        assert accepts(parallel, text), text
    assert not accepts(parallel, '<tool_call>\n{"name": "get_weather", "arguments": {}}')
    single = _grammar(JSON_FALLBACK, required=False, parallel=False)
    call = JSON_FALLBACK.render("set_unit", '{"unit":"c"}')
    assert accepts(single, f"ok {call}") and not accepts(single, f"{call}\n{call}")


@pytest.mark.parametrize("parameters, words", [
    ({"type": "string"}, "type: \"object\""),
    ([1], "type: \"list\""),
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "is not valid"),
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}},
     "uniqueItems"),
])
def test_bad_parameters_are_refused(parameters, words):
    with pytest.raises(ConstraintError, match=re.escape(words)):
        tool_function("f", parameters)


def test_strict_functions_follow_openais_rules():
    loose = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tool_function("f", loose)
    with pytest.raises(ConstraintError, match="additionalProperties"):
        tool_function("f", loose, strict=True)
    assert json.loads(tool_function("f", None).schema) == {
        "additionalProperties": False, "properties": {}, "type": "object"}


# -------------------------------------------------------------- wire shapes

def _setup(named=False, fmt=HERMES, names=("get_weather", "set_unit")):
    return ToolSetup(format=fmt, functions=names, named=named, constraint=None,  # type: ignore[arg-type]
                     template_tools=())


def _steps(pieces: list[str], reason=FinishReason.EOS_TOKEN) -> list[Step]:
    done = Finished(reason=reason, generated_text="".join(pieces), generated_tokens=len(pieces),
                    prompt_tokens=3, seed=None)
    return [Step(token=GeneratedToken(id=i, text=p, logprob=0.0, special=False), text=p,
                 finished=done if i == len(pieces) - 1 else None)
            for i, p in enumerate(pieces)]


def _stream(setup, steps):
    streamer = ToolStreamer(setup)
    deltas, reason = [], None
    for step in steps:
        deltas += streamer.feed(step)
        if step.finished is not None:
            more, reason = streamer.finish(step.finished)
            deltas += more
    return [msgspec.to_builtins(d) for d in deltas], reason


def test_stream_deltas_of_two_parallel_calls():
    setup = _setup()
    deltas, reason = _stream(setup, _steps(_chunkings(HERMES_TEXT[len("Let me check.\n"):], 3)))
    assert reason == "tool_calls"
    firsts = [d for d in deltas if "id" in d["tool_calls"][0]]
    assert [d["tool_calls"][0]["index"] for d in firsts] == [0, 1]
    for d in firsts:
        (call,) = d["tool_calls"]
        assert CALL_ID.match(call["id"]) and call["type"] == "function"
        assert call["function"]["arguments"] == "" and call["function"]["name"]
    assert len({d["tool_calls"][0]["id"] for d in firsts}) == 2
    for d in deltas:
        assert set(d) == {"tool_calls"}
        (call,) = d["tool_calls"]
        if "id" not in call:
            assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
    args = ["".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas
                    if d["tool_calls"][0]["index"] == i) for i in (0, 1)]
    assert args == ['{"city":"a}\\"{b","days":2}', '{"unit":"c"}']


def test_stream_and_message_agree_and_finish_reasons():
    steps = _steps(_chunkings(HERMES_TEXT, 5))
    message, reason = tool_message(_setup(), steps, steps[-1].finished)
    body = msgspec.to_builtins(message)
    assert body["content"] == "Let me check." and reason == "tool_calls"
    assert [c["function"]["name"] for c in body["tool_calls"]] == ["get_weather", "set_unit"]
    assert all(c["type"] == "function" and CALL_ID.match(c["id"]) for c in body["tool_calls"])
    _, named = _stream(_setup(named=True, names=("set_unit",)), _steps([U]))
    assert named == "stop"
    cut = _steps([W[:-5]], reason=FinishReason.LENGTH)
    message, reason = tool_message(_setup(), cut, cut[-1].finished)
    assert reason == "length" and message.tool_calls[0].function.arguments == '{"city":"Rome","days":3}'
    text = _steps(["just ", "words"])
    message, reason = tool_message(_setup(), text, text[-1].finished)
    assert message.content == "just words" and message.tool_calls is msgspec.UNSET
    assert reason == "stop"


def test_history_reaches_the_template_in_each_familys_form():
    req = oai.ChatCompletionRequest(messages=[
        oai.ChatMessageIn(role="user", content="weather?"),
        oai.ChatMessageIn(role="assistant", content=None, tool_calls=[oai.ToolCall(
            id="call_1", function=oai.FunctionCall(name="get_weather",
                                                   arguments='{"city":"Rome","days":1}'))]),
        oai.ChatMessageIn(role="tool", content="sunny", tool_call_id="call_1"),
    ])

    def model(template):
        return SimpleNamespace(tokenizer=SimpleNamespace(
            hf_tokenizer=SimpleNamespace(chat_template=template)))

    text_of = lambda m: m.content or ""  # noqa: E731
    from tests.support.hermes_model import QWEN_TOOLS_TEMPLATE

    native = chat_messages(model(QWEN_TOOLS_TEMPLATE), req, text_of, None)
    assert native[1].tool_calls == ({"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Rome", "days": 1}}},)
    assert native[2].role == "tool" and native[2].tool_call_id == "call_1"
    plain = chat_messages(model("{{ messages }}"), req, text_of, None)
    assert plain[1].tool_calls is None
    assert plain[1].content == '{"name": "get_weather", "arguments": {"city":"Rome","days":1}}'
    setup = ToolSetup(format=JSON_FALLBACK, functions=("get_weather",), named=False,
                      constraint=None,  # type: ignore[arg-type]
                      template_tools=({"type": "function",
                                       "function": {"name": "get_weather"}},))
    prompted = chat_messages(model("{{ messages }}"), req, text_of, setup)
    assert prompted[2].content.startswith("sunny\n---\n")
    assert prompted[2].content.endswith('{"type": "function", "function": {"name": "get_weather"}}')
