"""What ``--quantize int8`` (or int4) costs in accuracy and saves in memory, against bf16.

Loads a model folder with transformers in fp32 and makes copies whose
linears are the engine's own (``pack_linears``): bf16 dot-product panels (the
``--dtype bfloat16`` mode) and the panels of each ``--methods`` entry
(``--quantize int8``, ``int4``, ...; the installed plugins' methods). For a set
of prompts it reports, against the fp32 model: the relative error of the
logits at every position, and how often the argmax agrees (teacher-forced,
so one flip does not count twice); and each copy's linear weight bytes.

    .venv/bin/python benchmarks/int8_accuracy.py --model /tmp/bench-models/small-bf16

The benchmark models have random weights: their next-token distributions are
nearly flat, so argmax agreement here is a pessimistic figure (a trained
model's top token usually leads by far more than these errors). Compare the
int8 row with the bf16 row, which carries the same caveat. Attention and the
cache run in fp32 here; only the linears differ.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for sub in ("gateway", "spec", "plugins/xeon", "plugins/quant"):
    sys.path.insert(0, str(ROOT / sub))

from switchyard.plugins import PluginHost  # noqa: E402
from switchyard_xeon.kernels import load_kernels  # noqa: E402
from switchyard_xeon.linears import PanelLinear, pack_linears  # noqa: E402


def packed_copy(model: torch.nn.Module, quantize: str | None) -> torch.nn.Module:
    """A copy of fp32 ``model`` with the engine's bf16 dot-product linears, quantized by a method."""
    twin = copy.deepcopy(model)
    host = PluginHost.from_entry_points()
    method = host.resolve_quantization(quantize, host.engines()["xeon"])
    report = pack_linears(twin, panels=True, bf16_dot=True, quantization=method)
    if not report.bf16_dot:
        sys.exit(f"the dot-product panels did not pack: {report.reason}")
    return twin


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the packed linear weights (scales included)."""
    return sum(m.packed_weight.nbytes for m in model.modules() if isinstance(m, PanelLinear))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="/tmp/bench-models/small-bf16")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256, help="tokens per prompt")
    parser.add_argument("--methods", nargs="+", default=["int8"],
                        help="--quantize methods to compare with bf16 (int8, int4, int4-g64, ...)")
    args = parser.parse_args()
    if not load_kernels().bf16_dot:
        sys.exit("needs the AVX512_BF16 dot-product kernels: " + load_kernels().reason)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    copies = {name: packed_copy(model, None if name == "bf16" else name)
              for name in ("bf16", *args.methods)}
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompts = torch.randint(3, vocab, (args.prompts, args.tokens), generator=gen)
    errors: dict[str, list[float]] = {name: [] for name in copies}
    agree: dict[str, list[float]] = {name: [] for name in copies}
    with torch.inference_mode():
        for prompt in prompts:
            want = model(prompt[None]).logits[0]
            for name, twin in copies.items():
                got = twin(prompt[None]).logits[0]
                errors[name].append(((got - want).norm() / want.norm()).item())
                agree[name].append((got.argmax(-1) == want.argmax(-1)).float().mean().item())
    print(f"model {args.model}, {args.prompts} prompts x {args.tokens} tokens, vs fp32 logits\n")
    print("| linears | weight MB | logits rel. error | argmax agrees |\n|---|---:|---:|---:|")
    for name, twin in copies.items():
        print(f"| {name} | {weight_bytes(twin) / 1e6:.0f} | "
              f"{sum(errors[name]) / len(errors[name]):.2e} | "
              f"{100 * sum(agree[name]) / len(agree[name]):.1f}% |")


if __name__ == "__main__":
    main()
