"""What a JSON schema costs a loaded server: 32 streams with and without one, same run.

Starts `switchyard serve` on `--model` (bf16, EOS ignored) and alternates
phases of `--streams` concurrent streamed chat completions of `--new-tokens`
tokens: free text, then the same prompts with `response_format` a JSON schema
(a new schema each phase, so each phase compiles it once). The schema opens
with a free string, which the random-weight model rarely closes, so a
constrained stream runs about as long as a free one and the batch stays the
same size; the mean completion tokens of each kind are reported to show it.
(A `minLength` would guarantee the length, but xgrammar unrolls it into one
grammar state per character, each built on its first visit: milliseconds per
row per step, a cost of the schema, not of constraining.) Reports output
tokens/s and the median time to first token of each kind, the ratio, and the
schema's compile time (xgrammar, the same tokenizer, measured here once per
schema).

    .venv/bin/python benchmarks/grammar_throughput.py --model /tmp/bench-models/small
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from gateway_overhead import serve


def schema(phase: int) -> dict[str, object]:
    """A schema of its own for each phase (another property name: another compile)."""
    return {"type": "object", "properties": {f"text{phase}": {"type": "string"},
                                             "n": {"type": "integer"}},
            "required": [f"text{phase}", "n"], "additionalProperties": False}


async def one(client: httpx.AsyncClient, url: str, prompt: str, tokens: int,
              fmt: dict[str, object] | None) -> tuple[float, int]:
    """One streamed chat completion: (time to first content, completion tokens)."""
    body: dict[str, object] = {
        "model": "tgi", "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}
    if fmt is not None:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "out", "schema": fmt}}
    t0 = time.perf_counter()
    ttft, used = None, 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if ttft is None and any(c["delta"].get("content") for c in chunk["choices"]):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                used = chunk["usage"]["completion_tokens"]
    if ttft is None:
        raise RuntimeError("a stream ended without content")
    return ttft, used


async def phase(url: str, prompts: list[str], tokens: int,
                fmt: dict[str, object] | None) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(client, url, p, tokens, fmt) for p in prompts))
        wall = time.perf_counter() - t0
    return {"tok_s": sum(n for _, n in results) / wall,
            "ttft_p50_s": statistics.median(t for t, _ in results),
            "mean_tokens": statistics.fmean(n for _, n in results)}


def compile_seconds(model: str, fmt: dict[str, object]) -> float:
    """xgrammar's compile of ``fmt`` with the model's tokenizer (wrapped beforehand)."""
    import transformers
    import xgrammar as xgr

    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer,
                                                                      vocab_size=vocab),
                                   max_threads=1, cache_enabled=False)
    t0 = time.perf_counter()
    compiler.compile_json_schema(json.dumps(fmt), any_whitespace=False, separators=(",", ":"))
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="free/schema phase pairs")
    parser.add_argument("--out", help="Write the record as JSON here too.")
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="grammar-throughput-"))
    proc, url = serve(["--model-id", args.model, "--dtype", "bfloat16",
                       "--max-concurrent-requests", "256"], logs / "server.log",
                      {"TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"})
    prompts = [f"Request {i}: describe the standard library module number {i} in detail, "
               "its functions, classes and history." for i in range(args.streams)]
    rows: dict[str, list[dict[str, float]]] = {"free": [], "schema": []}
    compiles: list[float] = []
    try:
        asyncio.run(phase(url, prompts[:4], 8, None))  # first-use costs out of the way
        for r in range(args.rounds):
            rows["free"].append(asyncio.run(phase(url, prompts, args.new_tokens, None)))
            fmt = schema(r)
            compiles.append(compile_seconds(args.model, fmt))
            rows["schema"].append(asyncio.run(phase(url, prompts, args.new_tokens, fmt)))
            print(f"round {r}: free {rows['free'][-1]}, schema {rows['schema'][-1]}, "
                  f"compile {compiles[-1] * 1e3:.1f} ms", flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    free_tok = statistics.fmean(x["tok_s"] for x in rows["free"])
    schema_tok = statistics.fmean(x["tok_s"] for x in rows["schema"])
    free_ttft = statistics.fmean(x["ttft_p50_s"] for x in rows["free"])
    schema_ttft = statistics.fmean(x["ttft_p50_s"] for x in rows["schema"])
    record = {"settings": vars(args), "rounds": rows, "compile_s": compiles,
              "schema_vs_free_tok_s": schema_tok / free_tok,
              "free_ttft_p50_s": free_ttft, "schema_ttft_p50_s": schema_ttft}
    print(f"tokens/s with a schema: {schema_tok:.1f} against {free_tok:.1f} free "
          f"({schema_tok / free_tok:.1%}); TTFT p50 {schema_ttft * 1e3:.0f} ms against "
          f"{free_ttft * 1e3:.0f} ms (compile {statistics.fmean(compiles) * 1e3:.1f} ms)")
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
