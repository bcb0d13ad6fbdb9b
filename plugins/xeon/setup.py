"""Build switchyard-xeon's native kernels, once per ISA level, at install time.

setuptools with torch's ``BuildExtension`` (why: it knows torch's headers,
libraries and C++ ABI flags, and compiles with ninja in parallel; a CMake
project would have to find the same through Torch's CMake package). Each level
in ``switchyard_xeon/isa.py`` becomes one extension, ``_kernels_<level>``,
made of every kernel source compiled with that level's target flags and nothing
for the building machine (no ``-march=native``). The sources are compiled once
per level through generated one-line wrappers (``#include`` of the real file),
because setuptools names object files after their sources and the levels would
otherwise overwrite each other's.

Build without isolation, against the torch that will run the kernels:
``pip install --no-build-isolation ./plugins/xeon`` (or ``-e``), or
``python -m build --no-isolation --wheel plugins/xeon``. ``SWITCHYARD_XEON_VARIANTS``
(comma-separated level names) builds a subset, for a developer in a hurry.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
KERNELS = HERE / "switchyard_xeon" / "kernels"
SOURCES = sorted(KERNELS.glob("*.cpp"))
# -g0: Python's own CFLAGS carry -g, which on torch's headers costs minutes and megabytes.
COMMON_FLAGS = ["-O3", "-g0", "-ffast-math", "-fopenmp"]


def _isa_module():
    """``switchyard_xeon/isa.py``, read without importing the package (it needs only the
    standard library)."""
    path = HERE / "switchyard_xeon" / "isa.py"
    spec = importlib.util.spec_from_file_location("_switchyard_xeon_isa", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _wrappers(variant: str, digest: str) -> list[str]:
    """One wrapper per kernel source for `variant`, in the build tree (relative paths).

    Only ``build_info.cpp``'s wrapper carries the level and the sources' hash, so an
    edit to one kernel recompiles that kernel and ``build_info.cpp``, not every source.
    """
    folder = HERE / "build" / "variant_sources" / variant
    folder.mkdir(parents=True, exist_ok=True)
    wrappers = []
    for source in SOURCES:
        wrapper = folder / source.name
        text = f'#include "{source}"\n'
        if source.name == "build_info.cpp":
            text = f'#define SY_ISA "{variant}"\n#define SY_SOURCE_HASH "{digest}"\n' + text
        if not wrapper.exists() or wrapper.read_text() != text:
            wrapper.write_text(text)
        wrappers.append(str(wrapper.relative_to(HERE)))
    return wrappers


def _extensions() -> list[object]:
    from torch.utils.cpp_extension import CppExtension

    isa = _isa_module()
    wanted = {v.strip() for v in os.environ.get("SWITCHYARD_XEON_VARIANTS", "").split(",")
              if v.strip()}
    digest = isa.source_hash(KERNELS)
    return [
        CppExtension(
            name=f"switchyard_xeon.kernels.{variant.library}",
            sources=_wrappers(variant.name, digest),
            include_dirs=[str(KERNELS)],
            extra_compile_args=[*COMMON_FLAGS, *variant.cflags],
            extra_link_args=["-fopenmp"],
        )
        for variant in isa.VARIANTS if not wanted or variant.name in wanted
    ]


def _build_ext() -> type:
    from torch.utils.cpp_extension import BuildExtension

    class BuildKernels(BuildExtension):  # type: ignore[misc]
        """torch's build, with one object folder for every kind of build.

        An editable install, a wheel and an in-place build would each compile into a
        folder of their own (pip's editable builds into a temporary one); sharing
        ``build/objects`` lets ninja recompile only the sources that changed.
        """

        def finalize_options(self) -> None:
            super().finalize_options()
            self.build_temp = str(HERE / "build" / "objects")

    return BuildKernels


setup(ext_modules=_extensions(), cmdclass={"build_ext": _build_ext()})
