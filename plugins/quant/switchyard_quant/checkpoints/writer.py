"""``switchyard quantize MODEL OUT --method int4 [--gptq --calibration FILE]``: write a GPTQ folder.

Every linear layer but the LM head (the GPTQ tools' default) is rounded with
``int4``'s RTN (:func:`switchyard_quant.int4.quantize_uint4`), or with
``--gptq`` by GPTQ over a calibration file's texts, one decoder layer after
another (:mod:`switchyard_quant.gptq_layers`, :mod:`switchyard_quant.gptq_solver`;
with ``--act-order`` its columns in order of decreasing Hessian diagonal),
and stored in the GPTQ layout :mod:`.gptq` reads (``qweight``, ``qzeros``,
float16 ``scales``, ``g_idx``; act-order: ``qweight`` in the inputs' order,
``g_idx`` each input's group, ``desc_act`` true), so transformers and GPTQ
tools recognise the folder too. Zero points are stored minus one (``checkpoint_format`` "gptq", what
every GPTQ reader takes) unless a group has a zero point of 0, which that
format cannot hold: then the folder says ``gptq_v2`` and stores them as they
are. Embeddings, norms and the LM head keep their dtype; config.json gets the
``quantization_config``; tokenizer and generation files are copied.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from switchyard_spec import QuantizedWeight

from switchyard_quant.checkpoints.folder import CheckpointError, FolderTensors

if TYPE_CHECKING:
    from switchyard_quant.gptq_layers import GptqSettings

METHODS = {"int4": 128, "int4-g64": 64, "int4-g32": 32}
"""``--method`` -> group size."""
SKIPPED_FILES = ("config.json", "model.safetensors.index.json")
SKIPPED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def pack_along_n(values: torch.Tensor) -> torch.Tensor:
    """int ``[R, N]`` values 0..15 -> int32 ``[R, ceil(N/8)]``, least significant nibble first."""
    from switchyard_quant.int4 import pack_uint4_along_k

    return pack_uint4_along_k(values.to(torch.uint8))


def gptq_tensors(record: QuantizedWeight, v1: bool) -> dict[str, torch.Tensor]:
    """One ``uint4_group_asym`` record as GPTQ's four tensors (names without the prefix).

    A record with an ``input_order`` (act-order) is stored as GPTQ stores it:
    ``qweight`` in the inputs' order and ``g_idx`` each input's group.
    """
    from switchyard_quant.gptq_act_order import g_idx_of, restore_input_order
    from switchyard_quant.int4 import pack_uint4_along_k, unpack_uint4_along_k

    k, group_size = record.in_features, record.format.group_size
    if k % 8:
        raise CheckpointError(f"in_features {k} is not a multiple of 8, which GPTQ's qweight needs")
    data = record.data
    if record.input_order is not None:
        q = restore_input_order(unpack_uint4_along_k(record.data, k), record.input_order)
        data = pack_uint4_along_k(q)
    zeros = record.zero_points.long().T  # [G, N]
    scales = record.scales.T.to(torch.float16)
    flushed = (scales == 0) & (record.scales.T > 0)  # a scale float16 rounds to 0
    if not bool(torch.isfinite(scales).all()) or bool(flushed.any()):
        raise CheckpointError("a scale is outside float16's range")
    return {"qweight": data.T.contiguous(),  # [K/8, N]: the same words, transposed
            "qzeros": pack_along_n(zeros - 1 if v1 else zeros),
            "scales": scales.contiguous(),
            "g_idx": g_idx_of(record.input_order, group_size, k)}


def linear_names(folder: Path) -> tuple[list[str], str]:
    """The model's ``nn.Linear`` modules but the LM head (built on the meta device), and its
    name."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_modules() if m is head), "")
    names = [n for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and m is not head]
    return names, head_name


def rounded_records(src: Path, tensors: FolderTensors, names: list[str], group_size: int,
                    gptq: GptqSettings | None) -> tuple[dict[str, QuantizedWeight], str]:
    """Each linear's uint4 record (RTN, or GPTQ where ``gptq`` is given), and how it was made."""
    from switchyard_quant.int4 import quantize_uint4

    records: dict[str, QuantizedWeight] = {}
    how = "RTN"
    if gptq is not None:
        from switchyard_quant.gptq_layers import calibrate_and_quantize

        result = calibrate_and_quantize(src, names, gptq)
        records.update(result.records)
        how = (f"GPTQ over {result.prompts} calibration prompts, {result.tokens} tokens, "
               f"damp {gptq.damp:g}")
        if len(records) < len(names):
            how += f"; {len(names) - len(records)} linears outside the decoder layers by RTN"
    for n in names:
        if n not in records:
            records[n] = quantize_uint4(tensors.get(f"{n}.weight").float(), group_size)
    return records, how


def write_gptq(model: str | Path, out: str | Path, group_size: int = 128,
               gptq: GptqSettings | None = None) -> dict:
    """Quantize ``model`` (a folder) into the GPTQ folder ``out``; returns its quantization_config.

    RTN unless ``gptq`` (calibration file and settings) is given; the result
    also holds ``linears``, ``head`` and ``how`` (a line saying how it was rounded).
    """
    from safetensors.torch import save_file

    src, dst = Path(model), Path(out)
    if not (src / "config.json").is_file():
        raise CheckpointError(f"{src}: no config.json (a model folder is needed)")
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if config.get("quantization_config"):
        raise CheckpointError(f"{src}/config.json: the model is quantized already "
                              f"({config['quantization_config'].get('quant_method')})")
    tensors = FolderTensors(src)
    names, head = linear_names(src)
    quantize = [n for n in names if f"{n}.weight" in tensors]
    if not quantize:
        raise CheckpointError(f"{src}: no linear layer's weight found in the safetensors")
    if gptq is not None and gptq.group_size != group_size:
        raise ValueError(f"GPTQ group size {gptq.group_size} is not the method's {group_size}")
    records, how = rounded_records(src, tensors, quantize, group_size, gptq)
    # v1 (zero points minus one) unless some group's zero point is 0.
    v1 = all(int(r.zero_points.min()) > 0 for r in records.values())
    out_tensors: dict[str, torch.Tensor] = {}
    skip = {f"{n}.weight" for n in quantize}
    for name in tensors.names():
        if name not in skip:
            out_tensors[name] = tensors.get(name).contiguous()
    for n in quantize:
        for suffix, tensor in gptq_tensors(records[n], v1).items():
            out_tensors[f"{n}.{suffix}"] = tensor
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out_tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    act_order = gptq is not None and gptq.act_order
    quant = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": act_order,
             "sym": False, "true_sequential": True, "static_groups": False,
             "checkpoint_format": "gptq" if v1 else "gptq_v2", "lm_head": False}
    if gptq is not None:
        quant["damp_percent"] = gptq.damp
    config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for path in src.iterdir():
        if path.is_file() and path.name not in SKIPPED_FILES and not path.name.endswith(
                SKIPPED_SUFFIXES):
            shutil.copy2(path, dst / path.name)
    return {**quant, "linears": len(quantize), "head": head, "how": how}


def _parser() -> argparse.ArgumentParser:
    from switchyard_quant.gptq_layers import DEFAULT_MAX_TOKENS, DEFAULT_SAMPLES
    from switchyard_quant.gptq_solver import DEFAULT_DAMP, GROUP_SIZES

    parser = argparse.ArgumentParser(
        prog="switchyard quantize",
        description="Round a model's linear layers (all but the LM head) to 4 bits and write a "
                    "GPTQ folder that `switchyard serve --model-id OUT` serves (detected) and "
                    "GPTQ tools read. Round to nearest by default; --gptq --calibration FILE "
                    "for GPTQ's error feedback over calibration texts.")
    parser.add_argument("model", help="the model folder (config.json and safetensors)")
    parser.add_argument("out", help="the folder to write")
    parser.add_argument("--method", choices=sorted(METHODS), default=None,
                        help="int4: groups of 128 (default); int4-g64, int4-g32")
    parser.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=None,
                        help="the group size (instead of --method's suffix)")
    parser.add_argument("--gptq", action="store_true",
                        help="GPTQ (Hessian error feedback, layer by layer) instead of RTN; "
                             "needs --calibration")
    parser.add_argument("--calibration", metavar="FILE",
                        help="GPTQ's calibration texts: JSON Lines, one {\"text\": ...} or "
                             "string per line")
    parser.add_argument("--damp", type=float, default=None,
                        help=f"GPTQ's dampening, a fraction of the Hessian's mean diagonal "
                             f"(default {DEFAULT_DAMP})")
    parser.add_argument("--calibration-samples", type=int, default=None,
                        help=f"GPTQ: the file's first N texts (default {DEFAULT_SAMPLES})")
    parser.add_argument("--calibration-tokens", type=int, default=None,
                        help=f"GPTQ: tokens per text at most (default {DEFAULT_MAX_TOKENS})")
    parser.add_argument("--act-order", action="store_true",
                        help="GPTQ: round each layer's columns in order of decreasing Hessian "
                             "diagonal (desc_act, g_idx); only with --gptq")
    return parser


def _settings(parser: argparse.ArgumentParser, args: argparse.Namespace,
              ) -> tuple[int, GptqSettings | None]:
    """The group size and the GPTQ settings the arguments ask for; parser.error on a conflict."""
    from switchyard_quant.gptq_layers import GptqSettings

    group = args.group_size or METHODS[args.method or "int4"]
    if args.method and args.group_size and METHODS[args.method] != args.group_size:
        parser.error(f"--group-size {args.group_size} contradicts --method {args.method} "
                     f"(groups of {METHODS[args.method]})")
    gptq_only = {"--calibration": args.calibration, "--damp": args.damp,
                 "--act-order": args.act_order or None,
                 "--calibration-samples": args.calibration_samples,
                 "--calibration-tokens": args.calibration_tokens}
    if not args.gptq:
        given = [flag for flag, value in gptq_only.items() if value is not None]
        if given:
            parser.error(f"{', '.join(given)}: only with --gptq (round to nearest needs no "
                         "calibration and rounds every weight on its own)")
        return group, None
    if not args.calibration:
        parser.error("--gptq needs --calibration FILE: a JSON Lines file of calibration texts "
                     "(one {\"text\": ...} or string per line)")
    defaults = GptqSettings(calibration_file=args.calibration)
    settings = GptqSettings(
        calibration_file=args.calibration, group_size=group,
        damp=defaults.damp if args.damp is None else args.damp,
        samples=defaults.samples if args.calibration_samples is None else args.calibration_samples,
        max_tokens=(defaults.max_tokens if args.calibration_tokens is None
                    else args.calibration_tokens), act_order=args.act_order)
    if not 0.0 < settings.damp <= 1.0:
        parser.error(f"--damp {settings.damp:g}: must be above 0 and at most 1")
    if settings.samples < 1 or settings.max_tokens < 1:
        parser.error("--calibration-samples and --calibration-tokens must be positive")
    return group, settings


def main(argv: list[str]) -> int:
    """``switchyard quantize MODEL OUT [--method int4[-g64|-g32]] [--gptq --calibration FILE]``."""
    parser = _parser()
    args = parser.parse_args(argv)
    group, gptq = _settings(parser, args)
    begin = time.perf_counter()
    try:
        written = write_gptq(args.model, args.out, group, gptq)
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"switchyard quantize: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {written['linears']} linears as GPTQ 4-bit, group "
          f"{written['group_size']}{', act-order' if written['desc_act'] else ''}, "
          f"checkpoint_format {written['checkpoint_format']} "
          f"({written['how']}); {written['head'] or 'the LM head'} kept in float; "
          f"{time.perf_counter() - begin:.1f}s")
    return 0
