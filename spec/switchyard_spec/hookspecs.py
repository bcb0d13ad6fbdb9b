"""The hooks a Switchyard plugin may implement.

A plugin is a module registered under the ``switchyard.plugins`` entry-point
group. It implements any of the hooks below with ``@hookimpl``. Hooks are
synchronous and cheap: they return records and import nothing heavy (no torch
at import time), because ``switchyard plugins`` calls them just to list what is
installed.
"""

from __future__ import annotations

import pluggy

from switchyard_spec.quantization import QuantizationMethod
from switchyard_spec.types import CommandSpec, EngineSpec

PROJECT_NAME = "switchyard"
ENTRY_POINT_GROUP = "switchyard.plugins"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def switchyard_engines() -> list[EngineSpec]:
    """Declare the engines this plugin provides.

    Return one ``EngineSpec`` per engine: a unique name, a factory that builds
    an engine for one model (without loading weights), and a probe that says
    whether the device is present. Two plugins declaring the same engine name
    stop the server at start-up.
    """


@hookspec
def switchyard_quantization_methods() -> list[QuantizationMethod]:
    """Declare quantization methods: how to turn a float weight into a quantized format.

    Return one ``QuantizationMethod`` per method, named as users pass it to
    ``--quantize``, with the ``WeightFormat`` records its ``quantize`` returns.
    Engines never import the plugin that declares a method: the gateway finds
    it by name, checks that the chosen engine runs one of its formats
    (``EngineSpec.weight_formats``), and hands it over in
    ``EngineConfig.quantization``. Duplicate names stop the server at start-up.
    """


@hookspec
def switchyard_commands() -> list[CommandSpec]:
    """Declare subcommands of the ``switchyard`` command line.

    Return one ``CommandSpec`` per command. ``switchyard --help`` lists them
    beside the built-in ones; ``switchyard NAME ARGS...`` runs ``main(ARGS)``.
    Use it for what a user runs before or beside serving (sizing a device,
    calibrating); ``main`` may import heavy modules, the hook itself must not.
    A built-in command keeps its name (the plugin's is not reachable); two
    plugins declaring one name is an error.
    """
