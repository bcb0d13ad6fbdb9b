"""The gateway's one typed facade over the pluggy plugin manager.

Everything the gateway wants from plugins goes through `PluginHost`: nothing
else calls `pm.hook`. Plugins are found through the `switchyard.plugins`
entry-point group; `SWITCHYARD_PLUGINS` (allow list) and
`SWITCHYARD_DISABLE_PLUGINS` (block list), both comma-separated entry-point
names, choose which of the installed ones load.

Quantization methods and engines meet here: a method declares the weight
formats it produces, an engine the formats its kernels run, and
`resolve_quantization` refuses a `--quantize` the chosen engine cannot run
before the engine is built.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from types import ModuleType

import msgspec
import pluggy

from switchyard_spec import (
    ENTRY_POINT_GROUP,
    GGUF_BLOCKS_FILE,
    PROJECT_NAME,
    CommandSpec,
    DeviceInfo,
    EngineNotFoundError,
    EngineSpec,
    PluginConflictError,
    QuantizationMethod,
    UnsupportedQuantizationError,
    hookspecs,
)

log = logging.getLogger("switchyard.plugins")

ALLOW_ENV = "SWITCHYARD_PLUGINS"
BLOCK_ENV = "SWITCHYARD_DISABLE_PLUGINS"


class PluginRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One loaded plugin: its entry-point name, distribution and version."""

    name: str
    distribution: str
    version: str


class EngineAvailability(msgspec.Struct, frozen=True, kw_only=True):
    """An engine, the plugin that declared it, and whether its device is present."""

    engine: str
    plugin: str
    description: str
    priority: int
    device: DeviceInfo


class MethodSupport(msgspec.Struct, frozen=True, kw_only=True):
    """A quantization method, its plugin, its formats and the engines that run them."""

    method: str
    plugin: str
    description: str
    formats: tuple[str, ...]
    """Names of the weight formats the method produces."""
    engines: tuple[str, ...]
    """Installed engines that run at least one of those formats."""


def _names_from_env(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


class PluginHost:
    """Loads plugins and answers typed questions about what they provide."""

    def __init__(self) -> None:
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._records: list[PluginRecord] = []
        self._owners: dict[str, str] = {}

    @classmethod
    def from_entry_points(cls) -> PluginHost:
        """Load every installed plugin the allow/block environment variables let through."""
        host = cls()
        allow, block = _names_from_env(ALLOW_ENV), _names_from_env(BLOCK_ENV) or set()
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in block or (allow is not None and ep.name not in allow):
                log.info("plugin %s skipped by %s/%s", ep.name, ALLOW_ENV, BLOCK_ENV)
                continue
            module = ep.load()
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            host.register(module, ep.name, distribution=dist, version=version)
        return host

    def register(
        self, plugin: ModuleType | object, name: str, *, distribution: str = "?", version: str = "?"
    ) -> None:
        """Register one plugin object (a module or any object with hookimpls)."""
        self._pm.register(plugin, name=name)
        self._records.append(PluginRecord(name=name, distribution=distribution, version=version))
        log.info("plugin %s loaded (%s %s)", name, distribution, version)

    @property
    def plugins(self) -> list[PluginRecord]:
        """The plugins loaded, in load order."""
        return list(self._records)

    def engines(self) -> dict[str, EngineSpec]:
        """Every declared engine by name; two plugins declaring one name is an error."""
        found: dict[str, EngineSpec] = {}
        self._owners = {}
        for impl in self._pm.hook.switchyard_engines.get_hookimpls():
            for spec in impl.function() or []:
                if spec.name in found:
                    raise PluginConflictError(
                        f"engine name {spec.name!r} is declared by both plugin "
                        f"{self._owners[spec.name]!r} and plugin {impl.plugin_name!r}; "
                        f"uninstall one or block it with {BLOCK_ENV}={impl.plugin_name}"
                    )
                found[spec.name] = spec
                self._owners[spec.name] = impl.plugin_name
        return found

    def commands(self) -> dict[str, CommandSpec]:
        """Every plugin subcommand by name; two plugins declaring one name is an error."""
        found: dict[str, tuple[CommandSpec, str]] = {}
        for impl in self._pm.hook.switchyard_commands.get_hookimpls():
            for spec in impl.function() or []:
                if spec.name in found:
                    raise PluginConflictError(
                        f"command {spec.name!r} is declared by both plugin "
                        f"{found[spec.name][1]!r} and plugin {impl.plugin_name!r}")
                found[spec.name] = (spec, impl.plugin_name)
        return {name: spec for name, (spec, _) in found.items()}

    def quantization_methods(self) -> dict[str, QuantizationMethod]:
        """Every declared quantization method by name; duplicates are an error."""
        return {name: method for name, (method, _) in self._methods().items()}

    def _methods(self) -> dict[str, tuple[QuantizationMethod, str]]:
        """Each method by name, with the plugin that declared it."""
        found: dict[str, tuple[QuantizationMethod, str]] = {}
        for impl in self._pm.hook.switchyard_quantization_methods.get_hookimpls():
            for method in impl.function() or []:
                if method.name in found:
                    raise PluginConflictError(
                        f"quantization method {method.name!r} is declared by both plugin "
                        f"{found[method.name][1]!r} and plugin {impl.plugin_name!r}"
                    )
                found[method.name] = (method, impl.plugin_name)
        return found

    def quantization_support(self) -> list[MethodSupport]:
        """Every quantization method with the installed engines that can run it, by name."""
        engines = self.engines()
        rows = []
        for name, (method, plugin) in sorted(self._methods().items()):
            rows.append(MethodSupport(
                method=name, plugin=plugin, description=method.description,
                formats=tuple(f.name for f in method.formats),
                engines=tuple(e for e, spec in engines.items() if _runs(spec, method)),
            ))
        return rows

    def resolve_quantization(self, name: str | None,
                             engine: EngineSpec) -> QuantizationMethod | None:
        """The method ``--quantize`` names, if ``engine`` runs one of its formats; None for no name.

        Raises `UnsupportedQuantizationError`, naming the methods ``engine``
        can run, when no plugin declares ``name`` or when ``engine`` runs none
        of its formats. Called before the engine is built, so a wrong
        ``--quantize`` costs no weight loading.
        """
        if name is None:
            return None
        methods = self.quantization_methods()
        runnable = ", ".join(
            f"{m.name} ({'/'.join(f.name for f in m.formats)})"
            for m in sorted(methods.values(), key=lambda m: m.name) if _runs(engine, m)
        ) or "none"
        if name not in methods:
            hint = "" if methods else "; install switchyard-quant for int8 and int4"
            raise UnsupportedQuantizationError(
                f"--quantize {name!r}: no installed plugin declares that quantization method; "
                f"engine {engine.name!r} can run: {runnable}{hint}")
        method = methods[name]
        if not _runs(engine, method):
            formats = ", ".join(f.name for f in method.formats)
            raise UnsupportedQuantizationError(
                f"--quantize {name!r} produces {formats} weights, which engine {engine.name!r} "
                f"has no kernels for; it can run: {runnable}")
        return method

    def detect_quantization(self, name: str | None, model_path: str | os.PathLike,
                            engine: EngineSpec | None = None) -> str | None:
        """``--quantize`` for a model folder: ``name``, or the checkpoint method its config asks for.

        A folder whose config.json has ``quantization_config.quant_method``
        holds quantized weights: with no ``name`` it is served by the method
        declaring that ``config_quant_method`` (logged); a ``name`` of another
        method, or no method reading it, raises `UnsupportedQuantizationError`
        saying so, since its float weights are not there to quantize.

        A folder converted from a GGUF file that kept blocks
        (``GGUF_BLOCKS_FILE``) holds its float weights too: with no ``name`` it
        is served by a method whose ``config_quant_method`` is "gguf" and whose
        formats ``engine`` runs (any, when ``engine`` is None), else
        dequantized (None); a ``name`` stands, whatever it is. Each case logs
        what it does with the blocks.
        """
        detected = _config_quant_method(model_path)
        if detected is None:
            return self._gguf_quantization(name, model_path, engine)
        methods = self.quantization_methods()
        readers = sorted(m.name for m in methods.values()
                         if m.load is not None and m.config_quant_method == detected)
        where = f"{os.fspath(model_path)}/config.json"
        if name is None:
            if not readers:
                raise UnsupportedQuantizationError(
                    f"{where}: the weights are quantized with {detected!r} "
                    "(quantization_config.quant_method) and no installed plugin reads that "
                    "format; switchyard-quant reads gptq and awq")
            log.info("%s: quantization_config.quant_method %r: serving with --quantize %s",
                     where, detected, readers[0])
            return readers[0]
        if name not in readers:
            also = (f"serve it with --quantize {' or '.join(readers)} or without --quantize"
                    if readers else "no installed plugin reads that format")
            raise UnsupportedQuantizationError(
                f"--quantize {name!r}: {where} says the weights are already quantized with "
                f"{detected!r} (quantization_config.quant_method), so there are no float "
                f"weights for {name!r}; {also}")
        return name

    def _gguf_quantization(self, name: str | None, model_path: str | os.PathLike,
                           engine: EngineSpec | None) -> str | None:
        """:meth:`detect_quantization` for a folder that is no quantized checkpoint."""
        blocks = os.path.join(model_path, GGUF_BLOCKS_FILE)
        if not os.path.isfile(blocks):
            return name
        readers = [m for m in self.quantization_methods().values()
                   if m.load is not None and m.config_quant_method == "gguf"]
        names = " or ".join(sorted(m.name for m in readers))
        where = os.fspath(model_path)
        if name is not None:
            if name not in {m.name for m in readers}:
                log.info("%s: --quantize %s quantizes every linear from its dequantized GGUF "
                         "weights; %s keep the GGUF blocks of %s as they are", where, name,
                         f"no --quantize or --quantize {names}" if names else
                         "a plugin reading them would", GGUF_BLOCKS_FILE)
            return name
        runnable = sorted(m.name for m in readers if engine is None or _runs(engine, m))
        if runnable:
            log.info("%s: GGUF blocks in %s: serving with --quantize %s", where,
                     GGUF_BLOCKS_FILE, runnable[0])
            return runnable[0]
        why = (f"engine {engine.name!r} runs none of the formats of --quantize {names}"
               if readers and engine is not None else
               "no installed plugin reads them (switchyard-quant does: --quantize gguf)")
        log.info("%s: GGUF blocks in %s are served dequantized: %s", where, GGUF_BLOCKS_FILE,
                 why)
        return None

    def availability(self) -> list[EngineAvailability]:
        """Every engine with the answer of its device probe, best priority first."""
        specs = self.engines()
        rows = []
        for name, spec in specs.items():
            try:
                device = spec.probe()
            except Exception as exc:  # a probe must not take the listing down
                device = DeviceInfo(available=False, name="?", detail=f"probe failed: {exc}")
            rows.append(
                EngineAvailability(
                    engine=name,
                    plugin=self._owners[name],
                    description=spec.description,
                    priority=spec.priority,
                    device=device,
                )
            )
        return sorted(rows, key=lambda row: -row.priority)

    def select_engine(self, name: str | None) -> EngineSpec:
        """The engine named, or else the available one with the highest priority."""
        specs = self.engines()
        if name is not None:
            if name not in specs:
                known = ", ".join(sorted(specs)) or "none"
                raise EngineNotFoundError(f"no engine named {name!r}; installed engines: {known}")
            return specs[name]
        for row in self.availability():
            if row.device.available:
                log.info("engine %s selected (device: %s)", row.engine, row.device.name)
                return specs[row.engine]
        raise EngineNotFoundError(
            "no installed engine has its device present; install a hardware plugin "
            "such as switchyard-xeon (see `switchyard plugins`)"
        )


def _config_quant_method(model_path: str | os.PathLike) -> str | None:
    """config.json's ``quantization_config.quant_method`` (lower case), or None."""
    import json

    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as fh:
            config = json.load(fh)
    except (OSError, ValueError):
        return None  # the engine's loading reports a missing or broken config.json
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    return str(method).lower() if method else None


def _runs(engine: EngineSpec, method: QuantizationMethod) -> bool:
    """Whether ``engine`` declares a kernel for at least one of ``method``'s formats."""
    return any(f in engine.weight_formats for f in method.formats)
