"""``--sharded true --num-shard 2`` on the CPU device: two ranks, DeepSpeed AutoTP over gloo.

Rank 0 is the engine's thread (here, in the test process or the server's),
rank 1 a child process. Greedy tokens of the sharded engine must equal the
unsharded engine's and transformers' for prompts of different lengths sharing
padded batches, in process and end to end over HTTP with real clients; no
graph may compile after warmup on either rank; a killed rank must turn the
engine unhealthy with a log line naming it, fail what was in flight, and
leave no process behind. Bucket grids are tiny (4 and 5 shapes) and every
rank runs one thread, so that two ranks fit two cores.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import httpx
import openai
import pytest
import torch
from switchyard_gaudi.engine import GaudiEngine
from switchyard_gaudi.model_dims import ModelDims
from switchyard_spec import EngineRequest, EngineStartError, SamplingParams, StoppingParams
from text_generation import Client
from transformers import AutoTokenizer

from tests.support.engine_requests import Collector, greedy_request, prompt_of
from tests.support.gaudi_config import SMALL_ENV, cpu_config
from tests.support.greedy import generate_greedy
from tests.support.live_server import LiveServer, start_server, stop_server
from tests.support.waiting import eventually

pytest.importorskip("deepspeed", reason="sharding runs DeepSpeed AutoTP (see docs/gaudi.md)")

LIMITS = {"max_total_tokens": 64, "max_input_tokens": 32, "max_batch_size": 4,
          "max_batch_prefill_tokens": 64}
"""Prompt buckets 16 and 32, prefill batches of 2 and 4, one decode bucket of 4: 4 shapes."""
PROMPT_LENGTHS = (1, 7, 20, 31)
NEW = 16


def _started(model: Path, shards: int, env: dict[str, str] | None = None,
             warm: bool = True) -> GaudiEngine:
    engine = GaudiEngine(cpu_config(model, num_shard=shards, **LIMITS),
                         env={**SMALL_ENV, **(env or {})})
    try:
        engine.start()
        if warm:
            engine.warmup()
    except BaseException:
        engine.shutdown()
        raise
    return engine


@pytest.fixture(scope="module")
def one_and_two(default_model_path: Path) -> Iterator[tuple[GaudiEngine, GaudiEngine]]:
    """The same model and settings unsharded (eagerly: the same kernels as the compiled
    graphs, without their compile time) and on two ranks, warmed up."""
    one = _started(default_model_path, 1, env={"ENABLE_HPU_GRAPH": "false"})
    try:
        two = _started(default_model_path, 2)
    except BaseException:
        one.shutdown()
        raise
    yield one, two
    two.shutdown()
    one.shutdown()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_what_cannot_be_sharded_is_refused_before_any_rank_starts(default_model_path):
    with pytest.raises(EngineStartError, match="needs --num-shard N"):
        _started(default_model_path, 0, warm=False)  # --sharded true alone, on the CPU
    with pytest.raises(EngineStartError, match="does not divide the model's 4 attention heads "
                                               "and 2 key/value heads"):
        _started(default_model_path, 4, warm=False)


def test_the_plan_is_per_rank():
    """Llama-2-70B on 8 cards: heads, KV heads, MLP and every weight but the embedding split."""
    llama70 = ModelDims(model_type="llama", num_layers=80, hidden_size=8192,
                        intermediate_size=28672, num_heads=64, num_kv_heads=8, head_dim=128,
                        vocab_size=32000, max_position_embeddings=4096,
                        parameters=68_976_648_192)
    rank = llama70.per_rank(8)
    embedding = 32000 * 8192
    assert (rank.num_heads, rank.num_kv_heads, rank.intermediate_size) == (8, 1, 3584)
    assert rank.parameters == embedding + (llama70.parameters - embedding) // 8
    assert rank.kv_bytes_per_token(2) * 8 == llama70.kv_bytes_per_token(2)
    assert llama70.per_rank(1) is llama70


def test_the_plan_command_plans_one_rank(default_model_path, capsys):
    from switchyard_gaudi.__main__ import main

    args = ["plan", "--model-id", str(default_model_path), "--device-memory", "8GiB",
            "--max-total-tokens", "512", "--max-batch-size", "8"]
    kv = []
    for extra in ([], ["--num-shard", "2"]):
        assert main(args + extra) == 0
        out = capsys.readouterr().out
        kv.append(float(re.search(r"KV cache ([\d.]+) MiB", out)[1]))  # type: ignore[index]
    assert "split over 2 ranks" in out and abs(kv[1] - kv[0] / 2) <= 0.1  # printed to 0.1
    assert main(args + ["--num-shard", "4"]) == 2  # 4 does not divide 2 key/value heads


FAMILY = dict(vocab_size=512, hidden_size=128, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              initializer_range=0.1)


def _family(name: str) -> torch.nn.Module:
    """A tiny random Mistral (sliding window) or Qwen2 (biased q/k/v, a windowed layer)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if name == "mistral":
        return MistralForCausalLM(MistralConfig(sliding_window=8, **FAMILY)).eval()
    return Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, sliding_window=8,
                                        max_window_layers=1, **FAMILY)).eval()


@pytest.mark.e2e  # rank processes: the engine spread over processes, not a unit
@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_other_families_shard_and_shutdown_leaves_no_rank_behind(name, tmp_path):
    """Greedy parity with ``generate`` for the other sharded families (uncompiled, for
    time), then stop: the follower is gone. (These run first: the module's engines are
    then a later sharded engine of the process, on a process group built anew.)"""
    model = _family(name)
    model.save_pretrained(tmp_path)
    prompts = [prompt_of(n, start=3) for n in (6, 21, 31)]
    engine = _started(tmp_path, 2, env={"ENABLE_HPU_GRAPH": "false"}, warm=False)
    pids = engine._group.pids  # type: ignore[union-attr]
    assert len(pids) == 1 and _alive(pids[0])
    sink = Collector()
    for i, prompt in enumerate(prompts):
        engine.submit(greedy_request(f"f{i}", prompt, 10), sink)
    for i, prompt in enumerate(prompts):
        assert [e.token_id for e in sink.wait(f"f{i}")] == generate_greedy(model, prompt, 10)
    begin = time.monotonic()
    engine.shutdown()
    assert time.monotonic() - begin < 15
    assert not _alive(pids[0])


@pytest.mark.e2e  # rank processes: the engine spread over processes, not a unit
def test_two_ranks_give_the_unsharded_tokens_and_compile_nothing_after_warmup(
        one_and_two, reference_llama):
    """Four prompts of 1 to 31 tokens at once: they share padded prefills and decodes."""
    one, two = one_and_two
    compiled = (two.compiles, two.follower_compiles())
    assert compiled == (4, [4])  # every planned shape, on each rank
    prompts = [prompt_of(n, start=5 + n) for n in PROMPT_LENGTHS]
    tokens = []
    for engine in (one, two):
        sink = Collector()
        for i, prompt in enumerate(prompts):
            engine.submit(greedy_request(f"p{i}", prompt, NEW), sink)
        tokens.append([[e.token_id for e in sink.wait(f"p{i}")] for i in range(len(prompts))])
    assert tokens[1] == tokens[0]
    for prompt, ids in zip(prompts, tokens[1], strict=True):
        assert ids == generate_greedy(reference_llama, prompt, NEW)
    assert (two.compiles, two.follower_compiles()) == compiled
    assert two.healthy()


@pytest.mark.e2e  # rank processes: the engine spread over processes, not a unit
def test_logprobs_and_prompt_scores_match_the_unsharded_engine(one_and_two):
    """Prompt scores project the prompt through the split LM head on every rank."""
    prompt = prompt_of(20, start=3)
    request = EngineRequest(request_id="lp", prompt_token_ids=tuple(prompt), prompt_logprobs=True,
                            sampling=SamplingParams(top_n_tokens=3),
                            stopping=StoppingParams(max_new_tokens=6, ignore_eos=True))
    runs = []
    for engine in one_and_two:
        sink = Collector()
        engine.submit(request, sink)
        runs.append(sink.wait("lp"))
    unsharded, sharded = runs
    assert [e.token_id for e in sharded] == [e.token_id for e in unsharded]
    for a, b in zip(unsharded, sharded, strict=True):
        assert abs(a.logprob - b.logprob) < 1e-4
        assert [t.id for t in a.top_tokens] == [t.id for t in b.top_tokens]
    torch.testing.assert_close(torch.tensor(sharded[0].prompt_logprobs),
                               torch.tensor(unsharded[0].prompt_logprobs), atol=1e-4, rtol=0)
    assert [[t.id for t in p] for p in sharded[0].prompt_top_tokens] == \
        [[t.id for t in p] for p in unsharded[0].prompt_top_tokens]


# ------------------------------------------------------------- over HTTP
SERVE_ARGS = ("--engine", "gaudi", "--engine-option", "device=cpu",
              "--engine-option", "num_threads=1", "--dtype", "float32",
              "--max-total-tokens", "128", "--max-input-tokens", "64", "--max-batch-size", "4",
              "--max-batch-prefill-tokens", "128")
SERVE_ENV = {"PAD_SEQUENCE_TO_MULTIPLE_OF": "64", "PREFILL_BATCH_BUCKET_SIZE": "2",
             "BATCH_BUCKET_SIZE": "4"}
"""One prompt bucket of 64, prefill batches of 2, decode batches of 4: 2 shapes."""
PROMPTS = ["def fibonacci(n):", "x", "import sys\nimport os\n\nclass Config:\n" * 2]


@pytest.fixture(scope="module")
def servers(model_cache: Path, default_model_path: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveServer, LiveServer]]:
    """One server unsharded and one with ``--sharded true --num-shard 2``, same settings,
    started side by side."""
    logs = tmp_path_factory.mktemp("logs")
    sharded = ("--sharded", "true", "--num-shard", "2")
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start_server, model_cache, logs, *SERVE_ARGS, *extra,
                               env=SERVE_ENV, timeout=300) for extra in ((), sharded)]
        wait(futures)
    started = [f.result() for f in futures if f.exception() is None]
    if len(started) < 2:
        for live in started:
            stop_server(live)
        raise next(f.exception() for f in futures if f.exception() is not None)  # type: ignore
    yield started[0], started[1]
    for live in reversed(started):
        stop_server(live)


def _follower_pid(server: LiveServer) -> int:
    match = re.search(r"shard rank 1 started \(pid (\d+)\)", server.log())
    assert match is not None, server.log()
    return int(match[1])


@pytest.mark.e2e
def test_sharded_server_gives_the_one_shard_servers_tokens(servers, reference_llama,
                                                           default_model_path):
    one, two = servers
    assert "2 ranks ready" in two.log() and "gaudi warmup: 2 shapes" in two.log()
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    results = []
    for server in servers:
        outs: list[object] = [None] * len(PROMPTS)

        def ask(i: int, url: str = server.url, outs: list[object] = outs) -> None:
            outs[i] = Client(url, timeout=120).generate(PROMPTS[i], max_new_tokens=12,
                                                        decoder_input_details=True)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        results.append([[t.id for t in out.details.tokens] for out in outs])  # type: ignore
    assert results[1] == results[0]
    for prompt, ids in zip(PROMPTS, results[1], strict=True):
        want = generate_greedy(reference_llama, tokenizer(prompt)["input_ids"], 12)
        assert ids == want[: len(ids)]
    chats = []
    for server in servers:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="-", timeout=120)
        chats.append(client.chat.completions.create(
            model="tgi", messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
            temperature=0).choices[0].message.content)
    assert chats[1] == chats[0]


@pytest.mark.e2e
def test_a_killed_rank_makes_the_server_unhealthy_without_a_hang(servers):
    """Kill rank 1 mid-stream: the stream ends with an error, /health answers 503, the log
    names the rank, later requests fail at once, and stopping leaves no process behind."""
    _, two = servers
    pid = _follower_pid(two)
    assert httpx.get(f"{two.url}/health", timeout=30).status_code == 200
    body = {"inputs": "tell me everything:", "parameters": {"max_new_tokens": 100}}
    lines: list[str] = []
    begin = time.monotonic()
    with httpx.stream("POST", f"{two.url}/generate_stream", json=body, timeout=60) as stream:
        for line in stream.iter_lines():
            lines.append(line)
            if len(lines) == 1:
                os.kill(pid, signal.SIGKILL)
    assert time.monotonic() - begin < 30
    assert any("error" in line for line in lines), lines
    eventually(lambda: httpx.get(f"{two.url}/health", timeout=30).status_code == 503,
               timeout=10, interval=0.2, what="unhealthy after a rank died")
    assert re.search(rf"shard rank 1 \(pid {pid}\) was killed by SIGKILL", two.log())
    later = httpx.post(f"{two.url}/generate", timeout=30,
                       json={"inputs": "hi", "parameters": {"max_new_tokens": 2}})
    assert later.status_code >= 400 and "sharded engine failed" in later.text
    stop_server(two)
    assert two.process.returncode is not None and not _alive(pid)

