#!/usr/bin/env python3
"""Many LoRA adapters in one batch on the Xeon engine: what they cost against the base model.

Not a timed test: a measurement. On the default model (SmolLM2-135M-Instruct),
in process, one engine serves 8 PEFT adapters (random A and B, rank
``--rank``, on ``--targets``: by default every projection, q, k, v, o,
gate, up, down; PEFT's own default for Llama is q and v) and takes turns,
round after round, over the same 32 prompts:

- ``base``: 32 streams on the base model alone (steps keep the native
  one-call layer loop);
- ``native``: the same 32 streams spread over the 8 adapters (4 each), the
  native grouped product (``lora_kernel=native``, the default: each
  adapter's rows shrunk and expanded together inside the one-call layer
  loop, adapter weights in bf16 under bf16 dot products);
- ``native-fp32``: the same with the adapter weights held in fp32 (option
  ``lora_dtype=float32``; only where the engine's default is bf16);
- ``native-pyloop``: the native product with every step on the decoder's
  Python layer loop (the one-call loop switched off for the phase): the
  kernel's share of the gain, measured against ``grouped``;
- ``grouped``: the grouped product in PyTorch ops on the Python layer loop
  (``lora_kernel=grouped``: rows gathered per adapter, one batched shrink
  and one batched expand per module);
- ``stacked``: the same with ``lora_kernel=stacked`` (one shrink over every
  adapter's A, a per-row mask, one expand per module);
- ``looped``: the same, the plain PyTorch-ops path (``lora_kernel=looped``:
  per adapter and module, gather its rows, shrink, expand, scatter back, as
  vLLM's CPU path and TGI's fallback do).

Each stream generates ``--new-tokens`` tokens (EOS ignored, so every phase
does the same work); the figure is output tokens per second of the whole
phase, the best of ``--rounds``, and the ratios to ``base``: of the best
figures, and the median over rounds of each round's ratio to that round's
base (steadier where the machine's speed drifts between rounds).

At decode the adapters' matrices are read once per step for the rows that
use them: 8 adapters of rank 16 on every projection of a 135M model are 39 M
numbers (156 MB in fp32, 78 MB in bf16) against the base's 135 M bf16
weights (270 MB).

Usage: python benchmarks/lora.py [--rounds 2] [--new-tokens 64] [--rank 16]
                                 [--targets q_proj,v_proj] [--phases native,looped]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from switchyard.models.default_model import ensure_default_model
from switchyard_spec import EngineConfig, EngineRequest, SamplingParams, StoppingParams
from switchyard_xeon.engine import XeonEngine

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_path: Path, out: Path, count: int, rank: int,
                  targets: list[str] = TARGETS) -> dict[str, str]:
    """``count`` PEFT adapters of ``rank`` on ``targets``, saved by PEFT itself."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                            lora_dropout=0.0, task_type="CAUSAL_LM"))
    folders = {}
    for i in range(count):
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        folder = out / f"adapter-{i}"
        model.save_pretrained(folder, safe_serialization=True)
        folders[f"a{i}"] = str(folder)
    return folders


def run_phase(engine: XeonEngine, prompts: list[list[int]], adapters: list[str | None],
              new_tokens: int, tag: str) -> float:
    """Submit every stream at once; output tokens per second until the last one ends."""
    done = threading.Event()
    left = [len(prompts)]
    counted = [0]
    lock = threading.Lock()

    def sink(event) -> None:
        with lock:
            if event.error is not None:
                raise RuntimeError(event.error)
            counted[0] += 1
            if event.finish_reason is not None:
                left[0] -= 1
                if not left[0]:
                    done.set()

    start = time.perf_counter()
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters, strict=True)):
        engine.submit(EngineRequest(
            request_id=f"{tag}-{i}", prompt_token_ids=tuple(prompt), sampling=SamplingParams(),
            stopping=StoppingParams(max_new_tokens=new_tokens, ignore_eos=True),
            adapter_id=adapter), sink)
    if not done.wait(timeout=1800):
        raise RuntimeError("the phase did not finish")
    return counted[0] / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--targets", default=",".join(TARGETS),
                    help="comma-separated modules the adapters adapt")
    ap.add_argument("--phases", default="",
                    help="comma-separated phases after base (default: all); fewer phases "
                         "fit more rounds, which a machine whose speed drifts needs")
    args = ap.parse_args()
    model_path = ensure_default_model()
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        targets = args.targets.split(",")
        folders = make_adapters(model_path, Path(tmp), args.adapters, args.rank, targets)
        engine = XeonEngine(EngineConfig(model_path=str(model_path), dtype=args.dtype,
                                         lora_adapters=folders, max_loras=args.adapters))
        info = engine.start()
        engine.warmup()
        names = list(folders)
        prompts = [[(17 * i + 31 * j) % 40000 + 100 for j in range(24 + i % 9)]
                   for i in range(args.streams)]
        base = [None] * args.streams
        spread = [names[i % len(names)] for i in range(args.streams)]
        adapters = engine._adapters  # the lora_kernel option's switch, flipped between phases
        assert adapters is not None
        native_dtype = adapters.dtype
        forward = engine._runner._forward  # its one-call loop, off for native-pyloop
        one_call = forward.native
        phases = ["base", "native", "native-pyloop", "grouped", "stacked", "looped"]
        if native_dtype != torch.float32:
            phases.insert(2, "native-fp32")
        if args.phases:
            phases = ["base", *[p for p in args.phases.split(",") if p in phases]]
        best: dict[str, float] = {}
        ratios: dict[str, list[float]] = {}  # each round's phase against that round's base
        for r in range(args.rounds):
            for phase in phases:
                adapters.kernel = phase.removesuffix("-fp32").removesuffix("-pyloop")
                forward.native = None if phase == "native-pyloop" else one_call
                adapters.dtype = torch.float32 if phase == "native-fp32" else native_dtype
                rows = base if phase == "base" else spread
                tps = run_phase(engine, prompts, rows, args.new_tokens, f"{phase}{r}")
                best[phase] = max(best.get(phase, 0.0), tps)
                if phase == "base":
                    round_base = tps
                else:
                    ratios.setdefault(phase, []).append(tps / round_base)
                print(f"round {r + 1} {phase:11s} {tps:8.1f} tokens/s", flush=True)
        engine.shutdown()
    print(f"\n{info.model_type} {info.dtype}, {args.streams} streams x {args.new_tokens} tokens, "
          f"{args.adapters} adapters of rank {args.rank} on {', '.join(targets)}; native "
          f"adapter weights {str(native_dtype).removeprefix('torch.')}")
    print(f"base alone:                   {best['base']:8.1f} tokens/s")
    for kernel in phases[1:]:
        print(f"over {args.adapters} adapters, {kernel + ':':14s} {best[kernel]:8.1f} tokens/s "
              f"({best[kernel] / best['base']:.2f} of base's best; median of the rounds' "
              f"ratios {statistics.median(ratios[kernel]):.2f})")


if __name__ == "__main__":
    main()
