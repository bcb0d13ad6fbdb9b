"""The gateway matches a `--quantize` method with the chosen engine by weight format.

A method declares the formats it produces, an engine the formats its kernels
run; `PluginHost.resolve_quantization` refuses, before the engine is built, a
method the engine cannot run and names the ones it can. `switchyard plugins`
lists each method with the engines that run it.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from switchyard.cli import main
from switchyard.plugins import PluginHost
from switchyard_spec import (
    INT8_PER_CHANNEL,
    DeviceInfo,
    EngineSpec,
    QuantizationMethod,
    UnsupportedQuantizationError,
    hookimpl,
    uint4_group_asym,
)


def _method(name: str, *formats) -> QuantizationMethod:
    return QuantizationMethod(name=name, description=f"{name} method", formats=formats,
                              quantize=lambda w: w, dequantize=lambda q: q)


def _engine(name: str, *formats) -> EngineSpec:
    return EngineSpec(name=name, description="", factory=lambda config: None,
                      probe=lambda: DeviceInfo(available=True, name=name),
                      weight_formats=formats)


class _Plugin:
    def __init__(self, engines=(), methods=()):
        self._engines, self._methods = list(engines), list(methods)

    @hookimpl
    def switchyard_engines(self):
        return self._engines

    @hookimpl
    def switchyard_quantization_methods(self):
        return self._methods


@pytest.fixture
def host() -> PluginHost:
    host = PluginHost()
    host.register(_Plugin(engines=[_engine("cpu", INT8_PER_CHANNEL, uint4_group_asym(128)),
                                   _engine("accel")]), "hw")
    host.register(_Plugin(methods=[_method("int8", INT8_PER_CHANNEL),
                                   _method("int4", uint4_group_asym(128)),
                                   _method("int4-g32", uint4_group_asym(32))]), "q")
    return host


def test_a_method_the_engine_runs_is_handed_over(host):
    cpu = host.engines()["cpu"]
    assert host.resolve_quantization(None, cpu) is None
    method = host.resolve_quantization("int4", cpu)
    assert method is not None and method.name == "int4"
    assert method.formats == (uint4_group_asym(128),)  # records compare by value


def test_a_format_the_engine_has_no_kernel_for_is_refused_with_what_it_can_run(host):
    cpu, accel = host.engines()["cpu"], host.engines()["accel"]
    with pytest.raises(UnsupportedQuantizationError) as refused:
        host.resolve_quantization("int4-g32", cpu)
    assert str(refused.value) == (
        "--quantize 'int4-g32' produces uint4-group32-asym weights, which engine 'cpu' has no "
        "kernels for; it can run: int4 (uint4-group128-asym), int8 (int8-per-channel)")
    with pytest.raises(UnsupportedQuantizationError, match="engine 'accel'.*it can run: none"):
        host.resolve_quantization("int8", accel)


def test_an_unknown_method_is_refused_with_what_the_engine_can_run(host):
    with pytest.raises(UnsupportedQuantizationError) as refused:
        host.resolve_quantization("gptq", host.engines()["cpu"])
    assert "--quantize 'gptq': no installed plugin declares that quantization method" in str(
        refused.value)
    assert "int4 (uint4-group128-asym), int8 (int8-per-channel)" in str(refused.value)
    bare = PluginHost()
    bare.register(_Plugin(engines=[_engine("cpu", INT8_PER_CHANNEL)]), "hw")
    with pytest.raises(UnsupportedQuantizationError, match="install switchyard-quant"):
        bare.resolve_quantization("int8", bare.engines()["cpu"])


def test_support_lists_each_method_with_the_engines_that_run_it(host):
    rows = {row.method: row for row in host.quantization_support()}
    assert list(rows) == ["int4", "int4-g32", "int8"]
    assert rows["int8"].engines == ("cpu",) and rows["int8"].plugin == "q"
    assert rows["int4"].formats == ("uint4-group128-asym",)
    assert rows["int4-g32"].engines == ()


def test_installed_plugins_list_int8_and_int4_on_the_xeon_engine():
    """The real plugins: switchyard-quant's methods, switchyard-xeon's formats."""
    rows = {row.method: row for row in PluginHost.from_entry_points().quantization_support()}
    for name, fmt in (("int8", "int8-per-channel"), ("int4", "uint4-group128-asym"),
                      ("int4-g64", "uint4-group64-asym"), ("int4-g32", "uint4-group32-asym")):
        assert rows[name].plugin == "quant" and rows[name].formats == (fmt,)
        assert "xeon" in rows[name].engines
    out = CliRunner().invoke(main, ["plugins"]).output
    assert "quantization methods (--quantize):" in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("int4 "))
    assert "plugin=quant formats=uint4-group128-asym" in line and "xeon" in line
