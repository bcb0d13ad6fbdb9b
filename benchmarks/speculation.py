#!/usr/bin/env python3
"""N-gram speculative decoding on the Xeon engine, against the same engine without it.

Not a timed test: a measurement. On the default model (SmolLM2-135M-Instruct),
in process, one run: an engine with ``speculate=0`` and one with
``speculate=K`` take turns over the same requests, greedy, and report output
tokens per second of each and their ratio, per kind of prompt:

- input-grounded, at batch 1: editing a given text (spelling, grammar),
  summarizing it, adding type hints or a docstring to a given function,
  repeating a given list (the answer copies much of the prompt, which is
  where n-gram drafts are accepted);
- free-form chat, at batch 1 (little to copy: the drafts mostly fail);
- free-form chat, 32 streams at once (the load gate keeps drafts off).

Every answer ends at the model's EOS, as a server's does, or at
``--new-tokens``; the prompts of a batch-1 case are answered one after
another.

Both engines emit the same tokens (greedy output is token for token the same,
``tests/xeon/test_xeon_speculation.py``), so their times compare like for
like; the script checks it and reports the acceptance counters.

Usage: python benchmarks/speculation.py [--speculate 8] [--rounds 3] [--new-tokens 160]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from switchyard.models.default_model import ensure_default_model
from switchyard.text.chat import render_chat
from switchyard.text.tokenizer import load_tokenizer
from switchyard_spec import EngineConfig, EngineRequest, SamplingParams, StoppingParams
from switchyard_xeon.engine import XeonEngine

EDIT = ("Fix the spelling mistakes in this paragraph and change nothing else:\n\n"
        "The quick brown fox jumpped over the lazzy dog. It was a sunny day in the "
        "village, and the childen were playing near the river. Their parents watched "
        "from the bench, talking about the harvest and the wether. Later that evening, "
        "everyone gathered in the town hall for a dinner of bread, soup and aples.")
GRAMMAR = ("Correct the grammar in this text and return the corrected text only:\n\n"
           "My sister have two cats. They likes to sleep on the sofa all day long. When it "
           "rain, they sits by the window and watches the drops. In the evening my sister "
           "feed them fish and they is very happy.")
SUMMARY = ("Summarize this text in two sentences:\n\n"
           "The city council met on Tuesday to discuss the new park on the east side of "
           "town. The park will have a playground, a small lake and walking paths. "
           "Construction starts in May and should finish by October. The council approved "
           "a budget of two million dollars for the project.")
TYPE_HINTS = ("Add Python type hints to this function. Reply with the whole function only.\n\n"
              "def merge_counts(first, second):\n"
              "    merged = dict(first)\n"
              "    for key, value in second.items():\n"
              "        if key in merged:\n"
              "            merged[key] = merged[key] + value\n"
              "        else:\n"
              "            merged[key] = value\n"
              "    return merged\n")
DOCSTRING = ("Add a docstring to this Python function. Reply with the whole function.\n\n"
             "def is_prime(n):\n"
             "    if n < 2:\n"
             "        return False\n"
             "    for i in range(2, int(n ** 0.5) + 1):\n"
             "        if n % i == 0:\n"
             "            return False\n"
             "    return True\n")
LIST = ("Here is a shopping list: apples, bread, butter, carrots, cheese, eggs, flour, "
        "honey, lemons, milk, onions, pasta, rice, salt, sugar, tea, tomatoes, yogurt. "
        "Write the same list again, one item per line, in the same order.")
CHAT = ["Write a short poem about the sea.", "What should I pack for a week of hiking?",
        "Tell me a story about a brave mouse."]
GROUNDED = {"edit": [EDIT, GRAMMAR, SUMMARY], "code": [TYPE_HINTS, DOCSTRING], "list": [LIST]}
"""Input-grounded cases: each prompt is answered alone (batch 1), one after another."""


def _engine(folder: Path, speculate: int, threads: str | None, dtype: str,
            extra: dict[str, str] | None = None) -> XeonEngine:
    options = {"speculate": str(speculate), **(extra or {})}
    if threads:
        options["num_threads"] = threads
    engine = XeonEngine(EngineConfig(model_path=str(folder), dtype=dtype, options=options))
    engine.start()
    engine.warmup()
    return engine


Batch = list[list[int]]
"""Prompts submitted together."""


def _run(engine: XeonEngine, batches: list[Batch], new: int,
         eos: tuple[int, ...]) -> tuple[float, list[list[int]]]:
    """Seconds to answer every batch, one batch after another, and the answers."""
    answers: list[list[int]] = []
    start = time.perf_counter()
    for prompts in batches:
        done = {i: threading.Event() for i in range(len(prompts))}
        out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}

        def sink_for(i: int, out=out, done=done):
            def sink(event) -> None:
                if event.token_id >= 0:
                    out[i].append(event.token_id)
                if event.finish_reason is not None or event.error is not None:
                    done[i].set()
            return sink

        for i, prompt in enumerate(prompts):
            engine.submit(EngineRequest(
                request_id=f"b{time.monotonic_ns()}-{i}", prompt_token_ids=tuple(prompt),
                sampling=SamplingParams(),
                stopping=StoppingParams(max_new_tokens=new, eos_token_ids=eos)),
                sink_for(i))
        for finished in done.values():
            finished.wait(600)
        answers += [out[i] for i in range(len(prompts))]
    return time.perf_counter() - start, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speculate", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=160,
                        help="the most tokens per answer (each also ends at its EOS)")
    parser.add_argument("--threads", default=None, help="num_threads of both engines")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="another engine option of the speculating engine")
    parser.add_argument("--cases", default=None, help="comma-separated cases to run")
    parser.add_argument("--dtype", default="float32",
                        help="float32 (default: greedy tokens compare exactly) or auto")
    args = parser.parse_args()
    folder = ensure_default_model(Path.home() / ".cache" / "switchyard")
    tok = load_tokenizer(folder)
    eos = tuple(tok.eos_token_ids)

    def chat(text: str) -> list[int]:
        return tok.encode(render_chat(tok, [("user", text)]), False)

    # Batch 1 cases answer their prompts one at a time; "chat x32" sends 32 at once.
    cases: dict[str, list[Batch]] = {
        name: [[chat(text)] for text in texts] for name, texts in GROUNDED.items()}
    cases["chat"] = [[chat(text)] for text in CHAT]
    cases["chat x32"] = [[chat(CHAT[i % len(CHAT)] + f" ({i})") for i in range(32)]]
    plain = _engine(folder, 0, args.threads, args.dtype)
    extra = dict(o.split("=", 1) for o in args.option)
    spec = _engine(folder, args.speculate, args.threads, args.dtype, extra)
    if args.cases:
        cases = {k: v for k, v in cases.items() if k in args.cases.split(",")}
    print(f"| case | prompts | streams | tokens | off tok/s | speculate={args.speculate} tok/s "
          f"| ratio | accepted / drafted |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, batches in cases.items():
        times: dict[str, list[float]] = {"off": [], "on": []}
        tokens = 0
        before = spec._scheduler.counters
        drafted0, accepted0 = before.draft_tokens, before.accepted_tokens
        for _ in range(args.rounds):
            t_off, want = _run(plain, batches, args.new_tokens, eos)
            t_on, got = _run(spec, batches, args.new_tokens, eos)
            if got != want:
                same = [next((j for j, (a, b) in enumerate(zip(g, w)) if a != b),
                             min(len(g), len(w))) for g, w in zip(got, want)]
                print(f"{name}: greedy tokens differ from token {min(same)} on")
            times["off"].append(t_off)
            times["on"].append(t_on)
            tokens = sum(len(t) for t in want)
        after = spec._scheduler.counters
        off = tokens / statistics.median(times["off"])
        on = tokens / statistics.median(times["on"])
        prompts = sum(len(b) for b in batches)
        streams = max(len(b) for b in batches)
        print(f"| {name} | {prompts} | {streams} | {tokens} | {off:.1f} | {on:.1f} "
              f"| {on / off:.2f} | {after.accepted_tokens - accepted0} / "
              f"{after.draft_tokens - drafted0} |")
    plain.shutdown()
    spec.shutdown()


if __name__ == "__main__":
    main()
