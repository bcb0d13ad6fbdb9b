"""Compare Switchyard with transformers, vLLM (CPU) and llama.cpp on the same model shapes.

Run with Switchyard's venv from the repository root:

    .venv/bin/python benchmarks/compare_peers.py --shapes small,medium --streams 1,8,32,64

For each shape and each peer it sends waves of N
concurrent greedy requests of `--prompt-tokens` prompt tokens and exactly
`--new-tokens` new tokens (EOS ignored), and reports output tokens/s, TTFT and
ITL (p50/p90). It also measures memory read bandwidth and sets batch-1 decode
against the bound it implies. Shapes: `smollm2` is the real default model,
SmolLM2-135M-Instruct (prepared from its Q4_1 GGUF file as `switchyard serve`
does, then rounded to bf16 once; `switchyard-gguf` and `llamacpp-gguf` serve
the GGUF file itself); `small` and `medium` are random-weight models of real
shapes, built by benchmarks/make_model.py when missing. A peer that is not installed, fails or runs out
of its time budget becomes a "skipped" row with the reason; the run goes on.
Outputs: results.md, results.json and results.png in `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

try:  # the whole harness builds on switchyard.bench, hence on Switchyard's venv
    import bandwidth
    import report
    from peer_llamacpp import LlamaCppPeer
    from peers import (EnginePeer, Peer, ShapeRun, SwitchyardGgufPeer, SwitchyardPeer,
                       SwitchyardProcessPeer, SwitchyardQuantPeer, TransformersPeer, VllmPeer)
    from results import Point, skipped
    from switchyard.bench.prompts import corpus_words, local_builder
except ImportError as exc:
    sys.exit(f"cannot import the harness ({exc}): run it with Switchyard's .venv/bin/python")

HERE = Path(__file__).resolve().parent
PEERS = ("switchyard", "switchyard-process", "switchyard-int8", "switchyard-int4",
         "switchyard-fp8", "switchyard-smoothquant", "switchyard-gguf", "switchyard-engine",
         "hf-generate", "hf-generate-batch", "vllm", "llamacpp", "llamacpp-bf16",
         "llamacpp-gguf")
SHAPES = ("smollm2", "small", "medium")
REAL_SHAPE = "smollm2"
"""The shape that is a trained model: the default model, not built by make_model.py."""
MAKE_MODEL = HERE / "make_model.py"
# --quick: a smoke run that proves every path works in a few minutes, not a measurement.
QUICK = {"shapes": "small", "streams": "1,2", "prompt_tokens": 16, "new_tokens": 8,
         "bandwidth_mib": 256, "peer_timeout": 900.0}
FULL = {"shapes": "small,medium", "streams": "1,8,32,64", "prompt_tokens": 128,
        "new_tokens": 128, "bandwidth_mib": 1024, "peer_timeout": 1800.0}
# CPU flags that mean native bf16 matmuls; without them torch emulates bf16, very slowly.
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty when it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def resolve_dtype(choice: str) -> str:
    """`auto`: bfloat16 where the CPU has native bf16 (AVX512_BF16 or AMX), else float32."""
    if choice != "auto":
        return choice
    return "bfloat16" if cpu_flags() & set(BF16_FLAGS) else "float32"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options; those left out take the --quick or the full-run default."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", help=f"{', '.join(SHAPES)} (default: small,medium)")
    p.add_argument("--streams", help="concurrent streams per wave (default: 1,8,32,64)")
    p.add_argument("--prompt-tokens", type=int, help="tokens per prompt (default: 128)")
    p.add_argument("--new-tokens", type=int, help="tokens generated per request (default: 128)")
    p.add_argument("--peers", default="all", help=f"all, or a list of: {', '.join(PEERS)}")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="output folder")
    p.add_argument("--quick", action="store_true", help="tiny smoke-run settings")
    p.add_argument("--models-dir", type=Path, default=Path("/tmp/bench-models"),
                   help="where the shapes' model folders are (built when missing; the "
                        "smollm2 source lives in Switchyard's model cache)")
    p.add_argument("--make-model", type=Path, default=MAKE_MODEL, help="make_model.py to use")
    p.add_argument("--peer-timeout", type=float,
                   help="seconds per peer and shape, start-up included (default: 1800)")
    p.add_argument("--start-timeout", type=float, default=900.0,
                   help="seconds a server may take to become ready")
    p.add_argument("--bandwidth-mib", type=int, help="tensor size for the bandwidth test")
    p.add_argument("--seed", type=int, default=0, help="prompt selection seed")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads for llama.cpp and cores bound for vLLM (default: all CPUs)")
    p.add_argument("--switchyard-args", default="", help="extra `switchyard serve` arguments")
    p.add_argument("--vllm-args", default="", help="extra vLLM api_server arguments")
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                   help="weights and activations for every peer (default auto: bfloat16 "
                        "where the CPU has avx512_bf16 or amx_bf16, else float32)")
    p.add_argument("--checkpoint-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype the shapes' weights are saved in, as the real SmolLM2 and "
                        "Qwen2.5 checkpoints are (default bfloat16); peers load them in --dtype")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = resolve_dtype(args.dtype)
    return args


def make_peers(names: list[str], args: argparse.Namespace) -> list[Peer]:
    """Peer objects in the order they run."""
    factories = {
        "switchyard": lambda: SwitchyardPeer(args.switchyard_args),
        "switchyard-process": lambda: SwitchyardProcessPeer(args.switchyard_args),
        "switchyard-int8": lambda: SwitchyardQuantPeer("int8", args.switchyard_args),
        "switchyard-int4": lambda: SwitchyardQuantPeer("int4", args.switchyard_args),
        "switchyard-fp8": lambda: SwitchyardQuantPeer("fp8", args.switchyard_args),
        "switchyard-smoothquant": lambda: SwitchyardQuantPeer("smoothquant",
                                                              args.switchyard_args),
        "switchyard-gguf": lambda: SwitchyardGgufPeer(args.switchyard_args),
        "switchyard-engine": EnginePeer,
        "hf-generate": lambda: TransformersPeer("generate"),
        "hf-generate-batch": lambda: TransformersPeer("generate_batch"),
        "vllm": lambda: VllmPeer(args.vllm_args),
        "llamacpp": lambda: LlamaCppPeer(args.dtype),
        "llamacpp-bf16": lambda: LlamaCppPeer("bfloat16", name="llamacpp-bf16"),
        "llamacpp-gguf": lambda: LlamaCppPeer("stored", name="llamacpp-gguf"),
    }
    unknown = [n for n in names if n not in factories]
    if unknown:
        sys.exit(f"unknown peers {unknown}; choose from {', '.join(PEERS)}")
    return [factories[n]() for n in names]


def ensure_model(shape: str, args: argparse.Namespace) -> Path:
    """The shape's model folder in `--checkpoint-dtype`, built if it is not there yet.

    make_model.py saves fp32; a bf16 checkpoint is that model rounded to bf16
    once, in a folder of its own (`<shape>-bf16`).
    """
    folder = args.models_dir / shape
    if shape == REAL_SHAPE:
        from switchyard.models.default_model import ensure_default_model

        folder = ensure_default_model()
    elif not (folder / "config.json").exists():
        print(f"building the {shape} model into {args.models_dir} ...", flush=True)
        subprocess.run([sys.executable, str(args.make_model), shape, "--out",
                        str(args.models_dir)], check=True)
    if args.checkpoint_dtype == "float32":
        return folder
    narrowed = args.models_dir / f"{shape}-bf16"
    if not (narrowed / "config.json").exists():
        print(f"saving {folder} as bf16 into {narrowed} ...", flush=True)
        save_bf16_copy(folder, narrowed)
    return narrowed


def save_bf16_copy(source: Path, target: Path) -> None:
    """`source`'s checkpoint with every floating tensor rounded to bf16; other files copied."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    # A converted GGUF folder's kept blocks would make Switchyard serve them as
    # they are; the bf16 copy is plain bf16 for every peer.
    shutil.copytree(source, partial, ignore=shutil.ignore_patterns(
        "*.safetensors", "switchyard-gguf.json", "gguf-blocks"))
    for weights in source.glob("*.safetensors"):
        tensors = {name: t.to(torch.bfloat16) if t.is_floating_point() else t
                   for name, t in load_file(weights).items()}
        save_file(tensors, partial / weights.name, metadata={"format": "pt"})
    config = json.loads((partial / "config.json").read_text())
    config["dtype"] = "bfloat16"
    config.pop("torch_dtype", None)
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    partial.rename(target)  # only a finished folder gets the final name


def write_prompts(model_dir: Path, shape: str, count: int,
                  args: argparse.Namespace) -> tuple[list[tuple[str, int]], Path]:
    """`count` different prompts of `--prompt-tokens` tokens in the shape's own tokenizer."""
    builder = local_builder(str(model_dir), corpus_words(args.prompt_tokens), args.seed)
    rng = random.Random(args.seed)
    prompts = [builder.build(args.prompt_tokens, rng) for _ in range(count)]
    path = args.out / f"prompts-{shape}.json"
    path.write_text(json.dumps([p.text for p in prompts]))
    return [(p.text, p.tokens) for p in prompts], path


def machine() -> str:
    """One line about the machine, for the report."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = cpu_flags()
    isa = [f for f in ("avx512f", *BF16_FLAGS) if f in flags]
    no_avx512 = "AVX2, no AVX-512" if "avx2" in flags else "no AVX-512"
    # The load average says whether the numbers can be trusted: with other work on
    # the cores, spinning thread pools (OpenMP, ggml) lose far more than their share.
    load = os.getloadavg()[0]
    return (f"{cpu}, {os.cpu_count()} CPUs ({', '.join(isa) or no_avx512}), "
            f"Python {platform.python_version()}, torch {torch.__version__}, "
            f"load average {load:.1f} at start")


def run_peer(peer: Peer, shape_run: ShapeRun) -> list[Point]:
    """All rows of one peer on one shape; failures become skipped rows, never exceptions."""
    reason = peer.unavailable()
    points: list[Point] = []
    if reason is None:
        try:
            points = peer.measure(shape_run)
        except Exception as exc:  # noqa: BLE001 - any failure of a peer is a result, not a crash
            reason = f"{type(exc).__name__}: {exc}"
    measured = {p.streams for p in points}
    points += [skipped(peer.name, shape_run.shape, n, reason or "not measured")
               for n in shape_run.streams if n not in measured]
    return sorted(points, key=lambda p: p.streams)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    streams = sorted({int(s) for s in args.streams.split(",") if s})
    names = list(PEERS) if args.peers == "all" else [n for n in args.peers.split(",") if n]
    peers = make_peers(names, args)
    args.out.mkdir(parents=True, exist_ok=True)
    settings: dict[str, object] = {
        "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "streams": streams,
        "dtype": args.dtype, "checkpoint_dtype": args.checkpoint_dtype,
        "sampling": "greedy, EOS ignored", "peer_timeout_s": args.peer_timeout}
    run_report = report.RunReport(command=shlex.join([Path(sys.executable).name, *sys.argv]),
                                  machine=machine(), settings=settings)
    print(run_report.machine, flush=True)
    print(f"dtype: {args.dtype}", flush=True)
    if os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1):
        print("warning: the machine is busy; these numbers will not be representative",
              flush=True)
    try:
        run_report.bandwidth = bandwidth.measure_bandwidth(args.bandwidth_mib)
        print(f"memory read bandwidth: {run_report.bandwidth.read_gbs:.1f} GB/s", flush=True)
    except Exception as exc:  # noqa: BLE001 - no bound then, but the comparison still runs
        print(f"bandwidth measurement failed: {exc}", flush=True)
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        sys.exit(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
    for shape in shapes:
        model_dir = ensure_model(shape, args)
        gguf = None
        if shape == REAL_SHAPE:
            from switchyard.models.default_model import ensure_default_gguf

            gguf = ensure_default_gguf()
        if run_report.bandwidth is not None:
            run_report.bounds[shape] = bandwidth.decode_bound(
                model_dir, run_report.bandwidth, args.prompt_tokens, args.new_tokens,
                args.dtype, args.checkpoint_dtype)
        prompts, prompts_file = write_prompts(model_dir, shape, max(streams), args)
        for peer in peers:
            started = time.monotonic()
            print(f"[{shape}] {peer.name} ...", flush=True)
            shape_run = ShapeRun(shape=shape, model_dir=model_dir, prompts=prompts,
                                 prompts_file=prompts_file, prompt_tokens=args.prompt_tokens,
                                 new_tokens=args.new_tokens, streams=streams, out_dir=args.out,
                                 budget_s=args.peer_timeout, start_timeout_s=args.start_timeout,
                                 threads=args.threads, dtype=args.dtype, gguf=gguf)
            for point in run_peer(peer, shape_run):
                run_report.points.append(point)
                rate = point.output_tokens_per_s
                tps = "-" if rate is None else f"{rate:.1f}"
                print(f"  streams={point.streams:<3} {point.status:<8} tok/s={tps:<8} "
                      f"{point.reason}", flush=True)
            print(f"  ({time.monotonic() - started:.0f}s)", flush=True)
            report.write(run_report, args.out)
    report.write(run_report, args.out)
    print((args.out / "results.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
