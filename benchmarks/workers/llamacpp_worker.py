"""llama.cpp through llama-cpp-python, run with the interpreter of `.bench-venvs/llamacpp`.

Three sub-commands:

    convert --model HF_DIR --out FILE.gguf --llama-cpp DIR [--outtype bf16|f32]
        HF folder to a GGUF with llama.cpp's own converter (from the
        package's source distribution). The converter recognises a BPE
        pre-tokenizer by hashing its output on a test string; a tokenizer trained
        locally matches no known hash, and it is GPT-2's byte-level split, so the
        converter is told "gpt-2" (llama.cpp's name for it) instead of giving up.
    run --gguf FILE --prompts prompts.json --new-tokens N --threads T
        batch-1 decode in-process with `Llama.generate` (greedy): prints one
        JSON record (format in `benchmarks/results.py:from_worker`).
    serve --gguf FILE --port P ...
        `python -m llama_cpp.server` with end-of-generation detection turned
        off, so every request runs to `max_tokens` like the other peers.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import time
from itertools import pairwise
from pathlib import Path
from typing import Any


def convert(model: str, out: str, llama_cpp_dir: str, outtype: str = "bf16") -> None:
    """Run the vendored convert_hf_to_gguf.py with the GPT-2 pre-tokenizer forced."""
    root = Path(llama_cpp_dir)
    sys.path[:0] = [str(root), str(root / "gguf-py")]
    from conversion.base import TextModel  # the converter's own package

    def gpt2_pre(self: Any, tokenizer: Any) -> str:
        return "gpt-2"

    TextModel.get_vocab_base_pre = gpt2_pre  # type: ignore[method-assign]
    sys.argv = ["convert_hf_to_gguf.py", model, "--outfile", out, "--outtype", outtype]
    runpy.run_path(str(root / "convert_hf_to_gguf.py"), run_name="__main__")


def run(gguf: str, prompts_file: str, new_tokens: int, threads: int, n_ctx: int) -> None:
    """Time one greedy request at batch 1, token by token, after a short warmup."""
    from llama_cpp import Llama

    prompts: list[str] = json.loads(Path(prompts_file).read_text())
    llm = Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False)

    def one(prompt: str, count: int) -> dict[str, Any]:
        tokens = llm.tokenize(prompt.encode(), add_bos=False)
        stamps: list[float] = []
        start = time.perf_counter()
        # `generate` never stops at EOS by itself: the loop takes exactly `count` tokens.
        for _ in llm.generate(tokens, temp=0.0, top_k=1, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == count:
                break
        return {"ttft_s": stamps[0] - start, "e2e_s": stamps[-1] - start,
                "itl_s": [b - a for a, b in pairwise(stamps)],
                "output_tokens": len(stamps)}

    one(prompts[-1], 4)  # warm up
    # `generate` reuses whatever prefix the last call left in the context: with one
    # prompt the warm-up's would be the measured one's, so start from an empty context.
    llm.reset()
    start = time.perf_counter()
    request = one(prompts[0], new_tokens)
    record = {"streams": 1, "wall_s": time.perf_counter() - start, "requests": [request]}
    print(json.dumps(record), flush=True)


def serve(rest: list[str]) -> None:
    """llama_cpp.server's own entry point, EOS ignored (benchmark only)."""
    import llama_cpp.llama_cpp as lib
    from llama_cpp.server.__main__ import main

    # The completion loop asks this function whether a token ends generation.
    lib.llama_vocab_is_eog = lambda vocab, token: False
    sys.argv = ["llama_cpp.server", *rest]
    main()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_convert = sub.add_parser("convert")
    p_convert.add_argument("--model", required=True)
    p_convert.add_argument("--out", required=True)
    p_convert.add_argument("--llama-cpp", required=True, help="vendor/llama.cpp folder")
    p_convert.add_argument("--outtype", choices=["bf16", "f32"], default="bf16")
    p_run = sub.add_parser("run")
    p_run.add_argument("--gguf", required=True)
    p_run.add_argument("--prompts", required=True)
    p_run.add_argument("--new-tokens", type=int, required=True)
    p_run.add_argument("--threads", type=int, required=True)
    p_run.add_argument("--n-ctx", type=int, default=2048)
    sub.add_parser("serve", add_help=False)
    args, rest = parser.parse_known_args()
    if args.command == "convert":
        convert(args.model, args.out, args.llama_cpp, args.outtype)
    elif args.command == "run":
        run(args.gguf, args.prompts, args.new_tokens, args.threads, args.n_ctx)
    else:
        serve(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
