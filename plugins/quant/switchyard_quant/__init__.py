"""Switchyard's quantization methods: weight-only INT8 and INT4, round to nearest at load.

The gateway finds them through the ``switchyard.plugins`` entry point
(:mod:`switchyard_quant.plugin`, torch-free); the arithmetic is in
:mod:`switchyard_quant.int8` and :mod:`switchyard_quant.int4`. Engines never
import this package: they receive a method in ``EngineConfig.quantization``
and pack its ``QuantizedWeight`` output for their own kernels.
"""
