"""``python -m switchyard_gaudi plan``: the warmup plan and its memory, without a device or weights.

Size the settings before booking a Gaudi: it reads the model folder's
``config.json`` and safetensors headers (no weight is loaded), the seed's
bucket variables from the environment, and the launcher's limits from its
flags, and prints every shape warmup would run and the memory estimate
against ``--device-memory`` (a Gaudi2 has 96 GiB, a Gaudi3 128). A
configuration that would not fit exits with status 2 and the message the
server would stop with. With a QUANTIZE ``QUANT_CONFIG`` in the environment
the FP8 weights count at one byte each.

``python -m switchyard_gaudi measure``: the first half of FP8 (``QUANT_CONFIG``
pointing to a MEASURE config, e.g. ``plugins/gaudi/examples/maxabs_measure.json``):
starts the engine as the server would (same model setup, buckets and
limits), runs each calibration prompt of ``--prompts`` (one per line) to
``--max-new-tokens`` greedy tokens, and shuts the engine down, which writes
the statistics to the config's ``dump_stats_path``. A QUANTIZE config with
the same ``dump_stats_path`` then serves from them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import msgspec
from switchyard_spec import (
    EngineConfig,
    EngineRequest,
    EngineStartError,
    SamplingParams,
    StoppingParams,
    TokenEvent,
)

from switchyard_gaudi.assembly import check_model, memory_for, serving_dtype
from switchyard_gaudi.fp8 import fp8_dims
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
    plan.add_argument("--num-shard", type=int, default=1,
                      help="tensor-parallel ranks: the plan is one rank's")
    _add_measure(sub)
    args = parser.parse_args(argv)
    if args.command == "measure":
        return measure(args)
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
        if dims.takes_images:  # what a vision model cannot be served with stops here too
            check_model(dims, msgspec.structs.replace(config, num_shard=args.num_shard),
                        settings)
        dtype = serving_dtype(args.dtype, args.device)
        if settings.quant_config:  # FP8 weights at one byte; the statistics may come later
            dims = fp8_dims(dims, args.model_id, _quant_plan(settings.quant_config, args.device,
                                                             str(dtype).removeprefix("torch.")))
        if args.num_shard < 1 or dims.num_kv_heads % args.num_shard \
                or dims.num_heads % args.num_shard:
            raise EngineStartError(f"--num-shard {args.num_shard} must be positive and divide "
                                   f"the {dims.num_heads} attention and {dims.num_kv_heads} "
                                   "key/value heads")
        memory = memory_for(args.device, settings.enable_hpu_graph,
                            parse_bytes("--device-memory", args.device_memory), args.num_shard)
        result = resolve_plan(config, options, dims.per_rank(args.num_shard),
                              BucketSettings.from_settings(settings, dims.takes_images),
                              DTYPE_BYTES[str(dtype).removeprefix("torch.")], memory)
    except EngineStartError as exc:
        print(f"does not fit: {exc}", file=sys.stderr)
        return 2
    limits = result.limits
    print(f"model {dims.model_type}, {dims.parameters:,} parameters, "
          f"{str(dtype).removeprefix('torch.')} on {args.device}"
          + (f", split over {args.num_shard} ranks (the plan is one rank's)"
             if args.num_shard > 1 else ""))
    print(f"limits: max_input_tokens {limits.max_input_tokens}, max_total_tokens "
          f"{limits.max_total_tokens}, max_batch_size {limits.max_batch_size}, "
          f"max_batch_prefill_tokens {limits.max_batch_prefill_tokens}")
    print(result.describe())
    return 0


def _quant_plan(path: str, device: str, dtype: str) -> object:
    """QUANT_CONFIG read for the plan's memory (no INC, no statistics needed); EngineStartError."""
    try:
        from switchyard_quant.fp8_inc import Fp8Error, read_config
    except ImportError:
        raise EngineStartError("QUANT_CONFIG is set, and FP8 needs the quant plugin: pip install "
                               "'switchyard-quant[fp8]'") from None
    try:
        return read_config(path, device, dtype)
    except Fp8Error as exc:
        raise EngineStartError(f"QUANT_CONFIG={path}: {exc}") from None


def _add_measure(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("measure", help="FP8: run calibration prompts under a MEASURE "
                                       "QUANT_CONFIG and write the statistics")
    m.add_argument("--model-id", required=True, help="a local model folder")
    m.add_argument("--prompts", required=True,
                   help="a text file of calibration prompts, one per line (blank lines skipped)")
    m.add_argument("--max-new-tokens", type=int, default=32,
                   help="greedy tokens generated per prompt (measured too)")
    m.add_argument("--device", choices=("auto", "hpu", "cpu"), default="auto")
    m.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    m.add_argument("--max-input-tokens", "--max-input-length", type=int, default=0)
    for flag in ("--max-total-tokens", "--max-batch-size", "--max-batch-prefill-tokens",
                 "--max-batch-total-tokens", "--num-threads"):
        m.add_argument(flag, type=int, default=0)


class _Waiter:
    """A sink that counts finished sequences and keeps their errors."""

    def __init__(self, expected: int) -> None:
        self.left = expected
        self.generated = 0
        self.errors: list[str] = []
        self.done = threading.Event()
        self._lock = threading.Lock()
        if expected == 0:
            self.done.set()

    def __call__(self, event: TokenEvent) -> None:
        with self._lock:
            if event.error is not None:
                self.errors.append(f"{event.request_id}: {event.error}")
            elif event.token_id >= 0:
                self.generated += 1
            if event.error is not None or event.finish_reason is not None:
                self.left -= 1
                if self.left == 0:
                    self.done.set()


def measure(args: argparse.Namespace) -> int:
    """Run the calibration prompts through the engine in MEASURE mode; 0 when written, else 2."""
    path = os.environ.get("QUANT_CONFIG", "").strip()
    if not path:
        print("measure: set QUANT_CONFIG to a MEASURE config (e.g. "
              "plugins/gaudi/examples/maxabs_measure.json)", file=sys.stderr)
        return 2
    try:
        with open(path, encoding="utf-8") as fh:
            mode = str(json.load(fh).get("mode", "")).upper()
    except (OSError, ValueError, AttributeError):
        mode = ""  # the engine's start-up names what is wrong with the file
    if mode and mode != "MEASURE":
        print(f"measure: QUANT_CONFIG={path} is a {mode} config; measuring needs "
              "\"mode\": \"MEASURE\"", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from switchyard_gaudi.engine import GaudiEngine

    with open(args.prompts, encoding="utf-8") as fh:
        prompts = [line.strip() for line in fh if line.strip()]
    if not prompts:
        print(f"measure: {args.prompts} holds no prompt", file=sys.stderr)
        return 2
    options = {"device": args.device}
    if args.num_threads:
        options["num_threads"] = str(args.num_threads)
    config = EngineConfig(model_path=args.model_id, dtype=args.dtype,
                          max_total_tokens=args.max_total_tokens,
                          max_input_tokens=args.max_input_tokens,
                          max_batch_size=args.max_batch_size,
                          max_batch_prefill_tokens=args.max_batch_prefill_tokens,
                          max_batch_total_tokens=args.max_batch_total_tokens, options=options)
    engine = GaudiEngine(config)
    began = time.time() - 1.0  # file times may be rounded to the second
    try:
        engine.start()
        engine.warmup()
    except EngineStartError as exc:
        engine.shutdown()
        print(f"measure: {exc}", file=sys.stderr)
        return 2
    assert engine.plan is not None
    limits = engine.plan.limits
    tokenizer = AutoTokenizer.from_pretrained(args.model_id)
    waiter = _Waiter(len(prompts))
    prompt_tokens = 0
    for i, text in enumerate(prompts):
        ids = tokenizer(text)["input_ids"][-limits.max_input_tokens:]  # TGI's left truncation
        new = max(1, min(args.max_new_tokens, limits.max_total_tokens - len(ids)))
        prompt_tokens += len(ids)
        engine.submit(EngineRequest(request_id=f"calibration-{i}", prompt_token_ids=tuple(ids),
                                    sampling=SamplingParams(),
                                    stopping=StoppingParams(max_new_tokens=new, ignore_eos=True)),
                      waiter)
    waiter.done.wait()
    engine.shutdown()  # MEASURE: the statistics are written here
    if waiter.errors:
        print("measure: " + "; ".join(waiter.errors), file=sys.stderr)
        return 2
    from switchyard_quant.fp8_inc import read_config

    assert engine.info is not None and engine.device is not None
    plan = read_config(path, engine.device.kind, engine.info.dtype)
    files = [f for f in plan.measurement_files() if os.path.getmtime(f) >= began]
    if not files:
        print(f"measure: no statistics were written at {plan.dump_stats_path}_hooks_"
              f"{plan.observer}.* (see the log)", file=sys.stderr)
        return 2
    print(f"measured {len(prompts)} prompts ({prompt_tokens} prompt tokens, "
          f"{waiter.generated} generated); statistics: {', '.join(files)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
