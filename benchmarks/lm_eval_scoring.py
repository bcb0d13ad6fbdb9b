"""lm-evaluation-harness against `switchyard serve`, each log-likelihood checked with transformers.

Runs lm-eval's `local-completions` model with its default tokenized requests
(token-id prompts, `echo`, `logprobs: 1`, `max_tokens: 1`) on a small
multiple-choice task written here (a JSONL file and a task YAML: nothing from
the hub), with `--log_samples`, then recomputes each choice's log-likelihood
and "greedy" flag with transformers in float32 on the same tokens and prints
one row per choice. Exits 1 if any log-likelihood differs by more than 1e-3
or any greedy flag differs.

lm-eval is not a dependency of this project: install it in a virtual
environment of its own (torch first, pinned, so pip does not pull CUDA):

    python3 -m venv /tmp/lmeval-venv
    /tmp/lmeval-venv/bin/pip install torch==2.13.0
    /tmp/lmeval-venv/bin/pip install "lm-eval[api]" transformers

Then, from the repository root (it starts a float32 server on the built-in
default model unless `--base-url` names a running one; `--model-dir` must then
be that server's model folder):

    .venv/bin/python benchmarks/lm_eval_scoring.py --lm-eval /tmp/lmeval-venv/bin/lm_eval
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TASK = "switchyard_scoring_mc"
TOLERANCE = 1e-3
QUESTIONS = [
    ("Question: What is the capital of France?\nAnswer:", [" Paris", " London", " Berlin"], 0),
    ("Question: Which number is even?\nAnswer:", [" 7", " 12", " 9", " 15"], 1),
    ("def add(a, b):\n    return", [" a + b", " a - b", " None"], 0),
    ("Le café est", [" chaud", " froid", " délicieux ☕"], 2),
    ("日本の首都は", ["東京", "大阪", "京都"], 0),
    ("Emoji for a rocket:", [" 🚀", " 🙂", " 🎉"], 0),
]
"""(context, choices, answer); each choice carries its own separator (target_delimiter "")."""
GREEDY_CONTEXTS = ["import os\nimport", "class Foo:\n    def", "for i in range(10):\n   "]
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def greedy_question(model, tokenizer) -> tuple[str, list[str], int] | None:
    """A question whose first choice is the model's own greedy continuation (3 tokens).

    A random model's text is never greedy by chance; this choice must come back
    greedy from the server, which exercises lm-eval's `==` test on `top_logprobs`.
    None if no context's continuation survives decoding and re-encoding unchanged.
    """
    for context in GREEDY_CONTEXTS:
        ctx = tokenizer(context, add_special_tokens=False).input_ids
        ids = list(ctx)
        with torch.inference_mode():
            for _ in range(3):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        text = tokenizer.decode(ids[len(ctx):])
        if "\ufffd" in text or text != text.rstrip():
            continue
        if tokenizer(context + text, add_special_tokens=False).input_ids == ids:
            return context, [text, " x", " None"], 0
    return None


def write_task(folder: Path, extra: list[tuple[str, list[str], int]]) -> None:
    """The task's JSONL data and YAML in `folder` (lm-eval's `--include_path`)."""
    data = folder / f"{TASK}.jsonl"
    with data.open("w", encoding="utf-8") as out:
        for question, choices, answer in QUESTIONS + extra:
            out.write(json.dumps({"question": question, "choices": choices, "answer": answer},
                                 ensure_ascii=False) + "\n")
    (folder / f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=data), encoding="utf-8")


def start_server(model_dir: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """`switchyard serve` on the model in float32 on a free loopback port, once healthy."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "switchyard.cli", "serve", "--model-id", str(model_dir),
           "--dtype", "float32", "--hostname", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit(f"server not healthy:\n{log.read_text()}")


def run_lm_eval(lm_eval: str, base_url: str, model_dir: Path, work: Path) -> Path:
    """Run lm-eval's local-completions on the task; returns its samples file."""
    args = (f"model=tgi,base_url={base_url}/v1/completions,tokenizer={model_dir},"
            "tokenized_requests=True,max_retries=1")
    cmd = [lm_eval, "--model", "local-completions", "--model_args", args, "--tasks", TASK,
           "--include_path", str(work), "--output_path", str(work / "out"), "--log_samples",
           "--batch_size", "1"]
    print("$", " ".join(cmd), flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(cmd, check=True, env=env)
    found = glob.glob(str(work / "out" / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)
    if not found:
        raise SystemExit("lm-eval wrote no samples file")
    return Path(sorted(found)[-1])


def _pairs(sample: dict) -> list[tuple[str, str]]:
    """(context, continuation) of each choice, in whichever shape this lm-eval logs them."""
    args = sample["arguments"]
    if isinstance(args, dict):  # {"gen_args_0": {"arg_0": context, "arg_1": continuation}, ...}
        args = [list(a.values()) for a in args.values()]
    return [(str(a[0]), str(a[1])) for a in args]


def _answers(sample: dict) -> list[tuple[float, bool]]:
    """lm-eval's (log-likelihood, is_greedy) of each choice.

    The samples file holds them as strings ("-15.7", "False"), hence the parsing.
    """
    return [(float(r[0][0]), str(r[0][1]) == "True") for r in sample["resps"]]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Context and continuation ids as lm-eval encodes them for a causal model."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


def reference(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """transformers' log-likelihood of the continuation and whether it is greedy (float32)."""
    ids = torch.tensor([context + continuation])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(context) - 1 : -1].float()
    scores = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(continuation)
    total = scores.gather(1, targets[:, None]).sum().item()
    return total, bool((scores.argmax(-1) == targets).all())


def compare(samples: Path, model, tokenizer) -> bool:
    """Print one row per choice; True when every one agrees with transformers."""
    print(f"{'doc':>3} {'choice':<14} {'lm-eval':>12} {'transformers':>12} {'|diff|':>9} "
          f"{'greedy':>11}")
    ok, worst = True, 0.0
    for line in samples.read_text(encoding="utf-8").splitlines():
        sample = json.loads(line)
        for (context, continuation), (got, greedy) in zip(_pairs(sample), _answers(sample),
                                                         strict=True):
            ctx, cont = encode_pair(tokenizer, context, continuation)
            expected, expected_greedy = reference(model, ctx, cont)
            diff = abs(got - expected)
            worst = max(worst, diff)
            good = diff <= TOLERANCE and greedy == expected_greedy
            ok &= good
            print(f"{sample['doc_id']:>3} {continuation.strip()[:14]:<14} {got:>12.5f} "
                  f"{expected:>12.5f} {diff:>9.2e} {str(greedy):>5}/{str(expected_greedy):<5}"
                  f"{'' if good else '  MISMATCH'}")
    print(f"largest difference {worst:.2e} (tolerance {TOLERANCE:g}): {'ok' if ok else 'FAILED'}")
    return ok


def main() -> None:
    """Parse the command line, run lm-eval, compare."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lm-eval", default="/tmp/lmeval-venv/bin/lm_eval",
                        help="the lm_eval command of lm-eval's own environment")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="model folder (default: build the built-in default model)")
    parser.add_argument("--base-url", default=None,
                        help="a running server on --model-dir in float32 (default: start one)")
    opts = parser.parse_args()
    model_dir = opts.model_dir
    if model_dir is None:
        from switchyard.models.random_model import ensure_random_model
        model_dir = ensure_random_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    greedy = greedy_question(model, tokenizer)
    with tempfile.TemporaryDirectory(prefix="lm-eval-scoring-") as tmp:
        work = Path(tmp)
        write_task(work, [greedy] if greedy else [])
        proc = None
        base_url = opts.base_url
        if base_url is None:
            proc, base_url = start_server(model_dir, work / "server.log")
        try:
            samples = run_lm_eval(opts.lm_eval, base_url.rstrip("/"), model_dir, work)
            ok = compare(samples, model, tokenizer)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
