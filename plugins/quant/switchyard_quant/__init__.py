"""Switchyard's quantization methods: weight-only INT8 and INT4, round to nearest at load.

The gateway finds them through the ``switchyard.plugins`` entry point
(:mod:`switchyard_quant.plugin`, torch-free); the arithmetic is in
:mod:`switchyard_quant.int8` and :mod:`switchyard_quant.int4`. Engines do not
import this package for these: they receive a method in
``EngineConfig.quantization`` and pack its ``QuantizedWeight`` output for
their own kernels.

``--quantize fp8`` (:mod:`switchyard_quant.fp8_method`) is FP8 E4M3 through
the contract: calibrated with the contract's ``Calibration``, run by any
engine that declares its format. FP8 through Intel Neural Compressor
(:mod:`switchyard_quant.fp8_inc`, the ``fp8`` extra) calibrates the INC way
(a MEASURE run that dumps statistics files, read back by a QUANTIZE run), not
through the contract's ``Calibration``, so the gaudi engine imports that
module directly, and only when ``QUANT_CONFIG`` is set.
"""
