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
