"""Requests that no route serves, and bodies that are not JSON, answer in the API's format.

An unknown path or a wrong method is refused while routing, before any router
(and its exception handlers) is chosen; the app answers it in OpenAI's format
under `/v1/` (with OpenAI's own messages, `Invalid URL (POST /v1/foo)`) and in
TGI's elsewhere. A 405 names the allowed methods in `Allow`. Malformed JSON is
a 400 in the format of the route it was sent to.

The app is built with `create_app` and served by Litestar's `TestClient`
without entering it, so its lifespan (model loading) never runs: none of these
answers needs a model.
"""

from __future__ import annotations

from typing import Any

import pytest
from litestar.testing import TestClient

from switchyard.app import create_app
from switchyard.models.served import ServedModel
from switchyard.plugins import PluginHost
from switchyard.settings import ServeSettings

JSON = {"content-type": "application/json"}


def _no_model(settings: ServeSettings, plugins: PluginHost) -> ServedModel:
    raise AssertionError("routing errors must not need a model")


@pytest.fixture(scope="module")
def client() -> TestClient[Any]:
    return TestClient(app=create_app(ServeSettings(), loader=_no_model))


def _openai_error(body: Any) -> dict[str, Any]:
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _tgi_error(body: Any) -> dict[str, Any]:
    assert set(body) == {"error", "error_type"}, body
    return body


@pytest.mark.parametrize(("method", "path"), [("POST", "/v1/foo"), ("GET", "/v1")])
def test_unknown_openai_path_is_openais_404(client: TestClient[Any], method: str,
                                            path: str) -> None:
    r = client.request(method, path)
    assert r.status_code == 404
    assert _openai_error(r.json()) == {"message": f"Invalid URL ({method} {path})",
                                       "type": "invalid_request_error", "param": None,
                                       "code": None}


def test_unknown_path_elsewhere_is_tgis_404(client: TestClient[Any]) -> None:
    r = client.get("/foo")
    assert r.status_code == 404
    assert _tgi_error(r.json()) == {"error": "Invalid URL (GET /foo)", "error_type": "not_found"}


def _allowed(response: Any) -> set[str]:
    return {m.strip() for m in response.headers["allow"].split(",")}


def test_wrong_method_on_a_tgi_route_is_tgis_405(client: TestClient[Any]) -> None:
    r = client.get("/generate")
    assert r.status_code == 405
    assert "POST" in _allowed(r)
    assert _tgi_error(r.json()) == {"error": "Invalid method for URL (GET /generate)",
                                    "error_type": "method_not_allowed"}


def test_wrong_method_on_an_openai_route_is_openais_405(client: TestClient[Any]) -> None:
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405
    assert "POST" in _allowed(r)
    assert _openai_error(r.json()) == {
        "message": "Invalid method for URL (GET /v1/chat/completions)",
        "type": "invalid_request_error", "param": None, "code": None}


@pytest.mark.parametrize("path", ["/generate", "/generate_stream", "/", "/invocations"])
def test_malformed_json_on_a_tgi_route_is_tgis_400(client: TestClient[Any], path: str) -> None:
    r = client.post(path, content=b"{not json", headers=JSON)
    assert r.status_code == 400
    body = _tgi_error(r.json())
    assert body["error_type"] == "validation"
    assert body["error"].startswith("Input validation error: JSON is malformed")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_malformed_json_on_an_openai_route_is_openais_400(client: TestClient[Any],
                                                         path: str) -> None:
    r = client.post(path, content=b"{oops", headers=JSON)
    assert r.status_code == 400
    err = _openai_error(r.json())
    assert err["type"] == "invalid_request_error"
    assert err["message"].startswith("JSON is malformed")  # no TGI prefix in OpenAI's words
