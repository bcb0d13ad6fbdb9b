"""Prefix affinity against round-robin and least-loaded balancing: two replicas, one run.

Starts two replicas (`switchyard serve` on `--model`, one engine thread each,
a KV cache of `--cache-tokens` tokens with prefix caching) and one gateway
that serves them as three remote models differing only in `balancing`:
`rr` (round-robin), `load` (power of two choices) and `prefix` (affinity).
Two workloads, each request a system prompt drawn at random (seeded) plus a
short question of its own, streamed, `--concurrency` clients at a time:

- overflow: `--prefixes` system prompts of `--prefix-tokens` tokens, more in
  all than one replica's cache holds and fewer than two hold: rr vs prefix;
- fits: 2 system prompts, which fit in every replica's cache: load vs prefix.

Every (workload, balancing) pair gets system prompts of its own (different
text, same lengths), so no pair finds another's prefixes in a cache. Reports
mean and median time to first token of each pair and the ratios.

    .venv/bin/python benchmarks/prefix_affinity.py --model /tmp/bench-models/small
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import httpx
from gateway_overhead import serve


def system_prompts(tokenizer, count: int, tokens: int, seed: int) -> list[str]:
    """`count` texts of exactly `tokens` tokens, cut from the standard library's sources."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    rng = random.Random(seed)
    texts = []
    while len(texts) < count:
        source = rng.choice(files).read_text(errors="replace")
        ids = tokenizer(source)["input_ids"]
        if len(ids) < tokens + 1:
            continue
        start = rng.randrange(0, len(ids) - tokens)
        texts.append(tokenizer.decode(ids[start:start + tokens]))
    return texts


async def one_request(client: httpx.AsyncClient, gateway: str, model: str, prompt: str,
                      new_tokens: int) -> float:
    """Time to the first streamed token of one completion."""
    t0 = time.perf_counter()
    ttft = None
    async with client.stream("POST", f"{gateway}/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
            "stream": True}) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if ttft is None and line.startswith("data:") and '"text"' in line:
                ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError(f"{model}: the stream ended without a token")
    return ttft


async def run(gateway: str, model: str, prompts: list[str], requests: int, concurrency: int,
              new_tokens: int, seed: int) -> list[float]:
    """`requests` requests, each a random system prompt and a question; their TTFTs."""
    rng = random.Random(seed)
    work = [f"{rng.choice(prompts)}\n# Question {i}: what does this code do?\n"
            for i in range(requests)]
    ttfts: list[float] = []
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker() -> None:
            while work:
                prompt = work.pop(0)
                ttfts.append(await one_request(client, gateway, model, prompt, new_tokens))
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ttfts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Model folder both replicas serve.")
    parser.add_argument("--cache-tokens", type=int, default=3072)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--prefixes", type=int, default=8, help="System prompts (overflow).")
    parser.add_argument("--requests", type=int, default=64, help="Per (workload, balancing).")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="Write the record as JSON here too.")
    args = parser.parse_args()
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    logs = Path(tempfile.mkdtemp(prefix="prefix-affinity-"))
    procs = []
    try:
        replicas = []
        for i in range(2):
            proc, url = serve(["--model-id", args.model, "--dtype", "bfloat16",
                               "--engine-option", "num_threads=1",
                               "--max-batch-total-tokens", str(args.cache_tokens),
                               "--max-concurrent-requests", "64"], logs / f"replica{i}.log", {})
            procs.append(proc)
            replicas.append(url)
        config = logs / "models.toml"
        config.write_text("".join(
            f'[[models]]\nname = "{name}"\nupstreams = {json.dumps(replicas)}\n'
            f'balancing = "{name if name != "rr" else "round-robin"}"\n'
            for name in ("rr", "load", "prefix")))
        proc, gateway = serve(["--config", str(config)], logs / "gateway.log", {})
        procs.append(proc)
        pairs = [("overflow", "rr"), ("overflow", "prefix"), ("fits", "load"), ("fits", "prefix")]
        record: dict[str, object] = {"settings": vars(args), "results": {}}
        for n, (workload, model) in enumerate(pairs):
            count = args.prefixes if workload == "overflow" else 2
            prompts = system_prompts(tokenizer, count, args.prefix_tokens, args.seed * 100 + n)
            ttfts = asyncio.run(run(gateway, model, prompts, args.requests, args.concurrency,
                                    args.new_tokens, args.seed))
            result = {"mean_ttft_s": statistics.fmean(ttfts),
                      "p50_ttft_s": statistics.median(ttfts)}
            record["results"][f"{workload}/{model}"] = result  # type: ignore[index]
            print(f"{workload:>8} {model:>6}: TTFT mean {result['mean_ttft_s'] * 1e3:7.0f} ms, "
                  f"p50 {result['p50_ttft_s'] * 1e3:7.0f} ms", flush=True)
        results = record["results"]
        overflow = 1 - results["overflow/prefix"]["mean_ttft_s"] / \
            results["overflow/rr"]["mean_ttft_s"]  # type: ignore[index]
        fits = results["fits/prefix"]["mean_ttft_s"] / \
            results["fits/load"]["mean_ttft_s"]  # type: ignore[index]
        record["prefix_vs_round_robin_mean_ttft_reduction"] = overflow
        record["prefix_vs_load_mean_ttft_ratio"] = fits
        print(f"overflow: prefix affinity's mean TTFT is {overflow:.0%} lower than round-robin's")
        print(f"fits: prefix affinity's mean TTFT is {fits:.2f}x least-loaded's")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
