#!/usr/bin/env python3
"""Train a small Llama on a local corpus, so that accuracy figures mean something.

Random-weight models have nearly flat next-token distributions, which makes
every quantization accuracy number meaningless. This script trains a small
Llama-architecture model (about 5.6M parameters with the defaults) with the
default model's byte-level BPE tokenizer (2,048 tokens, trained on the same
files) on Python's standard library sources, holds out one file in twenty
for evaluation, and stops after ``--minutes``. It writes a model folder that
`switchyard serve --model-id` and the benchmarks load, and
``train_report.json`` with the held-out perplexity beside the uniform one
(2,048).

    .venv/bin/python benchmarks/train_accuracy_model.py --minutes 12 \\
        --out /tmp/accuracy-llama

Seeded and deterministic given the machine (thread count and kernels change
float sums). Matmuls run under bf16 autocast where the CPU computes bf16
natively (AVX512_BF16 or AMX), in fp32 elsewhere; the weights stay fp32.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "gateway"))

from switchyard_engine.loading import cpu_flags  # noqa: E402
from switchyard.models.random_model import ensure_random_model  # noqa: E402

SHAPE = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=6,
             num_attention_heads=8, num_key_value_heads=4, head_dim=32,
             max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
             tie_word_embeddings=False)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def corpus_files() -> tuple[list[str], list[str]]:
    """The standard library's .py files, split by a hash of their path: 1 in 20 held out."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
                   if "site-packages" not in f and "/test" not in f)
    held = [f for f in files if int(hashlib.sha1(os.path.relpath(f, root).encode())
                                    .hexdigest(), 16) % 20 == 0]
    held_set = set(held)
    return [f for f in files if f not in held_set], held


def encode(tokenizer, files: list[str], eos: int) -> torch.Tensor:
    """All files' tokens, each followed by EOS, as one long tensor."""
    ids: list[int] = []
    for path in files:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def held_out_perplexity(model, data: torch.Tensor, seq: int, max_windows: int,
                        autocast: bool) -> float:
    """exp(mean next-token loss) over non-overlapping windows of held-out text."""
    windows = data[: (len(data) // (seq + 1)) * (seq + 1)].view(-1, seq + 1)[:max_windows]
    total, count = 0.0, 0
    model.eval()
    with torch.inference_mode(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        for batch in windows.split(8):
            logits = model(batch[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
            total += float(loss)
            count += batch[:, 1:].numel()
    model.train()
    return math.exp(total / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer_dir = ensure_random_model()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    train_files, held_files = corpus_files()
    train, held = encode(tokenizer, train_files, eos), encode(tokenizer, held_files, eos)
    print(f"corpus: {len(train_files)} files, {len(train):,} tokens to train on; "
          f"{len(held_files)} files, {len(held):,} tokens held out", flush=True)

    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=eos, eos_token_id=eos,
                         pad_token_id=eos, initializer_range=0.02, **SHAPE)
    model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    autocast = bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
    print(f"model: {params:,} parameters; bf16 autocast: {autocast}", flush=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    budget = args.minutes * 60.0
    gen = torch.Generator().manual_seed(args.seed)
    start, step, losses = time.monotonic(), 0, []
    while (elapsed := time.monotonic() - start) < budget:
        # Cosine decay over the time budget, after a short warmup.
        frac = elapsed / budget
        lr = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * frac))
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(train) - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([train[o : o + args.seq + 1] for o in offsets.tolist()])
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            logits = model(batch[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        step += 1
        if step % 25 == 0:
            recent = sum(losses[-25:]) / 25
            print(f"step {step}: loss {recent:.3f} (ppl {math.exp(recent):.1f}), "
                  f"{elapsed / 60:.1f} min, lr {lr:.2e}", flush=True)
    ppl = held_out_perplexity(model, held, args.seq, 64, autocast)
    tokens = step * args.batch * args.seq
    print(f"trained {step} steps ({tokens:,} tokens) in {args.minutes:.1f} min; held-out "
          f"perplexity {ppl:.2f} (uniform: {len(tokenizer)})", flush=True)
    out = args.out
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    report = dict(parameters=params, steps=step, tokens=tokens, minutes=args.minutes,
                  train_loss=sum(losses[-50:]) / max(1, len(losses[-50:])),
                  held_out_perplexity=ppl, uniform_perplexity=len(tokenizer),
                  held_out_files=len(held_files), held_out_tokens=len(held),
                  seq=args.seq, batch=args.batch, autocast_bf16=autocast,
                  threads=torch.get_num_threads(), shape=SHAPE)
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
