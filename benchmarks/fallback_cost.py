"""What the fallback path costs: decode tokens/s of the Xeon engine on each path, same shape.

Builds random-weight models of one shape (``--hidden``, ``--layers``,
``--vocab``) as Llama (paged path) and as Bloom and StableLM (fallback path:
ALiBi, and attention outside transformers' attention interface), plus Llama
forced onto the fallback (``forward=fallback``), and for each runs waves of
``--streams`` greedy requests (``--prompt-tokens`` prompt, ``--new-tokens``
new tokens) through a real ``XeonEngine``, each configuration in a fresh
process (two engines in one process would share the cores between two
OpenMP pools). Decode tokens/s is measured over decode-only steps (the
engine's step reports), so prefill does not count.

``--batching`` also measures the choice the fallback runner makes: one
decode step of N sequences as N forwards on their own caches, against one
padded forward over a batched cache (with and without merging the
per-sequence caches into it and splitting them back, which a runner whose
sequences join and leave between steps pays at every change of the batch).

    .venv/bin/python benchmarks/fallback_cost.py --streams 1 8 --batching

Not a timed test: one short run; the figures in docs/xeon.md name the machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("gateway", "spec", "plugins/xeon", "plugins/quant"):
    sys.path.insert(0, str(ROOT / sub))

CONFIGS = {
    "llama-paged": ("llama", {}),
    "llama-fallback": ("llama", {"forward": "fallback"}),
    "bloom-fallback": ("bloom", {}),
    "stablelm-fallback": ("stablelm", {}),
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
    raise KeyError(family)


def run_one(folder: str, options: dict[str, str], streams: int, prompt_tokens: int,
            new_tokens: int, threads: int) -> dict[str, float]:
    """Start an engine on ``folder``; decode tokens/s of one wave of ``streams`` requests."""
    from switchyard_spec import EngineConfig, EngineRequest, SamplingParams, StoppingParams
    from switchyard_xeon.engine import XeonEngine

    engine = XeonEngine(EngineConfig(model_path=folder, dtype="float32",
                                     options={"num_threads": str(threads), **options}))
    engine.start()
    steps: list[tuple[int, float]] = []
    errors: list[str] = []
    engine.set_step_observer(
        lambda r: steps.append((r.decode_tokens, r.seconds)) if r.method == "decode" else None)
    try:
        for wave in ("warm", "timed"):
            steps.clear()
            done = threading.Semaphore(0)

            def sink(event, done=done):
                if event.error is not None:
                    errors.append(event.error)
                if event.finish_reason is not None or event.error is not None:
                    done.release()

            for i in range(streams):
                prompt = tuple((7 * j + 13 * i) % 900 + 10 for j in range(prompt_tokens))
                engine.submit(EngineRequest(
                    request_id=f"{wave}{i}", prompt_token_ids=prompt, sampling=SamplingParams(),
                    stopping=StoppingParams(max_new_tokens=new_tokens, ignore_eos=True)), sink)
            for _ in range(streams):
                done.acquire()
    finally:
        engine.shutdown()
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    tokens = sum(t for t, _ in steps)
    seconds = sum(s for _, s in steps)
    return {"decode_tokens_per_s": tokens / seconds, "ms_per_step": 1e3 * seconds / len(steps)}


def batching(folder: str, streams: int, context: int, threads: int, rounds: int = 5):
    """ms per decode step of ``streams`` sequences: per-sequence forwards vs one padded batch."""
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    lengths = [context - 3 * i for i in range(streams)]  # unequal, as in a real batch
    caches = []
    with torch.inference_mode():
        for n in lengths:
            out = model(input_ids=torch.arange(10, 10 + n)[None], use_cache=True)
            caches.append(out.cache)

        def per_sequence():
            for cache, n in zip(caches, lengths, strict=True):
                model(input_ids=torch.tensor([[5]]), cache=cache,
                      attention_mask=torch.ones(1, n + 1, dtype=torch.long),
                      position_ids=torch.tensor([[n]]), use_cache=True, logits_to_keep=1)
                cache.crop(-1)  # back to where it was: every round feeds the same step

        width = max(lengths)
        mask = torch.zeros(streams, width + 1, dtype=torch.long)
        for i, n in enumerate(lengths):
            mask[i, width - n:] = 1
        positions = torch.tensor([[n] for n in lengths])

        def merged() -> DynamicCache:
            batched = DynamicCache()
            for layer in range(len(caches[0].layers)):
                keys = [c.layers[layer].keys for c in caches]
                values = [c.layers[layer].values for c in caches]
                pad = [width - k.shape[2] for k in keys]
                k = torch.cat([torch.nn.functional.pad(t, (0, 0, p, 0)) for t, p in zip(keys, pad)])
                v = torch.cat([torch.nn.functional.pad(t, (0, 0, p, 0))
                               for t, p in zip(values, pad)])
                batched.update(k, v, layer)
            return batched

        def padded(merge: bool, batched: list) -> None:
            cache = merged() if merge else batched[0]
            model(input_ids=torch.full((streams, 1), 5), cache=cache, attention_mask=mask,
                  position_ids=positions, use_cache=True, logits_to_keep=1)
            if merge:  # the new column back into each sequence's own cache
                for layer in range(len(caches[0].layers)):
                    k, v = cache.layers[layer].keys[:, :, -1:], cache.layers[layer].values[:, :, -1:]
                    for i, c in enumerate(caches):
                        c.layers[layer].keys = torch.cat([c.layers[layer].keys, k[i:i + 1]], 2)
                        c.layers[layer].values = torch.cat([c.layers[layer].values,
                                                            v[i:i + 1]], 2)
                for c, n in zip(caches, lengths, strict=True):
                    c.crop(-1)
            else:
                cache.crop(-1)

        def best(fn) -> float:
            times = []
            for _ in range(rounds):
                begin = time.perf_counter()
                fn()
                times.append(time.perf_counter() - begin)
            return 1e3 * min(times)

        kept = [merged()]
        return {
            "per_sequence_ms": best(per_sequence),
            "padded_ms": best(lambda: padded(False, kept)),
            "padded_with_merge_ms": best(lambda: padded(True, kept)),
        }


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
    parser.add_argument("--batching", action="store_true")
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
    if args.batching:
        print("\none decode step, ms (best of 5): per-sequence forwards vs a padded batch")
        for family in sorted(folders):
            for streams in args.streams:
                if streams < 2:
                    continue
                r = batching(folders[family], streams, args.prompt_tokens + args.new_tokens,
                             args.threads)
                print(f"{family}, {streams} sequences: per-sequence {r['per_sequence_ms']:.1f}, "
                      f"padded {r['padded_ms']:.1f}, padded with merge and split "
                      f"{r['padded_with_merge_ms']:.1f}")


if __name__ == "__main__":
    main()
