"""The xeon kernels compiled for this machine only (``-march=native``), to compare with the
prebuilt ISA levels in one run.

The installed levels are compiled for a target ISA, not for the build machine; this builds
the same sources the old way, with torch's JIT extension loader, into a folder of its
own, and prints the library's path. Give it to the engine with
``SWITCHYARD_XEON_LIBRARY`` (the loader checks it came from the same sources), e.g.:

    lib=$(.venv/bin/python benchmarks/kernels/build_native.py)
    .venv/bin/python benchmarks/engine_paths.py --model /tmp/bench-models/small \\
        --streams 1 32 --rounds 3 --variant prebuilt= \\
        --variant native=env.SWITCHYARD_XEON_LIBRARY=$lib
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugins" / "xeon"))

from switchyard_xeon import isa  # noqa: E402

KERNELS = ROOT / "plugins" / "xeon" / "switchyard_xeon" / "kernels"


def main() -> None:
    from torch.utils import cpp_extension

    # torch builds with ninja: the venv's, whether or not its bin/ is on PATH.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

    folder = Path(tempfile.mkdtemp(prefix="switchyard-native-"))
    digest = isa.source_hash(KERNELS)
    cpp_extension.load(
        name="switchyard_xeon_native", sources=[str(p) for p in sorted(KERNELS.glob("*.cpp"))],
        extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp",
                      # Escaped: ninja hands the flags to a shell, which would eat bare quotes.
                      '-DSY_ISA=\\"native\\"', f'-DSY_SOURCE_HASH=\\"{digest}\\"'],
        extra_ldflags=["-fopenmp"], build_directory=str(folder), is_python_module=False,
        verbose=False)
    print(folder / "switchyard_xeon_native.so")


if __name__ == "__main__":
    main()
