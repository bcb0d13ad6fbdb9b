"""`switchyard bench` as users run it: the real CLI in a subprocess against the live server."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from switchyard.bench import prompts

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PHASE_FIELDS = {"name", "kind", "target_rate", "concurrency", "duration_s", "requests",
                "successful", "errors", "error_rate", "qps", "output_tokens_per_s",
                "prompt_tokens_avg", "output_tokens_avg", "e2e", "ttft", "itl", "tpot",
                "error_samples"}
STAT_FIELDS = {"avg", "p50", "p90", "p99", "min", "max", "count"}


def _bench(url: str, out: Path, *args: str,
           timeout: float = 60) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "switchyard.cli", "bench", "--url", url, "--out", str(out),
           "--profile", "smoke", "--no-progress", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    # IHDR: width and height are the first fields after the signature and chunk header.
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 100 and height > 100, (path, width, height)


def test_bench_tgi_sweep(server, tmp_path: Path) -> None:
    out = tmp_path / "run"
    done = _bench(server.url, out, "--input-tokens", "12", "--output-tokens", "6",
                  "--concurrency", "3", "--duration", "2", "--max-requests", "12",
                  "--rate-steps", "2", "--seed", "7")
    assert done.returncode == 0, done.stderr + done.stdout
    report = json.loads((out / "bench.json").read_text())
    assert report["api"] == "tgi" and report["url"] == server.url
    assert report["tokenizer"] == "server" and report["seed"] == 7
    assert report["profile"]["input_tokens"] == {"low": 12, "high": 12}
    phases = report["phases"]
    assert [p["kind"] for p in phases] == ["warmup", "throughput", "constant", "constant"]
    peak = phases[1]
    assert peak["concurrency"] == 3 and peak["requests"] <= 12
    for phase in phases:
        assert set(phase) == PHASE_FIELDS
        assert phase["successful"] == phase["requests"] > 0, phase["error_samples"]
        assert phase["error_rate"] == 0.0 and phase["qps"] > 0
        assert phase["output_tokens_per_s"] > 0
        # The server's own count (TGI details.input_length) equals what was asked for.
        assert phase["prompt_tokens_avg"] == 12.0
        assert 0 < phase["output_tokens_avg"] <= 6
        for key in ("e2e", "ttft"):
            assert set(phase[key]) == STAT_FIELDS
            assert 0 < phase[key]["p50"] <= phase[key]["p90"] <= phase[key]["p99"]
        assert phase["ttft"]["avg"] <= phase["e2e"]["avg"]
    # The sweep scales to the measured peak: 1/2 and 2/2 of 1.2 x its QPS.
    rates = [p["target_rate"] for p in phases[2:]]
    assert rates[1] == pytest.approx(peak["qps"] * 1.2, abs=1e-3)
    assert rates[0] == pytest.approx(rates[1] / 2, abs=1e-3)
    assert report["plots"] == ["latency.png", "ttft_itl.png", "throughput.png"]
    for name in report["plots"]:
        _assert_png(out / name)
    table = done.stdout.splitlines()
    assert table[0].startswith("| Benchmark") and "| QPS" in table[0]
    assert sum(line.startswith("| constant@") for line in table) == 2
    assert (out / "bench.md").read_text().count("| constant@") == 2


def test_bench_openai_chat_explicit_rates(server, tmp_path: Path) -> None:
    out = tmp_path / "chat"
    done = _bench(server.url + "/v1", out, "--api", "openai-chat", "--no-throughput",
                  "--rates", "4", "--arrival", "uniform", "--duration", "1", "--warmup", "1",
                  "--input-tokens", "8:16", "--output-tokens", "4")
    assert done.returncode == 0, done.stderr + done.stdout
    report = json.loads((out / "bench.json").read_text())
    assert report["api"] == "openai-chat" and report["model"]
    phases = report["phases"]
    assert [p["name"] for p in phases] == ["warmup", "constant@4.00req/s"]
    constant = phases[1]
    # Uniform arrivals at 4 req/s for 1 s: sends at 0, 0.25, 0.5 and 0.75 s.
    assert constant["requests"] == 4 and constant["errors"] == 0
    # The chat template adds tokens around the user's prompt (usage.prompt_tokens).
    assert constant["prompt_tokens_avg"] > 8
    assert 0 < constant["output_tokens_avg"] <= 4
    for name in report["plots"]:
        _assert_png(out / name)


def test_bench_fails_fast_when_the_server_is_unreachable(tmp_path: Path) -> None:
    done = _bench("http://127.0.0.1:9", tmp_path / "none", timeout=30)
    assert done.returncode == 1
    assert "cannot reach http://127.0.0.1:9" in done.stderr
    assert not (tmp_path / "none").exists()


def test_server_counted_prompts_have_the_asked_length(server, default_model_path: Path) -> None:
    # Prompts cut on the local tokenizer's boundaries re-tokenize to exactly N on the server.
    builder = prompts.local_builder(str(default_model_path), 1000, seed=3)
    rng = random.Random(3)
    for n in (1, 7, 50, 300):
        prompt = builder.build(n, rng)
        tokens = httpx.post(f"{server.url}/tokenize", json={"inputs": prompt.text}, timeout=30)
        assert len(tokens.json()) == n == prompt.tokens
