"""The gateway's request validation imports no torch.

Why: validating a request (wire types, parameters, JSON schemas, tool
definitions) is text work; a gateway process that only routes to remote
replicas or engine processes should not pay torch's import time and memory
to check a schema. The schema check uses the engine toolkit's torch-free
grammar text (``switchyard_engine.grammar_text``); xgrammar, which loads torch,
is imported only when a schema is first checked.
"""

from __future__ import annotations

import subprocess
import sys

VALIDATION_MODULES = ("switchyard.planning.tgi", "switchyard.planning.plan", "switchyard.constraints",
                      "switchyard.openai_mapping.plans", "switchyard.protocol.openai",
                      "switchyard.protocol.tgi", "switchyard_engine.grammar_text")
HEAVY = ("torch", "transformers", "xgrammar")


def _loaded_after_import(modules: tuple[str, ...], probe: tuple[str, ...]) -> list[str]:
    """Which of ``probe`` a fresh interpreter has in ``sys.modules`` after importing ``modules``."""
    code = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
            f"print(','.join(m for m in {probe!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    return [m for m in out.split(",") if m]


def test_request_validation_imports_no_torch() -> None:
    assert _loaded_after_import(VALIDATION_MODULES, HEAVY) == []


def test_the_probe_sees_torch_when_it_is_imported() -> None:
    """The check itself: an engine module that needs torch shows up."""
    assert "torch" in _loaded_after_import(("switchyard_engine.grammar",), HEAVY)
