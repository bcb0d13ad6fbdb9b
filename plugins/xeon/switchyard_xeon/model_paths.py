"""Which forward path a model takes: the paged attention, or the fallback with its own attention.

The paged path (:mod:`switchyard_xeon.runner`) plugs the engine's attention
into transformers' model code through its attention interface, so it needs a
model class that calls attention through that interface, accepts
``logits_to_keep``, and asks of attention nothing the engine's kernels lack
(attention sinks; logit soft-capping, as Gemma 2 asks, they compute). The
ALiBi families (Bloom, MPT, Falcon with ``alibi=True``) do not call that
interface, but take the paged path too: :mod:`switchyard_xeon.alibi_attention`
replaces their attention modules after loading. Every other causal LM that
transformers runs takes the fallback (:mod:`switchyard_xeon.fallback`): the
model's own attention over transformers' cache (prefills per sequence, decode
rows in one left-padded batch where the model's cache allows).

The choice is made from the config and the model class before any weights
are read, because loading a model with an attention name its class does not
know fails inside transformers (Falcon: ``KeyError: 'switchyard_xeon'``).
What only the loaded modules show (attention sinks) is checked after
loading by :func:`loaded_model_unsupported`.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from switchyard_engine.loading import checked_config

from switchyard_xeon import alibi_attention

logger = logging.getLogger("switchyard.xeon")


@dataclass(frozen=True)
class ForwardPath:
    """The path a model takes and why."""

    paged: bool
    reason: str
    alibi: bool = False
    """Paged through :mod:`switchyard_xeon.alibi_attention`: the model loads with its own
    attention, whose modules are then replaced."""

    def describe(self) -> str:
        """The start-up log line's text."""
        if self.alibi:
            return f"paged attention, the model's ALiBi attention modules replaced ({self.reason})"
        if self.paged:
            return f"paged attention through transformers' attention interface ({self.reason})"
        # How its decode rows run (padded batch or per sequence) is logged by the runner.
        return f"fallback: the model's own attention over transformers' cache ({self.reason})"


def class_unsupported(model_class: type, config: object) -> str:
    """'' when ``model_class`` with ``config`` can take the paged attention, else why not."""
    name = model_class.__name__
    if not getattr(model_class, "_supports_attention_backend", False):
        why = alibi_attention.unsupported(model_class, config)
        if why is not None:  # an ALiBi family: '' when its attention can be replaced
            return why
        return f"{name} does not use transformers' attention interface (its own attention code)"
    if "logits_to_keep" not in inspect.signature(model_class.forward).parameters:
        return f"{name}.forward does not accept logits_to_keep"
    return ""


def loaded_model_unsupported(model: torch.nn.Module) -> str:
    """'' when a loaded model can take the paged attention, else why not (checks the modules)."""
    why = class_unsupported(type(model), model.config)
    if why:
        return why
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        return f"{type(model).__name__} uses attention sinks, which the paged kernels do not"
    return ""


def choose_path(model_path: str | Path, forced_fallback: bool = False) -> ForwardPath:
    """The path of the model in ``model_path``, decided from its config and class alone.

    Raises :class:`~switchyard_spec.EngineStartError` (from
    :func:`~switchyard_engine.loading.checked_config`) for folders that hold
    no causal LM transformers knows: encoder-decoder models, unknown
    architectures.
    """
    import transformers

    config = checked_config(Path(model_path))
    if forced_fallback:
        return ForwardPath(False, "forward=fallback")
    model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    why = class_unsupported(model_class, config)
    if why:
        return ForwardPath(False, why)
    name = model_class.__name__
    if alibi_attention.unsupported(model_class, config) == "":
        return ForwardPath(True, f"{name}: ALiBi biases in the paged kernels", alibi=True)
    if getattr(config, "attn_logit_softcapping", None):
        return ForwardPath(True, f"{name}: logit soft-capping in the paged kernels")
    return ForwardPath(True, name)


def use_default_attention(model: torch.nn.Module) -> str:
    """Give a model loaded with the engine's attention its default one back; returns its name."""
    default = model.get_correct_attn_implementation(None)
    model.set_attn_implementation(default)
    return default
