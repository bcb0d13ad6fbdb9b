#!/usr/bin/env python3
"""What each ``--quantize`` method costs in accuracy and buys in speed, on a trained model.

For each method (``none`` is bf16 where the CPU computes it natively, else
fp32), a real ``XeonEngine`` serves the model folder (train one with
``benchmarks/train_accuracy_model.py``) and scores held-out windows of that
model's corpus through the engine's own prompt log-probabilities, with the
whole next-token distribution (``top_n_tokens`` = the vocabulary) at every
position. Against the ``none`` engine it reports:

- perplexity of the held-out text, and its change;
- KL(none || method) of the next-token distributions, mean over positions;
- top-1 agreement: how often both engines' most likely next token is the same;
- linear-weight bytes (packed, scales included);
- decode tokens/s at batch 1 and 32 (greedy, EOS ignored).

Methods ``gptq``, ``gptq-act-order`` and ``rtn`` are checkpoints, not
``--quantize`` flags: the model is first written by ``switchyard quantize
--method int4`` (group 128, as ``int4``; the LM head left as it is),
``gptq`` with ``--gptq`` and 16 calibration texts cut from the training
split, ``gptq-act-order`` with ``--act-order`` too, and that folder is
served (its ``quantization_config`` picks the reader).

Methods run one after another in fresh processes (two engines in one
process would share one OpenMP pool). Writes ``quant_report.json`` and
``quant_report.png`` to ``--out``.

    .venv/bin/python benchmarks/quant_report.py --model /tmp/accuracy-llama \\
        --methods none,int8,int4,smoothquant --out /tmp/quant-report
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for sub in ("gateway", "spec", "plugins/xeon", "plugins/quant", "benchmarks"):
    sys.path.insert(0, str(ROOT / sub))


def held_out_windows(model: Path, count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens from the held-out files, as the training split."""
    from train_accuracy_model import corpus_files, encode
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    _, held = corpus_files()
    data = encode(tokenizer, held, tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    step = max(length, (len(data) - length) // count)
    return [data[i : i + length].tolist() for i in range(0, step * count, step)][:count]


def score(engine, windows: list[list[int]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per scored position: the actual next token's log-prob, and every token's log-prob."""
    from switchyard_spec import EngineRequest, SamplingParams, StoppingParams, TokenEvent

    actual: list[float] = []
    dists: list[torch.Tensor] = []
    for i, window in enumerate(windows):
        done = threading.Event()
        first: list[TokenEvent] = []

        def sink(event: TokenEvent) -> None:
            if not first:
                first.append(event)
            if event.finish_reason is not None or event.error is not None:
                done.set()

        engine.submit(EngineRequest(
            request_id=f"score-{i}", prompt_token_ids=tuple(window), prompt_logprobs=True,
            sampling=SamplingParams(top_n_tokens=vocab),
            stopping=StoppingParams(max_new_tokens=1, ignore_eos=True), logprobs=False), sink)
        done.wait()
        event = first[0]
        if event.error:
            sys.exit(f"scoring failed: {event.error}")
        actual.extend(event.prompt_logprobs)
        for top in event.prompt_top_tokens:
            row = torch.full((vocab,), -math.inf)
            row[torch.tensor([t.id for t in top])] = torch.tensor([t.logprob for t in top])
            dists.append(row)
    return torch.tensor(actual, dtype=torch.float64), torch.stack(dists)


def linear_bytes() -> int:
    """Bytes of the engine's packed linear weights (scales included), found among live objects."""
    import gc
    import warnings

    from switchyard_xeon.fp8_linears import Fp8Linear
    from switchyard_xeon.linears import PackedLinear, PanelLinear

    with warnings.catch_warnings():  # some live objects warn when type-checked
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        packed = sum(o.packed_weight.nbytes for o in objects
                     if isinstance(o, (PanelLinear, PackedLinear)))
        # FP8's linears keep their native panels, or (without the kernels) their E4M3
        # weights and per-row output scales, as buffers.
        fp8 = sum(sum(b.nbytes for b in (o.packed_weight, o.fp8_weight, o.out_scale)
                      if b is not None) for o in objects if isinstance(o, Fp8Linear))
        return packed + fp8


def measure(method: str, model: Path, windows: int, length: int, threads: int,
            streams: list[int]) -> dict[str, object]:
    """One method in this process: its scores (written to a file) and its speed."""
    from engine_paths import run_wave
    from switchyard.plugins import PluginHost
    from switchyard_spec import EngineConfig
    from switchyard_xeon.engine import XeonEngine

    host = PluginHost.from_entry_points()
    # gptq: the folder's quantization_config names its reader, as `switchyard serve` finds it.
    name = host.detect_quantization(None if method in ("none", *CHECKPOINTS) else method, model)
    quantization = host.resolve_quantization(name, host.engines()["xeon"])
    engine = XeonEngine(EngineConfig(
        model_path=str(model), dtype="auto", quantize=name, quantization=quantization,
        max_batch_size=64, options={"num_threads": str(threads), "prefix_caching": "false"}))
    info = engine.start()
    engine.warmup()
    try:
        actual, dists = score(engine, held_out_windows(model, windows, length), info.vocab_size)
        speed = {}
        for n in streams:
            run_wave(engine, n, 64, 8, info.vocab_size, f"warm{n}")  # first-use costs
            speed[str(n)] = run_wave(engine, n, 128, 64, info.vocab_size, f"s{n}")["tok_s"]
        weight_bytes = linear_bytes()
    finally:
        engine.shutdown()
    return {"method": method, "dtype": info.dtype, "actual": actual, "dists": dists,
            "tok_s": speed, "linear_bytes": weight_bytes}


def compare(base: dict, other: dict) -> dict[str, float]:
    """Perplexity, KL(base || other), top-1 agreement and mean |Δ log p(actual)|."""
    pb, po = base["dists"].double(), other["dists"].double()
    # Positions where the base gives a token no mass add nothing to KL(base || other).
    kl = torch.where(pb > -math.inf, pb.exp() * (pb - po), torch.zeros_like(pb)).sum(-1)
    return {"perplexity": math.exp(-float(other["actual"].mean())),
            "kl": float(kl.mean()),
            "top1_agreement": float((pb.argmax(-1) == po.argmax(-1)).double().mean()),
            "mean_abs_delta_logprob": float((other["actual"] - base["actual"]).abs().mean()),
            "positions": int(pb.shape[0])}


CHECKPOINTS = ("gptq", "gptq-act-order", "rtn")
"""Methods served from a folder ``switchyard quantize`` writes first."""


def written_folder(model: Path, out: Path, method: str) -> Path:
    """``model`` written by ``switchyard quantize --method int4``: round to nearest (``rtn``),
    or ``--gptq`` calibrated on training texts (``gptq``; ``gptq-act-order`` adds
    ``--act-order``)."""
    from train_accuracy_model import corpus_files

    folder = out / f"{method}-model"
    if (folder / "config.json").exists():
        return folder
    if method == "rtn":
        subprocess.run([sys.executable, "-m", "switchyard.cli", "quantize", str(model),
                        str(folder), "--method", "int4"], check=True)
        return folder
    train, _ = corpus_files()
    texts = []
    for path in train[:: max(1, len(train) // 16)][:16]:
        text = Path(path).read_text(errors="replace")
        texts.append(json.dumps({"text": text[len(text) // 3:][:1200]}))
    calibration = out / "calibration.jsonl"
    calibration.write_text("\n".join(texts) + "\n")
    subprocess.run([sys.executable, "-m", "switchyard.cli", "quantize", str(model), str(folder),
                    "--method", "int4", "--gptq", "--calibration", str(calibration),
                    *(["--act-order"] if method == "gptq-act-order" else [])], check=True)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--methods", default="none,int8,int4,int4-g32,smoothquant")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", default="1,32")
    parser.add_argument("--out", type=Path, default=Path("quant-report"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one method
    parser.add_argument("--into", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    if args.one:
        result = measure(args.one, args.model, args.windows, args.length, args.threads, streams)
        torch.save(result, args.into)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for method in args.methods.split(","):
        into = args.out / f"{method}.scores.pt"
        print(f"{method}: scoring {args.windows} x {args.length} tokens, then decoding", flush=True)
        t0 = time.monotonic()
        model = written_folder(args.model, args.out, method) \
            if method in CHECKPOINTS else args.model
        subprocess.run([sys.executable, __file__, "--model", str(model), "--one", method,
                        "--into", str(into), "--windows", str(args.windows), "--length",
                        str(args.length), "--threads", str(args.threads), "--streams",
                        args.streams], check=True)
        results.append(torch.load(into))
        print(f"  done in {time.monotonic() - t0:.0f}s", flush=True)
    base = results[0]
    rows = []
    for r in results:
        row = {"method": r["method"], "dtype": r["dtype"], **compare(base, r),
               "linear_bytes": r["linear_bytes"],
               **{f"tok_s_{k}": v for k, v in r["tok_s"].items()}}
        rows.append(row)
    base_ppl = rows[0]["perplexity"]
    print(f"\n| method | perplexity | vs {rows[0]['method']} | KL | top-1 agree | linear MiB | "
          + " | ".join(f"tok/s @{s}" for s in streams) + " |")
    print("|---|---:|---:|---:|---:|---:|" + "---:|" * len(streams))
    for row in rows:
        print(f"| {row['method']} | {row['perplexity']:.3f} | "
              f"{100 * (row['perplexity'] / base_ppl - 1):+.2f}% | {row['kl']:.2e} | "
              f"{100 * row['top1_agreement']:.1f}% | {row['linear_bytes'] / 2**20:.1f} | "
              + " | ".join(f"{row[f'tok_s_{s}']:.1f}" for s in streams) + " |")
    (args.out / "quant_report.json").write_text(json.dumps(rows, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for row in rows:
            ax.scatter(row[f"tok_s_{streams[0]}"], 100 * (row["perplexity"] / base_ppl - 1))
            ax.annotate(row["method"], (row[f"tok_s_{streams[0]}"],
                                        100 * (row["perplexity"] / base_ppl - 1)))
        ax.set_xlabel(f"decode tokens/s at batch {streams[0]}")
        ax.set_ylabel("perplexity increase (%)")
        fig.tight_layout()
        fig.savefig(args.out / "quant_report.png", dpi=120)
    except ImportError:
        print("matplotlib is not installed: no PNG", file=sys.stderr)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
