"""What FP8 through Intel Neural Compressor (``QUANT_CONFIG``) costs in accuracy, on the CPU.

Runs the seed's two-phase flow with the shipped example configs
(``plugins/gaudi/examples/maxabs_measure.json``, then ``maxabs_quant.json``),
unchanged, through the same code the gaudi engine calls
(``switchyard_quant.fp8_inc``): the CPU's rewrites apply (``use_qdq`` true,
``maxabs_hw`` -> ``maxabs_pow2``). The model serves in bf16 around the FP8
matmuls (``hp_dtype`` bf16), as on a Gaudi.

1. measure: a bf16 copy with INC's observers runs the calibration prompts
   (teacher-forced forward passes); the statistics go to a temporary folder
   (the configs' relative ``dump_stats_path`` resolves against it);
2. quantize: another bf16 copy is converted to FP8 with them;
3. report, over evaluation prompts other than the calibration ones: the
   relative L2 error, largest absolute error and argmax agreement of the
   logits at every position (teacher-forced) of bf16 against fp32, and of
   FP8 against bf16 and fp32; and greedy decoding from each prompt with bf16
   and with FP8 (transformers' ``generate``): tokens until the first
   difference, and whole sequences equal.

    .venv/bin/python benchmarks/fp8_accuracy.py --model /tmp/bench-models/small

Without ``--model`` it builds and uses the gateway's default tiny model. The
models are random-weight: near-flat next-token distributions make every
perturbation move the argmax, so the agreement figures are pessimistic; read
FP8's row against bf16's, which carries the same caveat.
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for sub in ("gateway", "spec", "plugins/quant"):
    sys.path.insert(0, str(ROOT / sub))

from switchyard_quant import fp8_inc  # noqa: E402

EXAMPLES = ROOT / "plugins" / "gaudi" / "examples"


def logits_errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float, float]:
    """Relative L2 error, largest absolute error, argmax agreement of [T, V] logits."""
    got, want = got.float(), want.float()
    return (float((got - want).norm() / want.norm()), float((got - want).abs().max()),
            float((got.argmax(-1) == want.argmax(-1)).float().mean()))


def greedy(model: torch.nn.Module, prompt: torch.Tensor, new: int) -> list[int]:
    """``generate``'s greedy continuation, EOS ignored."""
    out = model.generate(prompt[None], attention_mask=torch.ones_like(prompt)[None],
                         do_sample=False, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
    return out[0, prompt.numel():].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model folder (default: the gateway's tiny model)")
    parser.add_argument("--prompts", type=int, default=8, help="evaluation prompts")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--calibration", type=int, default=8, help="calibration prompts")
    parser.add_argument("--new", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    model_path = args.model
    if model_path is None:
        from switchyard.models.random_model import ensure_random_model

        model_path = str(ensure_random_model())
    fp32 = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    vocab = fp32.config.vocab_size
    calibration = torch.randint(3, vocab, (args.calibration, args.tokens),
                                generator=torch.Generator().manual_seed(1))
    prompts = torch.randint(3, vocab, (args.prompts, args.tokens),
                            generator=torch.Generator().manual_seed(2))
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fp8-accuracy-") as work, torch.inference_mode():
        measure = fp8_inc.read_config(str(EXAMPLES / "maxabs_measure.json"), "cpu", "bfloat16",
                                      cwd=work)
        measuring = fp8_inc.apply(copy.deepcopy(bf16), measure)
        for prompt in calibration:
            measuring.model(prompt[None])
        measuring.finish()
        quant = fp8_inc.read_config(str(EXAMPLES / "maxabs_quant.json"), "cpu", "bfloat16",
                                    cwd=work)
        fp8 = fp8_inc.apply(copy.deepcopy(bf16), quant).model
        flow_s = time.perf_counter() - began
        rows: dict[str, list[tuple[float, float, float]]] = {
            "bf16 vs fp32": [], "FP8 vs bf16": [], "FP8 vs fp32": []}
        for prompt in prompts:
            want32 = fp32(prompt[None]).logits[0]
            want16 = bf16(prompt[None]).logits[0]
            got = fp8(prompt[None]).logits[0]
            rows["bf16 vs fp32"].append(logits_errors(want16, want32))
            rows["FP8 vs bf16"].append(logits_errors(got, want16))
            rows["FP8 vs fp32"].append(logits_errors(got, want32))
        prefix, same = [], 0
        for prompt in prompts:
            a, b = greedy(bf16, prompt, args.new), greedy(fp8, prompt, args.new)
            prefix.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
            same += a == b
    total_s = time.perf_counter() - began
    bf16_bytes = sum(p.numel() * p.element_size() for p in bf16.parameters())
    fp8_weights = fp8_inc.fp8_bytes(fp8)
    print(f"model {model_path}: {sum(p.numel() for p in fp32.parameters()):,} parameters; "
          f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"configs {EXAMPLES.relative_to(ROOT)}/maxabs_measure.json, maxabs_quant.json; CPU "
          f"rewrites: {'; '.join(quant.notes)}")
    print(f"calibration {args.calibration} x {args.tokens} tokens; evaluation {args.prompts} x "
          f"{args.tokens} tokens; measure + convert {flow_s:.1f}s, all {total_s:.1f}s")
    print(f"weights: bf16 {bf16_bytes / 2**20:.1f} MiB; FP8 model {fp8_weights / 2**20:.1f} MiB "
          "in float8_e4m3fn + the rest in bf16\n")
    print("| logits | relative L2 error | max abs error | argmax agrees |\n|---|---:|---:|---:|")
    for name, values in rows.items():
        rel, top, agree = (sum(v[i] for v in values) / len(values) for i in range(3))
        worst = max(v[1] for v in values)
        print(f"| {name} | {rel:.2e} | {worst:.3f} (mean {top:.3f}) | {100 * agree:.1f}% |")
    print(f"\ngreedy, {args.prompts} prompts x {args.new} tokens, FP8 against bf16: "
          f"{sum(prefix) / len(prefix):.1f} tokens equal before the first difference on "
          f"average; {same} of {args.prompts} sequences equal")


if __name__ == "__main__":
    main()
