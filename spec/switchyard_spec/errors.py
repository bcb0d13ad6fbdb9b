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


class AdapterError(SwitchyardError):
    """A LoRA adapter cannot be loaded or served; the message names it and says why.

    Raised by ``Engine.load_adapter`` / ``Engine.unload_adapter`` (a corrupt
    folder, a rank over ``EngineConfig.max_lora_rank``, DoRA, ``modules_to_save``,
    a bias, a target module the engine cannot adapt, an unknown name, or an
    engine without adapter support). The gateway answers it with a 4xx, never a 500.
    """


class UnknownAdapterError(AdapterError):
    """No adapter of that name is loaded on the engine."""
