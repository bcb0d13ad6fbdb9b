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
    UnsupportedQuantizationError,
)
from switchyard_spec.hookspecs import ENTRY_POINT_GROUP, PROJECT_NAME, hookimpl, hookspec
from switchyard_spec.quantization import (
    INT8_PER_CHANNEL,
    UINT4_GROUP_SIZES,
    W8A8_SMOOTHQUANT,
    W8A8_SMOOTHQUANT_STATIC,
    ActivationQuant,
    ActivationStatistics,
    Calibration,
    Packing,
    QuantizationMethod,
    QuantizedWeight,
    WeightFormat,
    uint4_group_asym,
)
from switchyard_spec.types import (
    DeviceInfo,
    EngineConfig,
    EngineRequest,
    CommandSpec,
    EngineSpec,
    EngineStats,
    EventSink,
    FinishReason,
    ModelInfo,
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
    "INT8_PER_CHANNEL",
    "PROJECT_NAME",
    "UINT4_GROUP_SIZES",
    "W8A8_SMOOTHQUANT",
    "W8A8_SMOOTHQUANT_STATIC",
    "ActivationQuant",
    "ActivationStatistics",
    "Calibration",
    "DeviceInfo",
    "Engine",
    "EngineConfig",
    "EngineNotFoundError",
    "EngineRequest",
    "CommandSpec",
    "EngineSpec",
    "EngineStartError",
    "EngineStats",
    "EventSink",
    "FinishReason",
    "ModelInfo",
    "Packing",
    "PluginConflictError",
    "QuantizationMethod",
    "QuantizedWeight",
    "SamplingParams",
    "StepObserver",
    "StepReport",
    "StoppingParams",
    "SwitchyardError",
    "TokenEvent",
    "TopToken",
    "UnsupportedQuantizationError",
    "WarmupReport",
    "WeightFormat",
    "hookimpl",
    "hookspec",
    "uint4_group_asym",
]
