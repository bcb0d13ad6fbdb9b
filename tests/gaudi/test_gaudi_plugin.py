"""The plugin: found through its entry point, absent without an HPU (with the reason), never the
default over the CPU engine, and runnable on the CPU only when asked."""

from __future__ import annotations

import subprocess
import sys

import pytest
from switchyard.plugins import PluginHost
from switchyard_gaudi import device, plugin
from switchyard_gaudi.model_code import describe_model_code
from switchyard_spec import EngineConfig, EngineStartError


def test_without_an_hpu_the_engine_is_listed_as_absent_with_the_reason():
    info = plugin.probe()
    assert not info.available
    assert "habana_frameworks" in info.detail and "device=cpu" in info.detail


def test_the_plugin_is_discovered_and_the_cpu_engine_stays_the_default():
    host = PluginHost.from_entry_points()
    assert "gaudi" in [p.name for p in host.plugins]
    rows = {row.engine: row for row in host.availability()}
    assert rows["gaudi"].priority > rows["xeon"].priority  # it would win where an HPU is
    assert not rows["gaudi"].device.available
    assert host.select_engine(None).name == "xeon"
    assert host.select_engine("gaudi").name == "gaudi"  # asked for by name, it is built


def test_switchyard_plugins_prints_the_reason():
    out = subprocess.run([sys.executable, "-m", "switchyard.cli", "plugins"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    line = next(line for line in out.splitlines() if "plugin=gaudi" in line)
    assert "device present=no" in line and "habana_frameworks" in line
    import transformers

    assert f"model code: transformers {transformers.__version__}" in line


def test_the_model_code_line_names_optimum_habana_when_a_gaudi_image_ships_it():
    # The real distributions here: transformers 5, no optimum-habana.
    assert "optimum-habana not installed" in describe_model_code()
    versions = {"transformers": "4.55.4", "optimum-habana": "1.21.2"}
    line = describe_model_code(versions.get)
    assert line.startswith("model code: transformers 4.55.4")
    assert "optimum-habana 1.21.2 installed but not used" in line


def test_asking_for_the_hpu_without_one_says_how_to_run_on_the_cpu(default_model_path):
    for choice in ("auto", "hpu"):
        engine = plugin.make_engine(EngineConfig(model_path=str(default_model_path),
                                                 options={"device": choice}))
        with pytest.raises(EngineStartError, match="--engine-option device=cpu"):
            engine.start()
    with pytest.raises(EngineStartError, match="device must be auto, hpu or cpu"):
        plugin.make_engine(EngineConfig(model_path=str(default_model_path),
                                        options={"device": "gpu"})).start()


def test_a_broken_habana_install_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(device.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setitem(sys.modules, "habana_frameworks", None)  # import fails
    status = device.detect_hpu()
    assert not status.available and "habana_frameworks failed" in status.detail


def test_cpu_memory_is_memavailable_capped_by_the_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8000000 kB\nMemAvailable: 4000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert device.available_cpu_memory(str(meminfo), str(cgroup)) == 4000000 * 1024
    (cgroup / "memory.max").write_text("3000000000\n")
    (cgroup / "memory.current").write_text("1000000000\n")
    assert device.available_cpu_memory(str(meminfo), str(cgroup)) == 2000000000
    (cgroup / "memory.max").write_text("max\n")
    assert device.available_cpu_memory(str(meminfo), str(cgroup)) == 4000000 * 1024
    assert device.available_cpu_memory(str(tmp_path / "none"), str(tmp_path / "none")) == 0
