"""Serving pooling models beside a chat model: concurrent requests share forwards, the te_*
metrics count requests per route and model, /v1/models lists every kind."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.prometheus import Scrape

pytestmark = pytest.mark.e2e


def test_metrics_per_route_and_model(pooling_server) -> None:
    url = pooling_server.url
    assert httpx.post(f"{url}/v1/embeddings", json={"model": "bert-cls", "input": "a"}) \
        .status_code == 200
    assert httpx.post(f"{url}/embed", headers={"X-Model": "bert-cls"},
                      json={"inputs": ""}).status_code == 422
    samples = Scrape.parse(httpx.get(f"{url}/metrics").text)
    ok = {"model": "bert-cls", "engine": "xeon", "route": "/v1/embeddings"}
    assert samples.value("te_request_success", **ok) >= 1
    assert samples.value("te_request_input_length_count", **ok) >= 1
    failed = {"model": "bert-cls", "engine": "xeon", "route": "/embed", "err": "validation"}
    assert samples.value("te_request_failure", **failed) >= 1
    assert samples.types["te_queue_size"] == "gauge"
    assert any(n == "te_queue_size" and labels == {"model": "bert-cls", "engine": "xeon"}
               for n, labels, _ in samples.samples)


def test_models_lists_every_kind(pooling_server) -> None:
    ids = {card["id"] for card in httpx.get(f"{pooling_server.url}/v1/models").json()["data"]}
    assert {"chat", "bert-mean", "bert-cls", "decoder-last", "cross-encoder"} <= ids


def test_concurrent_requests_share_forwards(pooling_server) -> None:
    """32 clients at once: the server answers each, in fewer forwards than requests."""
    url = pooling_server.url

    def forwards() -> float:
        scrape = Scrape.parse(httpx.get(f"{url}/metrics").text)
        return scrape.value("te_batch_inference_count", model="bert-cls")

    async def burst() -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            answers = await asyncio.gather(*(client.post(
                f"{url}/v1/embeddings", json={"model": "bert-cls", "input": f"cat {i} dog"})
                for i in range(32)))
        return [a.status_code for a in answers]

    before = forwards()
    assert asyncio.run(burst()) == [200] * 32
    assert 1 <= forwards() - before < 32
