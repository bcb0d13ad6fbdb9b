"""FP8 through Intel Neural Compressor (INC): measure, then quantize, from a ``QUANT_CONFIG`` file.

The two-phase flow of tgi-gaudi and optimum-habana:

1. a *measure* config (``"mode": "MEASURE"``, an observer such as ``maxabs``,
   ``dump_stats_path``) patches the model's linear layers with observers
   (``neural_compressor.torch.quantization.prepare``); the model then runs
   calibration prompts, and :meth:`Fp8Model.finish` writes the statistics
   (``finalize_calibration``) to files named after ``dump_stats_path``;
2. a *quant* config (``"mode": "QUANTIZE"``, a ``scale_method``, the same
   ``dump_stats_path``) reads them and replaces each linear layer by INC's
   FP8 one (``convert``): weights stored as ``float8_e4m3fn`` with a scale,
   inputs quantized to FP8 with the measured scales.

:func:`read_config` is pure (no INC import): it reads the JSON, checks it,
and rewrites what the device cannot honour, each rewrite returned as a note
for the caller to log. On the CPU, INC runs FP8 only as quantize-dequantize
(``"use_qdq": true``: the weights are stored in FP8 and dequantized to the
high-precision dtype for the matmul; activations are rounded through FP8 the
same way), and with the scale methods that need no Gaudi scale table
(:data:`CPU_SCALE_METHODS`); ``maxabs_hw`` (the Gaudi default) becomes
``maxabs_pow2``, its nearest CPU-capable method (power-of-two scales, without
the hardware's table of allowed exponents).

INC is an optional dependency: ``pip install 'switchyard-quant[fp8]'``
installs ``neural-compressor-pt``. It is imported when a model is prepared,
never at module import, and its absence is an :class:`Fp8Error` that names
the install.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import json
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

INSTALL = "pip install 'switchyard-quant[fp8]' (Intel Neural Compressor, neural-compressor-pt 3.10)"
"""What installs INC for this module."""
MEASURE, QUANTIZE = "MEASURE", "QUANTIZE"
MODES = (MEASURE, QUANTIZE)
"""The ``mode`` values a serving engine runs: measure statistics, or serve quantized."""
CPU_SCALE_METHODS = ("unit_scale", "maxabs_pow2", "maxabs_arbitrary")
"""Scale methods INC 3.10 runs on the CPU (tested); the others need a Gaudi's scale table."""
CPU_REPLACEMENTS = {"maxabs_hw": "maxabs_pow2"}
"""A Gaudi-only scale method -> the CPU-capable one closest to it."""
STATS_FREE_SCALE_METHODS = ("unit_scale",)
"""Scale methods whose scales are fixed: QUANTIZE reads no measurements for them."""
HP_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
"""Serving dtype -> INC's ``hp_dtype`` name (the precision around the FP8 matmuls)."""
DEFAULT_DUMP_STATS_PATH = "./hqt_output/measure"
"""INC's (and the seed's) ``dump_stats_path`` when a config has none."""
NOT_APPLIED_KEYS = {
    "method": "a key of Habana's older quantization toolkit; INC has one method",
    "dump_stats_xlsx_path": "INC 3.10 writes no spreadsheet of the statistics",
}
"""Keys of optimum-habana's example configs that INC 3.10 reads but does nothing with."""


class Fp8Error(ValueError):
    """A QUANT_CONFIG that cannot be used here, or INC missing or failing; the message says why."""


class Fp8Plan(msgspec.Struct, frozen=True, kw_only=True):
    """A QUANT_CONFIG file read, checked and rewritten for one device: what INC will be given."""

    path: str
    """The config file as given."""
    mode: str
    """``MEASURE`` or ``QUANTIZE``."""
    device: str
    """``hpu`` or ``cpu``: the device the rewrites were made for."""
    options: dict[str, Any]
    """The JSON object handed to INC, after the rewrites."""
    notes: tuple[str, ...] = ()
    """One line per value changed or not applied on this device, for the caller to log."""

    @property
    def dump_stats_path(self) -> str:
        """The absolute prefix of the statistics files (``<prefix>_hooks_<observer>.npz`` ...)."""
        return str(self.options["dump_stats_path"])

    @property
    def observer(self) -> str:
        """The observer whose statistics are written (MEASURE) or read (QUANTIZE)."""
        return str(self.options.get("observer", "maxabs"))

    @property
    def scale_method(self) -> str:
        """The scale method, as a string (a dict config is shown as JSON)."""
        method = self.options.get("scale_method", "maxabs_hw")
        return method if isinstance(method, str) else json.dumps(method, sort_keys=True)

    @property
    def needs_measurements(self) -> bool:
        """Whether QUANTIZE reads a MEASURE run's statistics (all scale methods but fixed ones)."""
        return self.mode == QUANTIZE and self.scale_method not in STATS_FREE_SCALE_METHODS

    def measurement_files(self) -> list[str]:
        """The statistics files of this config's prefix and observer that exist now.

        A run of one process writes ``<prefix>_hooks_<observer>.npz`` and
        ``.json``; INC adds ``_<rank>_<world size>`` when it runs sharded.
        """
        prefix = f"{self.dump_stats_path}_hooks_{self.observer}"
        pattern = re.compile(re.escape(prefix) + r"(_\d+_\d+)?\.(npz|json)")
        return sorted(p for p in glob.glob(glob.escape(prefix) + "*") if pattern.fullmatch(p))


def read_config(path: str, device: str, dtype: str, cwd: str | None = None) -> Fp8Plan:
    """Read the QUANT_CONFIG file ``path`` for serving in ``dtype`` on ``device``.

    ``device`` is ``hpu`` or ``cpu``; ``dtype`` a torch dtype name
    (``bfloat16``, ``float32``, ``float16``). A relative ``dump_stats_path``
    is made absolute against ``cwd`` (default: the working directory), as
    INC and tgi-gaudi resolve it. On the CPU, ``use_qdq`` becomes true and a
    Gaudi-only scale method its CPU counterpart; ``hp_dtype`` left out
    becomes the serving dtype. Every such change is a line of
    :attr:`Fp8Plan.notes`. Raises :class:`Fp8Error` for a file that is
    missing, not a JSON object, in another mode, with a scale method the
    device cannot run, or whose ``hp_dtype`` is not the serving dtype.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            raw = json.load(fh)
    except FileNotFoundError:
        raise Fp8Error(f"{path} does not exist") from None
    except OSError as exc:
        raise Fp8Error(f"{path} cannot be read: {exc}") from None
    except ValueError as exc:
        raise Fp8Error(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise Fp8Error(f"{path} must hold a JSON object, not {type(raw).__name__}")
    options = dict(raw)
    notes: list[str] = []
    mode = str(options.get("mode", "")).upper()
    if mode not in MODES:
        raise Fp8Error(f"{path}: \"mode\" must be \"MEASURE\" (write statistics) or \"QUANTIZE\" "
                       f"(serve in FP8), not {options.get('mode')!r}")
    options["mode"] = mode
    for key, why in NOT_APPLIED_KEYS.items():
        if key in options:
            notes.append(f"{key}={options[key]!r} is not applied: {why}")
    notes += _resolve_dump_path(options, cwd)
    notes += _hp_dtype(options, dtype, path)
    if device != "hpu":
        notes += _for_cpu(options, mode, path)
    return Fp8Plan(path=path, mode=mode, device=device, options=options, notes=tuple(notes))


def _resolve_dump_path(options: dict[str, Any], cwd: str | None) -> list[str]:
    given = options.get("dump_stats_path")
    if given is not None and (not isinstance(given, str) or not given.strip()):
        raise Fp8Error(f"\"dump_stats_path\" must be a path prefix, not {given!r}")
    raw = given if given is not None else DEFAULT_DUMP_STATS_PATH
    absolute = os.path.normpath(os.path.join(cwd or os.getcwd(), os.path.expanduser(raw)))
    options["dump_stats_path"] = absolute
    if given is None:
        return [f"dump_stats_path is not set: INC's default {DEFAULT_DUMP_STATS_PATH} "
                f"({absolute})"]
    return []


def _hp_dtype(options: dict[str, Any], dtype: str, path: str) -> list[str]:
    want = HP_DTYPES.get(dtype)
    if want is None:
        raise Fp8Error(f"FP8 serves around the FP8 matmuls in bfloat16, float16 or float32, "
                       f"not {dtype}")
    given = options.get("hp_dtype")
    if given is None:
        options["hp_dtype"] = want
        return [] if want == "bf16" else [
            f"hp_dtype is not set: {want}, the serving dtype (INC's default is bf16)"]
    if str(given).lower() != want:
        raise Fp8Error(f"{path}: \"hp_dtype\": {given!r} is not the serving dtype {dtype} "
                       f"({want}); change --dtype or hp_dtype so they agree")
    options["hp_dtype"] = want
    return []


def _for_cpu(options: dict[str, Any], mode: str, path: str) -> list[str]:
    notes = []
    if str(options.get("use_qdq", False)).lower() != "true":
        notes.append(f"use_qdq={options.get('use_qdq', False)!r} is not applicable on cpu: INC "
                     "runs FP8 there only as quantize-dequantize; use_qdq=true")
    options["use_qdq"] = True
    for key in ("device_for_scales",):
        if key in options:
            notes.append(f"{key}={options.pop(key)!r} is not applicable on cpu: it picks a "
                         "Gaudi generation's scale table; dropped")
    if mode != QUANTIZE:
        return notes
    method = options.get("scale_method", "maxabs_hw")
    if not isinstance(method, str):
        return notes  # a per-layer dict: INC checks it, and its error is reported as such
    method = method.lower()
    if method in CPU_REPLACEMENTS:
        options["scale_method"] = CPU_REPLACEMENTS[method]
        notes.append(f"scale_method={method!r} is not applicable on cpu: it rounds scales to a "
                     f"Gaudi's table; {CPU_REPLACEMENTS[method]!r} (power-of-two scales) instead")
    elif method not in CPU_SCALE_METHODS:
        raise Fp8Error(f"{path}: scale_method {method!r} needs a Gaudi; on the CPU use one of "
                       f"{', '.join(CPU_SCALE_METHODS)}")
    else:
        options["scale_method"] = method
    return notes


# ------------------------------------------------------------------ INC itself
def inc_available() -> bool:
    """Whether Intel Neural Compressor's PyTorch package can be imported (no import done)."""
    return importlib.util.find_spec("neural_compressor") is not None


def _inc(device: str) -> Any:
    """``neural_compressor.torch.quantization``, or Fp8Error naming the install."""
    if not inc_available():
        raise Fp8Error(f"Intel Neural Compressor is not installed: {INSTALL}")
    if device != "hpu":
        # INC picks its accelerator once, at import; on a Gaudi host running the CPU path,
        # this is INC's documented override.
        os.environ.setdefault("INC_TARGET_DEVICE", "cpu")
    try:
        return importlib.import_module("neural_compressor.torch.quantization")
    except ImportError as exc:
        raise Fp8Error(f"Intel Neural Compressor cannot be imported ({exc}): {INSTALL}") from exc


@dataclass
class Fp8Model:
    """A model prepared (MEASURE) or converted (QUANTIZE) by INC, with the plan that did it."""

    model: Any
    """The same module object, its linear layers replaced by INC's patched ones."""
    plan: Fp8Plan
    patched: int
    """How many modules INC patched."""

    def finish(self) -> list[str]:
        """MEASURE: write the statistics (``finalize_calibration``); the files written.

        QUANTIZE: nothing to write; returns []. Raises :class:`Fp8Error` if INC fails.
        """
        if self.plan.mode != MEASURE:
            return []
        inc = _inc(self.plan.device)
        try:
            inc.finalize_calibration(self.model)
        except Exception as exc:  # INC raises bare Exceptions
            raise Fp8Error(f"{self.plan.path}: writing the statistics to "
                           f"{self.plan.dump_stats_path}* failed: {exc}") from exc
        return self.plan.measurement_files()


def apply(model: Any, plan: Fp8Plan) -> Fp8Model:
    """Prepare ``model`` for measuring (MEASURE) or convert it to FP8 (QUANTIZE), in place.

    The plan's options go to INC as a JSON file (``FP8Config.from_json_file``:
    INC re-reads the file, so the rewrites must be in it), written to a
    temporary folder and removed afterwards. QUANTIZE first checks that the
    measurements exist (unless the scale method needs none). Raises
    :class:`Fp8Error` with INC's reason when INC refuses.
    """
    if plan.needs_measurements and not plan.measurement_files():
        raise Fp8Error(
            f"{plan.path}: QUANTIZE reads the statistics of a MEASURE run, and there are none at "
            f"{plan.dump_stats_path}_hooks_{plan.observer}.npz: run the measure config first "
            "with the same dump_stats_path (python -m switchyard_gaudi measure)")
    inc = _inc(plan.device)
    with tempfile.TemporaryDirectory(prefix="switchyard-fp8-") as folder:
        config_file = os.path.join(folder, "quant_config.json")
        with open(config_file, "w", encoding="utf-8") as fh:
            json.dump(plan.options, fh)
        try:
            os.makedirs(os.path.dirname(plan.dump_stats_path), exist_ok=True)
            config = inc.FP8Config.from_json_file(config_file)
            if plan.mode == MEASURE:
                model = inc.prepare(model, config)
            else:
                model = inc.convert(model, config)
        except Fp8Error:
            raise
        except Exception as exc:  # INC raises bare Exceptions, ValueErrors, KeyErrors
            raise Fp8Error(f"{plan.path}: Intel Neural Compressor refused the {plan.mode} "
                           f"config: {type(exc).__name__}: {exc}") from exc
    patched = sum(1 for m in model.modules() if "orig_mod" in vars(m))
    if patched == 0:
        raise Fp8Error(f"{plan.path}: no layer of the model was patched (check allowlist and "
                       "blocklist)")
    return Fp8Model(model=model, plan=plan, patched=patched)


def fp8_bytes(model: Any) -> int:
    """Bytes of the model's tensors stored in an FP8 dtype (the converted weights)."""
    import torch

    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    seen: set[int] = set()
    total = 0
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.dtype in fp8 and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def fp8_weight_elements(shapes: Mapping[str, tuple[int, ...]], plan: Fp8Plan) -> int:
    """Elements of the checkpoint weights a QUANTIZE plan stores in FP8, from tensor shapes alone.

    ``shapes`` maps checkpoint tensor names to shapes. A weight counts when it
    is a linear layer's (a 2-D ``*.weight`` not of an embedding) and INC's
    rules keep it: its module name matches no ``blocklist`` name pattern and,
    when the ``allowlist`` names any, one of them. An estimate for the memory
    plan, checked against :func:`fp8_bytes` on converted models by the tests.
    """
    if plan.mode != QUANTIZE:
        return 0
    block = _names(plan.options, "blocklist", "blacklist")
    allow = _names(plan.options, "allowlist", "whitelist")
    total = 0
    for name, shape in shapes.items():
        if len(shape) != 2 or not name.endswith(".weight") or "embed" in name:
            continue
        module = name.removesuffix(".weight")
        if any(re.search(p, module) for p in block):
            continue
        if allow and not any(re.search(p, module) for p in allow):
            continue
        total += shape[0] * shape[1]
    return total


def _names(options: Mapping[str, Any], key: str, legacy: str) -> list[str]:
    """The module-name patterns of an allow or block list (INC still reads the legacy key)."""
    names: list[str] = []
    for k in (key, legacy):
        entry = options.get(k)
        if isinstance(entry, dict):
            names += [str(n) for n in entry.get("names", []) or []]
    return names
