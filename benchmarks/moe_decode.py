"""Mixture-of-experts decode: the Xeon engine's grouped experts, the model's own, and `generate`.

Builds one random-weight MoE model (``--family`` mixtral or qwen2_moe;
``--hidden``, ``--inner`` (each expert's intermediate size), ``--experts``,
top-``--top-k``, ``--layers``, ``--vocab``; heads of 64, a quarter as many
KV heads) and measures decode tokens/s for waves of ``--streams`` greedy
requests (``--prompt-tokens`` prompt, ``--new-tokens`` new tokens), each
configuration in a fresh process (two engines in one process would share
the cores between two OpenMP pools):

- ``engine-grouped``: a real ``XeonEngine`` as it runs by default
  (``switchyard_xeon.moe``: per-expert linears on the engine's panels, tokens
  grouped by expert);
- ``engine-model``: the same engine with ``moe=model``, the model's own experts
  module (transformers' default ``grouped_mm`` implementation over its
  stacked weights, which the engine's packing does not reach, so fp32);
- ``generate``: transformers ``generate`` on the model loaded in bfloat16,
  its default experts implementation (``grouped_mm``); ``generate-eager``: the
  same with ``experts_implementation="eager"``, transformers' per-expert
  Python loop.

Engine figures count decode-only steps (the engine's step reports);
``generate``'s decode time is a ``max_new_tokens=N`` call less a
``max_new_tokens=1`` call on the same batch. The ``experts`` column is the
share of that decode time spent inside the experts modules (timed around
their ``forward``), the profile that says whether the experts dominate.

    .venv/bin/python benchmarks/moe_decode.py --streams 1 8 32 --threads 1

Not a timed test: one short run; the figures in docs/xeon.md name the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fallback_cost import decode_waves, machine

ROOT = Path(__file__).resolve().parents[1]
for sub in ("gateway", "spec", "plugins/xeon", "plugins/quant"):
    sys.path.insert(0, str(ROOT / sub))

CONFIGS = ("engine-grouped", "engine-model", "generate", "generate-eager")


def build(family: str, hidden: int, inner: int, experts: int, top_k: int, layers: int,
          vocab: int):
    """A random MoE model of ``family`` with the benchmark's shape."""
    import torch
    import transformers as T

    torch.manual_seed(0)
    heads = hidden // 64
    common = dict(vocab_size=vocab, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 4), max_position_embeddings=1024,
                  num_experts_per_tok=top_k)
    if family == "mixtral":
        config = T.MixtralConfig(intermediate_size=inner, num_local_experts=experts, **common)
        return T.MixtralForCausalLM(config).eval()
    if family == "qwen2_moe":
        config = T.Qwen2MoeConfig(moe_intermediate_size=inner, intermediate_size=4 * inner,
                                  shared_expert_intermediate_size=4 * inner,
                                  num_experts=experts, **common)
        return T.Qwen2MoeForCausalLM(config).eval()
    raise KeyError(family)


class ExpertsTimer:
    """Seconds spent inside ``model``'s experts modules (wrapped ``forward``)."""

    def __init__(self, model) -> None:
        self.seconds = 0.0
        for module in model.modules():
            if type(module).__name__.endswith("Experts"):
                self._wrap(module)

    def _wrap(self, module) -> None:
        inner = module.forward

        def forward(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        module.forward = forward


def _prompts(streams: int, prompt_tokens: int) -> list[list[int]]:
    return [[(7 * j + 13 * i) % 900 + 10 for j in range(prompt_tokens)] for i in range(streams)]


def run_engine(folder: str, moe: str, streams: int, prompt_tokens: int, new_tokens: int,
               threads: int) -> dict[str, float]:
    """Start an engine on ``folder``; decode tokens/s of one timed wave after a warm one."""
    from switchyard_spec import EngineConfig
    from switchyard_xeon.engine import XeonEngine

    engine = XeonEngine(EngineConfig(model_path=folder, dtype="bfloat16", options={
        "num_threads": str(threads), "moe": moe}))
    engine.start()
    runner = engine._runner
    timer = ExpertsTimer(runner._forward.model if hasattr(runner, "_forward") else runner.model)
    steps: list[tuple[int, float, float]] = []
    seen = [0.0]

    def observe(report) -> None:  # on the loop thread, after each step
        experts, seen[0] = timer.seconds - seen[0], timer.seconds
        if report.method == "decode":
            steps.append((report.decode_tokens, report.seconds, experts))

    engine.set_step_observer(observe)
    try:
        decode_waves(engine, _prompts(streams, prompt_tokens), new_tokens, steps.clear)
    finally:
        engine.shutdown()
    tokens = sum(t for t, _, _ in steps)
    seconds = sum(s for _, s, _ in steps)
    return {"tokens_per_s": tokens / seconds, "ms_per_step": 1e3 * seconds / len(steps),
            "experts_share": sum(e for _, _, e in steps) / seconds}


def run_generate(folder: str, experts: str, streams: int, prompt_tokens: int, new_tokens: int,
                 threads: int) -> dict[str, float]:
    """transformers ``generate`` (bf16) decode tokens/s: N new tokens less 1, same batch."""
    import torch
    import transformers as T

    torch.set_num_threads(threads)
    model = T.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16,
                                                   experts_implementation=experts).eval()
    timer = ExpertsTimer(model)
    ids = torch.tensor(_prompts(streams, prompt_tokens))

    def generate(new: int) -> tuple[float, float]:
        before, start = timer.seconds, time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                                 pad_token_id=0)
        assert out.shape[1] == prompt_tokens + new
        return time.perf_counter() - start, timer.seconds - before

    generate(4)  # warm
    full, full_experts = generate(new_tokens)
    one, one_experts = generate(1)
    seconds = full - one
    return {"tokens_per_s": streams * (new_tokens - 1) / seconds,
            "ms_per_step": 1e3 * seconds / (new_tokens - 1),
            "experts_share": (full_experts - one_experts) / seconds}


def run_one(config: str, folder: str, streams: int, args: argparse.Namespace) -> dict[str, float]:
    shape = (streams, args.prompt_tokens, args.new_tokens, args.threads)
    if config.startswith("engine-"):
        return run_engine(folder, config.removeprefix("engine-"), *shape)
    return run_generate(folder, "eager" if config == "generate-eager" else "grouped_mm", *shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", default="mixtral", choices=("mixtral", "qwen2_moe"))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inner", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--one", nargs=3, metavar=("CONFIG", "FOLDER", "STREAMS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        config, folder, streams = args.one
        print(json.dumps(run_one(config, folder, int(streams), args)))
        return
    folder = Path(tempfile.mkdtemp(prefix="moe-decode-")) / args.family
    build(args.family, args.hidden, args.inner, args.experts, args.top_k, args.layers,
          args.vocab).save_pretrained(folder)
    print(f"machine: {machine()}")
    print(f"shape: {args.family}, hidden {args.hidden}, {args.experts} experts of {args.inner} "
          f"top-{args.top_k}, {args.layers} layers, vocabulary {args.vocab}; bfloat16, "
          f"{args.threads} thread{'s' * (args.threads > 1)}; prompts {args.prompt_tokens}, "
          f"{args.new_tokens} new tokens")
    print("| configuration | " + " | ".join(
        f"{n} stream{'s' * (n > 1)}: tok/s (ms/step, experts %)" for n in args.streams) + " |")
    print("|---|" + "---|" * len(args.streams))
    forwarded = ["--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens),
                 "--threads", str(args.threads)]
    for config in args.configs:
        cells = []
        for streams in args.streams:
            out = subprocess.run(
                [sys.executable, __file__, "--one", config, str(folder), str(streams),
                 *forwarded], check=True, capture_output=True, text=True)
            result = json.loads(out.stdout.strip().splitlines()[-1])
            cells.append(f"{result['tokens_per_s']:.1f} ({result['ms_per_step']:.1f}, "
                         f"{100 * result['experts_share']:.0f}%)")
        print(f"| {config} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nafter the run: {machine()}")


if __name__ == "__main__":
    main()
