"""LoRA adapters in the Xeon engine: which rows run which adapter, and who may join a batch.

The toolkit (:mod:`switchyard_engine.lora`) reads the folders, holds them in
an LRU bank and computes the grouped low-rank product; this module ties it
to the engine:

- :func:`build_adapters` makes the bank at start-up (refusing adapters on a
  model the hand-written decoder does not run: only its Python layer loop
  can add deltas) and loads ``EngineConfig.lora_adapters``;
- :meth:`XeonAdapters.admit` is the scheduler's gate: a sequence joins the
  running batch only if its adapter is in memory or can be brought in
  without dropping one a running sequence holds (``max_loras``);
- :meth:`XeonAdapters.step` gives the runner a step's
  :class:`~switchyard_engine.lora.grouped.StepLora`: each packed row's
  group, or None for a step of base rows only, which keeps the native
  one-call layer loop.

Option ``lora_kernel`` (``grouped``, the default; ``stacked``; or ``looped``,
the plain PyTorch-ops path per adapter) picks how the product is computed
(:mod:`switchyard_engine.lora.grouped`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import Protocol

import torch
from switchyard_engine.lora.bank import AdapterBank, Handle
from switchyard_engine.lora.folder import LoraAdapter
from switchyard_engine.lora.grouped import StepLora
from switchyard_engine.lora.layouts import llama_family
from switchyard_spec import AdapterError, EngineConfig, EngineStartError

from switchyard_xeon.decoder import LlamaFamilyDecoder

logger = logging.getLogger("switchyard.xeon")

KERNELS = ("grouped", "stacked", "looped")


class AdapterRows(Protocol):
    """What the engine needs of a sequence to group its rows (``Sequence`` has it)."""

    lora: Handle | None
    adapter: LoraAdapter | None
    num_scheduled: int


class XeonAdapters:
    """The engine's adapter bank, and the per-step row groups; see the module docstring."""

    def __init__(self, bank: AdapterBank, kernel: str = "grouped") -> None:
        self.bank = bank
        self.kernel = kernel
        """How the product is computed: one of :data:`KERNELS`."""

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

    def step(self, seqs: Seq[AdapterRows]) -> StepLora | None:
        """The step's row groups and adapters; None when no row runs with an adapter."""
        if all(s.lora is None for s in seqs):
            return None
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


def build_adapters(config: EngineConfig, model: torch.nn.Module, forward: object
                   ) -> XeonAdapters | None:
    """The engine's adapters (with ``config.lora_adapters`` loaded), or None where it has none.

    Raises EngineStartError when adapters are configured and the model does
    not run on the hand-written decoder, or one of them cannot be served.
    """
    kernel = str(config.options.get("lora_kernel", "grouped")).strip() or "grouped"
    if kernel not in KERNELS:
        raise EngineStartError(f"xeon option lora_kernel={kernel!r} must be one of "
                               f"{', '.join(KERNELS)}")
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
        logger.info("lora: %d adapters (%s), max_loras %d, max_lora_rank %d, %s product",
                    len(config.lora_adapters), ", ".join(config.lora_adapters), bank.max_loras,
                    bank.max_rank, kernel)
    return XeonAdapters(bank, kernel=kernel)
