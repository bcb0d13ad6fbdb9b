"""Toolkit shared by hardware engines: model loading and batched sampling.

Torch lives here, not in the gateway's HTTP side: the submodules import torch,
so import them (``switchyard.engine.sampling``, ``switchyard.engine.loading``)
only from engine code. Importing this package itself stays cheap.
"""
