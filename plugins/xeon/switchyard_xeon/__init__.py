"""Switchyard's CPU engine: continuous batching on stock PyTorch.

The gateway finds it through the ``switchyard.plugins`` entry point
(:mod:`switchyard_xeon.plugin`); the engine itself is
:class:`switchyard_xeon.engine.XeonEngine`. Importing this package is cheap.
"""
