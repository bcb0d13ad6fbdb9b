"""``switchyard quantize MODEL OUT --method int4``: write a GPTQ folder (round to nearest).

Every linear layer but the LM head (the GPTQ tools' default) is rounded with
``int4``'s RTN (:func:`switchyard_quant.int4.quantize_uint4`) and stored in
the GPTQ layout :mod:`.gptq` reads (``qweight``, ``qzeros``, float16
``scales``, ``g_idx``), so transformers and GPTQ tools recognise the folder
too. Zero points are stored minus one (``checkpoint_format`` "gptq", what
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

import torch

from switchyard_spec import QuantizedWeight

from switchyard_quant.checkpoints.folder import CheckpointError, FolderTensors

METHODS = {"int4": 128, "int4-g64": 64, "int4-g32": 32}
"""``--method`` -> group size."""
SKIPPED_FILES = ("config.json", "model.safetensors.index.json")
SKIPPED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def pack_along_n(values: torch.Tensor) -> torch.Tensor:
    """int ``[R, N]`` values 0..15 -> int32 ``[R, ceil(N/8)]``, least significant nibble first."""
    from switchyard_quant.int4 import pack_uint4_along_k

    return pack_uint4_along_k(values.to(torch.uint8))


def gptq_tensors(record: QuantizedWeight, v1: bool) -> dict[str, torch.Tensor]:
    """One ``uint4_group_asym`` record as GPTQ's four tensors (names without the prefix)."""
    k, group_size = record.in_features, record.format.group_size
    if k % 8:
        raise CheckpointError(f"in_features {k} is not a multiple of 8, which GPTQ's qweight needs")
    zeros = record.zero_points.long().T  # [G, N]
    scales = record.scales.T.to(torch.float16)
    if not bool(torch.isfinite(scales).all()) or bool(((scales == 0) & (record.scales.T > 0)).any()):
        raise CheckpointError("a scale is outside float16's range")
    return {"qweight": record.data.T.contiguous(),  # [K/8, N]: the same words, transposed
            "qzeros": pack_along_n(zeros - 1 if v1 else zeros),
            "scales": scales.contiguous(),
            "g_idx": (torch.arange(k, dtype=torch.int32) // group_size)}


def linear_names(folder: Path) -> tuple[list[str], str]:
    """The model's ``nn.Linear`` modules but the LM head (built on the meta device), and its name."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    head_name = next((n for n, m in model.named_modules() if m is head), "")
    names = [n for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear) and m is not head]
    return names, head_name


def write_gptq(model: str | Path, out: str | Path, group_size: int = 128) -> dict:
    """Quantize ``model`` (a folder) into the GPTQ folder ``out``; returns its quantization_config."""
    from safetensors.torch import save_file

    from switchyard_quant.int4 import quantize_uint4

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
    records = {n: quantize_uint4(tensors.get(f"{n}.weight").float(), group_size)
               for n in quantize}
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
    quant = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False,
             "sym": False, "true_sequential": True, "static_groups": False,
             "checkpoint_format": "gptq" if v1 else "gptq_v2", "lm_head": False}
    config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    for path in src.iterdir():
        if path.is_file() and path.name not in SKIPPED_FILES and not path.name.endswith(
                SKIPPED_SUFFIXES):
            shutil.copy2(path, dst / path.name)
    return {**quant, "linears": len(quantize), "head": head}


def main(argv: list[str]) -> int:
    """``switchyard quantize MODEL OUT --method int4[-g64|-g32]``."""
    parser = argparse.ArgumentParser(
        prog="switchyard quantize",
        description="Round a model's linear layers (all but the LM head) to 4 bits and write a "
                    "GPTQ folder that `switchyard serve --model-id OUT` serves (detected) and "
                    "GPTQ tools read.")
    parser.add_argument("model", help="the model folder (config.json and safetensors)")
    parser.add_argument("out", help="the folder to write")
    parser.add_argument("--method", choices=sorted(METHODS), default="int4",
                        help="int4: groups of 128 (default); int4-g64, int4-g32")
    args = parser.parse_args(argv)
    begin = time.perf_counter()
    try:
        written = write_gptq(args.model, args.out, METHODS[args.method])
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"switchyard quantize: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {written['linears']} linears as GPTQ 4-bit, group "
          f"{written['group_size']}, checkpoint_format {written['checkpoint_format']} (RTN); "
          f"{written['head'] or 'the LM head'} kept in float; {time.perf_counter() - begin:.1f}s")
    return 0
