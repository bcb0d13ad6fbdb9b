"""Where the Xeon engine computes (NUMA node, cores) and which kernels it reports.

The NUMA tests build a fake ``/sys/devices/system/node`` and ``/proc/cpuinfo``
under ``tmp_path``; the IPEX tests inject fake look-ups, so every branch runs
without IPEX installed (and a mismatched IPEX is never imported).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from switchyard_spec import EngineConfig
from switchyard_xeon import machine
from switchyard_xeon.engine import XeonEngine
from switchyard_xeon.ipex_support import IPEX_MODULE, detect_acceleration

from tests.support.xeon_options import TEST_OPTIONS

# --------------------------------------------------------------- cpulist


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0-3,8-11\n", {0, 1, 2, 3, 8, 9, 10, 11}),
        ("5", {5}),
        ("0,2,4-5", {0, 2, 4, 5}),
        ("\n", set()),
        ("", set()),
        ("0-1,junk,3", {0, 1, 3}),  # a malformed part is skipped, the rest kept
    ],
)
def test_parse_cpulist(text, cpus):
    assert machine.parse_cpulist(text) == cpus


def test_format_cpulist_is_the_inverse():
    assert machine.format_cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert machine.parse_cpulist(machine.format_cpulist({0, 1, 2, 3, 8, 10, 11})) == {
        0, 1, 2, 3, 8, 10, 11}
    assert machine.format_cpulist([]) == ""


# ------------------------------------------------------------ NUMA choice


def write_cpuinfo(path: Path, cores: dict[int, tuple[int, int]]) -> str:
    """A cpuinfo with one block per CPU: ``cpu -> (physical id, core id)``."""
    path.write_text("\n".join(
        f"processor\t: {cpu}\nvendor_id\t: GenuineIntel\nmodel name\t: Intel Xeon\n"
        f"physical id\t: {socket}\ncore id\t\t: {core}\nflags\t\t: fpu avx512f\n"
        for cpu, (socket, core) in sorted(cores.items())
    ))
    return str(path)


def write_nodes(root: Path, nodes: dict[int, str]) -> str:
    for node, cpulist in nodes.items():
        (root / f"node{node}").mkdir(parents=True)
        (root / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    # Files the kernel keeps beside the node folders must not be taken for nodes.
    (root / "online").write_text("0-1\n")
    (root / "possible").write_text("0-1\n")
    return str(root)


@pytest.fixture
def two_sockets(tmp_path: Path) -> tuple[str, str]:
    """Two nodes of 2 cores x 2 hyper-threads, numbered as Linux does (siblings last)."""
    # node 0: CPUs 0,1 and their siblings 4,5; node 1: CPUs 2,3 and siblings 6,7.
    cores = {0: (0, 0), 1: (0, 1), 4: (0, 0), 5: (0, 1),
             2: (1, 0), 3: (1, 1), 6: (1, 0), 7: (1, 1)}
    cpuinfo = write_cpuinfo(tmp_path / "cpuinfo", cores)
    return write_nodes(tmp_path / "node", {0: "0-1,4-5", 1: "2-3,6-7"}), cpuinfo


def test_read_numa_nodes(two_sockets, tmp_path):
    root, _ = two_sockets
    assert machine.read_numa_nodes(root) == {0: {0, 1, 4, 5}, 1: {2, 3, 6, 7}}
    assert machine.read_numa_nodes(str(tmp_path / "absent")) == {}


def test_memory_only_node_is_ignored(tmp_path):
    root = write_nodes(tmp_path / "node", {0: "0-3", 1: ""})  # node 1: memory, no CPUs
    assert machine.read_numa_nodes(root) == {0: {0, 1, 2, 3}}


def test_two_nodes_pick_the_first_and_count_hyperthreads_once(two_sockets):
    root, cpuinfo = two_sockets
    placement = machine.choose_cpus(node_root=root, cpuinfo_path=cpuinfo, allowed=range(8))
    assert placement.node == 0 and placement.cpus == {0, 1, 4, 5}
    assert placement.physical_cores == 2  # 4 CPUs, 2 of them hyper-thread siblings
    assert placement.should_bind  # one node of two: binding keeps compute on one socket
    assert placement.describe() == "NUMA node 0 (CPUs 0-1,4-5)"


def test_first_node_that_intersects_the_mask(two_sockets):
    """A process confined (taskset, cgroup) to node 1 computes there, within its mask."""
    root, cpuinfo = two_sockets
    placement = machine.choose_cpus(node_root=root, cpuinfo_path=cpuinfo, allowed={3, 6, 7})
    assert placement.node == 1 and placement.cpus == {3, 6, 7}  # never widened to CPU 2
    assert placement.physical_cores == 2
    assert not placement.should_bind  # the whole mask already is that node


def test_single_node_machine_does_not_bind(tmp_path):
    cpuinfo = write_cpuinfo(tmp_path / "cpuinfo", {0: (0, 0), 1: (0, 0), 2: (0, 1), 3: (0, 1)})
    root = write_nodes(tmp_path / "node", {0: "0-3"})
    placement = machine.choose_cpus(node_root=root, cpuinfo_path=cpuinfo, allowed=range(4))
    assert placement.node == 0 and placement.physical_cores == 2 and not placement.should_bind


def test_no_numa_information_uses_every_allowed_cpu(tmp_path):
    cpuinfo = write_cpuinfo(tmp_path / "cpuinfo", {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1)})
    placement = machine.choose_cpus(node_root=str(tmp_path / "no-node-dir"),
                                    cpuinfo_path=cpuinfo, allowed={0, 1, 2, 3})
    assert placement.node is None and placement.cpus == {0, 1, 2, 3}
    assert placement.physical_cores == 2 and not placement.should_bind
    assert placement.describe() == "CPUs 0-3 (no NUMA information)"


def test_nothing_readable_still_answers(tmp_path):
    """No sysfs and no cpuinfo: each allowed CPU counts as a core; nothing raises."""
    placement = machine.choose_cpus(node_root=str(tmp_path / "x"),
                                    cpuinfo_path=str(tmp_path / "y"), allowed={0, 1, 2})
    assert placement.cpus == {0, 1, 2} and placement.physical_cores == 3


def test_real_machine_choice_is_within_the_affinity_mask():
    placement = machine.choose_cpus()
    assert placement.cpus and placement.cpus <= machine.allowed_cpus()
    assert 1 <= placement.physical_cores <= len(placement.cpus)


# ------------------------------------------------------------------ IPEX


def never_import(name: str) -> object:
    raise AssertionError(f"{name} must not be imported")


def test_ipex_absent():
    accel = detect_acceleration(find_spec=lambda name: None, version=never_import,
                                torch_version=lambda: "2.13.0+cpu", importer=never_import)
    assert accel.backend == "stock" and not accel.ipex_usable and accel.version is None
    assert accel.reason == f"{IPEX_MODULE} not installed"
    assert accel.describe() == f"stock PyTorch ({IPEX_MODULE} not installed)"


def test_ipex_mismatched_version_is_never_imported():
    accel = detect_acceleration(find_spec=lambda name: object(), version=lambda name: "2.8.0+cpu",
                                torch_version=lambda: "2.13.0+cpu", importer=never_import)
    assert accel.backend == "stock" and accel.version == "2.8.0+cpu"
    assert accel.reason == "IPEX 2.8 does not match torch 2.13"


def test_ipex_without_package_version_is_not_imported():
    def no_metadata(name: str) -> str:
        raise LookupError(name)  # what importlib.metadata.PackageNotFoundError derives from

    accel = detect_acceleration(find_spec=lambda name: object(), version=no_metadata,
                                torch_version=lambda: "2.8.0", importer=never_import)
    assert accel.backend == "stock" and "no package version" in accel.reason


@pytest.mark.parametrize("error", [AttributeError("module 'os' has no attribute 'exit'"),
                                   ImportError("libfoo.so"), SystemExit(127)])
def test_ipex_import_failure_falls_back(error):
    calls: list[str] = []

    def importer(name: str) -> object:
        calls.append(name)
        raise error

    accel = detect_acceleration(find_spec=lambda name: object(), version=lambda name: "2.8.0",
                                torch_version=lambda: "2.8.1+cpu", importer=importer)
    assert calls == [IPEX_MODULE]
    assert accel.backend == "stock" and accel.version == "2.8.0"
    assert accel.reason.startswith("IPEX 2.8.0 failed to import: ")
    assert type(error).__name__ in accel.reason


def test_ipex_matching_and_importable_is_usable():
    calls: list[str] = []
    accel = detect_acceleration(find_spec=lambda name: object(), version=lambda name: "2.8.0+cpu",
                                torch_version=lambda: "2.8.0+cpu",
                                importer=lambda name: calls.append(name))
    assert calls == [IPEX_MODULE]
    assert accel.backend == "ipex" and accel.ipex_usable and accel.version == "2.8.0+cpu"
    # Usable is reported as found, not as in use: the engine keeps its paged attention.
    assert accel.describe().startswith("stock PyTorch (IPEX 2.8.0+cpu usable but not applied")


def test_real_lookup_here_imports_nothing_mismatched():
    """On this stack (torch newer than any IPEX) the answer is stock, and nothing is imported."""
    calls: list[str] = []
    accel = detect_acceleration(importer=calls.append)
    assert accel.backend == "stock" and calls == []


# ---------------------------------------------------------------- engine


def test_engine_start_logs_and_exposes_the_selection(default_model_path, caplog):
    caplog.set_level(logging.INFO, logger="switchyard.xeon")
    engine = XeonEngine(EngineConfig(model_path=str(default_model_path), dtype="float32",
                                     options=TEST_OPTIONS))
    assert engine.acceleration is None and engine.placement is None
    engine.start()
    try:
        assert engine.acceleration is not None and engine.acceleration.backend == "stock"
        assert engine.placement is not None
        (line,) = [r.getMessage() for r in caplog.records
                   if r.getMessage().startswith("xeon: ") and " torch thread" in r.getMessage()]
        # TEST_OPTIONS sets num_threads=1: the option still overrides the node's core count.
        assert (f": 1 torch thread (num_threads option) on {engine.placement.describe()}"
                in line)
        assert line.endswith(f"; kernels: {engine.acceleration.describe()}")
        assert "kernels: stock PyTorch (" in line
    finally:
        engine.shutdown()


def test_engine_binds_its_compute_thread_on_a_multi_node_machine(default_model_path, caplog,
                                                                 monkeypatch):
    """With a node smaller than the mask, the loop thread (only) is pinned to that node."""
    allowed = machine.allowed_cpus()
    if len(allowed) < 2:
        pytest.skip("needs two allowed CPUs to fake a two-node machine")
    node_cpus = frozenset({min(allowed)})
    monkeypatch.setattr(machine, "choose_cpus", lambda: machine.CpuPlacement(
        cpus=node_cpus, node=0, physical_cores=1, allowed=allowed))
    caplog.set_level(logging.INFO, logger="switchyard.xeon")
    engine = XeonEngine(EngineConfig(model_path=str(default_model_path), dtype="float32",
                                     options=TEST_OPTIONS))
    engine.start()
    try:
        engine.warmup()  # the loop has run its first steps, so it has bound itself
        assert engine._thread is not None and engine._thread.native_id is not None
        assert os.sched_getaffinity(engine._thread.native_id) == node_cpus
        assert os.sched_getaffinity(0) == allowed  # the server's own threads stay free
        assert any(f"on NUMA node 0 (CPUs {min(allowed)}), compute thread bound to them; "
                   in r.getMessage() for r in caplog.records)
    finally:
        engine.shutdown()
