"""What a Switchyard gateway in front of a replica costs a client, measured in one run.

Starts a replica (`switchyard serve` on the built-in model, EOS ignored) and a
gateway whose config names it as a remote model's only upstream, then, with
the same client, alternates between talking to the replica directly and
through the gateway:

- added latency: sequential 1-token completions, direct and through the
  gateway in alternation; the median of each and their difference;
- throughput: `--streams` concurrent streamed completions of `--new-tokens`
  tokens each, tokens/s for each path (phases alternated `--rounds` times);
- inter-token gaps: per stream, the gaps between its events as the client's
  socket reads deliver them, p50/p90/p99 of each path, and how many events one
  read delivered on average (events that came in one read have a gap of 0:
  that is what a client sees);
- CPU: for servers this script started, the CPU time (user + system, all
  threads) the replica, the gateway and this client spent per token in the
  throughput phases, from /proc: what the relay costs where all of them share
  the same cores.

The client is a bare asyncio HTTP/1.1 client (keep-alive, one connection per
stream; asyncio sets TCP_NODELAY on every TCP socket, the servers' too): it
reads the socket as data arrives and costs far less CPU per event than an
httpx client, which on a small machine takes cores the servers need.

`--gateway-cpus` and `--replica-cpus` pin the servers (every thread; this
client goes with the replica) to measure a gateway that does not share cores.
Give `--replica-url` and `--gateway-url` to measure servers already running.

    .venv/bin/python benchmarks/gateway_overhead.py --requests 200 --streams 64 --new-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from switchyard.engine_process import parse_cpus

MODEL = "far"
LITELLM_KEY = b"sk-bench-0123456789abcdef"
"""The LiteLLM proxy's master key (it refuses to start without one)."""
LITELLM = Path(__file__).resolve().parents[1] / ".bench-venvs" / "litellm" / "bin" / "litellm"
"""Where `benchmarks/setup_peers.sh litellm` puts the proxy."""


def start_litellm(replica: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """LiteLLM's proxy in front of `replica` (OpenAI's completions, as `MODEL`), offline."""
    config = log.with_suffix(".yaml")
    config.write_text(f"model_list:\n  - model_name: {MODEL}\n    litellm_params:\n"
                      f"      model: text-completion-openai/tgi\n"
                      f"      api_base: {replica}/v1\n      api_key: \"-\"\n")
    port = _free_port()
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True",
           "LITELLM_MASTER_KEY": LITELLM_KEY.decode(), "LITELLM_LOG": "ERROR"}
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(LITELLM), "--config", str(config), "--port", str(port),
                                 "--host", "127.0.0.1"], stdout=out, stderr=subprocess.STDOUT,
                                env=env)
    url = f"http://127.0.0.1:{port}"
    return _ready(proc, url, "/health/liveliness", log), url


def _ready(proc: subprocess.Popen[bytes], url: str, path: str,
           log: Path) -> subprocess.Popen[bytes]:
    """`proc` once `url + path` answers 200 (SystemExit naming `log` if it exits or stalls)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[0]} exited: see {log}")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"not ready after 300 s: see {log}")


def _pin(pid: int, cpus: str | None) -> None:
    """Pin every thread of process `pid` to `cpus` ("0", "2-3", "0,2")."""
    if not cpus:
        return
    chosen = parse_cpus(cpus)
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), chosen)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(args: list[str], log: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    """Start `switchyard serve` with `args` on a free loopback port; wait until healthy."""
    port = _free_port()
    cmd = [sys.executable, "-m", "switchyard.cli", "serve", "--hostname", "127.0.0.1",
           "--port", str(port), *args]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    return _ready(proc, url, "/health", log), url


class _Connection:
    """One keep-alive HTTP/1.1 connection to a server, its requests one after another."""

    def __init__(self, url: str, headers: bytes = b"") -> None:
        parts = urlsplit(url)
        self.headers = headers
        """Extra header lines, each ending in CRLF (an API key)."""
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: dict[str, object],
                   on_read: list[tuple[float, bytes]] | None = None) -> tuple[int, bytes]:
        """POST `body` as JSON: the status and the body. With `on_read`, each socket read of
        the body is appended to it with the time it arrived (a chunked body's framing removed)."""
        payload = json.dumps(body).encode()
        request = (b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json"
                   b"\r\n%scontent-length: %d\r\n\r\n%s" % (
                       path.encode(), self.host.encode(), self.port, self.headers,
                       len(payload), payload))
        for fresh in (False, True):
            if fresh or self.writer is None or self.writer.is_closing():
                self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
            assert self.reader is not None and self.writer is not None
            self.writer.write(request)
            try:
                head = await self.reader.readuntil(b"\r\n\r\n")
                break
            except (asyncio.IncompleteReadError, ConnectionResetError):
                if fresh:  # a new connection that closes at once: the server is gone
                    raise
                # The server closed this idle keep-alive connection: once more on a new one.
                self.writer.close()
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in
                   (line.partition(":") for line in lines[1:] if line)}
        if "content-length" in headers:
            content = await self.reader.readexactly(int(headers["content-length"]))
            if on_read is not None:
                on_read.append((time.perf_counter(), content))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            content = await self._chunked(on_read)
        else:
            content = await self.reader.read()
            self.writer.close()
        if headers.get("connection", "").lower() == "close":
            self.writer.close()
        return status, content

    async def _chunked(self, on_read: list[tuple[float, bytes]] | None) -> bytes:
        assert self.reader is not None
        buffer, out, done = b"", [], False
        while not done:
            data = await self.reader.read(1 << 16)
            now = time.perf_counter()
            if not data:
                raise ConnectionError("closed in the middle of a chunked body")
            buffer += data
            got = []
            while True:  # every whole chunk in the buffer
                line_end = buffer.find(b"\r\n")
                if line_end < 0:
                    break
                size = int(buffer[:line_end].split(b";")[0], 16)
                if size == 0:
                    if buffer.find(b"\r\n", line_end + 2) < 0:  # the trailers' blank line
                        break
                    done = True
                    break
                if len(buffer) < line_end + 2 + size + 2:
                    break
                got.append(buffer[line_end + 2:line_end + 2 + size])
                buffer = buffer[line_end + 2 + size + 2:]
            if got:
                out.extend(got)
                if on_read is not None:
                    on_read.append((now, b"".join(got)))
        return b"".join(out)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _latency(conn: _Connection, model: str) -> float:
    t0 = time.perf_counter()
    status, _ = await conn.post("/v1/completions", {
        "model": model, "prompt": "hello", "max_tokens": 1, "temperature": 0})
    if status != 200:
        raise SystemExit(f"a completion answered {status}")
    return time.perf_counter() - t0


async def _stream(conn: _Connection, model: str, tokens: int, gaps: list[float],
                  per_read: list[int]) -> int:
    """One streamed completion: its token events (not `[DONE]`); each event's gap from the
    one before it, by the time of the read that completed it."""
    reads: list[tuple[float, bytes]] = []
    status, _ = await conn.post("/v1/completions", {
        "model": model, "prompt": "def fibonacci(n):", "max_tokens": tokens,
        "temperature": 0, "stream": True}, on_read=reads)
    if status != 200:
        raise SystemExit(f"a stream answered {status}")
    count, last, pending = 0, None, b""
    for at, data in reads:
        pending += data
        *events, pending = pending.replace(b"\r\n", b"\n").split(b"\n\n")
        tokens_here = sum(1 for e in events if e.startswith(b"data:") and b"[DONE]" not in e)
        if not tokens_here:
            continue
        per_read.append(tokens_here)
        for _ in range(tokens_here):
            if last is not None:
                gaps.append(at - last)
            last = at
        count += tokens_here
    return count


async def _throughput(conns: list[_Connection], model: str, tokens: int,
                      gaps: list[float], per_read: list[int]) -> tuple[int, float]:
    """Tokens streamed by every connection at once, and the seconds it took."""
    t0 = time.perf_counter()
    counts = await asyncio.gather(*(_stream(c, model, tokens, gaps, per_read) for c in conns))
    return sum(counts), time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system, every thread) a process has used; this one's for None."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / _TICK


async def measure(replica: str, gateway: str, requests: int, streams: int, tokens: int,
                  rounds: int, pids: dict[str, int | None] | None = None,
                  litellm: str | None = None) -> dict[str, object]:
    """Run every phase against every path; the numbers as one record.

    ``pids``: the replica's, the gateway's (and LiteLLM's) process ids, to count their CPU
    time. ``litellm``: a LiteLLM proxy serving the replica as `MODEL`, a third path."""
    paths = {"direct": (replica, "tgi", b""), "gateway": (gateway, MODEL, b"")}
    if litellm is not None:
        paths["litellm"] = (litellm, MODEL, b"authorization: Bearer %s\r\n" % LITELLM_KEY)
    pids = pids or {}
    processes = {who: pids.get(who) for who in ("replica", "gateway", "litellm")}
    single = {name: _Connection(url, auth) for name, (url, _, auth) in paths.items()}
    pools = {name: [_Connection(url, auth) for _ in range(streams)]
             for name, (url, _, auth) in paths.items()}
    try:
        for name, (_, model, _) in paths.items():  # warm: connections, the engine's first steps
            for _ in range(5):
                await _latency(single[name], model)
            await _throughput(pools[name], model, tokens, [], [])
        latency: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(requests):
            for name, (_, model, _) in paths.items():
                latency[name].append(await _latency(single[name], model))
        made = {name: 0 for name in paths}
        took = {name: 0.0 for name in paths}
        gaps: dict[str, list[float]] = {name: [] for name in paths}
        per_read: dict[str, list[int]] = {name: [] for name in paths}
        cpu = {name: {who: 0.0 for who in (*processes, "client")} for name in paths}
        for _ in range(rounds):
            for name, (_, model, _) in paths.items():
                before = {who: _cpu_s(pid) for who, pid in processes.items() if pid}
                before["client"] = _cpu_s(None)
                count, seconds = await _throughput(pools[name], model, tokens, gaps[name],
                                                   per_read[name])
                made[name] += count
                took[name] += seconds
                for who, pid in (*processes.items(), ("client", None)):
                    if who in before:
                        cpu[name][who] += _cpu_s(pid) - before[who]
    finally:
        for conn in (*single.values(), *(c for pool in pools.values() for c in pool)):
            conn.close()
    out: dict[str, object] = {"requests": requests, "streams": streams, "new_tokens": tokens,
                              "rounds": rounds, "load_average": os.getloadavg()}
    rate = {name: made[name] / took[name] for name in paths}
    for name in paths:
        out[name] = {
            "latency_median_ms": statistics.median(latency[name]) * 1000,
            "tokens_per_s": rate[name],
            "itl_p50_ms": _pct(gaps[name], 0.5) * 1000,
            "itl_p90_ms": _pct(gaps[name], 0.9) * 1000,
            "itl_p99_ms": _pct(gaps[name], 0.99) * 1000,
            "itl_mean_ms": statistics.fmean(gaps[name]) * 1000 if gaps[name] else float("nan"),
            "events_per_read": statistics.fmean(per_read[name]) if per_read[name] else 0.0,
            "cpu_us_per_token": {who: round(seconds / made[name] * 1e6, 1)
                                 for who, seconds in cpu[name].items()
                                 if who == "client" or processes.get(who)},
        }
    for name in paths:
        if name == "direct":
            continue
        added = [g - d for d, g in zip(latency["direct"], latency[name], strict=True)]
        suffix = "" if name == "gateway" else f"_{name}"
        out[f"added_latency_median_ms{suffix}"] = statistics.median(added) * 1000
        out[f"throughput_ratio{suffix}"] = rate[name] / rate["direct"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replica-url", help="A running replica (else one is started).")
    parser.add_argument("--gateway-url", help=f"A running gateway serving it as `{MODEL}`.")
    parser.add_argument("--requests", type=int, default=200, help="Latency pairs.")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6, help="Throughput phases per path.")
    parser.add_argument("--threads", default="1", help="The replica's engine num_threads.")
    parser.add_argument("--gateway-cpus", help="Pin the gateway to these CPUs, e.g. 1.")
    parser.add_argument("--replica-cpus", help="Pin the replica and this client, e.g. 0.")
    parser.add_argument("--litellm", action="store_true",
                        help="Also measure LiteLLM's proxy in front of the replica, a third "
                             "path (benchmarks/setup_peers.sh litellm installs it).")
    parser.add_argument("--out", help="Write the record as JSON here too.")
    args = parser.parse_args()
    procs = []
    litellm = None
    pids: dict[str, int | None] = {}
    logs = Path(tempfile.mkdtemp(prefix="gateway-overhead-"))
    replica, gateway = args.replica_url, args.gateway_url
    try:
        if replica is None:
            proc, replica = serve(["--model-id", "switchyard/tiny-llama-random",
                                   "--engine-option", f"num_threads={args.threads}",
                                   "--max-concurrent-requests", "512"], logs / "replica.log",
                                  {"TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"})
            procs.append(proc)
            pids["replica"] = proc.pid
            _pin(proc.pid, args.replica_cpus)
            _pin(os.getpid(), args.replica_cpus)
        if gateway is None:
            config = logs / "models.toml"
            config.write_text(f'[[models]]\nname = "{MODEL}"\nupstreams = ["{replica}"]\n'
                              "max_concurrent_requests = 512\n")
            proc, gateway = serve(["--config", str(config)], logs / "gateway.log", {})
            procs.append(proc)
            pids["gateway"] = proc.pid
            _pin(proc.pid, args.gateway_cpus)
        if args.litellm:
            if not LITELLM.exists():
                raise SystemExit(f"no {LITELLM}: run benchmarks/setup_peers.sh litellm")
            proc, litellm = start_litellm(replica, logs / "litellm.log")
            procs.append(proc)
            pids["litellm"] = proc.pid
            _pin(proc.pid, args.gateway_cpus)
        record = asyncio.run(measure(replica, gateway, args.requests, args.streams,
                                     args.new_tokens, args.rounds, pids, litellm))
        if args.gateway_cpus or args.replica_cpus:
            record["cpus"] = {"gateway": args.gateway_cpus, "replica": args.replica_cpus}
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
