"""Calibration inputs for the W8A8 and FP8 references, recorded by the tests, not by the toolkit.

:func:`calibration_prompts` tokenizes a method's calibration texts as the
engine does (cut to the method's token limit); :func:`input_absmax` records
each linear's input absmax per feature over prompts with a forward hook.
"""

from __future__ import annotations

import torch

from tests.support.quant_methods import method


def calibration_prompts(name: str, path, options: dict[str, str] | None = None
                        ) -> list[list[int]]:
    """``--quantize name``'s calibration texts, tokenized as the engine does (cut to its token
    limit), with the tokenizer of the model folder ``path``."""
    from transformers import AutoTokenizer

    calibration = method(name).calibration
    tokenizer = AutoTokenizer.from_pretrained(path)
    return [tokenizer(t).input_ids[: calibration.max_tokens]
            for t in calibration.prompts(options or {})]


def input_absmax(model: torch.nn.Module, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """Each linear's input absmax per feature over ``prompts`` (recorded here, not by the toolkit)."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def record(_m, args, name=name):
                top = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0)
                seen[name] = top if name not in seen else torch.maximum(seen[name], top)
            handles.append(module.register_forward_pre_hook(record))
    with torch.inference_mode():
        for ids in prompts:
            model(torch.tensor([ids]))
    for h in handles:
        h.remove()
    return seen
