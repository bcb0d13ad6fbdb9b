"""What metrics, traces and request logs cost: Xeon throughput with telemetry off vs on.

Run from the repository root with Switchyard's venv:

    .venv/bin/python benchmarks/telemetry_overhead.py --rounds 5 --duration 20

It starts the same `switchyard serve` once per variant on the default model,
side by side on loopback, EOS ignored so every request generates exactly
`--new-tokens`:

- off: `--disable-telemetry` (no request records, no step observer, no spans,
  no request log lines);
- metrics: the default: metrics and the per-request log line (INFO);
- on: metrics, request log lines and tracing, exported over OTLP/HTTP to a
  collector this script runs (it answers 200 and counts the exports).

Then it runs measured phases in rotating order (off, metrics, on / metrics,
on, off / ...) so that drift of a shared, noisy machine falls on all alike:
each phase runs `--concurrency` closed-loop streaming clients
(`switchyard.bench`'s TGI client on `/generate_stream`) for `--duration`
seconds and reports output tokens/s and the server's CPU time per 1000 tokens
(user + system, all its threads, from /proc); idle servers wait on an empty
queue meanwhile. The servers run on `--server-cpus` and this client on the
other CPUs, so that the client does not preempt the engine's threads. Per
variant: the median rate, the median of the per-round ratios to the baseline
(a round's phases are adjacent in time) and the median CPU per token.

On a shared, busy machine those move by more than the 2% in question, so the
script also accounts for the cost directly: it measures, in its own process,
the CPU that telemetry's code takes per request (middleware around a stream,
metrics, the JSON log line, spans and their OTLP export) and per engine step,
and sets it against the server CPU a token takes at the measured steps per
token. Prints a table, writes JSON with `--json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NamedTuple

import httpx

try:
    from switchyard.bench.client import Endpoint, RequestSpec, send
except ImportError as exc:
    sys.exit(f"cannot import switchyard ({exc}): run it with Switchyard's .venv/bin/python")

ROOT = Path(__file__).resolve().parents[1]


class _Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP endpoint that accepts every export and counts them."""

    exports: Any = None  # multiprocessing.Value("q"), set in its process
    received: Any = None

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        with self.exports.get_lock():
            self.exports.value += 1
            self.received.value += len(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _serve_collector(port: Any, exports: Any, received: Any) -> None:
    _Collector.exports, _Collector.received = exports, received
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    port.value = httpd.server_address[1]
    httpd.serve_forever()


class Collector:
    """The OTLP collector, in a process of its own: its CPU is nobody's overhead."""

    def __init__(self) -> None:
        self.exports, self.received = multiprocessing.Value("q", 0), multiprocessing.Value("q", 0)
        port = multiprocessing.Value("i", 0)
        self.process = multiprocessing.Process(
            target=_serve_collector, args=(port, self.exports, self.received), daemon=True)
        self.process.start()
        while not port.value:
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{port.value}"

    def stop(self) -> None:
        """End the collector's process."""
        self.process.terminate()
        self.process.join()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(name: str, extra: list[str], log_dir: Path,
                 cpus: set[int]) -> tuple[subprocess.Popen[bytes], str]:
    """`switchyard serve` on `cpus` and a free port; returns once `/health` answers 200."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"}
    argv = [sys.executable, "-m", "switchyard.cli", "serve", "--hostname", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--max-total-tokens", "1024", *extra]
    log = (log_dir / f"{name}.log").open("wb")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} server exited; see {log_dir / f'{name}.log'}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.terminate()
    raise RuntimeError(f"{name} server never became ready")


class Phase(NamedTuple):
    """One measured phase: tokens/s and the server's CPU seconds per 1000 tokens."""

    rate: float
    cpu_per_ktok: float
    """All threads."""
    other_cpu_per_ktok: float
    """All threads but the busiest one (the engine loop): the event loop, exporters."""


def thread_cpu(pid: int) -> dict[str, float]:
    """User + system CPU seconds of each thread of process `pid` so far."""
    tick = os.sysconf("SC_CLK_TCK")
    times = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        times[tid] = (int(fields[11]) + int(fields[12])) / tick
    return times


def run_phase(proc: subprocess.Popen[bytes], url: str, args: argparse.Namespace,
              spec: RequestSpec, duration: float) -> Phase:
    """Load the server for `duration` seconds; what it delivered and what it spent."""
    before = thread_cpu(proc.pid)
    tokens, elapsed = asyncio.run(measure(url, args.concurrency, duration, spec))
    after = thread_cpu(proc.pid)
    spent = sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)
    per_ktok = 1000 / tokens if tokens else 0.0
    return Phase(rate=tokens / elapsed, cpu_per_ktok=sum(spent) * per_ktok,
                 other_cpu_per_ktok=sum(spent[1:]) * per_ktok)


async def measure(url: str, concurrency: int, duration: float,
                  spec: RequestSpec) -> tuple[int, float]:
    """Output tokens and seconds of `concurrency` closed-loop streams for `duration` seconds."""
    endpoint = Endpoint(url=url, api="tgi")
    tokens = 0
    errors = 0
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(
            max_connections=concurrency * 2)) as client:
        begin = time.perf_counter()
        stop = begin + duration

        async def user() -> None:
            nonlocal tokens, errors
            while time.perf_counter() < stop:
                result = await send(client, endpoint, spec, time.perf_counter())
                tokens += result.output_tokens
                errors += result.error is not None

        await asyncio.gather(*(user() for _ in range(concurrency)))
        elapsed = time.perf_counter() - begin
    if errors:
        raise RuntimeError(f"{errors} requests failed against {url}")
    return tokens, elapsed


def _cpu_list(text: str) -> set[int]:
    """`0-3,6` as {0, 1, 2, 3, 6}."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


class Costs(NamedTuple):
    """CPU seconds telemetry adds, per request (of `tokens` streamed events) and per step."""

    per_request: float
    per_step: float


def telemetry_costs(otlp: str, tokens: int, n: int = 300, repeats: int = 3) -> Costs:
    """Measure, in this process, the CPU that telemetry adds to a server's work.

    Per request: the middleware around a stream of `tokens` events (against the
    same app without it), the sequence's record, and `Telemetry.finish` with
    metrics, the JSON request log line (to /dev/null) and spans exported by the
    real OTLP/HTTP exporter to `otlp` (its background thread included: this is
    process CPU time, flushed at the end). Per step: a `StepReport` to the
    metrics observer. `n` requests' spans fit the span processor's queue (2048),
    so none is dropped unexported. Each figure is the least of `repeats` runs,
    as `timeit` advises: what other load adds is noise, never a saving.
    """
    import logging

    from switchyard.telemetry import Telemetry, Tracing
    from switchyard.telemetry.logs import JsonFormatter
    from switchyard.telemetry.request import note_model, note_sequence
    from switchyard_spec import StepReport

    request_log = logging.getLogger("switchyard.request")
    handler = logging.StreamHandler(open(os.devnull, "w"))  # noqa: SIM115 - process lifetime
    handler.setFormatter(JsonFormatter())
    request_log.addHandler(handler)
    request_log.setLevel(logging.INFO)
    request_log.propagate = False
    scope = {"type": "http", "method": "POST", "path": "/generate_stream", "headers": []}
    body = {"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True}

    async def app(scope: dict, receive: object, send: Any) -> None:
        note_model("m", "xeon")
        seq = note_sequence((1, 2, 3), tokens)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(tokens):
            await send(body)
        if seq is not None:
            seq.first(0.001)
            seq.end(tokens, "length")
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def sink(message: object) -> None:
        pass

    async def drive(target: Any) -> None:
        for _ in range(n):
            await target(scope, None, sink)

    def cpu_of_requests(with_telemetry: bool) -> float:
        telemetry = Telemetry(list, Tracing.otlp(otlp, "overhead"))
        telemetry.metrics.add_model(4095, 4096)
        target = telemetry.middleware()[0](app) if with_telemetry else app  # type: ignore
        begin = time.process_time()
        asyncio.run(drive(target))
        telemetry.shutdown()  # flush the spans: their export is part of the cost
        return time.process_time() - begin

    cpu_of_requests(True)  # warm: imports, first connection
    per_request = min(cpu_of_requests(True) - cpu_of_requests(False)
                      for _ in range(repeats)) / n
    observe = Telemetry(list).metrics.step_observer("m", "xeon")
    report = StepReport(method="decode", batch_size=8, prefill_tokens=0, decode_tokens=8,
                        seconds=0.004, kv_tokens_used=128, kv_tokens_total=4096)

    def cpu_of_steps() -> float:
        begin = time.process_time()
        for _ in range(n * 100):
            observe(report)
        return time.process_time() - begin

    per_step = min(cpu_of_steps() for _ in range(repeats)) / (n * 100)
    return Costs(per_request=per_request, per_step=per_step)


def steps_per_token(url: str) -> float:
    """Forward steps per generated token over the server's life, from its /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    steps = tokens = 0.0
    for line in text.splitlines():
        if line.startswith("tgi_batch_inference_count{"):
            steps += float(line.rsplit(" ", 1)[1])
        elif line.startswith("tgi_request_generated_tokens_sum{"):
            tokens += float(line.rsplit(" ", 1)[1])
    return steps / tokens if tokens else 0.0


VARIANTS = {
    "off": ["--disable-telemetry"],
    "metrics": [],
    "on": ["--otlp-endpoint", "{otlp}"],
}
"""Server flags per variant: nothing recorded; metrics and request logs (the default);
metrics, request logs and traces exported over OTLP."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="phases per variant")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--variants", default="off,metrics,on",
                        help=f"which of {', '.join(VARIANTS)} to run; the first is the baseline")
    parser.add_argument("--server-cpus", default=None,
                        help="CPUs for the servers, e.g. 0-6 (default: all but the last one)")
    parser.add_argument("--model-id", default="switchyard/tiny-llama-random",
                        help="the model of every server (default: the random-weight model)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    model_flags = ["--model-id", args.model_id] if args.model_id else []
    names = args.variants.split(",")

    cpus = sorted(os.sched_getaffinity(0))
    server_cpus = _cpu_list(args.server_cpus) if args.server_cpus else set(cpus[:-1] or cpus)
    client_cpus = set(cpus) - server_cpus or set(cpus)
    os.sched_setaffinity(0, client_cpus)

    collector = Collector()
    otlp = collector.url
    log_dir = Path(tempfile.mkdtemp(prefix="telemetry-overhead-"))
    prompt = " ".join(["word"] * args.prompt_words)
    spec = RequestSpec(prompt=prompt, prompt_tokens=args.prompt_words,
                       max_tokens=args.new_tokens)

    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    results: dict[str, list[Phase]] = {name: [] for name in names}
    try:
        for name in names:
            flags = [flag.format(otlp=otlp) for flag in VARIANTS[name]] + model_flags
            servers[name] = start_server(name, flags, log_dir, server_cpus)
        for proc, url in servers.values():  # warm all: caches, allocator, first requests
            run_phase(proc, url, args, spec, 3.0)
        for round_index in range(args.rounds):
            shift = round_index % len(names)  # each variant takes each place in turn
            for name in names[shift:] + names[:shift]:
                phase = run_phase(*servers[name], args, spec, args.duration)
                results[name].append(phase)
                print(f"round {round_index + 1} {name:>7}: {phase.rate:8.1f} tok/s, "
                      f"server CPU {phase.cpu_per_ktok:.3f} s per 1000 tokens "
                      f"({phase.other_cpu_per_ktok:.3f} s outside the engine loop)", flush=True)
        observed = next((n for n in ("on", "metrics") if n in servers), None)
        step_ratio = steps_per_token(servers[observed][1]) if observed else 0.0
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)

    base = names[0]
    summary = {}
    print(f"\n{args.rounds} rounds x {args.duration:g}s, {args.concurrency} streams, "
          f"{args.new_tokens} new tokens; servers on CPUs {sorted(server_cpus)}, client on "
          f"{sorted(client_cpus)}; OTLP exports received: {collector.exports.value} "
          f"({collector.received.value} bytes); logs in {log_dir}")
    print(f"{'variant':>8} {'tok/s':>8} {'drop':>7} {'paired':>7} {'CPU s/1k tok':>13} "
          f"{'extra':>7} {'non-engine':>10}")
    for name in names:
        rates = [p.rate for p in results[name]]
        ratios = [p.rate / b.rate for p, b in zip(results[name], results[base], strict=True)]
        cpu = statistics.median(p.cpu_per_ktok for p in results[name])
        other = statistics.median(p.other_cpu_per_ktok for p in results[name])
        base_cpu = statistics.median(p.cpu_per_ktok for p in results[base])
        rate, base_rate = statistics.median(rates), statistics.median(
            p.rate for p in results[base])
        summary[name] = {
            "rates": rates, "cpu_s_per_1000_tokens": [p.cpu_per_ktok for p in results[name]],
            "median_rate": rate, "drop_percent": (1 - rate / base_rate) * 100,
            "paired_drop_percent": (1 - statistics.median(ratios)) * 100,
            "median_cpu_s_per_1000_tokens": cpu, "cpu_extra_percent": (cpu / base_cpu - 1) * 100,
            "median_non_engine_cpu_s_per_1000_tokens": other,
        }
        row = summary[name]
        print(f"{name:>8} {rate:8.1f} {row['drop_percent']:+6.2f}% "
              f"{row['paired_drop_percent']:+6.2f}% {cpu:13.3f} {row['cpu_extra_percent']:+6.2f}% "
              f"{other:10.3f}")
    print("drop: of the median rate; paired: median of per-round ratios to the baseline; "
          "extra: server CPU per token over the baseline's; non-engine: CPU s per 1000 tokens "
          "of all threads but the engine loop (event loop, span export)")
    # The same cost by accounting: what telemetry's own code takes per request and per
    # step, measured here, at the rates the servers ran (steady where the above is not).
    costs = telemetry_costs(otlp, args.new_tokens)
    collector.stop()
    base_cpu = statistics.median(p.cpu_per_ktok for p in results[base]) / 1000
    per_token = costs.per_request / args.new_tokens + costs.per_step * step_ratio
    accounted = per_token / base_cpu * 100
    print(f"accounted: {costs.per_request * 1e6:.0f} us per request ({args.new_tokens} events, "
          f"metrics, log line, spans + OTLP export), {costs.per_step * 1e6:.1f} us per step "
          f"x {step_ratio:.3f} steps per token = {per_token * 1e6:.2f} us per token, "
          f"{accounted:.2f}% of the {base_cpu * 1e6:.0f} us of server CPU a token takes")
    summary["accounted"] = {"us_per_request": costs.per_request * 1e6,
                            "us_per_step": costs.per_step * 1e6, "steps_per_token": step_ratio,
                            "percent_of_server_cpu": accounted}
    if args.json is not None:
        args.json.write_text(json.dumps({
            "variants": summary, "rounds": args.rounds, "duration_s": args.duration,
            "concurrency": args.concurrency, "new_tokens": args.new_tokens,
            "model_id": args.model_id or "default",
            "otlp_exports": collector.exports.value}, indent=2))


if __name__ == "__main__":
    main()
