"""Errors that cross the plugin line."""

from __future__ import annotations


class SwitchyardError(Exception):
    """Base class of every error Switchyard raises on purpose."""


class PluginConflictError(SwitchyardError):
    """Two plugins declared the same engine or quantization-method name."""


class EngineStartError(SwitchyardError):
    """An engine could not load or warm up its model; the message says why."""


class EngineNotFoundError(SwitchyardError):
    """No installed engine has the requested name, or none has its device present."""


class UnsupportedQuantizationError(SwitchyardError):
    """``--quantize`` names no installed method, or one the chosen engine cannot run.

    Raised by the gateway at start-up, before the engine is built; the message
    lists the methods that engine can run.
    """
