"""Switchyard's Gaudi engine: static-shape bucketed batching, as TGI on Gaudi serves.

The gateway finds it through the ``switchyard.plugins`` entry point
(:mod:`switchyard_gaudi.plugin`); the engine is
:class:`switchyard_gaudi.engine.GaudiEngine`. Only :mod:`switchyard_gaudi.device`
imports Habana's software, so everything else runs, and is tested, on the CPU
device. Importing this package is cheap.
"""
