"""``QUANT_CONFIG``: FP8 through Intel Neural Compressor, as the engine uses it.

The flow itself (reading the config, INC's ``prepare``/``convert``/
``finalize_calibration``) belongs to the quant plugin,
:mod:`switchyard_quant.fp8_inc`; this module is the engine's side of it,
imported only when ``QUANT_CONFIG`` is set:

- :func:`read_plan` reads the file before any weight loads, logs every
  value the device cannot honour, and stops start-up (``EngineStartError``
  naming ``QUANT_CONFIG`` and the file) for a config that cannot run, for
  INC not installed, or for a QUANTIZE config whose measurements are missing;
- in MEASURE mode the engine serves with observers in every linear layer,
  eagerly (:func:`measuring_settings`: no graphs, no warmup shapes, so only
  real requests are measured), and writes the statistics when it shuts down;
- in QUANTIZE mode the weights load, INC converts them (:func:`convert`), and
  only then are the step functions captured and warmed up;
- :func:`fp8_dims` makes the memory plan count the FP8 weights at one byte.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from switchyard_spec import EngineStartError

from switchyard_gaudi.model_dims import ModelDims, safetensors_shapes
from switchyard_gaudi.settings import GaudiSettings

if TYPE_CHECKING:
    from switchyard_quant.fp8_inc import Fp8Model, Fp8Plan

logger = logging.getLogger("switchyard.gaudi")

INSTALL = "pip install 'switchyard-quant[fp8]' (Intel Neural Compressor, neural-compressor-pt 3.10)"


def _fp8_inc() -> Any:
    try:
        return importlib.import_module("switchyard_quant.fp8_inc")
    except ImportError:
        raise EngineStartError(f"QUANT_CONFIG is set, and FP8 needs the quant plugin with Intel "
                               f"Neural Compressor: {INSTALL}") from None


def read_plan(path: str, device_kind: str, dtype_name: str) -> Fp8Plan:
    """The QUANT_CONFIG file ``path`` checked for ``device_kind``; each rewrite logged once.

    Raises EngineStartError, naming the variable and the file, when the
    config cannot be used, INC is not installed, or a QUANTIZE config finds
    no measurements at its ``dump_stats_path``.
    """
    fp8_inc = _fp8_inc()
    try:
        plan = fp8_inc.read_config(path, device_kind, dtype_name)
    except fp8_inc.Fp8Error as exc:
        raise EngineStartError(f"QUANT_CONFIG={path}: {exc}") from None
    if not fp8_inc.inc_available():
        raise EngineStartError(f"QUANT_CONFIG={path}: Intel Neural Compressor is not installed: "
                               f"{INSTALL}")
    if plan.needs_measurements and not plan.measurement_files():
        raise EngineStartError(
            f"QUANT_CONFIG={path}: mode QUANTIZE reads the statistics of a MEASURE run, and "
            f"there are none at {plan.dump_stats_path}_hooks_{plan.observer}.npz; measure first "
            "with a MEASURE config of the same dump_stats_path (python -m switchyard_gaudi "
            "measure)")
    for note in plan.notes:
        logger.warning("gaudi: QUANT_CONFIG=%s: %s", path, note)
    logger.info("gaudi: QUANT_CONFIG=%s: FP8 %s through Intel Neural Compressor, statistics "
                "%s_hooks_%s*%s", path, plan.mode, plan.dump_stats_path, plan.observer,
                f", scale method {plan.scale_method}" if plan.mode == "QUANTIZE" else "")
    return plan


def measuring_settings(settings: GaudiSettings, plan: Fp8Plan) -> GaudiSettings:
    """MEASURE mode runs eagerly and warms nothing up: only requests' activations are measured.

    Graphs would freeze the observers' Python-side bookkeeping, and warmup
    would measure batches of padding alone. Each change is logged.
    """
    if plan.mode != "MEASURE":
        return settings
    if settings.enable_hpu_graph:
        logger.warning("gaudi: QUANT_CONFIG MEASURE mode: ENABLE_HPU_GRAPH=true is not applied "
                       "while measuring; the steps run eagerly")
    if settings.warmup_enabled:
        logger.warning("gaudi: QUANT_CONFIG MEASURE mode: WARMUP_ENABLED=true is not applied "
                       "while measuring; only requests are measured")
    return replace(settings, enable_hpu_graph=False, warmup_enabled=False)


def fp8_dims(dims: ModelDims, model_path: str, plan: Fp8Plan | None) -> ModelDims:
    """``dims`` with the weights a QUANTIZE plan stores in FP8 counted at one byte each."""
    if plan is None or plan.mode != "QUANTIZE":
        return dims
    elements = _fp8_inc().fp8_weight_elements(safetensors_shapes(model_path), plan)
    return replace(dims, fp8_parameters=elements)


def convert(model: Any, plan: Fp8Plan) -> Fp8Model:
    """INC's ``prepare`` (MEASURE) or ``convert`` (QUANTIZE) on the loaded ``model``, logged."""
    fp8_inc = _fp8_inc()
    try:
        done = fp8_inc.apply(model, plan)
    except fp8_inc.Fp8Error as exc:
        raise EngineStartError(f"QUANT_CONFIG={plan.path}: {exc}") from None
    if plan.mode == "MEASURE":
        logger.info("gaudi: FP8 MEASURE: observers in %d layers; statistics are written to "
                    "%s_hooks_%s.* when the engine shuts down", done.patched,
                    plan.dump_stats_path, plan.observer)
    else:
        logger.info("gaudi: FP8 QUANTIZE: %d layers converted, %.1f MiB of FP8 weights%s",
                    done.patched, fp8_inc.fp8_bytes(model) / 2**20,
                    " (quantize-dequantize on the CPU)" if plan.device != "hpu" else "")
    return done


def finish(done: Fp8Model | None) -> list[str]:
    """At shutdown: a MEASURE model's statistics written (logged); never raises."""
    if done is None or done.plan.mode != "MEASURE":
        return []
    try:
        files = done.finish()
    except Exception:  # shutting down: report, do not mask the shutdown
        logger.exception("gaudi: FP8 MEASURE: writing the statistics failed")
        return []
    logger.info("gaudi: FP8 MEASURE: statistics written: %s", ", ".join(files))
    return files
