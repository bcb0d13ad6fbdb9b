"""What the fallback path costs: decode tokens/s of the Xeon engine on each path, same shape.

Builds random-weight models of one shape (``--hidden``, ``--layers``,
``--vocab``) as Llama (paged path), Bloom (ALiBi) and Gemma 2 (soft-capped
logits, sliding-window layers), which take the paged path and are also forced
onto the fallback (``forward=fallback``) to compare the two, StableLM
(fallback path: attention outside transformers' attention interface), plus
Llama forced onto the fallback, and for each runs waves of
``--streams`` greedy requests (``--prompt-tokens`` prompt, ``--new-tokens``
new tokens) through a real ``XeonEngine``, each configuration in a fresh
process (two engines in one process would share the cores between two
OpenMP pools). Decode tokens/s is measured over decode-only steps (the
engine's step reports), so prefill does not count.

Each fallback configuration runs twice: as the engine runs it (decode rows
in one left-padded forward over a batched cache, ``switchyard_xeon.fallback``)
and with ``FallbackRunner.padded_decode`` off (``-per-seq``: one forward per
sequence per step, the runner's other mode), so the table compares the two
in one run. Each family also runs through transformers ``generate``
(``-generate``: the same prompts in one batch), the reference for both paths.

    .venv/bin/python benchmarks/fallback_cost.py --streams 1 8 32 --threads 1

Not a timed test: one short run; the figures in docs/xeon.md name the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("gateway", "spec", "plugins/xeon", "plugins/quant"):
    sys.path.insert(0, str(ROOT / sub))

PER_SEQUENCE = "padded_decode"
"""A pseudo-option of this script (taken out before the engine sees the options): "off" turns
the fallback runner's padded decode batch off."""

GENERATE = "generate"
"""A pseudo-option: the same waves through transformers ``generate`` (one batch of equal-length
prompts, no padding), the reference every path is measured against."""

CONFIGS = {
    "llama-paged": ("llama", {}),
    "llama-fallback": ("llama", {"forward": "fallback"}),
    "llama-fallback-per-seq": ("llama", {"forward": "fallback", PER_SEQUENCE: "off"}),
    "bloom-paged": ("bloom", {}),
    "bloom-fallback": ("bloom", {"forward": "fallback"}),
    "bloom-fallback-per-seq": ("bloom", {"forward": "fallback", PER_SEQUENCE: "off"}),
    "gemma2-paged": ("gemma2", {}),
    "gemma2-fallback": ("gemma2", {"forward": "fallback"}),
    "stablelm-fallback": ("stablelm", {}),
    "stablelm-fallback-per-seq": ("stablelm", {PER_SEQUENCE: "off"}),
    "llama-generate": ("llama", {GENERATE: "on"}),
    "bloom-generate": ("bloom", {GENERATE: "on"}),
    "gemma2-generate": ("gemma2", {GENERATE: "on"}),
    "stablelm-generate": ("stablelm", {GENERATE: "on"}),
}


def build(family: str, hidden: int, layers: int, vocab: int):
    """A random model of ``family`` with the benchmark's shape (heads of 64)."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    heads = hidden // 64
    ids = dict(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "llama":
        config = T.LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden,
                               num_hidden_layers=layers, num_attention_heads=heads,
                               max_position_embeddings=1024, **ids)
        return T.LlamaForCausalLM(config).eval()
    if family == "stablelm":
        config = T.StableLmConfig(hidden_size=hidden, intermediate_size=4 * hidden,
                                  num_hidden_layers=layers, num_attention_heads=heads,
                                  num_key_value_heads=heads, max_position_embeddings=1024, **ids)
        return T.StableLmForCausalLM(config).eval()
    if family == "bloom":
        return T.BloomForCausalLM(T.BloomConfig(hidden_size=hidden, n_layer=layers,
                                                n_head=heads, **ids)).eval()
    if family == "gemma2":  # a third of the heads for keys/values, as the 135M shape has
        config = T.Gemma2Config(hidden_size=hidden, intermediate_size=4 * hidden,
                                num_hidden_layers=layers, num_attention_heads=heads,
                                num_key_value_heads=max(1, heads // 3), head_dim=64,
                                max_position_embeddings=1024, sliding_window=4096, **ids)
        return T.Gemma2ForCausalLM(config).eval()
    raise KeyError(family)


def _prompts(streams: int, prompt_tokens: int) -> list[tuple[int, ...]]:
    return [tuple((7 * j + 13 * i) % 900 + 10 for j in range(prompt_tokens))
            for i in range(streams)]


def run_generate(folder: str, streams: int, prompt_tokens: int, new_tokens: int,
                 threads: int) -> dict[str, float]:
    """transformers ``generate`` on the same waves: decode tokens/s from the time of
    ``new_tokens`` minus that of one token (the prefill), best of two."""
    import time

    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor(_prompts(streams, prompt_tokens))

    def timed(n: int) -> float:
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                               max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
            best = min(best, time.perf_counter() - t0)
        return best

    timed(2)  # first-use costs
    seconds = timed(new_tokens) - timed(1)
    steps = new_tokens - 1
    return {"decode_tokens_per_s": streams * steps / seconds, "ms_per_step": 1e3 * seconds / steps}


def decode_waves(engine, prompts: list[tuple[int, ...]], new_tokens: int,
                 new_wave: Callable[[], None]) -> None:
    """A warm wave, then a timed one, of greedy requests for ``prompts`` (EOS ignored), each
    waited for; ``new_wave`` runs before each (to reset what a step observer gathers).
    RuntimeError if any request failed."""
    from switchyard_spec import EngineRequest, SamplingParams, StoppingParams

    errors: list[str] = []
    for wave in ("warm", "timed"):
        new_wave()
        done = threading.Semaphore(0)

        def sink(event, done=done):
            if event.error is not None:
                errors.append(event.error)
            if event.finish_reason is not None or event.error is not None:
                done.release()

        for i, prompt in enumerate(prompts):
            engine.submit(EngineRequest(
                request_id=f"{wave}{i}", prompt_token_ids=tuple(prompt),
                sampling=SamplingParams(),
                stopping=StoppingParams(max_new_tokens=new_tokens, ignore_eos=True)), sink)
        for _ in prompts:
            done.acquire()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")


def run_one(folder: str, options: dict[str, str], streams: int, prompt_tokens: int,
            new_tokens: int, threads: int) -> dict[str, float]:
    """Start an engine on ``folder``; decode tokens/s of one wave of ``streams`` requests."""
    from switchyard_spec import EngineConfig
    from switchyard_xeon.engine import XeonEngine
    from switchyard_xeon.fallback import FallbackRunner

    options = dict(options)
    if options.pop(GENERATE, None):
        return run_generate(folder, streams, prompt_tokens, new_tokens, threads)
    FallbackRunner.padded_decode = options.pop(PER_SEQUENCE, "on") != "off"
    engine = XeonEngine(EngineConfig(model_path=folder, dtype="float32",
                                     options={"num_threads": str(threads), **options}))
    engine.start()
    steps: list[tuple[int, float]] = []
    engine.set_step_observer(
        lambda r: steps.append((r.decode_tokens, r.seconds)) if r.method == "decode" else None)
    try:
        decode_waves(engine, _prompts(streams, prompt_tokens), new_tokens, steps.clear)
    finally:
        engine.shutdown()
    tokens = sum(t for t, _ in steps)
    seconds = sum(s for _, s in steps)
    return {"decode_tokens_per_s": tokens / seconds, "ms_per_step": 1e3 * seconds / len(steps)}


def machine() -> str:
    """The CPU and its load, for the header (figures from a shared VM need both)."""
    import os

    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{model}, {os.cpu_count()} cores, load average {load}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--one", nargs=3, metavar=("FOLDER", "OPTIONS", "STREAMS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        folder, options, streams = args.one
        print(json.dumps(run_one(folder, json.loads(options), int(streams), args.prompt_tokens,
                                 args.new_tokens, args.threads)))
        return
    workdir = Path(tempfile.mkdtemp(prefix="fallback-cost-"))
    folders: dict[str, str] = {}
    for family in sorted({CONFIGS[c][0] for c in args.configs}):
        folder = workdir / family
        build(family, args.hidden, args.layers, args.vocab).save_pretrained(folder)
        folders[family] = str(folder)
    print(f"machine: {machine()}")
    print(f"shape: hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}, float32, "
          f"{args.threads} threads; prompts {args.prompt_tokens}, {args.new_tokens} new tokens")
    print("| configuration | " + " | ".join(f"{n} stream{'s' * (n > 1)} tok/s (ms/step)"
                                             for n in args.streams) + " |")
    print("|---|" + "---|" * len(args.streams))
    for name in args.configs:
        family, options = CONFIGS[name]
        cells = []
        for streams in args.streams:
            out = subprocess.run(
                [sys.executable, __file__, "--one", folders[family], json.dumps(options),
                 str(streams), "--prompt-tokens", str(args.prompt_tokens), "--new-tokens",
                 str(args.new_tokens), "--threads", str(args.threads)],
                check=True, capture_output=True, text=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            cells.append(f"{result['decode_tokens_per_s']:.0f} ({result['ms_per_step']:.1f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\nafter the run: {machine()}")


if __name__ == "__main__":
    main()
