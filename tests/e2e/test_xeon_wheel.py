"""The xeon plugin as a wheel: it installs and serves on a machine with no compiler.

The wheel is built from this checkout (`pip wheel --no-build-isolation`; the
objects `make kernels` compiled are reused, so it mostly links) and installed
into a fresh virtual environment that sees the rest of the project's packages
through a site directory but has nothing on `PATH` beside its own `bin/`: no
`gcc`, `g++` or `c++`. Its server must name the kernel level it loaded and
answer greedy requests with the tokens the session server (the source tree's
engine) answers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import httpx
import pytest

from switchyard_xeon import isa
from tests.support.live_server import start_server, stop_server

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation",
                    "--no-deps", "-w", str(out), str(ROOT / "plugins" / "xeon")],
                   check=True, timeout=1800, env={**os.environ, "MAX_JOBS": "2"})
    (built,) = out.glob("switchyard_xeon-*.whl")
    return built


def test_the_wheel_is_for_this_platform_and_holds_every_level(wheel):
    assert wheel.name.endswith("-linux_x86_64.whl"), wheel.name  # not py3-none-any
    names = zipfile.ZipFile(wheel).namelist()
    for variant in isa.VARIANTS:
        assert any(n.startswith(f"switchyard_xeon/kernels/{variant.library}.") and
                   n.endswith(".so") for n in names), (variant.name, names)
    assert "switchyard_xeon/kernels/paged_attention.cpp" in names  # the hash's sources


@pytest.fixture(scope="module")
def bare_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding only the wheel, seeing the project's other packages, with no
    compiler on PATH."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
        "site-packages"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), str(wheel)], check=True, timeout=300)
    # The project's other packages (and torch), after the wheel's: a site directory, so
    # their own .pth files (the editable installs) are read too.
    parent = sysconfig.get_paths()["purelib"]
    (site / "zz_parent.pth").write_text(f"import site; site.addsitedir({parent!r})\n")
    return venv


def test_the_wheel_serves_without_a_compiler_and_answers_as_the_source_tree(
        bare_venv, server, model_cache, tmp_path_factory):
    path = str(bare_venv / "bin")
    for tool in ("gcc", "g++", "c++", "cc", "ninja"):
        assert shutil.which(tool, path=path) is None, tool
    python = bare_venv / "bin" / "python"
    where = subprocess.run([str(python), "-c", "import switchyard_xeon; "
                            "print(switchyard_xeon.__file__)"], env={"PATH": path},
                           capture_output=True, text=True, check=True, timeout=120)
    assert where.stdout.strip().startswith(str(bare_venv))  # the wheel's, not the checkout's
    env = {"PATH": path, "HOME": str(tmp_path_factory.mktemp("home")),
           "SWITCHYARD_CACHE": str(model_cache), "HF_HUB_OFFLINE": "1"}
    live = start_server(model_cache, tmp_path_factory.mktemp("logs"), "--dtype", "float32",
                        "--max-total-tokens", "512", "--max-input-tokens", "400",
                        env=env, python=str(python), inherit_env=False)
    try:
        best = isa.runnable(isa.cpu_flags())[-1].name
        assert f"native kernels for {best}" in live.log(), live.log()
        for prompt in PROMPTS:
            body = {"inputs": prompt, "parameters": {"max_new_tokens": 16, "details": True}}
            got = httpx.post(f"{live.url}/generate", json=body, timeout=120).json()
            want = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()
            assert [t["id"] for t in got["details"]["tokens"]] == \
                [t["id"] for t in want["details"]["tokens"]]
    finally:
        stop_server(live)
