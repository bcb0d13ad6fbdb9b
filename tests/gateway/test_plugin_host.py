"""The typed plugin facade: discovery, conflicts, allow/block lists, engine choice."""

from __future__ import annotations

import pytest

from switchyard.plugins import PluginHost
from switchyard_spec import (
    INT8_PER_CHANNEL,
    CommandSpec,
    DeviceInfo,
    EngineNotFoundError,
    EngineSpec,
    PluginConflictError,
    QuantizationMethod,
    hookimpl,
)


def _spec(name: str, available: bool = True, priority: int = 0) -> EngineSpec:
    return EngineSpec(
        name=name,
        description=f"{name} engine",
        factory=lambda config: None,  # never called here
        probe=lambda: DeviceInfo(available=available, name=f"{name}-device"),
        priority=priority,
    )


class _Plugin:
    def __init__(self, *specs: EngineSpec, methods: tuple[QuantizationMethod, ...] = ()):
        self._specs, self._methods = list(specs), list(methods)

    @hookimpl
    def switchyard_engines(self):
        return self._specs

    @hookimpl
    def switchyard_quantization_methods(self):
        return self._methods


def test_installed_xeon_plugin_is_discovered():
    host = PluginHost.from_entry_points()
    assert "xeon" in [p.name for p in host.plugins]
    rows = {row.engine: row for row in host.availability()}
    assert rows["xeon"].device.available
    assert rows["xeon"].plugin == "xeon"


def test_duplicate_engine_names_fail_with_a_clear_message():
    host = PluginHost()
    host.register(_Plugin(_spec("cpu")), "first")
    host.register(_Plugin(_spec("cpu")), "second")
    with pytest.raises(PluginConflictError, match="'cpu'.*'first'.*'second'"):
        host.engines()


def test_duplicate_quantization_methods_fail():
    method = QuantizationMethod(name="int8", description="x", formats=(INT8_PER_CHANNEL,),
                                quantize=lambda w: w, dequantize=lambda q: q)
    host = PluginHost()
    host.register(_Plugin(methods=(method,)), "a")
    host.register(_Plugin(methods=(method,)), "b")
    with pytest.raises(PluginConflictError, match="int8"):
        host.quantization_methods()


def test_block_and_allow_lists(monkeypatch):
    monkeypatch.setenv("SWITCHYARD_DISABLE_PLUGINS", "xeon")
    assert "xeon" not in [p.name for p in PluginHost.from_entry_points().plugins]
    monkeypatch.delenv("SWITCHYARD_DISABLE_PLUGINS")
    monkeypatch.setenv("SWITCHYARD_PLUGINS", "someone-else")
    assert PluginHost.from_entry_points().plugins == []
    monkeypatch.setenv("SWITCHYARD_PLUGINS", "xeon")
    assert [p.name for p in PluginHost.from_entry_points().plugins] == ["xeon"]


def test_engine_selection_by_priority_and_presence():
    host = PluginHost()
    host.register(_Plugin(_spec("low", priority=1), _spec("absent", available=False, priority=9),
                          _spec("high", priority=5)), "p")
    assert host.select_engine(None).name == "high"
    assert host.select_engine("low").name == "low"
    with pytest.raises(EngineNotFoundError, match="no engine named 'nope'"):
        host.select_engine("nope")


def test_no_available_engine_is_explained():
    host = PluginHost()
    host.register(_Plugin(_spec("gone", available=False)), "p")
    with pytest.raises(EngineNotFoundError, match="switchyard-xeon"):
        host.select_engine(None)


def test_probe_that_raises_does_not_break_listing():
    def bad_probe():
        raise RuntimeError("boom")

    spec = EngineSpec(name="bad", description="", factory=lambda c: None, probe=bad_probe)
    host = PluginHost()
    host.register(_Plugin(spec), "p")
    (row,) = host.availability()
    assert not row.device.available and "boom" in row.device.detail


class _Commands:
    def __init__(self, *names: str):
        self._names = names

    @hookimpl
    def switchyard_commands(self):
        return [CommandSpec(name=n, help=n, main=lambda argv: len(argv)) for n in self._names]


def test_plugin_commands_are_collected_and_duplicates_fail():
    host = PluginHost()
    host.register(_Commands("size-it", "calibrate"), "a")
    commands = host.commands()
    assert sorted(commands) == ["calibrate", "size-it"]
    assert commands["size-it"].main(["x", "y"]) == 2
    host.register(_Commands("calibrate"), "b")
    with pytest.raises(PluginConflictError, match="'calibrate'.*'a'.*'b'"):
        host.commands()
