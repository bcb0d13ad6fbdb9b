#!/usr/bin/env python3
"""What each ``--quantize`` method costs in accuracy and buys in speed, on a trained model.

For each method (``none`` is bf16 where the CPU computes it natively, else
fp32), a real ``XeonEngine`` serves the model and scores held-out windows
of text through its own prompt log-probabilities. ``--model`` is a model
id as ``switchyard serve --model-id`` takes it: by default the default
model (``switchyard/smollm2-135m-instruct``, prepared into the model cache
by ``switchyard.models.default_model`` on first use), or a folder such as
one ``benchmarks/train_accuracy_model.py`` trains. ``--text FILE`` takes
the windows from that file, tokenized with the model's tokenizer, evenly
spread and not overlapping (``benchmarks/data/alice-chapters-1-2.txt`` is
shipped for this); without it they come from the held-out files of
``train_accuracy_model.py``'s corpus. Against the ``none`` engine it reports:

- perplexity of the held-out text, and its change;
- KL(none || method) of the next-token distributions over the whole
  vocabulary, mean over positions;
- top-1 agreement: how often both engines' most likely next token is the same;
- linear-weight bytes (packed, scales included);
- decode tokens/s at batch 1 and 32 (greedy, EOS ignored).

Each request asks for prompt log-probs with ``top_n_tokens`` 1; the whole
distribution at each position is taken from the same step, as the engine's
scoring computes it (``logit - logsumexp`` in float32, from the engine's
call of ``switchyard_engine.logprobs.prompt_scores``), and checked against
the log-probs the engine returned: a 49,152-token vocabulary returned as
``top_n_tokens`` would cost seconds per window. The ``none`` run writes its
distributions to ``--out``; each later method compares its own against
them in its process.

Methods ``gptq``, ``gptq-act-order`` and ``rtn`` are checkpoints, not
``--quantize`` flags: the model is first written by ``switchyard quantize
--method int4`` (group 128, as ``int4``; the LM head left as it is),
``gptq`` with ``--gptq`` and ``--calibration FILE`` (JSON Lines, as
``switchyard quantize`` reads it), by default 16 texts cut from the training
split of ``train_accuracy_model.py``'s corpus (Python's standard library, as
SmoothQuant's default calibration), ``gptq-act-order`` with ``--act-order``
too, and that folder is served (its ``quantization_config`` picks the reader).

Methods run one after another in fresh processes (two engines in one
process would share one OpenMP pool); the first is the reference. Writes
``quant_report.json`` and ``quant_report.png`` to ``--out``.

    .venv/bin/python benchmarks/quant_report.py \\
        --text benchmarks/data/alice-chapters-1-2.txt \\
        --methods none,int8,int4,int4-g32,smoothquant --out /tmp/quant-report
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

from switchyard.models.default_model import DEFAULT_MODEL_NAME


def held_out_windows(model: Path, count: int, length: int,
                     text: Path | None = None) -> list[list[int]]:
    """``count`` windows of ``length`` tokens: from ``text`` (evenly spread, not
    overlapping), else from the held-out files of ``train_accuracy_model``'s corpus."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    if text is None:
        from train_accuracy_model import corpus_files, encode

        _, held = corpus_files()
        data = encode(tokenizer, held, tokenizer.convert_tokens_to_ids("<|endoftext|>"))
        step = max(length, (len(data) - length) // count)
        return [data[i : i + length].tolist() for i in range(0, step * count, step)][:count]
    ids = tokenizer.encode(text.read_text(encoding="utf-8"), add_special_tokens=False)
    if count * length > len(ids):
        sys.exit(f"{text} is {len(ids)} tokens for this tokenizer: at most "
                 f"{len(ids) // length} windows of {length}")
    spread = (len(ids) - length) / max(1, count - 1)
    return [ids[round(i * spread) : round(i * spread) + length] for i in range(count)]


class Distributions:
    """Collects, while ``rows`` is a list, the log-probabilities over the whole vocabulary of
    every row the engine scores: ``logit - logsumexp`` in float32, as its ``prompt_scores``
    computes the log-probs it returns, from the same logits."""

    def __init__(self) -> None:
        from switchyard_xeon import runner

        self.rows: list[torch.Tensor] | None = None
        original = runner.prompt_scores

        def collecting(logits, targets, rows=None, top_n=0, **kwargs):
            if self.rows is not None:
                part = (logits if rows is None else logits[rows]).float()
                self.rows.append(part - torch.logsumexp(part, dim=-1, keepdim=True))
            return original(logits, targets, rows, top_n, **kwargs)

        runner.prompt_scores = collecting


def score(engine, windows: list[list[int]],
          collected: Distributions) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per scored position: the actual next token's log-prob (as the engine returned it),
    and, per window, every token's log-prob ([positions, vocab] float32)."""
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

        collected.rows = []
        engine.submit(EngineRequest(
            request_id=f"score-{i}", prompt_token_ids=tuple(window), prompt_logprobs=True,
            sampling=SamplingParams(top_n_tokens=1),
            stopping=StoppingParams(max_new_tokens=1, ignore_eos=True), logprobs=False), sink)
        done.wait()
        rows, collected.rows = torch.cat(collected.rows), None
        event = first[0]
        if event.error:
            sys.exit(f"scoring failed: {event.error}")
        # The collected rows must be the ones behind the returned log-probs.
        returned = torch.tensor(event.prompt_logprobs, dtype=torch.float32)
        best = torch.tensor([top[0].logprob for top in event.prompt_top_tokens])
        if rows.shape[0] != len(returned) or not (
                torch.equal(rows.gather(1, torch.tensor(window[1:])[:, None])[:, 0], returned)
                and torch.equal(rows.max(-1).values, best)):
            sys.exit(f"window {i}: the collected distributions do not match the engine's "
                     "prompt log-probs")
        actual.extend(event.prompt_logprobs)
        dists.append(rows)
    return torch.tensor(actual, dtype=torch.float64), dists


def against(reference: list[torch.Tensor], dists: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per position: KL(reference || dists) and whether both most likely tokens agree."""
    kl, same = [], []
    for pb, po in zip(reference, dists, strict=True):
        pb, po = pb.double(), po.double()
        # Tokens the reference gives no mass add nothing to KL(reference || other).
        kl.append(torch.where(pb > -math.inf, pb.exp() * (pb - po), 0.0).sum(-1))
        same.append(pb.argmax(-1) == po.argmax(-1))
    return {"kl": torch.cat(kl), "top1": torch.cat(same)}


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
            streams: list[int], text: Path | None, reference: Path,
            is_reference: bool) -> dict[str, object]:
    """One method in this process: its scores against the reference's distributions (which
    the reference itself writes to ``reference``), and its speed."""
    from engine_paths import run_wave
    from switchyard.plugins import PluginHost
    from switchyard_spec import EngineConfig
    from switchyard_xeon.engine import XeonEngine

    host = PluginHost.from_entry_points()
    # gptq: the folder's quantization_config names its reader, as `switchyard serve` finds it.
    # `none` is the float weights, also of a folder converted from GGUF that kept its blocks
    # (which `switchyard serve` serves with the method reading them: `--methods gguf` here).
    name = None if method == "none" else host.detect_quantization(
        None if method in CHECKPOINTS else method, model)
    quantization = host.resolve_quantization(name, host.engines()["xeon"])
    engine = XeonEngine(EngineConfig(
        model_path=str(model), dtype="auto", quantize=name, quantization=quantization,
        max_batch_size=64, options={"num_threads": str(threads), "prefix_caching": "false"}))
    collected = Distributions()
    info = engine.start()
    engine.warmup()
    try:
        actual, dists = score(engine, held_out_windows(model, windows, length, text), collected)
        if is_reference:
            torch.save(dists, reference)
        versus = against(torch.load(reference), dists)
        del dists
        speed = {}
        for n in streams:
            run_wave(engine, n, 64, 8, info.vocab_size, f"warm{n}")  # first-use costs
            speed[str(n)] = run_wave(engine, n, 128, 64, info.vocab_size, f"s{n}")["tok_s"]
        weight_bytes = linear_bytes()
    finally:
        engine.shutdown()
    return {"method": method, "dtype": info.dtype, "actual": actual, **versus,
            "tok_s": speed, "linear_bytes": weight_bytes}


def compare(base: dict, other: dict) -> dict[str, float]:
    """Perplexity, KL(base || other), top-1 agreement and mean |Δ log p(actual)|."""
    return {"perplexity": math.exp(-float(other["actual"].mean())),
            "kl": float(other["kl"].mean()),
            "top1_agreement": float(other["top1"].double().mean()),
            "mean_abs_delta_logprob": float((other["actual"] - base["actual"]).abs().mean()),
            "positions": int(other["actual"].shape[0])}


CHECKPOINTS = ("gptq", "gptq-act-order", "rtn")
"""Methods served from a folder ``switchyard quantize`` writes first."""


def written_folder(model: Path, out: Path, method: str, calibration: Path | None = None) -> Path:
    """``model`` written by ``switchyard quantize --method int4``: round to nearest (``rtn``),
    or ``--gptq`` calibrated on ``calibration`` (default: training texts) (``gptq``;
    ``gptq-act-order`` adds ``--act-order``)."""
    from train_accuracy_model import corpus_files

    folder = out / f"{method}-model"
    if (folder / "config.json").exists():
        return folder
    if method == "rtn":
        subprocess.run([sys.executable, "-m", "switchyard.cli", "quantize", str(model),
                        str(folder), "--method", "int4"], check=True)
        return folder
    if calibration is None:
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
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME,
                        help="a model id as `switchyard serve --model-id` takes it "
                             "(default: the default model)")
    parser.add_argument("--text", type=Path,
                        help="score windows of this text (default: the held-out files of "
                             "train_accuracy_model.py's corpus)")
    parser.add_argument("--calibration", type=Path,
                        help="gptq's calibration texts, JSON Lines (default: 16 texts from "
                             "train_accuracy_model.py's training split)")
    parser.add_argument("--methods", default="none,int8,int4,int4-g32,smoothquant")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--streams", default="1,32")
    parser.add_argument("--out", type=Path, default=Path("quant-report"))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one method
    parser.add_argument("--into", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--reference", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--is-reference", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    if args.one:
        result = measure(args.one, Path(args.model), args.windows, args.length, args.threads,
                         streams, args.text, args.reference, args.is_reference)
        torch.save(result, args.into)
        return
    from switchyard.models.loader import resolve_model_path

    model_id, folder = resolve_model_path(args.model)
    print(f"{model_id}: {folder}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    reference = args.out / "reference.dists.pt"
    results = []
    for i, method in enumerate(args.methods.split(",")):
        into = args.out / f"{method}.scores.pt"
        print(f"{method}: scoring {args.windows} x {args.length} tokens, then decoding", flush=True)
        t0 = time.monotonic()
        model = written_folder(folder, args.out, method, args.calibration) \
            if method in CHECKPOINTS else folder
        subprocess.run([sys.executable, __file__, "--model", str(model), "--one", method,
                        "--into", str(into), "--windows", str(args.windows), "--length",
                        str(args.length), "--threads", str(args.threads), "--streams",
                        args.streams, "--reference", str(reference),
                        *(["--text", str(args.text)] if args.text else []),
                        *(["--is-reference"] if i == 0 else [])], check=True)
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
