"""``--quantize fp8`` on the Gaudi engine: the contract's ``fp8-e4m3-per-tensor`` linears.

The quant plugin's ``fp8`` method declares the format; this engine declares
that it runs it (``switchyard_gaudi.plugin.WEIGHT_FORMATS``). At start-up,
after the weights load and before any step function is captured:

1. the toolkit calibrates the float model
   (:func:`switchyard_engine.calibration.calibrate`: every linear's input
   maxima over the method's prompts, cached on disk, the same statistics and
   cache file the Xeon engine reads);
2. every ``nn.Linear`` (the LM head included) is quantized by the method
   (``Calibration.quantize``: ``float8_e4m3fn`` weight with one scale, a
   static input scale from the maxima) and becomes an :class:`Fp8Linear`
   holding only the FP8 weight, its scale and the input scale;
3. warmup then captures the steps with these layers in them.

:class:`Fp8Linear` asks the device seam for both operations:
``Device.to_fp8`` (the input in E4M3 with the static scale) and
``Device.fp8_linear`` (FP8 x FP8 matmul, scaled). On an HPU these are
Habana's cast and FP8 GEMM, the ops Intel Neural Compressor's converted
linears call; on the CPU device they are the format's math in stock PyTorch
(fp32 sums of exact E4M3 products), checked against a float64 reference in
``tests/gaudi/test_gaudi_fp8_contract.py``.

Why not Intel Neural Compressor's ``convert`` fed with the toolkit's
statistics: INC quantizes the weights itself, by its own scale methods, so
the served weights would not be the method's ``QuantizedWeight``s, and on
the CPU it runs them as QDQ in its own order. ``QUANT_CONFIG`` keeps INC's
flow for those who want its configs (:mod:`switchyard_gaudi.fp8`).

Layers are not fused (the engine runs transformers' modules with its own
attention), so each has one weight scale.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from switchyard_engine.fp8_records import check_fp8_weight
from switchyard_spec import (
    FP8_E4M3_PER_TENSOR,
    ActivationStatistics,
    QuantizationMethod,
    QuantizedWeight,
)

from switchyard_gaudi.device import Device


def runs_fp8(method: QuantizationMethod | None) -> bool:
    """Whether ``method`` produces ``fp8-e4m3-per-tensor`` weights (the format this engine runs)."""
    return method is not None and FP8_E4M3_PER_TENSOR in method.formats


class Fp8Linear(torch.nn.Module):
    """One linear layer in ``fp8-e4m3-per-tensor``: E4M3 weight and input, both scaled per tensor.

    ``forward(x) = dequant(to_e4m3(x / a)) @ dequant(W).T + bias`` in ``x``'s
    dtype, through the device seam (``device``).
    """

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None,
                 device: Device) -> None:
        super().__init__()
        check_fp8_weight(weight)
        n, k = weight.out_features, weight.in_features
        scales = weight.scales.float()
        if n and not bool((scales == scales[0]).all()):
            raise ValueError("the gaudi engine runs one weight scale per tensor; these rows "
                             "hold different scales")
        self.out_features, self.in_features = n, k
        self.activation_scale = float(weight.activation_scale)
        self._device = device
        at = device.torch_device
        self.register_buffer("fp8_weight", weight.data.contiguous().to(at), persistent=False)
        a = torch.tensor(self.activation_scale, dtype=torch.float32)
        self.register_buffer("input_scale", a.to(at), persistent=False)
        self.register_buffer("input_scale_inv", (1.0 / a).to(at), persistent=False)
        s = scales[0] if n else torch.tensor(1.0)
        self.register_buffer("weight_scale", s.clone().to(at), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone().to(at),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The layer on ``x`` of any leading shape; the result has ``x``'s dtype."""
        xq = self._device.to_fp8(x, self.input_scale, self.input_scale_inv)
        return self._device.fp8_linear(xq, self.fp8_weight, self.input_scale, self.weight_scale,
                                       self.bias, x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"stored={FP8_E4M3_PER_TENSOR.name}, activation_scale={self.activation_scale:.4g}")


def quantize_linears(model: torch.nn.Module, method: QuantizationMethod,
                     statistics: Mapping[str, ActivationStatistics], options: Mapping[str, str],
                     device: Device) -> str:
    """Replace every ``nn.Linear`` of ``model`` by an :class:`Fp8Linear` on ``device``.

    Each is quantized by ``method.calibration.quantize`` with its input's
    statistics (by qualified name), or by ``method.quantize`` (unit input
    scale) when it has none. Returns a phrase for the start-up log.
    """
    calibration = method.calibration
    layers = uncalibrated = 0
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            qualified = f"{prefix}.{name}" if prefix else name
            weight = child.weight.detach().float()
            if calibration is not None and qualified in statistics:
                record = calibration.quantize(weight, statistics[qualified], options)
            else:
                record = method.quantize(weight)
                uncalibrated += 1
            setattr(parent, name, Fp8Linear(record, child.bias, device))
            layers += 1
    unscaled = f", {uncalibrated} with unit input scales (not calibrated)" if uncalibrated else ""
    return (f"{layers} linears as FP8 E4M3 ({FP8_E4M3_PER_TENSOR.name}{unscaled}): weights and "
            f"inputs per-tensor scaled, run by the device's FP8 matmul ({device.kind})")


def fp8_weight_elements(shapes: Mapping[str, tuple[int, ...]], tied_embeddings: bool
                        ) -> tuple[int, int]:
    """(weights stored in FP8, elements added) for the memory plan, from checkpoint shapes.

    Every linear's weight (a 2-D ``*.weight`` not of an embedding) is held in
    FP8. A tied LM head becomes an FP8 copy of the embedding's matrix beside
    the float embedding: its elements are both added and held in FP8.
    """
    linear = sum(s[0] * s[1] for name, s in shapes.items()
                 if len(s) == 2 and name.endswith(".weight") and "embed" not in name)
    added = 0
    if tied_embeddings and not any(name.endswith("lm_head.weight") for name in shapes):
        embedding = [s for name, s in shapes.items()
                     if name.endswith("embed_tokens.weight") and len(s) == 2]
        added = embedding[0][0] * embedding[0][1] if embedding else 0
    return linear + added, added
