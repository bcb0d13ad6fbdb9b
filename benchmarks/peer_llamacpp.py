"""llama.cpp through llama-cpp-python (`.bench-venvs/llamacpp`).

The HF folder is converted once per shape and dtype to a GGUF with llama.cpp's
own converter (bf16 for bfloat16, f32 for float32; kept in `<out>/gguf/` as
`<shape>-<outtype>.gguf`, so both are cached side by side); `stored` serves
the shape's own GGUF file instead (the real model's Q4_1 file). Batch 1 runs
in-process (`Llama.generate`, no HTTP in the way); more streams go through the
package's OpenAI-compatible server, which serves one request at a time: its
rows show what a llama.cpp Python deployment does under concurrent load, not
batched decoding.
"""

from __future__ import annotations

from pathlib import Path

from peers import VENVS, WORKERS, ServerPeer, ShapeRun, points_from_records, run_worker
from results import Point, skipped
from switchyard.bench.client import Endpoint

VENV = VENVS / "llamacpp"
PYTHON = VENV / "bin" / "python"
SOURCE = VENV / "llama.cpp"
"""vendor/llama.cpp of the sdist, linked here by benchmarks/setup_peers.sh."""
OUTTYPES = {"bfloat16": "bf16", "float32": "f32"}
"""GGUF converter `--outtype` for each torch dtype name."""
STORED = "stored"
"""Not a converter type: serve the shape's own GGUF file (``ShapeRun.gguf``)."""


class LlamaCppPeer(ServerPeer):
    """In-process at 1 stream, `llama_cpp.server` above."""

    name = "llamacpp"
    ready_path = "/v1/models"

    def __init__(self, dtype: str = "bfloat16", name: str = "llamacpp") -> None:
        self.name = name
        self.outtype = STORED if dtype == STORED else OUTTYPES[dtype]
        kind = "the GGUF file as shipped" if self.outtype == STORED else f"{self.outtype} GGUF"
        self.note = (f"{kind}; 1 stream in-process, more through llama_cpp.server "
                     "(one request at a time)")
        self.gguf: Path | None = None

    def unavailable(self) -> str | None:
        if not PYTHON.exists():
            return f"{PYTHON} not found (see benchmarks/README.md to build llama-cpp-python)"
        if not (SOURCE / "convert_hf_to_gguf.py").exists():
            return f"{SOURCE}/convert_hf_to_gguf.py not found (re-run benchmarks/setup_peers.sh)"
        return None

    def _convert(self, run: ShapeRun) -> Path:
        """The shape's GGUF, converted on first use (or its own file, for `stored`)."""
        if self.outtype == STORED:
            if run.gguf is None:
                raise RuntimeError(f"the {run.shape} shape has no GGUF source")
            return run.gguf
        # Named by the model folder: a bf16 and an fp32 checkpoint of a shape differ.
        gguf = run.out_dir / "gguf" / f"{run.model_dir.name}-{self.outtype}.gguf"
        if not gguf.exists():
            gguf.parent.mkdir(parents=True, exist_ok=True)
            partial = gguf.with_suffix(".partial")
            argv = [str(PYTHON), str(WORKERS / "llamacpp_worker.py"), "convert",
                    "--model", str(run.model_dir), "--out", str(partial),
                    "--llama-cpp", str(SOURCE), "--outtype", self.outtype]
            log = run.out_dir / "logs" / f"gguf-{run.model_dir.name}-{self.outtype}.log"
            _, problem = run_worker(argv, log, run.left_s())
            if problem or not partial.exists():
                raise RuntimeError(f"GGUF conversion failed: {problem or 'no output file'}")
            partial.rename(gguf)  # only a finished file gets the final name
        return gguf

    def _n_ctx(self, run: ShapeRun) -> int:
        return run.prompt_tokens + run.new_tokens + 64

    def measure(self, run: ShapeRun) -> list[Point]:
        self.gguf = self._convert(run)
        points: list[Point] = []
        if 1 in run.streams:
            argv = [str(PYTHON), str(WORKERS / "llamacpp_worker.py"), "run",
                    "--gguf", str(self.gguf), "--prompts", str(run.prompts_file),
                    "--new-tokens", str(run.new_tokens), "--threads", str(run.threads),
                    "--n-ctx", str(self._n_ctx(run))]
            log = run.out_dir / "logs" / f"{self.name}-{run.shape}-inproc.log"
            records, problem = run_worker(argv, log, run.left_s())
            points += points_from_records(self.name, run, [1], records, problem, self.note)
        try:
            return points + super().measure(run)
        except Exception as exc:  # noqa: BLE001 - keep the in-process row if the server fails
            reason = f"{type(exc).__name__}: {exc}"
            return points + [skipped(self.name, run.shape, n, reason)
                             for n in self.streams_here(run)]

    def streams_here(self, run: ShapeRun) -> list[int]:
        return [n for n in run.streams if n > 1]

    def command(self, run: ShapeRun, port: int) -> tuple[list[str], dict[str, str]]:
        assert self.gguf is not None
        threads = str(run.threads)
        # logits_all off: the server's default computes logits for every prompt token.
        # interrupt_requests off: by default a new request cancels the one streaming.
        argv = [str(PYTHON), str(WORKERS / "llamacpp_worker.py"), "serve",
                "--model", str(self.gguf), "--model_alias", "bench",
                "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(self._n_ctx(run)),
                "--n_threads", threads, "--n_threads_batch", threads,
                "--logits_all", "false", "--interrupt_requests", "false"]
        return argv, {}

    def endpoint(self, port: int) -> Endpoint:
        return Endpoint(url=f"http://127.0.0.1:{port}", api="openai-completions", model="bench")
