"""The test suite's own layout: no test module imports another test module, and nothing
under tests/ imports a ``tests.*`` module outside ``tests.support``.

What two test modules share (helpers, references, fixtures) lives in
``tests/support/`` or, for a fixture, in a ``conftest.py``; a test module
imported by another is collected twice under two names, and its helpers
look private to the reader while other files depend on them. A conftest is
pytest's to load (it finds the fixtures there without an import), and helpers
imported from it hide among its fixtures; a helper module beside the test
modules is shared code outside the one place shared code lives.
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


def imported_outside_support(source: str, path: Path) -> list[str]:
    """The ``tests.*`` modules outside ``tests.support`` that ``source`` (the file at ``path``
    under tests/) imports, each as ``line: module``: absolute or relative, at any depth of
    the file. ``from tests import x`` names ``tests.x``; ``from tests import support`` and
    ``tests.support`` itself are allowed."""
    package = path.relative_to(TESTS.parent).parent.parts  # ("tests", "xeon")
    found = []

    def outside(module: list[str]) -> bool:
        return module[:1] == ["tests"] and module[1:2] != ["support"]

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"{node.lineno}: {alias.name}" for alias in node.names
                      if outside(alias.name.split(".")) and alias.name != "tests"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[:len(package) - node.level + 1])
            else:
                base = []
            module = [*base, *(node.module.split(".") if node.module else [])]
            if module == ["tests"]:
                found += [f"{node.lineno}: tests.{alias.name}" for alias in node.names
                          if alias.name != "support"]
            elif outside(module):
                found.append(f"{node.lineno}: {'.'.join(module)}")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


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


def test_nothing_under_tests_imports_a_tests_module_outside_support():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        for found in imported_outside_support(path.read_text(), path):
            offenders.append(f"{path.relative_to(TESTS.parent)}:{found}")
    assert not offenders, ("files under tests/ importing tests.* modules outside tests.support "
                           "(move the helper into tests/support/; a fixture stays in its "
                           "conftest.py, which pytest finds without an import):\n"
                           + "\n".join(offenders))


def test_the_support_check_finds_each_form_of_import():
    """Imports of conftests, helpers beside the tests and test modules are caught, absolute or
    relative, at module level or in a function; imports of tests.support are not."""
    path = TESTS / "xeon" / "test_example.py"
    source = "\n".join([
        "from tests.xeon.conftest import Collector",
        "from .conftest import token_ids",
        "from tests import kernel_paths",
        "from tests.e2e.family_models import build_model",
        "import tests.conftest",
        "from ..gaudi.conftest import cpu_config",
        "from .sched_sim import make_seq",
        "def helper():",
        "    from tests.quant.methods import method",
        "    import tests.gguf_files as gguf",
        "from tests.xeon.test_xeon_decoder import NEW",
        "from tests.support.greedy import assert_greedy_near",
        "from tests.support import kernel_paths",
        "from tests import support",
        "import tests.support.prometheus",
        "from ..support.waiting import eventually",
        "from switchyard_spec import EngineConfig",
    ])
    assert imported_outside_support(source, path) == [
        "1: tests.xeon.conftest",
        "2: tests.xeon.conftest",
        "3: tests.kernel_paths",
        "4: tests.e2e.family_models",
        "5: tests.conftest",
        "6: tests.gaudi.conftest",
        "7: tests.xeon.sched_sim",
        "9: tests.quant.methods",
        "10: tests.gguf_files",
        "11: tests.xeon.test_xeon_decoder",
    ]
