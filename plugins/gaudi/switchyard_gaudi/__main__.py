"""``python -m switchyard_gaudi plan``: the warmup plan and its memory, without a device or weights.

Size the settings before booking a Gaudi: it reads the model folder's
``config.json`` and safetensors headers (no weight is loaded), the seed's
bucket variables from the environment, and the launcher's limits from its
flags, and prints every shape warmup would run and the memory estimate
against ``--device-memory`` (a Gaudi2 has 96 GiB, a Gaudi3 128). A
configuration that would not fit exits with status 2 and the message the
server would stop with.
"""

from __future__ import annotations

import argparse
import sys

from switchyard_spec import EngineConfig, EngineStartError

from switchyard_gaudi.assembly import memory_for, serving_dtype
from switchyard_gaudi.limits import EngineOptions, parse_bytes, resolve_plan
from switchyard_gaudi.model_dims import DTYPE_BYTES, read_model_dims
from switchyard_gaudi.settings import GaudiSettings
from switchyard_gaudi.warmup_plan import BucketSettings


def main(argv: list[str] | None = None) -> int:
    """Print the plan for the arguments; 0 when it fits, 2 when it does not."""
    parser = argparse.ArgumentParser(prog="python -m switchyard_gaudi")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="print the warmup shapes and their memory estimate")
    plan.add_argument("--model-id", required=True, help="a local model folder")
    plan.add_argument("--device-memory", required=True, help="free device memory, e.g. 96GiB")
    plan.add_argument("--device", choices=("hpu", "cpu"), default="hpu")
    plan.add_argument("--dtype", default="auto",
                      choices=("auto", "float32", "bfloat16", "float16"))
    plan.add_argument("--max-input-tokens", "--max-input-length", type=int, default=0)
    for flag in ("--max-total-tokens", "--max-batch-size", "--max-batch-prefill-tokens",
                 "--max-batch-total-tokens"):
        plan.add_argument(flag, type=int, default=0)
    args = parser.parse_args(argv)
    try:
        settings = GaudiSettings.from_env()
        config = EngineConfig(model_path=args.model_id, dtype=args.dtype,
                              max_total_tokens=args.max_total_tokens,
                              max_input_tokens=args.max_input_tokens,
                              max_batch_size=args.max_batch_size,
                              max_batch_prefill_tokens=args.max_batch_prefill_tokens,
                              max_batch_total_tokens=args.max_batch_total_tokens)
        options = EngineOptions()
        dims = read_model_dims(args.model_id)
        dtype = serving_dtype(args.dtype, args.device)
        memory = memory_for(args.device, settings.enable_hpu_graph,
                            parse_bytes("--device-memory", args.device_memory))
        result = resolve_plan(config, options, dims, BucketSettings.from_settings(settings),
                              DTYPE_BYTES[str(dtype).removeprefix("torch.")], memory)
    except EngineStartError as exc:
        print(f"does not fit: {exc}", file=sys.stderr)
        return 2
    limits = result.limits
    print(f"model {dims.model_type}, {dims.parameters:,} parameters, "
          f"{str(dtype).removeprefix('torch.')} on {args.device}")
    print(f"limits: max_input_tokens {limits.max_input_tokens}, max_total_tokens "
          f"{limits.max_total_tokens}, max_batch_size {limits.max_batch_size}, "
          f"max_batch_prefill_tokens {limits.max_batch_prefill_tokens}")
    print(result.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
