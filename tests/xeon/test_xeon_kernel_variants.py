"""The native kernels' ISA levels: which one a CPU loads, and that each one this CPU runs works.

The choice is read off the CPU's flags before any library is opened, so the
decision is tested on the flag sets of real CPUs (a CPU without AVX-512 never
gets an AVX-512 library). Each level this machine can run is then loaded in a
process of its own (one level per process: they register the same operators)
with ``SWITCHYARD_XEON_ISA``, must say it is that level, pass the loader's
checks against the PyTorch references, and run the kernel tests; a library
that is stale, truncated or missing leaves the engine on the PyTorch path at
once, with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from switchyard_xeon import isa

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "plugins" / "xeon" / "switchyard_xeon"

V3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm", "sse4_2"}
V4 = V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
CPUS = {
    "haswell": (V3, "avx2"),
    "zen3": (V3 | {"sha_ni", "vaes"}, "avx2"),
    "skylake-x (no VNNI)": (V4, "avx2"),
    "cascade-lake": (V4 | {"avx512_vnni"}, "avx512"),
    "zen4": (V4 | {"avx512_vnni", "avx512_bf16", "avx512_vbmi"}, "avx512_bf16"),
    "sapphire-rapids": (V4 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8",
                              "amx_bf16", "avx512_fp16"}, "avx512_bf16"),
    "sandy-bridge": ({"avx", "sse4_2"}, None),
    "aarch64": (set(), None),
}


@pytest.mark.parametrize("cpu", CPUS)
def test_each_cpu_gets_the_best_level_it_can_run(cpu):
    flags, want = CPUS[cpu]
    choice = isa.choose(frozenset(flags), cap="")
    assert (choice.variant.name if choice.variant else None) == want, choice.reason
    if choice.variant is not None:
        assert set(choice.variant.needs) <= flags  # every instruction it was built for
    if "avx512f" not in flags:
        assert all("avx512" not in v.name for v in isa.runnable(frozenset(flags)))


@pytest.mark.parametrize("cap", ["avx2", "avx512", "avx512_bf16", "none"])
def test_the_cap_lowers_the_level_and_never_raises_it(cap):
    zen3, _ = CPUS["zen3"]
    spr, _ = CPUS["sapphire-rapids"]
    on_zen3 = isa.choose(frozenset(zen3), cap=cap)
    assert on_zen3.variant is (None if cap == "none" else isa.VARIANTS[0])
    on_spr = isa.choose(frozenset(spr), cap=cap)
    assert (on_spr.variant.name if on_spr.variant else "none") == cap
    assert cap in on_spr.reason or on_spr.variant is isa.VARIANTS[-1]
    with pytest.raises(ValueError, match="SWITCHYARD_XEON_ISA"):
        isa.choose(frozenset(spr), cap="avx1024")


UNCAPPED = {isa.ISA_ENV: ""}
"""The environment of a process that chooses its level from the CPU alone: the tests that
break the best library check that choice, whatever cap this run has (make test-isa-avx2)."""


def _runnable_here() -> list[str]:
    return [v.name for v in isa.runnable(isa.cpu_flags())]


def _status(env: dict[str, str], pythonpath: Path | None = None) -> dict[str, object]:
    """`load_kernels()` in a fresh process with `env`: its level, reason and what it checked."""
    code = ("import json, torch\n"
            "from switchyard_xeon.kernels import load_kernels\n"
            "s = load_kernels()\n"
            "built = torch.ops.switchyard_xeon.build_isa() if s.fn is not None else None\n"
            "print(json.dumps({'variant': s.variant, 'reason': s.reason, 'built': built,\n"
            "  'fused': s.fused is not None, 'prefill': s.prefill is not None,\n"
            "  'bf16_dot': s.bf16_dot, 'quant_fma': s.quant_fma, 'w8a8': s.w8a8}))\n")
    full = {**os.environ, **env}
    if pythonpath is not None:
        full["PYTHONPATH"] = f"{pythonpath}{os.pathsep}{full.get('PYTHONPATH', '')}"
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("level", [v.name for v in isa.VARIANTS])
def test_each_level_this_cpu_runs_loads_and_passes_its_checks(level):
    if level not in _runnable_here():
        pytest.skip(f"this CPU cannot run {level}")
    status = _status({isa.ISA_ENV: level})
    assert status["variant"] == level and status["built"] == level, status
    assert status["fused"] and status["quant_fma"], status
    # What each level adds over the one below, checked against the PyTorch references.
    assert status["prefill"] == (level != "avx2"), status
    assert status["bf16_dot"] == (level == "avx512_bf16"), status
    assert ("vnni" in str(status["w8a8"])) == (level != "avx2"), status


def test_none_is_the_pytorch_path():
    status = _status({isa.ISA_ENV: "none"})
    assert status["variant"] == "none" and status["built"] is None
    assert "SWITCHYARD_XEON_ISA=none" in status["reason"]


KERNEL_TESTS = ["tests/xeon/test_xeon_decoder.py", "tests/xeon/test_xeon_prefill_kernel.py",
                "tests/xeon/test_xeon_quant_fma.py", "tests/xeon/test_xeon_w8a8.py",
                "tests/xeon/test_xeon_token_mask.py"]
"""The kernels' own tests, against their float64 / PyTorch references, of the paths that
differ between levels (the int8/uint4 dot-product panels exist at the top level only)."""


@pytest.mark.e2e  # reruns the kernel suites in a process per ISA level, not a unit
@pytest.mark.parametrize("level", [v.name for v in isa.VARIANTS[:-1]])
def test_kernel_tests_pass_on_each_lower_level(level):
    """This run's other tests use the best level; these run again on each lower one."""
    runnable = _runnable_here()
    if level not in runnable:
        pytest.skip(f"this CPU cannot run {level}")
    used = isa.choose().variant  # the level this run's other tests use (a cap lowers it)
    if used is not None and level == used.name:
        pytest.skip(f"{level} is the level this run uses: the rest of the suite runs on it")
    if used is not None and runnable.index(level) > runnable.index(used.name):
        pytest.skip(f"this run is capped at {used.name} ({isa.ISA_ENV})")
    env = {**os.environ, isa.ISA_ENV: level}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-x", *KERNEL_TESTS], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def _copy_package(tmp_path: Path) -> Path:
    """The installed package copied to `tmp_path`, libraries included, to break one."""
    shutil.copytree(PACKAGE, tmp_path / "switchyard_xeon",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _best_library(folder: Path) -> Path:
    best = isa.runnable(isa.cpu_flags())[-1]
    path = isa.library_path(best, folder / "switchyard_xeon" / "kernels")
    assert path is not None, "the package has no library for this CPU: run `make kernels`"
    return path


def test_a_library_older_than_its_sources_is_refused(tmp_path):
    copy = _copy_package(tmp_path)
    source = copy / "switchyard_xeon" / "kernels" / "token_mask.cpp"
    source.write_text(source.read_text() + "\n// edited after the build\n")
    status = _status(UNCAPPED, pythonpath=copy)
    assert status["variant"] == "none" and "older than their sources" in status["reason"]


def test_a_truncated_library_serves_the_pytorch_path_at_once(tmp_path):
    """What a build killed half way can leave behind: the next start does not wait on
    anything, and says why it runs without the kernels."""
    copy = _copy_package(tmp_path)
    library = _best_library(copy)
    whole = library.read_bytes()
    # Opened as it is, a library cut short kills the process (SIGBUS): it must be measured.
    library.write_bytes(whole[: len(whole) // 3])
    status = _status(UNCAPPED, pythonpath=copy)
    assert status["variant"] == "none" and "is cut short" in status["reason"], status
    library.write_bytes(b"\0" * len(whole))
    status = _status(UNCAPPED, pythonpath=copy)
    assert status["variant"] == "none" and "not a 64-bit ELF" in status["reason"], status


def test_a_missing_library_falls_back_to_the_best_built_level_below(tmp_path):
    runnable = _runnable_here()
    if len(runnable) < 2:
        pytest.skip("this CPU runs one level only")
    copy = _copy_package(tmp_path)
    _best_library(copy).unlink()
    status = _status(UNCAPPED, pythonpath=copy)
    assert status["variant"] == runnable[-2], status
    assert "was not built" in status["reason"]
