#!/usr/bin/env python3
"""Embedding throughput: the server's batching against sentence-transformers' own batched
`encode`, on the same model, in one run.

Not a timed test: a measurement. The model is a random-weight BERT with the
shape of all-MiniLM-L6-v2 (hidden 384, 6 layers, 12 heads, intermediate 1536,
mean pooling and Normalize), built locally as a sentence-transformers folder
(no hub). The texts are 64 sentences of 128 tokens ([CLS] and [SEP] included).

- sentence-transformers: `SentenceTransformer(folder).encode(texts, batch_size=B)`
  in this process, fp32 (its default), and bf16 (`model_kwargs={"dtype": bf16}`);
- Switchyard: `switchyard serve --model-id folder --dtype D` in its own process,
  and 64 concurrent `POST /v1/embeddings` requests of one sentence each (the
  client decodes base64, as the openai SDK does); the server batches them.

Each figure is the best of `--rounds` rounds (after one warm-up round), in
sentences per second; the ratios are Switchyard over sentence-transformers.

Usage: python benchmarks/embeddings.py [--rounds 5] [--dtypes auto float32]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import random
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_load import ServerProcess, free_port

MODEL_DIR = Path("/tmp/bench-models/bert-minilm-shape")
SENTENCES = 64
TOKENS = 128
SEED = 0


def build_model(out: Path) -> Path:
    """The MiniLM-shaped BERT as a sentence-transformers folder (once)."""
    if (out / "modules.json").is_file():
        return out
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules
    from transformers import BertConfig, BertModel, BertTokenizerFast

    words = [f"w{i}" for i in range(4000)]
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    base = out.with_name(out.name + "-base")
    tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, model_max_length=512)
    tok.save_pretrained(base)
    torch.manual_seed(SEED)
    config = BertConfig(vocab_size=len(vocab), hidden_size=384, num_hidden_layers=6,
                        num_attention_heads=12, intermediate_size=1536,
                        max_position_embeddings=512)
    BertModel(config).eval().save_pretrained(base, safe_serialization=True)
    transformer = modules.Transformer(str(base), max_seq_length=256)
    pooling = modules.Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    SentenceTransformer(modules=[transformer, pooling, modules.Normalize()],
                        device="cpu").save(str(out))
    return out


def texts() -> list[str]:
    """64 sentences of 126 words, each one token: 128 tokens with [CLS] and [SEP]."""
    rng = random.Random(SEED)
    return [" ".join(f"w{rng.randrange(4000)}" for _ in range(TOKENS - 2))
            for _ in range(SENTENCES)]


def st_rate(folder: Path, sentences: list[str], batch_size: int, rounds: int,
            dtype: str) -> tuple[float, np.ndarray]:
    """sentence-transformers' encode, best of `rounds`, sentences/s, and its vectors."""
    import torch
    from sentence_transformers import SentenceTransformer

    kwargs = {"model_kwargs": {"dtype": torch.bfloat16}} if dtype == "bfloat16" else {}
    model = SentenceTransformer(str(folder), device="cpu", **kwargs)
    vectors = model.encode(sentences, batch_size=batch_size)
    best = min(_timed(lambda: model.encode(sentences, batch_size=batch_size))
               for _ in range(rounds))
    return len(sentences) / best, np.asarray(vectors, dtype=np.float32)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


async def _burst(url: str, sentences: list[str]) -> tuple[float, np.ndarray]:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=128)) as c:
        async def one(text: str) -> np.ndarray:
            r = await c.post(url, json={"input": text, "encoding_format": "base64"})
            r.raise_for_status()
            return np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), "<f4")

        await asyncio.gather(*(one(t) for t in sentences[:4]))  # connections open
        t0 = time.perf_counter()
        vectors = await asyncio.gather(*(one(t) for t in sentences))
        seconds = time.perf_counter() - t0
    assert all(v.shape == (384,) for v in vectors)
    return seconds, np.stack(vectors)


def server_rate(folder: Path, sentences: list[str], dtype: str,
                rounds: int) -> tuple[float, np.ndarray]:
    """Switchyard's `/v1/embeddings` under 64 concurrent requests, best of `rounds`, and the
    vectors it answered."""
    port = free_port()
    argv = [sys.executable, "-m", "switchyard.cli", "serve", "--hostname", "127.0.0.1",
            "--port", str(port), "--model-id", str(folder), "--dtype", dtype,
            "--max-concurrent-requests", "256"]
    log = Path("/tmp/bench-models") / f"embeddings-server-{dtype}.log"
    with ServerProcess(argv, {"HF_HUB_OFFLINE": "1"}, log, f"http://127.0.0.1:{port}/health",
                       300):
        url = f"http://127.0.0.1:{port}/v1/embeddings"
        _, vectors = asyncio.run(_burst(url, sentences))  # warm-up round
        best = min(asyncio.run(_burst(url, sentences))[0] for _ in range(rounds))
    return len(sentences) / best, vectors


def main() -> None:
    """Print each configuration's sentences/s and the ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtypes", nargs="+", default=["auto", "float32"],
                        help="the server's --dtype values to measure")
    args = parser.parse_args()
    folder = build_model(MODEL_DIR)
    sentences = texts()
    print(f"model: BERT 384x6 (MiniLM shape, random weights) at {folder}; "
          f"{SENTENCES} sentences x {TOKENS} tokens; torch threads {os.cpu_count()}")
    st, reference = {}, None
    for dtype in ("float32", "bfloat16"):
        for batch in (32, 64):
            st[(dtype, batch)], vectors = st_rate(folder, sentences, batch, args.rounds, dtype)
            if reference is None:
                reference = vectors
            print(f"sentence-transformers encode {dtype} batch_size={batch}: "
                  f"{st[(dtype, batch)]:.1f} sentences/s")
    baseline = max(st[("float32", b)] for b in (32, 64))
    for dtype in args.dtypes:
        rate, vectors = server_rate(folder, sentences, dtype, args.rounds)
        cosine = 1 - np.sum(vectors * reference, axis=1) / (
            np.linalg.norm(vectors, axis=1) * np.linalg.norm(reference, axis=1))
        print(f"switchyard /v1/embeddings --dtype {dtype}, {SENTENCES} concurrent requests: "
              f"{rate:.1f} sentences/s = {rate / baseline:.2f}x sentence-transformers fp32 "
              f"(best batch), {rate / max(st[('bfloat16', b)] for b in (32, 64)):.2f}x its "
              f"bf16; max cosine distance to its fp32 vectors {cosine.max():.1e}")


if __name__ == "__main__":
    main()
