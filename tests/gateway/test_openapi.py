"""The OpenAPI document: checked in and current, valid OpenAPI 3.x, and a superset of TGI's.

`spec/openapi.json` is what the app serves at `/openapi.json`; when a route or a
wire type changes, regenerate it with `switchyard openapi -o spec/openapi.json`.

The comparison with TGI's document walks every TGI route, its request body and
its answers, and checks that every property TGI names is in ours with a
compatible JSON type: a request we decode must accept whatever TGI accepts, an
answer we send must be of a type TGI declares. Deliberate differences are listed
in `DEVIATIONS` with their reason; an entry that no longer excuses anything fails
the test, so the list stays true.

TGI's side comes from `tests/gateway/data/tgi_openapi_facts.json`, in the
repository, so a clone runs the comparison too: for each TGI route and method,
the flattened shape of its request body and of each answer (JSON types, enum
values, property names, required names, array items), extracted from TGI's
document by `extract_facts`. Where TGI's document itself is beside the
checkout (`../shared/reference/tgi-openapi.json`, as in CI), a test re-extracts
the facts from it and fails when the file no longer matches.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient
from openapi_spec_validator import validate

from switchyard.app import create_app
from switchyard.models.served import ServedModel
from switchyard.openapi import document
from switchyard.plugins import PluginHost
from switchyard.settings import ServeSettings

ROOT = Path(__file__).resolve().parents[2]
CHECKED_IN = ROOT / "spec" / "openapi.json"
TGI_DOCUMENT = ROOT.parent / "shared" / "reference" / "tgi-openapi.json"
"""TGI's own document, in the shared folder beside the repository (as in CI)."""
TGI_FACTS = Path(__file__).resolve().parent / "data" / "tgi_openapi_facts.json"
"""What the comparison needs from TGI's document, kept in the repository."""
REEXTRACT = ('.venv/bin/python -c "from tests.gateway.test_openapi import write_facts; '
             'write_facts()"')
REGENERATE = "switchyard openapi -o spec/openapi.json"

NOT_YET_SERVED: dict[str, str] = {}
"""TGI routes we do not serve yet. Each is compared as soon as it is served."""

_OPENAI_ERRORS = (
    "the OpenAI routes answer errors in OpenAI's format, {error: {message, type, param, "
    "code}} (DESIGN.md, tgi-api.md); TGI's document gives its own format there"
)
_STREAM_ERRORS = (
    "as in TGI's code, /generate_stream answers errors found after the body was read as an "
    "in-stream event with status 200; only an unreadable body is a JSON 4xx. TGI's document "
    "lists them as text/event-stream 4xx/5xx, which its code never sends"
)

_LOGIT_BIAS = (
    "OpenAI's object form {token id: bias}; TGI takes an array of floats and ignores it "
    "(tgi-api.md §5)"
)
_INVOCATIONS_ERRORS = (
    "a chat or completion body is answered, errors included, as its OpenAI route answers "
    "it; a generate body in TGI's format"
)

DEVIATIONS: dict[str, str] = {
    "POST /v1/chat/completions 422": _OPENAI_ERRORS,
    "POST /v1/chat/completions 424": _OPENAI_ERRORS,
    "POST /v1/chat/completions 429": _OPENAI_ERRORS,
    "POST /v1/chat/completions 500": _OPENAI_ERRORS,
    "POST /v1/completions 422": _OPENAI_ERRORS,
    "POST /v1/completions 424": _OPENAI_ERRORS,
    "POST /v1/completions 429": _OPENAI_ERRORS,
    "POST /v1/completions 500": _OPENAI_ERRORS,
    "POST /generate_stream 422 text/event-stream": _STREAM_ERRORS,
    "POST /generate_stream 424": _STREAM_ERRORS,
    "POST /generate_stream 429": _STREAM_ERRORS,
    "POST /generate_stream 500": _STREAM_ERRORS,
    "POST /v1/chat/completions request .logit_bias": _LOGIT_BIAS,
    "POST /chat_tokenize request .logit_bias": _LOGIT_BIAS,
    "POST /invocations request .logit_bias": _LOGIT_BIAS,
    "POST /invocations 200 application/json : type ['array', 'object']": (
        "a body with `inputs` is answered as POST / answers it, with a JSON array, as TGI's "
        "code does; TGI's document says an object"
    ),
    "POST /invocations 200 text/event-stream .choices[].delta.tool_call_id": (
        "TGI's delta reuses its request type TextMessage; a delta never carries tool_call_id"
    ),
    "POST /invocations 422": _INVOCATIONS_ERRORS,
    "POST /invocations 424": _INVOCATIONS_ERRORS,
    "POST /invocations 429": _INVOCATIONS_ERRORS,
    "POST /invocations 500": _INVOCATIONS_ERRORS,
    "POST /v1/completions 200 application/json .choices[].logprobs": (
        "OpenAI's legacy logprobs object {tokens, token_logprobs, top_logprobs, text_offset}; "
        "TGI's document says an array of floats, and TGI always sends null"
    ),
    "POST /v1/completions 200 text/event-stream .choices[].logprobs": (
        "OpenAI's legacy logprobs object, as in the JSON answer"
    ),
    "POST /v1/chat/completions 200 application/json .choices[].message.tool_call_id": (
        "TGI's reply message reuses its request type TextMessage; a reply never carries "
        "tool_call_id (OpenAI's neither)"
    ),
    "POST /v1/chat/completions 200 application/json .choices[].message.tool_calls[].function"
    ".description": (
        "TGI's reply call reuses its request type FunctionDefinition; a call the model made "
        "has a name and arguments only (OpenAI's too)"
    ),
    "POST /v1/chat/completions 200 text/event-stream .choices[].delta.tool_call_id": (
        "TGI's delta reuses its request type TextMessage; a delta never carries tool_call_id"
    ),
    "GET /v1/models 200 application/json": (
        "TGI's document says one ModelInfo, but its code answers OpenAI's list object "
        "{object: list, data: [ModelInfo]} (tgi-api.md §1), as we do"
    ),
    "GET /v1/models 404": "listing models looks none up, so there is no 404 (nor in TGI's code)",
    "POST /tokenize 404": "TGI answers 404 without a fast tokenizer; we always have one",
}
"""Where ours differs from TGI's document on purpose: location prefix -> why."""


# --- the checked-in document ------------------------------------------------


def _no_model(settings: ServeSettings, plugins: PluginHost) -> ServedModel:
    raise AssertionError("the OpenAPI document must not need a model")


@pytest.fixture(scope="module")
def app_document() -> dict[str, Any]:
    """The document the app serves, built in-process: no model is loaded for it."""
    app = create_app(ServeSettings(), loader=_no_model)
    # Not entered as a context manager: the app's lifespan (model loading) never runs.
    client = TestClient(app=app)
    served = {path: client.get(path) for path in
              ("/openapi.json", "/api-doc/openapi.json", "/docs/openapi.json")}
    for path, response in served.items():
        assert response.status_code == 200, (path, response.text)
    bodies = [response.json() for response in served.values()]
    assert bodies[0] == bodies[1] == bodies[2], "the three OpenAPI paths serve different documents"
    assert bodies[0] == json.loads(json.dumps(document(app)))
    return bodies[0]


def test_checked_in_document_is_current(app_document: dict[str, Any]) -> None:
    assert CHECKED_IN.exists(), f"spec/openapi.json is missing: run `{REGENERATE}`"
    checked_in = json.loads(CHECKED_IN.read_text())
    if checked_in != app_document:
        changed = _differences(checked_in, app_document)
        pytest.fail(
            "spec/openapi.json differs from the document the app serves "
            f"({len(changed)} differences, first: {changed[:5]}).\n"
            f"Regenerate it with `{REGENERATE}` and commit it."
        )


def test_document_is_valid_openapi(app_document: dict[str, Any]) -> None:
    assert app_document["openapi"].startswith("3.")
    validate(app_document)  # raises with the offending path when invalid


def test_error_bodies_are_the_apis_own(app_document: dict[str, Any]) -> None:
    """No route documents Litestar's validation-error body: clients never get it."""
    for path, item in app_document["paths"].items():
        for method, operation in item.items():
            for status, response in operation.get("responses", {}).items():
                for media in (response.get("content") or {}).values():
                    schema = json.dumps(media.get("schema", {}))
                    assert '"status_code"' not in schema, (method, path, status)


def _differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Paths at which two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                out.append(f"{where}/{key}")
            else:
                out.extend(_differences(a[key], b[key], f"{where}/{key}"))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in _differences(x, y, f"{where}/{i}")]
    return [] if a == b else [where or "/"]


# --- the comparison with TGI's document --------------------------------------

ANY = "any"


@dataclass
class Shape:
    """What a JSON schema allows, flattened: `$ref`s resolved, `allOf` merged, and the
    alternatives of `oneOf`/`anyOf` united (their object properties merged)."""

    types: set[str] = field(default_factory=set)
    """JSON types other than null; ANY for a schema that allows any value."""
    enum: set[Any] | None = None
    properties: dict[str, Shape] = field(default_factory=dict)
    required: set[str] = field(default_factory=set)
    items: Shape | None = None


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object" if isinstance(value, dict) else "null"


def _union(shapes: list[Shape]) -> Shape:
    out = Shape()
    objects = [s for s in shapes if "object" in s.types]
    for s in shapes:
        out.types |= s.types
        for name, prop in s.properties.items():
            out.properties[name] = _union([out.properties[name], prop]) \
                if name in out.properties else prop
        if s.items is not None:
            out.items = s.items if out.items is None else _union([out.items, s.items])
    # Only what every object alternative requires is surely required.
    out.required = set.intersection(*(s.required for s in objects)) if objects else set()
    enums = [s.enum for s in shapes]
    out.enum = set().union(*enums) if enums and all(e is not None for e in enums) else None
    if ANY in out.types:
        out.types = {ANY}
    return out


def _intersection(shapes: list[Shape]) -> Shape:
    typed = [s for s in shapes if s.types and ANY not in s.types]
    out = Shape(types=set.intersection(*(s.types for s in typed)) if typed else {ANY})
    for s in shapes:
        for name, prop in s.properties.items():
            out.properties.setdefault(name, prop)
        out.required |= s.required
        out.items = out.items or s.items
        if s.enum is not None:
            out.enum = s.enum if out.enum is None else out.enum & s.enum
    if out.properties and out.types == {ANY}:
        out.types = {"object"}
    return out


def shape_of(schema: Any, doc: dict[str, Any], depth: int = 0) -> Shape:
    """Flatten a schema of `doc` (OpenAPI 3.0 `nullable` or 3.1 type lists alike)."""
    if depth > 20 or not isinstance(schema, dict):
        return Shape(types={ANY})
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        resolved = shape_of(doc["components"]["schemas"][name], doc, depth + 1)
        rest = {k: v for k, v in schema.items() if k != "$ref"}
        return _intersection([resolved, shape_of(rest, doc, depth + 1)]) \
            if any(k in rest for k in ("type", "allOf", "oneOf", "anyOf")) else resolved
    parts: list[Shape] = []
    own = Shape()
    declared = schema.get("type")
    if isinstance(declared, str):
        own.types = {declared}
    elif isinstance(declared, list):
        own.types = set(declared)
    if "enum" in schema or "const" in schema:
        values = schema.get("enum", [schema.get("const")])
        own.enum = {v for v in values if v is not None}
        own.types = own.types or {_json_type(v) for v in values}
    if "properties" in schema:
        own.types = own.types or {"object"}
        own.properties = {k: shape_of(v, doc, depth + 1) for k, v in schema["properties"].items()}
        own.required = set(schema.get("required", []))
    if "items" in schema:
        own.types = own.types or {"array"}
        own.items = shape_of(schema["items"], doc, depth + 1)
    own.types.discard("null")
    if own.types or own.enum is not None:
        parts.append(own)
    if "allOf" in schema:
        parts.append(_intersection([shape_of(s, doc, depth + 1) for s in schema["allOf"]]))
    for key in ("oneOf", "anyOf"):
        if key in schema:
            alternatives = [shape_of(s, doc, depth + 1) for s in schema[key]]
            # Null alternatives only make the value nullable, which is always compatible.
            alternatives = [a for a in alternatives if a.types or a.enum is not None]
            parts.append(_union(alternatives) if alternatives else Shape())
    if not parts:
        # `{"type": "null"}` allows null only (an empty Shape); no type at all, anything.
        return Shape() if declared in ("null", ["null"]) else Shape(types={ANY})
    return parts[0] if len(parts) == 1 else _intersection(parts)


def _covers(wide: set[str], narrow: set[str]) -> bool:
    """Whether every type of `narrow` is allowed by `wide` (an integer is a number)."""
    if ANY in wide:
        return True
    return all(t in wide or (t == "integer" and "number" in wide) for t in narrow)


def compare(tgi: Shape, ours: Shape, *, request: bool, where: str) -> Iterator[str]:
    """Problems that would break a TGI client; `request`: we decode it, else we send it."""
    if ANY in tgi.types or not tgi.types or not ours.types:
        return  # TGI allows anything, or one side is null only: nothing to compare
    if ANY in ours.types:
        if not request:  # an undocumented answer tells a client nothing
            yield f"{where}: ours allows any value, TGI's is {sorted(tgi.types)}"
        return
    accepted = _covers(ours.types, tgi.types) if request else _covers(tgi.types, ours.types)
    if not accepted:
        yield f"{where}: type {sorted(ours.types)} is not compatible with TGI's {sorted(tgi.types)}"
        return
    if tgi.enum is not None and ours.enum is not None:
        extra = (tgi.enum - ours.enum) if request else (ours.enum - tgi.enum)
        if extra:
            yield f"{where}: enum values {sorted(map(str, extra))} are TGI's only" if request \
                else f"{where}: enum values {sorted(map(str, extra))} are not TGI's"
    if "object" in tgi.types and "object" in ours.types:
        for name, tgi_prop in sorted(tgi.properties.items()):
            if name not in ours.properties:
                yield f"{where}.{name}: missing"
                continue
            yield from compare(tgi_prop, ours.properties[name], request=request,
                               where=f"{where}.{name}")
        if request:
            for name in sorted(ours.required - tgi.required):
                if name in tgi.properties:
                    yield f"{where}.{name}: required by us, optional in TGI's"
    if "array" in tgi.types and "array" in ours.types and tgi.items and ours.items:
        yield from compare(tgi.items, ours.items, request=request, where=f"{where}[]")


def compare_operation(method: str, path: str, tgi_facts: dict[str, Any],
                      our_doc: dict[str, Any]) -> list[str]:
    """Every problem of one route, each starting with `METHOD /path`."""
    where = f"{method.upper()} {path}"
    ours_item = our_doc["paths"].get(path, {})
    if method not in ours_item:
        return [f"{where}: not served"]
    tgi_op, our_op = tgi_facts["operations"][where], ours_item[method]
    problems: list[str] = []
    if tgi_op.get("request") is not None:
        our_body = our_op.get("requestBody", {}).get("content", {}).get("application/json")
        if our_body is None:
            problems.append(f"{where} request: no JSON body")
        else:
            problems += compare(shape_from_facts(tgi_op["request"]),
                                shape_of(our_body["schema"], our_doc),
                                request=True, where=f"{where} request ")
    for status, tgi_media in tgi_op.get("responses", {}).items():
        ours = our_op.get("responses", {}).get(status)
        if ours is None:
            problems.append(f"{where} {status}: not documented")
            continue
        for media, tgi_shape in tgi_media.items():
            our_media = (ours.get("content") or {}).get(media)
            if our_media is None:
                problems.append(f"{where} {status} {media}: not documented")
                continue
            problems += compare(shape_from_facts(tgi_shape),
                                shape_of(our_media.get("schema", {}), our_doc),
                                request=False, where=f"{where} {status} {media} ")
    return problems


# --- TGI's facts: extracted from its document, kept in the repository ---------


def shape_to_facts(shape: Shape, path: str = "$", required: bool = False) -> list[str]:
    """A flattened shape as lines, one per value: `$.a.b[]: type|type [required] [enum [...]]`."""
    line = f"{path}: {'|'.join(sorted(shape.types))}"
    if required:
        line += " required"
    if shape.enum is not None:
        line += " enum " + json.dumps(sorted(shape.enum, key=lambda v: (str(type(v)), str(v))))
    lines = [line]
    for name, prop in sorted(shape.properties.items()):
        lines += shape_to_facts(prop, f"{path}.{name}", name in shape.required)
    if shape.items is not None:
        lines += shape_to_facts(shape.items, f"{path}[]")
    return lines


_FACT = re.compile(r"(\$[^:]*): ([^ ]*)( required)?(?: enum (.*))?")


def shape_from_facts(lines: list[str]) -> Shape:
    """The :class:`Shape` that :func:`shape_to_facts` wrote."""
    shapes: dict[str, Shape] = {}
    for line in lines:
        match = _FACT.fullmatch(line)
        assert match, f"unreadable fact: {line!r}"
        path, types, required, enum = match.groups()
        shape = Shape(types=set(types.split("|")) - {""},
                      enum=set(json.loads(enum)) if enum else None)
        shapes[path] = shape
        if path.endswith("[]"):
            shapes[path[:-2]].items = shape
        elif path != "$":
            parent, name = path.rsplit(".", 1)
            shapes[parent].properties[name] = shape
            if required:
                shapes[parent].required.add(name)
    return shapes["$"]


def extract_facts(tgi_doc: dict[str, Any]) -> dict[str, Any]:
    """What the comparison reads from TGI's document: routes, methods, flattened shapes."""
    operations: dict[str, Any] = {}
    for path, item in sorted(tgi_doc["paths"].items()):
        for method, op in sorted(item.items()):
            body = op.get("requestBody", {}).get("content", {}).get("application/json")
            operations[f"{method.upper()} {path}"] = {
                "request": None if body is None else shape_to_facts(
                    shape_of(body["schema"], tgi_doc)),
                "responses": {
                    status: {media: shape_to_facts(shape_of(content.get("schema", {}), tgi_doc))
                             for media, content in sorted((response.get("content") or {}).items())}
                    for status, response in sorted(op.get("responses", {}).items())},
            }
    return {
        "about": ("Facts from TGI's OpenAPI document (text-generation-inference "
                  f"{tgi_doc.get('info', {}).get('version', '?')}): for each route and method, "
                  "the JSON shape of its request body and of each answer by status and media "
                  "type, flattened ($refs resolved, allOf merged, oneOf/anyOf united): JSON "
                  "types, enum values, property names, required names, array items. "
                  "Extracted by tests/gateway/test_openapi.py (extract_facts)."),
        "operations": operations,
    }


def write_facts() -> None:
    """Re-extract the facts file from TGI's document beside the checkout."""
    facts = extract_facts(json.loads(TGI_DOCUMENT.read_text()))
    TGI_FACTS.parent.mkdir(parents=True, exist_ok=True)
    TGI_FACTS.write_text(json.dumps(facts, indent=1) + "\n")


def _tgi_facts() -> dict[str, Any]:
    return json.loads(TGI_FACTS.read_text()) if TGI_FACTS.exists() else {"operations": {}}


# A missing facts file fails the tests (by `tgi_facts`) instead of breaking collection.
TGI_OPERATIONS = [(where.split(" ", 1)[0].lower(), where.split(" ", 1)[1])
                  for where in sorted(_tgi_facts()["operations"])] or [("post", "/generate")]


@pytest.fixture(scope="module")
def tgi_facts() -> dict[str, Any]:
    assert TGI_FACTS.exists(), f"{TGI_FACTS} is missing: extract it with `{REEXTRACT}`"
    return _tgi_facts()


@pytest.fixture(scope="module")
def all_problems(tgi_facts: dict[str, Any], app_document: dict[str, Any]) -> list[str]:
    """Every problem of every TGI route we serve."""
    return [problem for method, path in TGI_OPERATIONS if path in app_document["paths"]
            for problem in compare_operation(method, path, tgi_facts, app_document)]


def test_facts_match_tgis_document(tgi_facts: dict[str, Any]) -> None:
    """The facts file says what TGI's document says (checked where the document is at hand)."""
    if not TGI_DOCUMENT.exists():
        pytest.skip(f"TGI's OpenAPI document is not at {TGI_DOCUMENT}: the facts file stands in")
    fresh = extract_facts(json.loads(TGI_DOCUMENT.read_text()))
    assert tgi_facts == json.loads(json.dumps(fresh)), (
        f"{TGI_FACTS.name} is stale: re-extract it with `{REEXTRACT}`")


def test_facts_read_back_as_the_shapes_they_were_written_from(
        app_document: dict[str, Any]) -> None:
    """Every body and answer shape of our own document survives the facts' line format."""
    facts = extract_facts(app_document)
    for where, op in facts["operations"].items():
        shapes = [op["request"]] if op["request"] is not None else []
        shapes += [lines for media in op["responses"].values() for lines in media.values()]
        for lines in shapes:
            assert shape_to_facts(shape_from_facts(lines)) == lines, where


def test_facts_cover_the_routes_the_readme_claims(tgi_facts: dict[str, Any]) -> None:
    """A clone compares the TGI routes the docs list, with their bodies' field names."""
    operations = tgi_facts["operations"]
    for where in ("POST /generate", "POST /generate_stream", "POST /", "POST /tokenize",
                  "POST /v1/chat/completions", "POST /v1/completions", "GET /info",
                  "GET /health", "GET /metrics", "GET /v1/models"):
        assert where in operations, where
    generate = operations["POST /generate"]
    request = shape_from_facts(generate["request"])
    assert {"inputs", "parameters"} <= set(request.properties) and "inputs" in request.required
    assert {"max_new_tokens", "do_sample", "watermark", "seed"} <= set(
        request.properties["parameters"].properties)
    answer = shape_from_facts(generate["responses"]["200"]["application/json"])
    assert "generated_text" in answer.properties


def _excuse(problem: str) -> str | None:
    return next((key for key in DEVIATIONS if problem.startswith(key)), None)


@pytest.mark.parametrize(("method", "path"), TGI_OPERATIONS,
                         ids=[f"{m.upper()} {p}" for m, p in TGI_OPERATIONS])
def test_tgi_route_is_served_compatibly(method: str, path: str, tgi_facts: dict[str, Any],
                                        app_document: dict[str, Any]) -> None:
    if path not in app_document["paths"] and path in NOT_YET_SERVED:
        pytest.skip(f"not served yet: {NOT_YET_SERVED[path]}")
    problems = compare_operation(method, path, tgi_facts, app_document)
    unexcused = [p for p in problems if _excuse(p) is None]
    assert not unexcused, "incompatible with TGI's OpenAPI document:\n" + "\n".join(unexcused)


def test_every_deviation_is_still_needed(all_problems: list[str]) -> None:
    used = {_excuse(p) for p in all_problems}
    stale = sorted(set(DEVIATIONS) - used)
    assert not stale, f"these DEVIATIONS excuse nothing any more, remove them: {stale}"


def test_served_routes_are_not_listed_as_unserved(app_document: dict[str, Any]) -> None:
    served = sorted(set(NOT_YET_SERVED) & set(app_document["paths"]))
    assert not served, f"served now, remove them from NOT_YET_SERVED: {served}"


def test_comparison_catches_incompatibilities() -> None:
    """The walker itself: a missing field, a narrower request type, a wider answer type."""
    tgi_doc = {"components": {"schemas": {
        "P": {"type": "object", "required": ["a"], "properties": {
            "a": {"type": "number", "nullable": True},
            "b": {"allOf": [{"$ref": "#/components/schemas/Q"}], "nullable": True},
        }},
        "Q": {"type": "object",
              "properties": {"c": {"type": "array", "items": {"type": "string"}}}},
    }}}
    good = {"components": {"schemas": {
        "P": {"type": "object", "required": ["a"], "properties": {
            "a": {"oneOf": [{"type": "number"}, {"type": "null"}]},
            "b": {"anyOf": [{"$ref": "#/components/schemas/Q"}, {"type": "null"}]},
            "extra": {"type": "string"},
        }},
        "Q": {"type": "object", "properties": {"c": {"type": ["array", "null"],
                                                     "items": {"type": "string"}}}},
    }}}
    ref = {"$ref": "#/components/schemas/P"}
    assert not list(compare(shape_of(ref, tgi_doc), shape_of(ref, good), request=True, where=""))
    bad = json.loads(json.dumps(good))
    bad["components"]["schemas"]["P"]["properties"]["a"] = {"type": "integer"}
    del bad["components"]["schemas"]["Q"]["properties"]["c"]
    bad["components"]["schemas"]["P"]["required"] = ["a", "b"]
    problems = list(compare(shape_of(ref, tgi_doc), shape_of(ref, bad), request=True, where=""))
    assert any(p.startswith(".a: type") for p in problems), problems
    assert ".b.c: missing" in problems, problems
    assert ".b: required by us, optional in TGI's" in problems, problems
    # In an answer an integer is a number, but a number is not an integer.
    assert not list(compare(Shape(types={"number"}), Shape(types={"integer"}), request=False,
                            where="x"))
    answer = list(compare(Shape(types={"integer"}), Shape(types={"number"}), request=False,
                          where="x"))
    assert answer and "not compatible" in answer[0]
