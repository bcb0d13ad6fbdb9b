"""Whose model code the engine runs: transformers' own, and why not optimum-habana's.

optimum-habana holds Gaudi adaptations of transformers' models (fused
kernels, static-shape caches, `adapt_transformers_to_gaudi`). Its releases
pin one transformers minor version (1.21 needs transformers >=4.55,<4.56),
and this engine needs transformers 5 (its attention interface carries the
static cache into every family's own attention). The two cannot share an
environment, so the engine always runs plain transformers and says so; where
a Gaudi image ships optimum-habana anyway, `switchyard plugins` names the
conflict instead of importing it (its import also imports habana_frameworks).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata

VersionOf = Callable[[str], str | None]
"""A distribution's installed version, or None when it is not installed."""


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution``, read from its metadata (nothing imported)."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def describe_model_code(version_of: VersionOf = installed_version) -> str:
    """One line for ``switchyard plugins``: the model code in use and optimum-habana's status."""
    transformers = version_of("transformers") or "not installed"
    optimum = version_of("optimum-habana")
    if optimum is None:
        status = "optimum-habana not installed"
    else:
        status = (f"optimum-habana {optimum} installed but not used: it pins a transformers 4.x "
                  "this engine cannot run on")
    return f"model code: transformers {transformers} ({status})"
