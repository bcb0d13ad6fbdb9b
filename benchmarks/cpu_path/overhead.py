"""Framework overhead of one decode step: the same 30-layer Llama code path with tiny matrices.

A model with the 135M model's layer count and attention code path but hidden
size 128 (2 heads of 64, 1 KV head), intermediate 256, vocab 512 does almost
no arithmetic, so its step time is what Python, transformers' module plumbing
and the aten dispatcher cost per step. Compare with decode.py's step times.

  nice -n 5 .venv/bin/python benchmarks/cpu_path/overhead.py --variant loop:stock cpp:stock:fuse
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from common import header, setup_threads
import decode
import harness


def tiny_model_dir() -> str:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=30,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=512,
                      tie_word_embeddings=True, max_position_embeddings=4096)
    d = tempfile.mkdtemp(prefix="cpu_path_tiny_")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    return d


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", nargs="+", default=["loop:stock", "cpp:stock:fuse"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--dtype", default="bfloat16",
                    help="tiny bf16 GEMMs carry oneDNN's fixed per-call cost (16-21 us); "
                         "float32 shows the rest (the cpp attention variants need bf16)")
    args = ap.parse_args()
    setup_threads(args.threads)
    header(f"framework overhead per decode step (tiny matrices, 30 layers, {args.dtype})")
    path = tiny_model_dir()
    for spec in args.variant:
        model, runner = decode.build(path, spec, getattr(torch, args.dtype))
        for b in args.batch:
            times, cpu, _ = harness.decode_bench(runner, b, 64, args.steps)
            seqs = harness.make_prompts(b, 64, 512)
            with torch.inference_mode():
                runner.step(seqs)
                runner.step(seqs)
                from torch.profiler import profile
                with profile() as prof:
                    runner.step(seqs)
            ops = sum(e.count for e in prof.key_averages() if e.key.startswith("aten::"))
            print(f"{spec:24s} B={b:<3d} {statistics.median(times)*1e3:7.2f} ms/step "
                  f"(cpu {statistics.median(cpu)*1e3:6.2f})  aten ops/step {ops}", flush=True)


if __name__ == "__main__":
    main()
