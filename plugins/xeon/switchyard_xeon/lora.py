"""LoRA adapters in the Xeon engine: which rows run which adapter, and who may join a batch.

The toolkit (:mod:`switchyard_engine.lora`) reads the folders, holds them in
an LRU bank and computes the grouped low-rank product in PyTorch ops; this
module ties it to the engine:

- :func:`build_adapters` makes the bank at start-up (refusing adapters on a
  model the hand-written decoder does not run: only its layer loops add
  deltas) and loads ``EngineConfig.lora_adapters``;
- :meth:`XeonAdapters.admit` is the scheduler's gate: a sequence joins the
  running batch only if its adapter is in memory or can be brought in
  without dropping one a running sequence holds (``max_loras``);
- :meth:`XeonAdapters.step` gives the runner a step's rows and adapters, or
  None for a step of base rows only.

Option ``lora_kernel`` picks how the product is computed:

- ``native`` (the default where the native kernels are loaded and the
  decoder's activations are fp32): the native grouped shrink/expand
  (``kernels/lora.cpp``, :mod:`switchyard_xeon.native_lora`), inside
  ``decode_layers`` for decode steps where the decoder runs that one-call
  layer loop (every projection on the panel kernels), so steps with
  adapter rows keep it; after each projection of the Python layer loop
  otherwise. Each adapter is held as one flat buffer, in bf16 under bf16
  dot products and fp32 otherwise (option ``lora_dtype``: ``float32`` or
  ``bfloat16`` to choose);
- ``grouped``, ``stacked`` or ``looped`` (the plain PyTorch-ops path per
  adapter): :mod:`switchyard_engine.lora.grouped` on the Python layer loop,
  in fp32.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import Protocol

import torch
from switchyard_engine.lora.bank import AdapterBank, Handle
from switchyard_engine.lora.flat import FlatAdapter, flatten
from switchyard_engine.lora.folder import LoraAdapter
from switchyard_engine.lora.grouped import StepLora
from switchyard_engine.lora.layouts import PROJECTIONS, llama_family
from switchyard_spec import AdapterError, EngineConfig, EngineStartError

from switchyard_xeon.decoder import LlamaFamilyDecoder
from switchyard_xeon.kernels import load_kernels
from switchyard_xeon.native_lora import NativeLora

logger = logging.getLogger("switchyard.xeon")

KERNELS = ("native", "grouped", "stacked", "looped")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class AdapterRows(Protocol):
    """What the engine needs of a sequence to group its rows (``Sequence`` has it)."""

    lora: Handle | None
    adapter: LoraAdapter | None
    num_scheduled: int


class XeonAdapters:
    """The engine's adapter bank, and the per-step row groups; see the module docstring."""

    def __init__(self, bank: AdapterBank, kernel: str = "grouped", layers: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        self.bank = bank
        self.kernel = kernel
        """How the product is computed: one of :data:`KERNELS`."""
        self.layers = layers
        """The model's decoder layers (the native kernel's tables cover them all)."""
        self.dtype = dtype
        """The native kernel's adapter weights' dtype (the product is fp32 math either way)."""

    def admit(self, seq: AdapterRows, running: Iterable[AdapterRows]) -> bool:
        """Whether ``seq`` may join a batch of ``running`` now; sets ``seq.adapter`` if so."""
        if seq.lora is None:
            return True
        in_use = {s.lora for s in running if s.lora is not None}
        adapter = self.bank.acquire(seq.lora, in_use)
        if adapter is None:
            return False
        seq.adapter = adapter
        return True

    def step(self, seqs: Seq[AdapterRows]) -> StepLora | NativeLora | None:
        """The step's row groups and adapters; None when no row runs with an adapter."""
        if all(s.lora is None for s in seqs):
            return None
        if self.kernel == "native":
            return self._native_step(seqs)
        order: dict[Handle, int] = {}
        adapters: list[LoraAdapter] = []
        groups: list[int] = []
        for seq in seqs:
            group = -1
            if seq.lora is not None and seq.adapter is not None:
                group = order.get(seq.lora, -1)
                if group < 0:
                    group = order[seq.lora] = len(adapters)
                    adapters.append(seq.adapter)
            groups.extend([group] * seq.num_scheduled)
        return StepLora(adapters=tuple(adapters),
                        groups=torch.tensor(groups, dtype=torch.long).unsqueeze(1),
                        stacks=self.bank.stacks(tuple(order)), layouts=self.bank.layouts,
                        kernel=self.kernel)

    def _native_step(self, seqs: Seq[AdapterRows]) -> NativeLora:
        """The step's adapter rows group by group, with each group's flat adapter."""
        members: dict[Handle, list[int]] = {}
        adapters: dict[Handle, LoraAdapter] = {}
        row = 0
        for seq in seqs:
            if seq.lora is not None and seq.adapter is not None:
                members.setdefault(seq.lora, []).extend(range(row, row + seq.num_scheduled))
                adapters[seq.lora] = seq.adapter
            row += seq.num_scheduled
        flats = [self._flat(adapters[handle]) for handle in members]
        counts = [len(rows) for rows in members.values()]
        return NativeLora(
            rows=torch.tensor([r for rows in members.values() for r in rows], dtype=torch.long),
            starts=torch.tensor([0, *counts], dtype=torch.long).cumsum(0),
            weights=[flat.weights for flat in flats], tables=[flat.table for flat in flats])

    def _flat(self, adapter: LoraAdapter) -> FlatAdapter:
        """``adapter`` in the native kernel's form, made once while it stays in memory."""
        key = ("xeon-native", self.dtype)
        flat = adapter.derived.get(key)
        if flat is None:
            flat = adapter.derived[key] = flatten(adapter, self.bank.layouts, PROJECTIONS,
                                                  self.layers, self.dtype)
        return flat  # type: ignore[return-value]


def build_adapters(config: EngineConfig, model: torch.nn.Module, forward: object,
                   fp32_activations: bool = True, bf16_dot: bool = False
                   ) -> XeonAdapters | None:
    """The engine's adapters (with ``config.lora_adapters`` loaded), or None where it has none.

    ``fp32_activations``: the decoder's activations are fp32 (the native
    product takes only those); ``bf16_dot``: the linears run bf16 dot
    products (the native product then holds adapters in bf16 unless option
    ``lora_dtype`` says otherwise). Raises EngineStartError when adapters
    are configured and the model does not run on the hand-written decoder,
    or one of them cannot be served.
    """
    native = (isinstance(forward, LlamaFamilyDecoder) and fp32_activations
              and load_kernels().lora)
    kernel = str(config.options.get("lora_kernel", "")).strip() or (
        "native" if native else "grouped")
    if kernel not in KERNELS:
        raise EngineStartError(f"xeon option lora_kernel={kernel!r} must be one of "
                               f"{', '.join(KERNELS)}")
    if kernel == "native" and not native and config.lora_adapters:
        raise EngineStartError(
            "xeon option lora_kernel=native needs the native kernels (with the LoRA product) "
            "and fp32 activations on the hand-written decoder, which this engine does not "
            "have here; use lora_kernel=grouped")
    dtype_name = str(config.options.get("lora_dtype", "")).strip() or (
        "bfloat16" if bf16_dot else "float32")
    if dtype_name not in DTYPES:
        raise EngineStartError(f"xeon option lora_dtype={dtype_name!r} must be one of "
                               f"{', '.join(DTYPES)}")
    if not isinstance(forward, LlamaFamilyDecoder):
        if config.lora_adapters:
            raise EngineStartError(
                f"xeon engine: LoRA adapters need the hand-written Llama-family decoder, which "
                f"does not run {type(model).__name__} here (Llama, Mistral, Qwen2 and Phi-3 "
                "run it unless a fallback option is set)")
        return None
    layouts = llama_family(model.config)
    bank = AdapterBank(layouts.shapes, layouts.layouts, config.max_loras, config.max_lora_rank)
    for name, path in config.lora_adapters.items():
        try:
            bank.register(name, path)
        except AdapterError as exc:
            raise EngineStartError(f"xeon engine: {exc}") from None
    if config.lora_adapters:
        logger.info("lora: %d adapters (%s), max_loras %d, max_lora_rank %d, %s product%s",
                    len(config.lora_adapters), ", ".join(config.lora_adapters), bank.max_loras,
                    bank.max_rank, kernel, f" over {dtype_name} weights" if kernel == "native"
                    else " in float32")
    return XeonAdapters(bank, kernel=kernel, layers=len(forward.layers),
                        dtype=DTYPES[dtype_name])
