"""The Switchyard plugin contract: hooks, the engine interface and the records they exchange.

Plugin authors import everything they need from here and nothing from the
gateway. This package imports neither torch nor the gateway.
"""

from switchyard_spec.engine import Engine
from switchyard_spec.errors import (
    EngineNotFoundError,
    EngineStartError,
    PluginConflictError,
    SwitchyardError,
)
from switchyard_spec.hookspecs import ENTRY_POINT_GROUP, PROJECT_NAME, hookimpl, hookspec
from switchyard_spec.types import (
    DeviceInfo,
    EngineConfig,
    EngineRequest,
    EngineSpec,
    EngineStats,
    EventSink,
    FinishReason,
    ModelInfo,
    QuantizationMethod,
    SamplingParams,
    StepObserver,
    StepReport,
    StoppingParams,
    TokenEvent,
    TopToken,
    WarmupReport,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "PROJECT_NAME",
    "DeviceInfo",
    "Engine",
    "EngineConfig",
    "EngineNotFoundError",
    "EngineRequest",
    "EngineSpec",
    "EngineStartError",
    "EngineStats",
    "EventSink",
    "FinishReason",
    "ModelInfo",
    "PluginConflictError",
    "QuantizationMethod",
    "SamplingParams",
    "StepObserver",
    "StepReport",
    "StoppingParams",
    "SwitchyardError",
    "TokenEvent",
    "TopToken",
    "WarmupReport",
    "hookimpl",
    "hookspec",
]
