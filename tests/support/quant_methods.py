"""The installed quantization methods, found as the engine gets them: through the gateway's facade.

Engines never import ``switchyard_quant``; tests of the Xeon engine take its
methods from here so that they exercise the same path as ``switchyard serve``.
"""

from __future__ import annotations

import functools

from switchyard.plugins import PluginHost
from switchyard_spec import QuantizationMethod


@functools.cache
def method(name: str) -> QuantizationMethod:
    """The installed method ``--quantize name`` selects for the xeon engine (int8, int4, ...)."""
    host = PluginHost.from_entry_points()
    found = host.resolve_quantization(name, host.engines()["xeon"])
    assert found is not None
    return found
