"""GPTQ over a whole transformers causal LM, one decoder layer at a time, from calibration texts.

As the GPTQ paper does: the calibration prompts' inputs to the first decoder
layer are captured once (the embeddings, with the keyword arguments the model
hands its layers: positions, rotary embeddings, mask). Then, layer by layer:

1. one pass through the layer records the order its linears run in, and
   which of them share an input (q|k|v, gate|up): those form a step;
2. per step (``true_sequential``), the layer runs over every prompt with a
   forward pre-hook on the step's linears that folds their inputs into each
   one's Hessian (:class:`~switchyard_quant.gptq_solver.HessianAccumulator`);
   each is then rounded by :func:`~switchyard_quant.gptq_solver.gptq_quantize`
   and its weight replaced by the dequantized one, so the next step sees
   this step's rounding;
3. the layer, now quantized, runs over every prompt once more, and its
   outputs are the next layer's inputs: later layers see the error of earlier
   ones and compensate for it.

Memory stays at one layer's activations per prompt (a handful of short
prompts) and one Hessian per linear of a step. Prompts run alone, batch 1,
so no padding enters a Hessian. Everything is float32 (float64 in the
solver) on the CPU, in a fixed order: the same model, texts and settings
give the same integers, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from switchyard_spec import QuantizedWeight

from switchyard_quant.gptq_act_order import restore_input_order
from switchyard_quant.gptq_solver import DEFAULT_DAMP, HessianAccumulator, gptq_quantize

DEFAULT_SAMPLES = 16
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class GptqSettings:
    """What ``switchyard quantize --gptq`` was asked for."""

    calibration_file: str
    group_size: int = 128
    damp: float = DEFAULT_DAMP
    samples: int = DEFAULT_SAMPLES
    max_tokens: int = DEFAULT_MAX_TOKENS
    act_order: bool = False
    """Columns in order of decreasing Hessian diagonal (GPTQ's ``desc_act``)."""


@dataclass
class GptqResult:
    """The records of the linears GPTQ rounded, and what calibration it had."""

    records: dict[str, QuantizedWeight]
    prompts: int
    tokens: int


class _Captured(Exception):
    """Raised by the first layer's pre-hook: the model need not run further."""


@dataclass
class LayerInput:
    """One prompt's input to a decoder layer: hidden states, and the rest of its arguments."""

    hidden: torch.Tensor
    kwargs: dict[str, Any]


def calibration_prompts(folder: str | Path, settings: GptqSettings) -> list[list[int]]:
    """The calibration file's texts as token ids, each cut to ``max_tokens``.

    The file is read as the engines' calibration reads it
    (:func:`switchyard_quant.smoothquant.read_calibration_file`: JSON Lines, one
    ``{"text": ...}`` or string per line): a ValueError names the file when it is
    unreadable, not JSON Lines, or empty.
    """
    from transformers import AutoTokenizer

    from switchyard_quant.smoothquant import read_calibration_file

    if settings.samples < 1 or settings.max_tokens < 1:
        raise ValueError("GPTQ: calibration samples and tokens must be positive")
    texts = read_calibration_file(settings.calibration_file, settings.samples)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [list(tokenizer(text).input_ids[: settings.max_tokens]) for text in texts]
    prompts = [p for p in prompts if p]
    if not prompts:
        raise ValueError(f"calibration file {settings.calibration_file}: its texts tokenize to "
                         "nothing")
    return prompts


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's stack of decoder layers: the ModuleList of ``num_hidden_layers`` entries."""
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for _name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count and any(
                isinstance(m, torch.nn.Linear) for m in module[0].modules()):
            return module
    raise ValueError("GPTQ: no stack of decoder layers found in the model (a ModuleList of "
                     "config.num_hidden_layers layers holding linear layers)")


def capture_inputs(model: torch.nn.Module, first: torch.nn.Module,
                   prompts: list[list[int]]) -> list[LayerInput]:
    """Each prompt's arguments to the first decoder layer (the model stops there)."""
    captured: list[LayerInput] = []

    def hook(_module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        hidden = args[0] if args else kwargs.pop("hidden_states")
        captured.append(LayerInput(hidden.detach(), dict(kwargs)))
        raise _Captured

    handle = first.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for ids in prompts:
            try:
                model(input_ids=torch.tensor([ids]), use_cache=False)
            except _Captured:
                pass
    finally:
        handle.remove()
    return captured


def run_layer(layer: torch.nn.Module, item: LayerInput) -> torch.Tensor:
    """The layer's output hidden states for one prompt."""
    out = layer(item.hidden, **item.kwargs)
    return out[0] if isinstance(out, tuple) else out


def sequential_steps(layer: torch.nn.Module, linears: dict[str, torch.nn.Linear],
                     item: LayerInput) -> list[list[str]]:
    """``linears`` (of ``layer``) in the order they run; those sharing an input together."""
    seen: list[tuple[str, torch.Tensor]] = []  # the inputs are kept: no id is reused
    handles = [module.register_forward_pre_hook(
        lambda _m, args, name=name: seen.append((name, args[0])))
        for name, module in linears.items()]
    try:
        run_layer(layer, item)
    finally:
        for handle in handles:
            handle.remove()
    steps: list[list[str]] = []
    previous: torch.Tensor | None = None
    for name, tensor in seen:
        if any(name in step for step in steps):
            continue
        if previous is not None and tensor is previous:
            steps[-1].append(name)
        else:
            steps.append([name])
        previous = tensor
    missing = sorted(set(linears) - {n for step in steps for n in step})
    return steps + [[name] for name in missing]  # never run: no inputs, all columns dead


def hessians(layer: torch.nn.Module, linears: dict[str, torch.nn.Linear],
             names: Iterable[str], inputs: list[LayerInput]) -> dict[str, HessianAccumulator]:
    """Each named linear's Hessian over every prompt's pass through ``layer``."""
    found = {name: HessianAccumulator(linears[name].in_features) for name in names}
    handles = [linears[name].register_forward_pre_hook(
        lambda _m, args, acc=acc: acc.add(args[0])) for name, acc in found.items()]
    try:
        for item in inputs:
            run_layer(layer, item)
    finally:
        for handle in handles:
            handle.remove()
    return found


def quantize_layer(layer: torch.nn.Module, linears: dict[str, torch.nn.Linear],
                   inputs: list[LayerInput], group_size: int, damp: float,
                   act_order: bool = False) -> dict[str, QuantizedWeight]:
    """GPTQ every linear of ``layer``, step by step; their weights become the dequantized ones."""
    from switchyard_quant.int4 import dequantize_uint4

    records: dict[str, QuantizedWeight] = {}
    for step in sequential_steps(layer, linears, inputs[0]):
        for name, acc in hessians(layer, linears, step, inputs).items():
            module = linears[name]
            record = gptq_quantize(module.weight.detach(), acc.hessian, group_size, damp,
                                   act_order=act_order)
            weight = restore_input_order(dequantize_uint4(record), record.input_order)
            module.weight.data.copy_(weight.to(module.weight.dtype))
            records[name] = record
    return records


def gptq_model(model: torch.nn.Module, prompts: list[list[int]], names: Iterable[str],
               group_size: int, damp: float,
               progress: Callable[[str], None] | None = None,
               act_order: bool = False) -> dict[str, QuantizedWeight]:
    """GPTQ records for the linears ``names`` of ``model`` that lie in its decoder layers.

    ``model`` (float32, eval) is changed: those linears end holding their
    dequantized weights. Linears outside the decoder layers are left out of
    the result (the caller rounds them otherwise).
    """
    wanted = set(names)
    layers = decoder_layers(model)
    prefix = next(n for n, m in model.named_modules() if m is layers)
    records: dict[str, QuantizedWeight] = {}
    with torch.no_grad():
        inputs = capture_inputs(model, layers[0], prompts)
        for index, layer in enumerate(layers):
            linears = {f"{prefix}.{index}.{n}": m for n, m in layer.named_modules()
                       if isinstance(m, torch.nn.Linear) and f"{prefix}.{index}.{n}" in wanted}
            if linears:
                records.update(quantize_layer(layer, linears, inputs, group_size, damp,
                                              act_order))
            inputs = [LayerInput(run_layer(layer, item), item.kwargs) for item in inputs]
            if progress is not None:
                progress(f"layer {index + 1}/{len(layers)}: {len(linears)} linears")
    return records


def calibrate_and_quantize(folder: str | Path, names: Iterable[str],
                           settings: GptqSettings) -> GptqResult:
    """Load the float model in ``folder``, read the calibration texts, GPTQ linears ``names``."""
    import transformers

    prompts = calibration_prompts(folder, settings)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    records = gptq_model(model, prompts, names, settings.group_size, settings.damp,
                         act_order=settings.act_order)
    return GptqResult(records=records, prompts=len(prompts),
                      tokens=sum(len(p) for p in prompts))
