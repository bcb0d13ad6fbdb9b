"""Tensor parallelism: how many ranks serve the model, and splitting its weights over them.

``--sharded true --num-shard N`` (``EngineConfig.num_shard``: 1 unsharded, 0
every device there is, N that many ranks) is resolved by :func:`resolve_ranks`
before any weight loads, refusing clearly what cannot run: ``--sharded true``
without a count on the CPU device (its ranks are processes, there is no device
count to take), more ranks than HPUs, a model whose heads do not split evenly,
a model family not verified sharded, or DeepSpeed missing.

:func:`shard_model` splits a loaded transformers model in place with
DeepSpeed's AutoTP (``init_inference`` with ``replace_with_kernel_inject=False``,
as optimum-habana does): the query, key, value, gate and up projections are
split by output features (each rank keeps ``heads / N`` attention heads and
``kv_heads / N`` key/value heads), the output and down projections and the LM
head by input features, each followed by an all-reduce, so every rank ends a
layer (and the step) with the whole hidden state and the whole logits. The
engine's attention function and static cache work unchanged on each rank's
heads. Every rank calls both functions with the same arguments.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from switchyard_spec import EngineStartError

from switchyard_gaudi.device import CPU, HPU, Device
from switchyard_gaudi.model_dims import ModelDims

if TYPE_CHECKING:
    import torch

SHARDED_MODELS = ("llama", "mistral", "qwen2")
"""Model types whose greedy output on two CPU ranks equals ``generate``'s
(tests/gaudi/test_gaudi_sharding.py).

Phi-3's fused ``qkv_proj`` and ``gate_up_proj`` are not split right by AutoTP
for this engine (its sharded steps failed when tried): it is refused when sharded.
"""
SHM_COMM_OP = "deepspeed_shm_comm"
"""DeepSpeed's shared-memory all-reduce for CPU ranks, which this engine turns off."""


def resolve_ranks(num_shard: int, device: Device, dims: ModelDims,
                  environ: Mapping[str, str]) -> int:
    """The number of ranks to serve ``dims`` with; EngineStartError when it cannot be done."""
    if num_shard == 1:
        return 1
    if num_shard < 0:
        raise EngineStartError(f"--num-shard must be positive, not {num_shard}")
    if num_shard == 0 and device.kind == CPU:
        raise EngineStartError(
            "gaudi engine on the CPU device: --sharded true needs --num-shard N (the CPU "
            "device has no count of devices to shard over; each rank is a process)")
    ranks = num_shard or device.count()
    if ranks == 1:
        return 1
    if device.kind == HPU and ranks > device.count():
        raise EngineStartError(f"--num-shard {ranks}: only {device.count()} HPU(s) here")
    if dims.model_type not in SHARDED_MODELS:
        raise EngineStartError(
            f"gaudi engine: sharding a {dims.model_type!r} model is not supported (sharded: "
            f"{', '.join(SHARDED_MODELS)}); serve it with --num-shard 1")
    if dims.num_heads % ranks or dims.num_kv_heads % ranks:
        raise EngineStartError(
            f"--num-shard {ranks} does not divide the model's {dims.num_heads} attention heads "
            f"and {dims.num_kv_heads} key/value heads; use a divisor of {dims.num_kv_heads}")
    problem = device.sharding_problem(environ)
    if problem is not None:
        raise EngineStartError(f"gaudi engine: --num-shard {ranks}: {problem}")
    if importlib.util.find_spec("deepspeed") is None:
        raise EngineStartError(
            f"gaudi engine: --num-shard {ranks} needs DeepSpeed (on the CPU: pip install "
            "--no-build-isolation 'deepspeed==0.19.*'; on an HPU: Habana's DeepSpeed fork)")
    return ranks


def shard_model(model: torch.nn.Module, device: Device, ranks: int,
                dtype: torch.dtype) -> torch.nn.Module:
    """Split ``model``'s weights over ``ranks`` ranks with DeepSpeed AutoTP; returns the module.

    The process group must be up (every rank calls this at the same point:
    it creates a group of the ranks, a collective). Three things are set first:

    - on the CPU device, DeepSpeed's accelerator is the CPU (``DS_ACCELERATOR``,
      unless set): on a machine with an HPU, ``device=cpu`` would get the HPU;

    - DeepSpeed's shared-memory all-reduce for CPU ranks is turned off, so the
      all-reduces go through the process group (gloo): the shared-memory one
      spins on flags in shared memory with no timeout, so a peer that dies
      would hang the others instead of failing their step, and it is
      compiled on first use (a minute on two cores, a compiler needed);
    - DeepSpeed caches its tensor-parallel group on a class; it is cleared so
      that an engine started after another in the same process (tests) gets a
      group of its own process group, not of the one torn down.
    """
    if device.kind == CPU:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.ops
    from deepspeed.inference.engine import InferenceEngine

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
    InferenceEngine.inference_mp_group = None
    engine = deepspeed.init_inference(model, tensor_parallel={"tp_size": ranks}, dtype=dtype,
                                      replace_with_kernel_inject=False)
    return engine.module
