"""Continuous batching and greedy parity, end to end over HTTP.

This module runs its own server with TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN set,
so every request produces exactly `max_new_tokens` tokens.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from text_generation import Client
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.live_server import start_server, stop_server


@pytest.fixture(scope="module")
def ignore_eos_server(model_cache, default_model_path, tmp_path_factory):
    live = start_server(model_cache, tmp_path_factory.mktemp("logs"), "--dtype", "float32",
                        "--max-total-tokens", "1024",
                        env={"TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN": "true"})
    yield live
    stop_server(live)


def test_request_joins_running_batch(ignore_eos_server):
    """A request sent while another decodes gets tokens before the first one finishes."""
    url = ignore_eos_server.url
    long_done = threading.Event()
    first_token_of_short: list[float] = []
    long_finished_at: list[float] = []
    long_started = threading.Event()

    def long_request():
        for i, _ in enumerate(Client(url, timeout=300).generate_stream("a long story:",
                                                                      max_new_tokens=300)):
            if i == 5:
                long_started.set()
        long_finished_at.append(time.monotonic())
        long_done.set()

    t = threading.Thread(target=long_request)
    t.start()
    assert long_started.wait(120)
    for _ in Client(url, timeout=300).generate_stream("short:", max_new_tokens=3):
        first_token_of_short.append(time.monotonic())
        break
    t.join(300)
    assert long_finished_at and first_token_of_short
    assert first_token_of_short[0] < long_finished_at[0]


def test_sixteen_concurrent_streams(ignore_eos_server):
    url = ignore_eos_server.url

    def run(i: int) -> tuple[int, int, str]:
        n = 8 + i
        events = list(Client(url, timeout=300).generate_stream(f"prompt number {i}:",
                                                               max_new_tokens=n))
        last = events[-1]
        assert last.details.finish_reason.value == "length"
        return n, len(events), last.details.generated_tokens

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, range(16)))
    for want, events, reported in results:
        assert events == want == reported


PROMPTS = ["x", "def add(a, b):\n    return", "import sys\nimport os\n\nclass Config:\n" * 3]


def test_greedy_parity_with_transformers(ignore_eos_server, default_model_path):
    """3 prompts of different lengths, sent concurrently, equal transformers' greedy output."""
    url = ignore_eos_server.url
    n = 24

    def ours(prompt: str) -> list[int]:
        out = Client(url, timeout=300).generate(prompt, max_new_tokens=n)
        return [t.id for t in out.details.tokens]

    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(ours, PROMPTS))

    tok = AutoTokenizer.from_pretrained(default_model_path)
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    for prompt, ids in zip(PROMPTS, got, strict=True):
        inputs = tok(prompt, return_tensors="pt")
        with torch.inference_mode():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=n)
        want = out[0, inputs["input_ids"].shape[1]:].tolist()
        # transformers stops at EOS, the server was told to ignore it: compare the common part.
        assert ids[: len(want)] == want, prompt
        assert len(ids) == n
