"""What a Switchyard gateway in front of a replica costs a client, measured in one run.

Starts a replica (`switchyard serve` on the built-in model, EOS ignored) and a
gateway whose config names it as a remote model's only upstream, then, with
the same client, alternates between talking to the replica directly and
through the gateway:

- added latency: sequential 1-token completions, direct and through the
  gateway in alternation; the median of each and their difference;
- throughput: `--streams` concurrent streamed completions of `--new-tokens`
  tokens each, tokens/s for each path (phases alternated `--rounds` times);
- inter-token gaps: the gaps between the events a streaming client receives
  in those phases, p50 and p90 of each path.

Give `--replica-url` and `--gateway-url` to measure servers already running.

    .venv/bin/python benchmarks/gateway_overhead.py --requests 200 --streams 64 --new-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MODEL = "far"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(args: list[str], log: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    """Start `switchyard serve` with `args` on a free loopback port; wait until healthy."""
    port = _free_port()
    cmd = [sys.executable, "-m", "switchyard.cli", "serve", "--hostname", "127.0.0.1",
           "--port", str(port), *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: see {log}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"server not ready: see {log}")


async def _latency(client: httpx.AsyncClient, url: str, model: str) -> float:
    t0 = time.perf_counter()
    answer = await client.post(f"{url}/v1/completions", json={
        "model": model, "prompt": "hello", "max_tokens": 1, "temperature": 0})
    answer.raise_for_status()
    return time.perf_counter() - t0


async def _stream(client: httpx.AsyncClient, url: str, model: str, tokens: int,
                  gaps: list[float]) -> int:
    count, last = 0, None
    async with client.stream("POST", f"{url}/v1/completions", json={
            "model": model, "prompt": "def fibonacci(n):", "max_tokens": tokens,
            "temperature": 0, "stream": True}) as answer:
        async for line in answer.aiter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
                count += 1
    return count


async def _throughput(client: httpx.AsyncClient, url: str, model: str, streams: int,
                      tokens: int, gaps: list[float]) -> float:
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(_stream(client, url, model, tokens, gaps)
                                    for _ in range(streams)))
    return sum(counts) / (time.perf_counter() - t0)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def measure(replica: str, gateway: str, requests: int, streams: int, tokens: int,
                  rounds: int) -> dict[str, object]:
    """Run every phase against both paths; the numbers as one record."""
    paths = {"direct": (replica, "tgi"), "gateway": (gateway, MODEL)}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=streams * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        for url, model in paths.values():  # warm both: connections, the engine's first steps
            for _ in range(5):
                await _latency(client, url, model)
        latency: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(requests):
            for name, (url, model) in paths.items():
                latency[name].append(await _latency(client, url, model))
        rates: dict[str, list[float]] = {name: [] for name in paths}
        gaps: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(rounds):
            for name, (url, model) in paths.items():
                rates[name].append(await _throughput(client, url, model, streams, tokens,
                                                     gaps[name]))
    out: dict[str, object] = {"requests": requests, "streams": streams, "new_tokens": tokens,
                              "rounds": rounds}
    for name in paths:
        out[name] = {
            "latency_median_ms": statistics.median(latency[name]) * 1000,
            "tokens_per_s": statistics.mean(rates[name]),
            "itl_p50_ms": _pct(gaps[name], 0.5) * 1000,
            "itl_p90_ms": _pct(gaps[name], 0.9) * 1000,
        }
    added = [g - d for d, g in zip(latency["direct"], latency["gateway"], strict=True)]
    out["added_latency_median_ms"] = statistics.median(added) * 1000
    out["throughput_ratio"] = (statistics.mean(rates["gateway"]) /
                               statistics.mean(rates["direct"]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replica-url", help="A running replica (else one is started).")
    parser.add_argument("--gateway-url", help=f"A running gateway serving it as `{MODEL}`.")
    parser.add_argument("--requests", type=int, default=200, help="Latency pairs.")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="Throughput phases per path.")
    parser.add_argument("--threads", default="1", help="The replica's engine num_threads.")
    parser.add_argument("--out", help="Write the record as JSON here too.")
    args = parser.parse_args()
    procs = []
    logs = Path(tempfile.mkdtemp(prefix="gateway-overhead-"))
    replica, gateway = args.replica_url, args.gateway_url
    try:
        if replica is None:
            proc, replica = serve(["--engine-option", f"num_threads={args.threads}",
                                   "--max-concurrent-requests", "512"], logs / "replica.log",
                                  {"TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"})
            procs.append(proc)
        if gateway is None:
            config = logs / "models.toml"
            config.write_text(f'[[models]]\nname = "{MODEL}"\nupstreams = ["{replica}"]\n'
                              "max_concurrent_requests = 512\n")
            proc, gateway = serve(["--config", str(config)], logs / "gateway.log", {})
            procs.append(proc)
        record = asyncio.run(measure(replica, gateway, args.requests, args.streams,
                                     args.new_tokens, args.rounds))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
