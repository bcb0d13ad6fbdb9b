"""Whether Intel Extension for PyTorch (IPEX) could be used, decided without risk.

IPEX wheels are built for exactly one torch major.minor. Importing one under a
different torch is not a clean ImportError: IPEX 2.8 prints an error to stdout
and then fails with AttributeError. So the version is read from the package
metadata first, and IPEX is imported only when it matches the installed torch.

Even a usable IPEX is not applied: ``ipex.llm.optimize`` swaps the model's
attention modules for its own fused ones, which would bypass the engine's paged
attention and KV cache. The engine only reports what it found. (IPEX stopped at
2.8, which needs torch 2.8, so with a newer torch the answer is always stock.)
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

IPEX_MODULE = "intel_extension_for_pytorch"
"""Both the import name and the distribution name of IPEX."""


@dataclass(frozen=True)
class Acceleration:
    """The kernel library the engine found for the CPU, and why."""

    backend: str
    """``"ipex"`` when IPEX matches torch and imports cleanly, otherwise ``"stock"``."""
    reason: str
    """One human-readable line: what was found, or why IPEX is not usable."""
    version: str | None = None
    """The installed IPEX version when one was found (usable or not)."""

    @property
    def ipex_usable(self) -> bool:
        """True when IPEX matches torch and imported without error."""
        return self.backend == "ipex"

    def describe(self) -> str:
        """The kernels the engine runs, for its start-up log line.

        The engine computes with stock PyTorch either way (see the module
        docstring), so a usable IPEX is named as found, not as in use.
        """
        if self.ipex_usable:
            return (f"stock PyTorch (IPEX {self.version} usable but not applied: "
                    "ipex.llm.optimize would replace the paged attention)")
        return f"stock PyTorch ({self.reason})"


def detect_acceleration(
    *,
    find_spec: Callable[[str], object | None] = importlib.util.find_spec,
    version: Callable[[str], str] = importlib.metadata.version,
    torch_version: Callable[[], str] | None = None,
    importer: Callable[[str], Any] = importlib.import_module,
) -> Acceleration:
    """Decide whether IPEX can be used; never raises and never imports a mismatched IPEX.

    The keyword parameters replace the real look-ups (for tests): ``find_spec``
    locates the module, ``version`` reads a distribution's version,
    ``torch_version`` returns torch's version string (default: the installed
    torch's ``__version__``), and ``importer`` imports a module by name.
    """
    try:
        found = find_spec(IPEX_MODULE) is not None
    except Exception as exc:  # a broken install can make even locating it fail
        return Acceleration("stock", f"{IPEX_MODULE} cannot be located: {exc}")
    if not found:
        return Acceleration("stock", f"{IPEX_MODULE} not installed")

    try:
        ipex_version = version(IPEX_MODULE)
    except Exception:
        # Without a version the match cannot be checked, and importing blind is what
        # prints to stdout and raises on a mismatch.
        return Acceleration("stock", f"{IPEX_MODULE} has no package version; not imported")
    try:
        torch_full = torch_version() if torch_version is not None else _installed_torch_version()
    except Exception as exc:
        return Acceleration("stock", f"torch version unknown ({exc}); IPEX not imported",
                            ipex_version)
    ipex_mm, torch_mm = _major_minor(ipex_version), _major_minor(torch_full)
    if ipex_mm is None or ipex_mm != torch_mm:
        ipex_shown, torch_shown = _show(ipex_mm, ipex_version), _show(torch_mm, torch_full)
        return Acceleration("stock", f"IPEX {ipex_shown} does not match torch {torch_shown}",
                            ipex_version)

    try:
        importer(IPEX_MODULE)
    except (Exception, SystemExit) as exc:
        # SystemExit too: IPEX's own version check exits, and that must not end the server.
        return Acceleration("stock", f"IPEX {ipex_version} failed to import: "
                                     f"{type(exc).__name__}: {exc}", ipex_version)
    return Acceleration("ipex", f"IPEX {ipex_version} matches torch {torch_full}", ipex_version)


def _installed_torch_version() -> str:
    # Imported here so that importing this module stays free of torch.
    import torch

    return str(torch.__version__)


def _major_minor(text: str) -> tuple[int, int] | None:
    """``"2.8.0+cpu"`` -> ``(2, 8)``; None when the string does not start with two numbers."""
    match = re.match(r"\s*(\d+)\.(\d+)", text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _show(major_minor: tuple[int, int] | None, full: str) -> str:
    return f"{major_minor[0]}.{major_minor[1]}" if major_minor else repr(full)
