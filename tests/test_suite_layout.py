"""The test suite's own layout: no test module imports another test module.

What two test modules share (helpers, references, fixtures) lives in
``tests/support/`` or, for a fixture, in a ``conftest.py``; a test module
imported by another is collected twice under two names, and its helpers
look private to the reader while other files depend on them.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _is_test_module(name: str) -> bool:
    return name.startswith("test_")


def imported_test_modules(source: str, path: Path) -> list[str]:
    """The test modules ``source`` (the file at ``path`` under tests/) imports, each as
    ``line: module``: absolute (``tests.x.test_y``, ``from tests.x import test_y``) or
    relative (``.test_y``, ``from . import test_y``), at any depth of the file."""
    package = path.relative_to(TESTS.parent).parent.parts  # ("tests", "xeon")
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tests" and any(
                        _is_test_module(part) for part in alias.name.split(".")[1:]):
                    found.append(f"{node.lineno}: {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - node.level + 1])
            else:
                base = []
            module = [*base, *(node.module.split(".") if node.module else [])]
            if module[:1] != ["tests"]:
                continue
            if any(_is_test_module(part) for part in module[1:]):
                found.append(f"{node.lineno}: {'.'.join(module)}")
            else:
                found += [f"{node.lineno}: {'.'.join([*module, alias.name])}"
                          for alias in node.names if _is_test_module(alias.name)]
    return found



def test_no_test_module_imports_another_test_module():
    offenders = []
    for path in sorted(TESTS.rglob("test_*.py")):
        for found in imported_test_modules(path.read_text(), path):
            offenders.append(f"{path.relative_to(TESTS.parent)}:{found}")
    assert not offenders, ("test modules importing test modules (move what they share into "
                           "tests/support/ or a conftest.py):\n" + "\n".join(offenders))


def test_the_check_finds_each_form_of_import():
    """Each way one test module can import another is caught; support modules, conftests and
    other helpers are not."""
    path = TESTS / "xeon" / "test_example.py"
    source = "\n".join([
        "from tests.xeon.test_xeon_decoder import _assert_greedy_near",
        "import tests.e2e.test_metrics",
        "from tests.quant import test_gptq_solver",
        "from .test_xeon_fallback import IDS",
        "from . import test_xeon_fast_path",
        "from ..engine.test_grammar_mask import reference_mask",
        "def helper():",
        "    from tests.xeon.test_xeon_checkpoints import NEW",
        "from tests.support.greedy import assert_greedy_near",
        "from tests.xeon.conftest import Collector",
        "from .conftest import token_ids",
        "from tests import kernel_paths",
        "from tests.e2e.family_models import build_model",
        "import tests.support.prometheus",
    ])
    assert imported_test_modules(source, path) == [
        "1: tests.xeon.test_xeon_decoder",
        "2: tests.e2e.test_metrics",
        "3: tests.quant.test_gptq_solver",
        "4: tests.xeon.test_xeon_fallback",
        "5: tests.xeon.test_xeon_fast_path",
        "6: tests.engine.test_grammar_mask",
        "8: tests.xeon.test_xeon_checkpoints",
    ]
