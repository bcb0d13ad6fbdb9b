"""Every hook and public contract type has a docstring (tests/test_docs.py checks the plugin guide)."""

from __future__ import annotations

import inspect

import switchyard_spec
from switchyard_spec import hookspecs


def _hook_names() -> list[str]:
    return [name for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
            if name.startswith("switchyard_")]


def test_there_are_hooks():
    assert set(_hook_names()) >= {"switchyard_engines", "switchyard_quantization_methods"}


def test_every_hook_has_a_docstring():
    for name in _hook_names():
        assert (getattr(hookspecs, name).__doc__ or "").strip(), name


def test_every_public_type_and_engine_method_is_documented():
    for name in switchyard_spec.__all__:
        obj = getattr(switchyard_spec, name)
        if inspect.isclass(obj):
            assert (obj.__doc__ or "").strip(), name
    for name, fn in inspect.getmembers(switchyard_spec.Engine, inspect.isfunction):
        if not name.startswith("_"):
            assert (fn.__doc__ or "").strip(), f"Engine.{name}"


def test_spec_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, switchyard_spec; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
