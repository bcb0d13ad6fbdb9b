"""What the HTTP side costs the engine at 32 streams: engine thread vs engine process.

Three runs of the same decode work (the harness forward path on the 135M
shape, N streams of --new tokens each, greedy, EOS ignored):

- ``alone``: the engine loop with no-op sinks, no server (the engine's own cost);
- ``thread``: the real gateway app (Litestar + uvicorn, TGI /generate_stream,
  incremental detokenizer, SSE) with the engine loop in a thread of the server
  process, as the Xeon engine is today;
- ``process``: the same app, the engine loop in a child process, requests and
  per-step event batches crossing one pipe as msgspec msgpack.

The clients run in a separate process (raw asyncio HTTP, no parsing beyond
counting events). Reported per run: median decode-step time at full batch,
tokens/s seen by the clients, and CPU seconds per generated token of the
server process's threads (event loop vs engine vs OpenMP workers).

  nice -n 5 .venv/bin/python benchmarks/cpu_path/gateway_cost.py --streams 32 --new 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common  # noqa: E402  (sys.path for the gateway and spec packages)


def set_thread_name(name: str) -> None:
    """Name the calling OS thread (shows in /proc/self/task/*/comm); threads it creates inherit it."""
    import ctypes
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except Exception:
        pass


MARKED: dict[int, str] = {}
"""Native thread ids with a label of their own (the engine loop thread itself)."""


def thread_cpu() -> dict[str, float]:
    """CPU seconds per thread of this process, by thread name (comm)."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as fh:
                raw = fh.read()
        except OSError:
            continue
        name = raw[raw.index("(") + 1: raw.rindex(")")]
        if int(tid) in MARKED:
            name = MARKED[int(tid)]
        elif name == "engine":
            name = "omp-workers"
        fields = raw[raw.rindex(")") + 2:].split()
        secs = (int(fields[11]) + int(fields[12])) / tick
        out[f"{name}:{tid}"] = secs
    return out


# --------------------------------------------------------------------------- engine loop
class Loop:
    """The engine's compute loop over the harness runner: admit, prefill, decode, emit."""

    def __init__(self, model_path: str, variant: str, threads: int, full_batch: int) -> None:
        import torch
        import decode
        torch.set_num_threads(threads)
        self.torch = torch
        self.model, self.runner = decode.build(model_path, variant)
        self.full = full_batch
        self.step_times: list[float] = []

    def run(self, inbox, emit, stop: threading.Event) -> None:
        """``inbox``: queue of (request_id, prompt ids, max_new); ``emit(list of (id, token, done))``."""
        import harness
        torch = self.torch
        set_thread_name("engine")
        MARKED[threading.get_native_id()] = "engine-loop"
        torch.set_num_threads(torch.get_num_threads())
        running: list[tuple[str, harness.Seq, int]] = []
        with torch.inference_mode():
            while not stop.is_set():
                new = []
                try:
                    item = inbox.get(timeout=0.2) if not running else inbox.get_nowait()
                    while True:
                        if item is None:
                            return
                        new.append(item)
                        item = inbox.get_nowait()
                except queue.Empty:
                    pass
                batch_new = [(rid, harness.Seq(tokens=list(p)), n) for rid, p, n in new]
                for i in range(0, len(batch_new), 8):
                    chunk = batch_new[i:i + 8]
                    toks = self.runner.step([s for _, s, _ in chunk])
                    emit([(rid, t, n <= 1) for (rid, _, n), t in zip(chunk, toks)])
                    running.extend((rid, s, n) for rid, s, n in chunk if n > 1)
                if not running:
                    continue
                t0 = time.perf_counter()
                toks = self.runner.step([s for _, s, _ in running])
                dt = time.perf_counter() - t0
                if len(running) == self.full:
                    self.step_times.append(dt)
                events, keep = [], []
                for (rid, s, n), t in zip(running, toks):
                    done = s.generated_count() >= n
                    events.append((rid, t, done))
                    if done:
                        self.runner.release(s)
                    else:
                        keep.append((rid, s, n))
                running = keep
                emit(events)


def _seq_generated(self):
    return len(self.tokens) - self.prompt_len


def _patch_seq():
    import harness
    if not hasattr(harness.Seq, "generated_count"):
        orig_init = harness.Seq.__init__

        def init(self, *a, **kw):
            orig_init(self, *a, **kw)
            self.prompt_len = len(self.tokens)
        harness.Seq.__init__ = init
        harness.Seq.generated_count = _seq_generated


# --------------------------------------------------------------------------- engines
def make_engine_class():
    from switchyard_spec import (Engine, EngineStats, FinishReason, TokenEvent, WarmupReport)

    class _Base(Engine):
        def __init__(self) -> None:
            self.sinks: dict[str, object] = {}
            self.prompt_lens: dict[str, int] = {}

        def start(self):
            raise NotImplementedError

        def warmup(self):
            return WarmupReport(seconds=0, max_batch_total_tokens=1 << 20, max_batch_size=64)

        def abort(self, request_id: str) -> None:
            pass

        def stats(self) -> EngineStats:
            return EngineStats(running=len(self.sinks), waiting=0)

        def healthy(self) -> bool:
            return True

        def probe_liveness(self, timeout: float = 30.0) -> bool:
            return True

        def deliver(self, events) -> None:
            for rid, tok, done in events:
                sink = self.sinks.get(rid)
                if sink is None:
                    continue
                sink(TokenEvent(request_id=rid, token_id=tok, logprob=0.0,
                                finish_reason=FinishReason.LENGTH if done else None,
                                prompt_tokens=self.prompt_lens.get(rid, 0)))
                if done:
                    self.sinks.pop(rid, None)

    class ThreadEngine(_Base):
        """The engine loop in a thread of the server process (today's design)."""

        def __init__(self, loop: Loop) -> None:
            super().__init__()
            self.loop = loop
            self.inbox: queue.SimpleQueue = queue.SimpleQueue()
            self.stop = threading.Event()
            self.thread = threading.Thread(target=loop.run, args=(self.inbox, self.deliver, self.stop),
                                           name="engine", daemon=True)
            self.thread.start()

        def submit(self, request, sink) -> None:
            self.sinks[request.request_id] = sink
            self.prompt_lens[request.request_id] = len(request.prompt_token_ids)
            self.inbox.put((request.request_id, request.prompt_token_ids,
                            request.stopping.max_new_tokens))

        def shutdown(self) -> None:
            self.stop.set()
            self.inbox.put(None)

    class ProcessEngine(_Base):
        """The engine loop in a child process; requests and per-step event batches over a pipe."""

        def __init__(self, args) -> None:
            super().__init__()
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_child_main, args=(child, args.model, args.variant,
                                                              args.threads, args.streams),
                                    name="engine-proc", daemon=True)
            self.proc.start()
            assert self.conn.recv_bytes() == b"ready"
            self.lock = threading.Lock()
            self.reader = threading.Thread(target=self._read, name="engine-reader", daemon=True)
            self.reader.start()
            self.child_stats = None

        def _read(self) -> None:
            import msgspec
            set_thread_name("pipe-reader")
            dec = msgspec.msgpack.Decoder()
            while True:
                try:
                    raw = self.conn.recv_bytes()
                except (EOFError, OSError):
                    return
                msg = dec.decode(raw)
                if isinstance(msg, dict):
                    self.child_stats = msg
                    return
                self.deliver(msg)

        def submit(self, request, sink) -> None:
            import msgspec
            self.sinks[request.request_id] = sink
            self.prompt_lens[request.request_id] = len(request.prompt_token_ids)
            with self.lock:
                self.conn.send_bytes(msgspec.msgpack.encode(
                    [request.request_id, list(request.prompt_token_ids),
                     request.stopping.max_new_tokens]))

        def shutdown(self) -> None:
            with self.lock:
                self.conn.send_bytes(b"\xc0")  # msgpack nil: stop
            self.reader.join(timeout=30)

    return ThreadEngine, ProcessEngine


def _child_main(conn, model, variant, threads, streams) -> None:
    import msgspec
    _patch_seq()
    loop = Loop(model, variant, threads, streams)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder()
    send_lock = threading.Lock()

    def emit(events):
        with send_lock:
            conn.send_bytes(enc.encode(events))

    def read():
        set_thread_name("pipe-reader")
        while True:
            msg = dec.decode(conn.recv_bytes())
            if msg is None:
                inbox.put(None)
                return
            inbox.put((msg[0], msg[1], msg[2]))

    threading.Thread(target=read, daemon=True).start()
    conn.send_bytes(b"ready")
    c0 = thread_cpu()
    loop.run(inbox, emit, stop)
    c1 = thread_cpu()
    conn.send_bytes(enc.encode({"step_times": loop.step_times,
                                "threads": {k: v - c0.get(k, 0.0) for k, v in c1.items()}}))


# --------------------------------------------------------------------------- server
def serve(args) -> None:
    import uvicorn
    from switchyard.app import create_app
    from switchyard.models.served import Admission, ServedModel
    from switchyard.settings import ServeSettings, TokenLimits
    from switchyard.text import load_tokenizer
    from switchyard_spec import DeviceInfo, EngineSpec, ModelInfo

    _patch_seq()
    ThreadEngine, ProcessEngine = make_engine_class()
    tokenizer = load_tokenizer(Path(args.model))
    if args.mode == "thread":
        engine = ThreadEngine(Loop(args.model, args.variant, args.threads, args.streams))
    else:
        engine = ProcessEngine(args)
    model = ServedModel(
        name="bench", model_id="bench", tokenizer=tokenizer, engine=engine,
        engine_spec=EngineSpec(name="harness", description="harness", factory=lambda c: engine,
                               probe=lambda: DeviceInfo(available=True, name="cpu")),
        info=ModelInfo(model_type="llama", dtype="bfloat16", vocab_size=tokenizer.vocab_size,
                       max_position_embeddings=8192, eos_token_ids=(), device="cpu"),
        limits=TokenLimits(max_input_tokens=2048, max_total_tokens=4096),
        admission=Admission(limit=256),
    )
    app = create_app(ServeSettings(log_level="warning"), loader=lambda s, p: model,
                     plugins=__import__("switchyard.plugins", fromlist=["PluginHost"]).PluginHost())
    set_thread_name("event-loop")
    cpu0 = thread_cpu()
    latest: dict[str, float] = {}
    sampling = threading.Event()

    def sample():  # threads that end (the engine's, at the app's shutdown) keep their last value
        while not sampling.wait(0.25):
            latest.update(thread_cpu())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    wall0 = time.perf_counter()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    wall = time.perf_counter() - wall0
    sampling.set()
    sampler.join()
    latest.update(thread_cpu())
    cpu1 = latest
    engine.shutdown()
    stats = {"threads": {k: cpu1[k] - cpu0.get(k, 0.0) for k in cpu1}, "wall": wall}
    if args.mode == "thread":
        stats["step_times"] = engine.loop.step_times
    else:
        stats["step_times"] = (engine.child_stats or {}).get("step_times", [])
        stats["child_threads"] = (engine.child_stats or {}).get("threads", {})
    Path(args.stats).write_text(json.dumps(stats))


# --------------------------------------------------------------------------- client
async def _stream(port: int, body: bytes) -> tuple[int, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /generate_stream HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()
    events = 0
    t0 = time.perf_counter()
    tail = b""
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            break
        data = tail + chunk
        events += data.count(b"data:") - tail.count(b"data:")
        tail = data[-8:]
    writer.close()
    return events, time.perf_counter() - t0


async def _clients(port: int, streams: int, prompt: str, new: int) -> dict:
    body = json.dumps({"inputs": prompt, "parameters": {"max_new_tokens": new}}).encode()
    t0 = time.perf_counter()
    res = await asyncio.gather(*(_stream(port, body) for _ in range(streams)))
    wall = time.perf_counter() - t0
    tokens = sum(r[0] for r in res)
    return {"tokens": tokens, "wall": wall, "tok_s": tokens / wall}


def client(args) -> None:
    from switchyard.text import load_tokenizer
    tok = load_tokenizer(Path(args.model))
    text = (Path(os.__file__).read_text()[:20000])
    ids = tok.encode(text) if hasattr(tok, "encode") else tok.tokenizer.encode(text).ids
    prompt = tok.decode(ids[: args.prompt]) if hasattr(tok, "decode") else text[:600]
    res = asyncio.run(_clients(args.port, args.streams, prompt, args.new))
    print(json.dumps(res))


# --------------------------------------------------------------------------- orchestration
def alone(args) -> dict:
    _patch_seq()
    loop = Loop(args.model, args.variant, args.threads, args.streams)
    import harness
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()
    vocab = loop.model.config.vocab_size
    for i, s in enumerate(harness.make_prompts(args.streams, args.prompt, vocab)):
        inbox.put((f"r{i}", s.tokens, args.new))
    done = []

    def emit(events):
        done.extend(e for e in events if e[2])
        if len(done) == args.streams:
            inbox.put(None)

    c0, t0 = thread_cpu(), time.perf_counter()
    th = threading.Thread(target=loop.run, args=(inbox, emit, stop), name="engine")
    th.start()
    c1 = {}
    while th.is_alive():  # sample while it runs: the thread's entry goes when it ends
        c1 = thread_cpu()
        th.join(timeout=0.5)
    return {"step_times": loop.step_times, "threads": {k: v - c0.get(k, 0.0) for k, v in c1.items()},
            "wall": time.perf_counter() - t0, "tok_s": args.streams * args.new / (time.perf_counter() - t0)}


def run_server_mode(args, mode: str) -> dict:
    stats_path = f"/tmp/cpu_path_gw_{mode}_{os.getpid()}.json"
    cmd = [sys.executable, __file__, "serve", "--mode", mode, "--stats", stats_path,
           "--port", str(args.port), "--model", args.model, "--variant", args.variant,
           "--threads", str(args.threads), "--streams", str(args.streams)]
    srv = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        import urllib.request
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=2).status == 200:
                    break
            except Exception:
                time.sleep(1)
        ccmd = [sys.executable, __file__, "client", "--port", str(args.port), "--model", args.model,
                "--streams", str(args.streams), "--new", str(args.new), "--prompt", str(args.prompt)]
        res = json.loads(subprocess.run(ccmd, capture_output=True, text=True, check=True).stdout)
    finally:
        srv.send_signal(signal.SIGINT)
        try:
            _, err = srv.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            srv.kill()
            err = b""
    stats = json.loads(Path(stats_path).read_text())
    stats.update(res)
    return stats


def summarize(name: str, r: dict, tokens: int) -> None:
    st = r.get("step_times") or [float("nan")]
    line = f"{name:8s} step(full batch) median {statistics.median(st)*1e3:7.2f} ms over {len(st)} steps; " \
           f"clients {r.get('tok_s', float('nan')):7.1f} tok/s"
    print(line)
    for key in ("threads", "child_threads"):
        th = r.get(key)
        if not th:
            continue
        groups: dict[str, float] = {}
        for k, v in th.items():
            groups[k.split(":")[0]] = groups.get(k.split(":")[0], 0.0) + v
        desc = ", ".join(f"{k} {v*1e6/tokens:.0f}" for k, v in sorted(groups.items(), key=lambda x: -x[1]) if v > 0.05)
        print(f"         {key} CPU us/token: {desc}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", nargs="?", default="run", choices=["run", "serve", "client"])
    ap.add_argument("--mode", default="thread", choices=["thread", "process"])
    ap.add_argument("--modes", nargs="+", default=["alone", "thread", "process"])
    ap.add_argument("--model", default=str(common.MODELS / "small"))
    ap.add_argument("--variant", default="loop:stock")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--port", type=int, default=18931)
    ap.add_argument("--stats")
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if args.cmd == "serve":
        return serve(args)
    if args.cmd == "client":
        return client(args)
    common.header(f"gateway cost, {args.streams} streams x {args.new} tokens, {args.variant}, "
                  f"{args.threads} threads")
    out = {}
    tokens = args.streams * args.new
    for mode in args.modes:
        r = alone(args) if mode == "alone" else run_server_mode(args, mode)
        out[mode] = r
        summarize(mode, r, tokens)
    print(f"# load after: {common.load()}")
    if args.json:
        Path(args.json).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
