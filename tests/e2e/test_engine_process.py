"""Engines in their own processes (`engine_process = true`, `--engine-process`), end to end.

One `switchyard serve --config` serves the built-in model three times, on
three xeon engines with one thread each: `inproc` in the server's process,
`proc` and `other` each in a process of its own. The same weights and
settings make `inproc` the reference: `proc` must answer with the same
tokens. Then `proc`'s engine process is killed with SIGKILL under load: its
requests end with a clear error in their API's format, `other` keeps
serving, the process comes back, and when the server stops no engine
process is left behind. A second server, pinned with `--cpus`, is killed
with SIGKILL itself: its engine process follows it.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from text_generation import Client
from text_generation.errors import GenerationError

from tests.support.abandoned import (
    CHAT,
    COMPLETION,
    abandon,
    decode_steps,
    dropped_lines,
    wait_until_idle,
)
from tests.support.live_server import LiveServer, start_server, stop_server
from tests.support.waiting import eventually

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Once upon a time"]
LIMITS = "max_total_tokens = 512\nmax_input_tokens = 400\n"


def _model(name: str, path: Path, engine_process: bool) -> str:
    return (f'[[models]]\nname = "{name}"\naliases = ["{name}-alias"]\nmodel_id = "{path}"\n'
            f'engine = "xeon"\nengine_options = {{ num_threads = 1 }}\nengine_process = '
            f'{"true" if engine_process else "false"}\n{LIMITS}\n')


@pytest.fixture(scope="module")
def live(server: LiveServer, model_cache: Path, default_model_path: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = tmp_path_factory.mktemp("engine-process")
    config = folder / "models.toml"
    config.write_text(_model("inproc", default_model_path, False)
                      + _model("proc", default_model_path, True)
                      + _model("other", default_model_path, True)
                      # The same model served by another server (the session's): a remote one.
                      + f'[[models]]\nname = "far"\naliases = ["faraway"]\n'
                        f'upstreams = ["{server.url}"]\n')
    server = start_server(model_cache, folder, "--config", str(config), "--dtype", "float32",
                          timeout=300)
    yield server
    stop_server(server)


def _engine_pids(server: LiveServer, model: str) -> list[int]:
    """The engine processes the server started for `model`, oldest first (from its log)."""
    return [int(pid) for pid in re.findall(
        rf"model {re.escape(model)}: engine process (\d+) started", server.log())]


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting to be reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _metric(server: LiveServer, name: str, model: str, method: str | None = None) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    labels = f'model="{model}",engine="xeon"' + (f',method="{method}"' if method else "")
    found = re.search(rf"^{name}{{{re.escape(labels)}}} (\S+)$", text, re.M)
    assert found, f"{name}{{{labels}}} not in /metrics"
    return float(found[1])


def test_every_engine_process_runs_apart_from_the_server(live):
    procs, others = _engine_pids(live, "proc"), _engine_pids(live, "other")
    assert len(procs) == 1 and len(others) == 1 and not _engine_pids(live, "inproc")
    for pid in (*procs, *others):
        assert _running(pid) and pid != live.process.pid
        assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:3] == [
            b"-m", b"switchyard.engine_process.child"]
    ids = [m["id"] for m in httpx.get(f"{live.url}/v1/models", timeout=30).json()["data"]]
    assert ids == ["inproc", "inproc-alias", "proc", "proc-alias", "other", "other-alias",
                   "far", "faraway"]


@pytest.mark.parametrize("name", ["proc", "proc-alias", "other", "other-alias", "far",
                                  "faraway"])
def test_every_client_reaches_each_model_by_name_and_alias(live, server, name):
    """Two engine processes and a remote model in one gateway: the OpenAI, TGI and Hugging
    Face clients, streamed and not, get what the session server gives for the same model."""
    from huggingface_hub import InferenceClient

    prompt = PROMPTS[0]
    want = Client(server.url, timeout=120).generate(prompt, max_new_tokens=8)
    oai = openai.OpenAI(base_url=f"{live.url}/v1", api_key="-", timeout=120)
    got = oai.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0)
    assert got.choices[0].text == want.generated_text
    chunks = oai.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0,
                                    stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.generated_text
    tgi = Client(live.url, headers={"X-Model": name}, timeout=120)
    answer = tgi.generate(prompt, max_new_tokens=8)
    assert [t.id for t in answer.details.tokens] == [t.id for t in want.details.tokens]
    assert [e.token.id for e in tgi.generate_stream(prompt, max_new_tokens=8)] == \
        [t.id for t in want.details.tokens]
    hub = InferenceClient(base_url=live.url, headers={"X-Model": name}, timeout=120)
    assert hub.text_generation(prompt, max_new_tokens=8) == want.generated_text
    streamed = "".join(hub.text_generation(prompt, max_new_tokens=8, stream=True))
    assert streamed == want.generated_text


def test_tokens_are_those_of_the_in_process_engine(live):
    """Greedy and seeded sampling, with logprobs and alternatives: the same as in process."""
    for params in ({}, {"do_sample": True, "seed": 7, "temperature": 0.8, "top_k": 20}):
        for prompt in PROMPTS:
            answers = {}
            for model in ("inproc", "proc"):
                client = Client(live.url, headers={"X-Model": model}, timeout=120)
                answers[model] = client.generate(prompt, max_new_tokens=12, top_n_tokens=2,
                                                 decoder_input_details=True, **params)
            want, got = answers["inproc"], answers["proc"]
            assert got.generated_text == want.generated_text, (prompt, params)
            assert [t.id for t in got.details.tokens] == [t.id for t in want.details.tokens]
            assert [t.logprob for t in got.details.tokens] == pytest.approx(
                [t.logprob for t in want.details.tokens], abs=1e-5)
            assert [[a.id for a in top] for top in got.details.top_tokens] == [
                [a.id for a in top] for top in want.details.top_tokens]
            assert [t.logprob for t in got.details.prefill[1:]] == pytest.approx(
                [t.logprob for t in want.details.prefill[1:]], abs=1e-5)
            assert got.details.seed == want.details.seed
            assert got.details.finish_reason == want.details.finish_reason


def test_openai_streaming_and_usage(live):
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="-", timeout=120)
    whole = client.completions.create(model="proc", prompt=PROMPTS[0], max_tokens=16,
                                      temperature=0)
    reference = client.completions.create(model="inproc", prompt=PROMPTS[0], max_tokens=16,
                                          temperature=0)
    assert whole.choices[0].text == reference.choices[0].text
    assert whole.usage.model_dump() == reference.usage.model_dump()
    chunks = list(client.completions.create(
        model="proc", prompt=PROMPTS[0], max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert len([c for c in chunks if c.choices]) > 1  # streamed, not one burst at the end
    messages = [{"role": "user", "content": "hi"}]
    chat_ref = client.chat.completions.create(model="inproc", messages=messages, max_tokens=8,
                                              temperature=0)
    chat_chunks = list(client.chat.completions.create(
        model="proc", messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices) == \
        chat_ref.choices[0].message.content
    assert chat_chunks[-1].usage.model_dump() == chat_ref.usage.model_dump()


def test_responses_reach_an_engine_process_by_alias_and_chain_there(live):
    """`/v1/responses` on a model in its own process, by its alias: the in-process model's
    answer, streamed or not, and a chained turn there."""
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="-", timeout=120)
    want = client.responses.create(model="inproc", input="hi", max_output_tokens=8,
                                   temperature=0)
    got = client.responses.create(model="proc-alias", input="hi", max_output_tokens=8,
                                  temperature=0)
    assert got.output_text == want.output_text and got.model == "proc"
    events = list(client.responses.create(model="proc", input="hi", max_output_tokens=8,
                                          temperature=0, stream=True))
    assert events[-1].response.output_text == want.output_text
    again = client.responses.create(model="proc", input="and?", previous_response_id=got.id,
                                    max_output_tokens=8, temperature=0)
    ref = client.responses.create(model="inproc", input="and?", previous_response_id=want.id,
                                  max_output_tokens=8, temperature=0)
    assert again.output_text == ref.output_text


def test_a_client_that_disconnects_aborts_its_sequence_in_the_engine_process(live):
    steps = lambda: _metric(live, "tgi_batch_inference_count", "proc", "decode")  # noqa: E731
    before = steps()
    with httpx.stream("POST", f"{live.url}/v1/completions", timeout=60, json={
            "model": "proc", "prompt": "hello", "max_tokens": 480, "stream": True,
            "temperature": 0}) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                break
    # The engine process stops decoding at once (480 tokens would take seconds more): its
    # load, pushed by the process once it went quiet, shows an empty batch ...
    eventually(lambda: _metric(live, "tgi_batch_current_size", "proc") == 0, timeout=30,
               interval=0.2, what="an empty batch")
    settled = steps()
    assert settled - before < 400
    # ... and stays so. That is an absence, with no event to wait on: the sleep is the window
    # in which a sequence still decoding would add steps (dozens a second here).
    time.sleep(1.0)
    assert steps() == settled, "the engine process still decodes the abandoned sequence"


@pytest.mark.parametrize(("name", "engine_model", "upstream"), [
    ("proc", "proc", False), ("far", "switchyard/tiny-llama-random", True)],
    ids=["engine-process", "remote-model"])
def test_abandoned_json_requests_are_aborted_in_the_engine_process_and_upstream(
        live, server, name, engine_model, upstream):
    """Clients that leave non-streamed requests while they run: an engine process drops their
    sequences, and a remote model's replica sees its request closed and drops them too."""
    engine_server = server if upstream else live
    start = len(engine_server.log())
    for path, body, count, n in (("/v1/chat/completions", {**CHAT, "model": name}, 8, 1),
                                 ("/v1/completions", {**COMPLETION, "model": name, "n": 2}, 2, 2)):
        steps = decode_steps(engine_server, engine_model)
        abandon(live, path, body, count, engine_model, engine_server=engine_server, sequences=n)
        wait_until_idle(engine_server, engine_model, steps)
    dropped_lines(engine_server, start, 10, sequences=2)
    r = httpx.post(f"{live.url}/v1/completions", timeout=60,
                   json={"model": name, "prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


def _stream_until_error(url: str, started: threading.Event, outcome: list[object]) -> None:
    client = Client(url, headers={"X-Model": "proc"}, timeout=120)
    try:
        for _ in client.generate_stream("Once upon a time", max_new_tokens=480):
            started.set()
        outcome.append("finished")
    except Exception as exc:  # the error the client sees is what is checked
        started.set()
        outcome.append(exc)


def test_a_killed_engine_process_fails_its_requests_and_comes_back(live):
    victim = _engine_pids(live, "proc")[-1]
    other_pid = _engine_pids(live, "other")[-1]
    stop = threading.Event()
    other_results: list[object] = []

    def keep_asking_other() -> None:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="-", timeout=120,
                               max_retries=0)
        while not stop.is_set():
            try:
                out = client.completions.create(model="other", prompt="hello", max_tokens=8,
                                                temperature=0)
                other_results.append(out.usage.completion_tokens)
            except Exception as exc:
                other_results.append(exc)

    background = threading.Thread(target=keep_asking_other)
    background.start()
    outcomes: list[list[object]] = [[] for _ in range(3)]
    starts = [threading.Event() for _ in outcomes]
    streams = [threading.Thread(target=_stream_until_error, args=(live.url, s, o))
               for s, o in zip(starts, outcomes)]
    try:
        for thread in streams:
            thread.start()
        assert all(s.wait(60) for s in starts)
        start = len(live.log())
        os.kill(victim, signal.SIGKILL)
        for thread in streams:
            thread.join(60)
            assert not thread.is_alive(), "a request to the dead engine hangs"
        # The streams in flight end with TGI's generation error, naming what happened.
        for outcome in outcomes:
            assert len(outcome) == 1 and isinstance(outcome[0], GenerationError), outcome
            assert "engine process of model `proc` was killed by SIGKILL" in str(outcome[0])
        # Meanwhile the model is unavailable with a 503 in its API's format, and unhealthy.
        refused = httpx.post(f"{live.url}/v1/completions", timeout=30,
                             json={"model": "proc", "prompt": "hi", "max_tokens": 2})
        if refused.status_code == 503:  # (unless the restart already finished)
            assert refused.json()["error"]["type"] == "unhealthy"
            assert "restarting" in refused.json()["error"]["message"]
            assert httpx.get(f"{live.url}/health", timeout=30).status_code == 503
        line = re.search(r"ERROR switchyard\.engine_process: model proc: engine process "
                         rf"{victim} was killed by SIGKILL; \d+ requests in flight failed; "
                         r"restarting in \d+s", live.log()[start:])
        assert line, live.log()[start:]
        # It comes back: a new process serves, and /health is 200 again.
        eventually(lambda: httpx.get(f"{live.url}/health", timeout=30).status_code == 200,
                   timeout=180, interval=0.2, what="healthy again")
        assert _engine_pids(live, "proc")[-1] != victim and not _running(victim)
        again = Client(live.url, headers={"X-Model": "proc"}, timeout=120).generate(
            PROMPTS[0], max_new_tokens=6)
        want = Client(live.url, headers={"X-Model": "inproc"}, timeout=120).generate(
            PROMPTS[0], max_new_tokens=6)
        assert again.generated_text == want.generated_text
    finally:
        stop.set()
        background.join(120)
    # The other model served throughout, on the same process as before.
    assert other_results and all(r == 8 for r in other_results), [
        r for r in other_results if r != 8]
    assert _engine_pids(live, "other") == [other_pid] and _running(other_pid)


def test_no_engine_process_outlives_the_server(live):
    pids = _engine_pids(live, "proc") + _engine_pids(live, "other")
    assert any(_running(pid) for pid in pids)
    stop_server(live)
    assert live.process.returncode is not None
    eventually(lambda: not any(_running(pid) for pid in pids), timeout=20, interval=0.2,
               what="every engine process gone")
    assert "engine process stopped" in live.log()


def test_a_pinned_engine_process_exits_when_the_server_is_killed(
        model_cache: Path, tmp_path: Path):
    cpu = sorted(os.sched_getaffinity(0))[0]
    server = start_server(model_cache, tmp_path, "--dtype", "float32", "--max-total-tokens",
                          "256", "--engine-process", "--cpus", str(cpu), "--engine-option",
                          "num_threads=1", timeout=300)
    try:
        (pid,) = _engine_pids(server, "switchyard/tiny-llama-random")
        status = Path(f"/proc/{pid}/status").read_text()
        assert re.search(rf"^Cpus_allowed_list:\s+{cpu}$", status, re.M), status
        out = Client(server.url, timeout=120).generate(PROMPTS[0], max_new_tokens=4)
        assert out.details.generated_tokens == 4
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(30)
        # The engine process reads end of file on its pipe and exits on its own.
        eventually(lambda: not _running(pid), timeout=20, interval=0.2,
                   what=f"engine process {pid} gone")
    finally:
        stop_server(server)
