"""`switchyard bench` without a server: percentiles, phase aggregates, rates, the table,
stream parsing and the runner's request counts on a fake transport."""

from __future__ import annotations

import asyncio
import random

import httpx
import msgspec
import numpy as np
import pytest

from switchyard.bench.client import Api, Endpoint, RequestResult, RequestSpec, send
from switchyard.bench.profile import (PROFILES, LengthSpec, Phase, auto_rates, parse_rates,
                                      resolve_profile)
from switchyard.bench.report import COLUMNS, BenchReport, markdown_table, read_json, write_json
from switchyard.bench.runner import arrival_gaps, run_closed_loop, run_open_loop
from switchyard.bench.stats import latency_stats, percentile, summarize


@pytest.mark.parametrize("values", [[1.0], [3.0, 1.0], [5.0, 1.0, 4.0, 2.0, 3.0],
                                    [0.1 * i * i for i in range(37)]])
@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_interpolates_between_ranks() -> None:
    # rank = 0.9 * 3 = 2.7: 70% of the way from 30 to 40.
    assert percentile([10.0, 20.0, 30.0, 40.0], 90) == pytest.approx(37.0)
    assert percentile([40.0, 10.0, 30.0, 20.0], 50) == pytest.approx(25.0)


def test_percentile_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_latency_stats() -> None:
    assert latency_stats([]) is None
    stats = latency_stats([0.4, 0.1, 0.2, 0.3])
    assert stats is not None
    assert (stats.avg, stats.min, stats.max, stats.count) == (pytest.approx(0.25), 0.1, 0.4, 4)
    assert stats.p50 == pytest.approx(0.25)


def _ok(sent_at: float, e2e: float, ttft: float, gaps: list[float], out: int,
        prompt: int = 10) -> RequestResult:
    return RequestResult(sent_at=sent_at, e2e_s=e2e, ttft_s=ttft, itl_s=gaps,
                         prompt_tokens=prompt, output_tokens=out)


def test_summarize_counts_only_successes_in_latency() -> None:
    phase = Phase(name="constant@2.00req/s", kind="constant", duration_s=2.0, max_requests=10,
                  rate=2.0)
    results = [
        _ok(0.0, 1.0, 0.2, [0.4, 0.4], 3),
        _ok(0.5, 2.0, 0.5, [0.5, 0.5, 0.5], 4, prompt=20),
        RequestResult(sent_at=1.0, e2e_s=9.0, error="HTTP 429: overloaded"),
        RequestResult(sent_at=1.5, e2e_s=0.1, error="HTTP 429: overloaded"),
        RequestResult(sent_at=1.6, e2e_s=0.1, error="timeout after 5s"),
    ]
    s = summarize(phase, results, elapsed_s=4.0)
    assert (s.requests, s.successful, s.errors) == (5, 2, 3)
    assert s.error_rate == pytest.approx(0.6)
    assert s.qps == pytest.approx(2 / 4.0)
    assert s.output_tokens_per_s == pytest.approx(7 / 4.0)
    assert s.prompt_tokens_avg == pytest.approx(15.0)
    assert s.output_tokens_avg == pytest.approx(3.5)
    assert s.target_rate == 2.0 and s.concurrency is None
    assert s.e2e is not None and s.e2e.avg == pytest.approx(1.5) and s.e2e.max == 2.0
    assert s.ttft is not None and s.ttft.avg == pytest.approx(0.35)
    # ITL pools every gap: 2 gaps of 0.4 and 3 of 0.5.
    assert s.itl is not None and s.itl.count == 5 and s.itl.avg == pytest.approx(2.3 / 5)
    # TPOT per request: (1.0 - 0.2) / 2 and (2.0 - 0.5) / 3.
    assert s.tpot is not None and s.tpot.avg == pytest.approx((0.4 + 0.5) / 2)
    assert s.error_samples == ["HTTP 429: overloaded", "timeout after 5s"]


def test_summarize_all_failed_and_empty() -> None:
    phase = Phase(name="throughput", kind="throughput", duration_s=1.0, max_requests=4,
                  concurrency=2)
    s = summarize(phase, [RequestResult(sent_at=0.0, error="boom")], elapsed_s=1.0)
    assert (s.successful, s.error_rate, s.qps, s.e2e, s.ttft, s.itl) == (0, 1.0, 0.0, None, None,
                                                                        None)
    empty = summarize(phase, [], elapsed_s=0.0)
    assert (empty.requests, empty.error_rate, empty.qps) == (0, 0.0, 0.0)


def test_a_request_without_tokens_is_not_a_success() -> None:
    assert not RequestResult(sent_at=0.0, output_tokens=0).ok
    assert RequestResult(sent_at=0.0, output_tokens=1).ok


def test_length_spec() -> None:
    assert LengthSpec.parse("200") == LengthSpec(200, 200)
    spec = LengthSpec.parse("10:20")
    rng = random.Random(0)
    draws = {spec.sample(rng) for _ in range(500)}
    assert min(draws) == 10 and max(draws) == 20
    assert spec.describe() == "10:20" and LengthSpec(5, 5).describe() == "5"
    for bad in ("0", "20:10", "a", "1:2:3", "-5"):
        with pytest.raises(ValueError):
            LengthSpec.parse(bad)


def test_rates() -> None:
    # Ten steps up to 1.2x the peak, as inference-benchmarker's sweep.
    rates = auto_rates(4.30, 10, 1.2)
    assert len(rates) == 10
    assert rates[0] == pytest.approx(0.516) and rates[-1] == pytest.approx(5.16)
    assert auto_rates(0.0, 10, 1.2) == ()
    assert parse_rates("0.5, 1,2") == (0.5, 1.0, 2.0)
    for bad in ("", "0", "1,-2", "x"):
        with pytest.raises(ValueError):
            parse_rates(bad)


def test_arrival_gaps_average_to_the_rate() -> None:
    rng = random.Random(1)
    poisson = arrival_gaps(4.0, "poisson", rng)
    gaps = [poisson() for _ in range(20_000)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.03)
    assert arrival_gaps(4.0, "uniform", rng)() == 0.25


def test_resolve_profile_overrides() -> None:
    p = resolve_profile("quick", input_tokens="32:64", rates="1,2", duration_s=5.0,
                        concurrency=None)
    assert p.input_tokens == LengthSpec(32, 64) and p.rates == (1.0, 2.0)
    assert p.duration_s == 5.0 and p.concurrency == PROFILES["quick"].concurrency
    with pytest.raises(ValueError):
        resolve_profile("nope")


def test_table_and_json_round_trip(tmp_path) -> None:
    phase = Phase(name="warmup", kind="warmup", duration_s=10.0, max_requests=1, concurrency=1)
    summary = summarize(phase, [_ok(0.0, 7.68, 0.1719, [0.0094] * 799, 800, prompt=200)], 7.68)
    table = markdown_table([summary]).splitlines()
    assert table[0].startswith("| Benchmark") and len(table) == 3
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert len(cells) == len(COLUMNS)
    assert cells[:4] == ["warmup", "0.13 req/s", "7.68 sec", "171.90 ms"]
    assert cells[4:] == ["9.40 ms", "104.17 tokens/sec", "0.00%", "1/1", "200.00", "800.00"]
    report = BenchReport(version="0", started_at="2025-01-01T00:00:00+00:00", url="u",
                         api="tgi", model=None, tokenizer="server", ignore_eos=True,
                         temperature=0.0, seed=0, profile=PROFILES["smoke"], phases=[summary])
    write_json(report, tmp_path / "bench.json")
    assert read_json(tmp_path / "bench.json") == report


# The runner and client on a fake transport: counts, windows and parsing, no server.

def _sse(*events: str) -> bytes:
    return "".join(f"data: {e}\n\n" for e in events).encode()


TGI_STREAM = _sse('{"index":1,"token":{"id":5,"text":"a","logprob":0,"special":false}}',
                  '{"index":2,"token":{"id":6,"text":"b","logprob":0,"special":false},'
                  '"generated_text":"ab","details":{"finish_reason":"length",'
                  '"generated_tokens":2,"seed":null,"input_length":9}}')


def _client(body: bytes, status: int = 200) -> httpx.AsyncClient:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body, headers={"content-type": "text/event-stream"})
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _spec() -> RequestSpec:
    return RequestSpec(prompt="hi", prompt_tokens=1, max_tokens=2)


async def _send(api: Api, body: bytes, status: int = 200) -> RequestResult:
    async with _client(body, status) as client:
        return await send(client, Endpoint(url="http://x", api=api), _spec(), 0.0)


def test_client_reads_tgi_details_and_errors() -> None:
    r = asyncio.run(_send("tgi", TGI_STREAM))
    assert r.ok and (r.output_tokens, r.prompt_tokens, len(r.itl_s)) == (2, 9, 1)
    assert r.ttft_s is not None and r.ttft_s <= r.e2e_s
    r = asyncio.run(_send("tgi", _sse('{"error":"Model is overloaded","error_type":"overloaded"}')))
    assert r.error == "Model is overloaded" and not r.ok
    r = asyncio.run(_send("tgi", b'{"error":"nope"}', status=422))
    assert r.error is not None and r.error.startswith("HTTP 422")


def test_client_reads_openai_usage_and_skips_role_chunk() -> None:
    chunks = _sse('{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}',
                  '{"choices":[{"index":0,"delta":{"content":"a"}}]}',
                  '{"choices":[{"index":0,"delta":{"content":"bc"},"finish_reason":"length"}]}',
                  '{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,'
                  '"total_tokens":10}}', "[DONE]")
    r = asyncio.run(_send("openai-chat", chunks))
    # Two text events, but the server's usage says three tokens.
    assert r.ok and (r.output_tokens, r.prompt_tokens, len(r.itl_s)) == (3, 7, 1)
    plain = _sse('{"choices":[{"index":0,"text":"a"}]}', '{"choices":[{"index":0,"text":"b"}]}')
    r = asyncio.run(_send("openai-completions", plain))
    assert r.ok and (r.output_tokens, r.prompt_tokens) == (2, 1)
    r = asyncio.run(_send("openai-chat", _sse('{"error":{"message":"overloaded"}}')))
    assert r.error == "overloaded"


def test_open_loop_uniform_counts_and_window() -> None:
    phase = Phase(name="c", kind="constant", duration_s=0.5, max_requests=100, rate=10.0)

    async def go(phase: Phase):  # type: ignore[no-untyped-def]
        async with _client(TGI_STREAM) as client:
            return await run_open_loop(phase, client, Endpoint(url="http://x", api="tgi"), _spec,
                                       arrival="uniform", rng=random.Random(0), timeout_s=5.0)

    run = asyncio.run(go(phase))
    # Sends at 0.0, 0.1, ..., 0.4 s; the rate is measured over the whole 0.5 s window.
    assert len(run.results) == 5 and all(r.ok for r in run.results)
    assert run.elapsed_s >= 0.5
    # Capped at two sends (0.0 and 0.1 s) in a 20 s window: the run ends with its last
    # send, not the window (10 s: half the window, a hundred times what it needs).
    capped = asyncio.run(go(msgspec.structs.replace(phase, max_requests=2, duration_s=20.0)))
    assert len(capped.results) == 2 and capped.elapsed_s < 10.0


def test_closed_loop_respects_the_request_cap() -> None:
    phase = Phase(name="t", kind="throughput", duration_s=30.0, max_requests=7, concurrency=3)

    async def go():  # type: ignore[no-untyped-def]
        async with _client(TGI_STREAM) as client:
            return await run_closed_loop(phase, client, Endpoint(url="http://x", api="tgi"),
                                         _spec, timeout_s=5.0)

    run = asyncio.run(go())
    # The cap ends the run, not its 30 s window.
    assert len(run.results) == 7 and run.elapsed_s < 10.0
