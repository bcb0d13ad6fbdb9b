"""Load a model whose linear layers come already quantized from a checkpoint (GPTQ, AWQ, ipex's).

A checkpoint method (``QuantizationMethod.load``) reads the quantized layers
as a ``QuantizedCheckpoint``; this module builds the model from config.json
without initialising any weight (transformers' ``no_init_weights``: the
tensors are allocated, never written, so untouched pages cost no memory),
puts a :class:`QuantizedLinear` in the place of each quantized layer, and
fills every other tensor (embeddings, norms, float layers, the LM head) from
the folder's safetensors. Every tensor the model needs must come from one of
the two, with the shape the model has: anything missing or mis-shaped stops
start-up with an ``EngineStartError`` naming the file and tensor. An engine
then packs the ``QuantizedLinear`` records for its kernels.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from switchyard_engine.loading import LoadedModel, checked_config, dtype_name, model_info, resolve_dtype
from switchyard_spec import EngineStartError, QuantizationMethod, QuantizedCheckpoint, QuantizedWeight

logger = logging.getLogger("switchyard.engine")


class QuantizedLinear(torch.nn.Module):
    """A linear layer held as the ``QuantizedWeight`` a checkpoint gave, until an engine packs it.

    ``forward`` is the reference: ``F.linear`` over the method's
    ``dequantize`` (float32), computed once; engines replace the module with
    their own kernels. ``bias`` is a float parameter (filled from the
    checkpoint or the folder) or None.
    """

    def __init__(self, quantized: QuantizedWeight, bias: bool,
                 method: QuantizationMethod) -> None:
        super().__init__()
        self.quantized = quantized
        self.method = method
        self.in_features, self.out_features = quantized.in_features, quantized.out_features
        self.bias = (torch.nn.Parameter(torch.zeros(quantized.out_features), requires_grad=False)
                     if bias else None)
        self._weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + b`` over the dequantized weight, in ``x``'s dtype."""
        if self._weight is None:
            self._weight = self.method.dequantize(self.quantized).float()
        return torch.nn.functional.linear(x, self._weight.to(x.dtype),
                                          None if self.bias is None else self.bias.to(x.dtype))

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.quantized.format.name}")


def read_checkpoint(method: QuantizationMethod, model_path: str | Path,
                    options: Mapping[str, str]) -> QuantizedCheckpoint:
    """``method.load`` on the folder; its ``ValueError`` as a start-up error naming the method."""
    assert method.load is not None
    try:
        checkpoint = method.load(str(model_path), options)
    except (ValueError, OSError) as exc:
        raise EngineStartError(f"--quantize {method.name}: {exc}") from exc
    if not checkpoint.weights:
        raise EngineStartError(f"--quantize {method.name}: the checkpoint in {model_path} "
                               "holds no quantized layer")
    return checkpoint


def load_quantized_causal_lm(model_path: str | Path, method: QuantizationMethod,
                             options: Mapping[str, str], dtype: str = "float32",
                             attn_implementation: str | None = None,
                             ) -> tuple[LoadedModel, QuantizedCheckpoint]:
    """The model of ``model_path`` with ``method``'s checkpoint layers as :class:`QuantizedLinear`."""
    import transformers
    from transformers.initialization import no_init_weights

    path = Path(model_path)
    config = checked_config(path)
    torch_dtype = resolve_dtype(dtype)
    start = time.perf_counter()
    checkpoint = read_checkpoint(method, path, options)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # the layers are ours to build; transformers' quantizers stay out
    kwargs: dict[str, object] = {"dtype": torch_dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    # Without initialisation transformers leaves tied weights untied: tie them, so that a
    # tied LM head (absent from the safetensors, as tied models save it) is the embedding.
    model.tie_weights()
    _place_quantized(model, checkpoint, method, path)
    _fill_tensors(model, checkpoint, path, torch_dtype)
    model = model.eval()
    seconds = time.perf_counter() - start
    logger.info("loaded %s in %.2fs: %s", path, seconds, checkpoint.source)
    return LoadedModel(model=model, info=model_info(model, config, torch_dtype, "cpu"),
                       seconds=seconds), checkpoint


def _place_quantized(model: torch.nn.Module, checkpoint: QuantizedCheckpoint,
                     method: QuantizationMethod, path: Path) -> None:
    """Swap each checkpoint layer's ``nn.Linear`` for a :class:`QuantizedLinear`, shapes checked."""
    for name, quantized in sorted(checkpoint.weights.items()):
        parent_name, _, child = name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
            linear = getattr(parent, child)
        except AttributeError:
            raise EngineStartError(
                f"--quantize {method.name}: the checkpoint in {path} quantizes {name!r}, which "
                "the model built from config.json does not have") from None
        if not isinstance(linear, torch.nn.Linear):
            raise EngineStartError(f"--quantize {method.name}: {name!r} is a "
                                   f"{type(linear).__name__} in the model, not a linear layer")
        got = (quantized.out_features, quantized.in_features)
        want = (linear.out_features, linear.in_features)
        if got != want:
            raise EngineStartError(
                f"--quantize {method.name}: the checkpoint's {name!r} is [out {got[0]}, in "
                f"{got[1]}] but config.json's model has [out {want[0]}, in {want[1]}] ({path})")
        if quantized.format not in method.formats:
            raise EngineStartError(f"--quantize {method.name}: {name!r} came in format "
                                   f"{quantized.format.name}, not one the method declares")
        has_bias = linear.bias is not None or name in checkpoint.biases
        replacement = QuantizedLinear(quantized, has_bias, method)
        if name in checkpoint.biases:
            bias = checkpoint.biases[name]
            if tuple(bias.shape) != (quantized.out_features,):
                raise EngineStartError(f"--quantize {method.name}: the checkpoint's bias of "
                                       f"{name!r} has shape {list(bias.shape)}, expected "
                                       f"[{quantized.out_features}]")
            replacement.bias.data.copy_(bias.float())  # type: ignore[union-attr]
        setattr(parent, child, replacement)


def _fill_tensors(model: torch.nn.Module, checkpoint: QuantizedCheckpoint, path: Path,
                  dtype: torch.dtype) -> None:
    """Copy every float tensor the model needs from the folder's safetensors, or say what is not there."""
    from safetensors import safe_open

    targets: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    persistent = model.state_dict(keep_vars=True)
    targets.update({n: t for n, t in model.named_buffers(remove_duplicate=False) if n in persistent})
    given = {f"{n}.bias" for n in checkpoint.biases}
    filled: set[int] = set()
    unexpected = 0
    with torch.no_grad():
        for file in sorted(path.glob("*.safetensors")):
            try:
                handle = safe_open(str(file), framework="pt")
            except Exception as exc:  # safetensors' own error types
                raise EngineStartError(f"cannot read {file}: {exc}") from exc
            with handle as fh:
                for key in fh.keys():  # noqa: SIM118 (safe_open is no mapping)
                    if key in checkpoint.tensors or key in given:
                        continue
                    target = targets.get(key)
                    if target is None:
                        unexpected += 1
                        continue
                    tensor = fh.get_tensor(key)
                    if tuple(tensor.shape) != tuple(target.shape):
                        raise EngineStartError(
                            f"{file.name}: tensor {key!r} has shape {list(tensor.shape)}, but "
                            f"config.json's model needs {list(target.shape)}")
                    target.copy_(tensor.to(target.dtype if target.is_floating_point() else
                                           tensor.dtype))
                    filled.add(id(target))
    for name in given:
        if name in targets:
            filled.add(id(targets[name]))
    missing = sorted(n for n, t in targets.items() if id(t) not in filled)
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise EngineStartError(f"model folder {str(path)!r}: tensor {shown}{more} is missing from "
                               "its safetensors (neither a float weight nor a checkpoint layer)")
    if unexpected:
        logger.warning("%s: %d tensors in the safetensors are not used by the model", path,
                       unexpected)
    logger.info("float tensors from %s as %s", path, dtype_name(dtype))
