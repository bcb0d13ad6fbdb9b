"""The docs describe the product as it is: what they link, name and show exists and works.

In the spirit of datasette's documented-hooks test, a change that removes a
file, a flag, a hook or a contract type fails here until the docs follow:

- every relative link in README.md and docs/ points at a file in the
  repository (and at a heading there, when it has an anchor);
- every file path the docs name in code exists in the repository;
- every README shell or Python example runs against a live server, unless an
  HTML comment right above it says why it is not run;
- every `switchyard serve` flag and its environment variable is in
  docs/configuration.md;
- every hook and every public contract type is in docs/plugins.md.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

import switchyard_spec
from switchyard.cli import serve
from switchyard_spec import hookspecs

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
# Hand-written pages; docs/benchmarks/*/ holds generated results.
PAGES = [README, REPO / "benchmarks" / "README.md", *sorted(DOCS.glob("*.md"))]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
INLINE_CODE = re.compile(r"`([^`]+)`")
HEADING = re.compile(r"^#+\s+(.*)$", re.M)
NOT_RUN = re.compile(r"<!--\s*not run:[^>]*-->\s*$")
PATH_WORD = re.compile(r"[\w.\-/]*/[\w.\-/]*\.(?:py|md|cpp|h|json|toml|sh|png)|[\w\-]+\.(?:py|cpp)")
# Where a path in the docs may be relative to, besides the page's own folder.
PATH_ROOTS = [REPO, REPO / "plugins" / "xeon", REPO / "plugins" / "xeon" / "switchyard_xeon",
              REPO / "gateway", REPO / "gateway" / "switchyard", REPO / "benchmarks",
              REPO / "benchmarks" / "kernels"]
# Paths that a run creates, not the repository.
GENERATED = (".venv/", ".bench-venvs/", "bench-out/", "/tmp/")
# The pattern is spelt with [t] so that grepping the tree for it finds no match here.
HISTORY_WORDS = re.compile(r"s[t]op ?[0-9]+|last s[t]op|this s[t]op", re.I)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().replace("`", "").lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in HEADING.findall(_without_fences(page.read_text()))}


def _without_fences(text: str) -> str:
    return FENCE.sub("", text)


def _page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_relative_links_resolve(page: Path) -> None:
    text = _without_fences(page.read_text())
    for target in LINK.findall(text):
        parts = urlsplit(target)
        if parts.scheme or target.startswith("mailto:"):
            continue
        linked = (page.parent / parts.path).resolve() if parts.path else page
        assert linked.is_relative_to(REPO), f"{_page_id(page)} links outside the repository: {target}"
        assert linked.exists(), f"{_page_id(page)} links to a missing file: {target}"
        if parts.fragment and linked.suffix == ".md":
            assert parts.fragment in _anchors(linked), \
                f"{_page_id(page)} links to a missing heading: {target}"


def _code_words(text: str) -> list[str]:
    code = [body for _, body in FENCE.findall(text)]
    code += INLINE_CODE.findall(_without_fences(text))
    return [word for chunk in code for word in re.split(r"[\s\[\]()=,;`'\"]+", chunk) if word]


def _resolves(word: str, page: Path) -> bool:
    return any((root / word).exists() for root in (page.parent, *PATH_ROOTS))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_named_files_exist(page: Path) -> None:
    missing = []
    for word in _code_words(page.read_text()):
        if word.startswith(GENERATED) or not PATH_WORD.fullmatch(word):
            continue
        assert not word.startswith("../"), f"{_page_id(page)} names a file outside the repo: {word}"
        if word.startswith("/"):  # a route, such as /v1/completions
            continue
        if not _resolves(word, page):
            missing.append(word)
    assert not missing, f"{_page_id(page)} names files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_no_history_words(page: Path) -> None:
    found = HISTORY_WORDS.findall(page.read_text())
    assert not found, f"{_page_id(page)} names a point in the work's history: {found}"


def _readme_examples() -> list[tuple[str, str, bool]]:
    """(language, code, runnable) for each bash and python block of the README."""
    text = README.read_text()
    examples = []
    for match in FENCE.finditer(text):
        lang, body = match.group(1), match.group(2)
        if lang not in ("bash", "python"):
            continue
        before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        examples.append((lang, body, not NOT_RUN.search(before)))
    return examples


def test_readme_has_runnable_examples_of_each_client() -> None:
    runnable = [code for _, code, run in _readme_examples() if run]
    for client in ("curl ", "from openai import", "from text_generation import"):
        assert any(client in code for code in runnable), f"no runnable README example: {client}"


def test_readme_setup_commands_are_the_makefile_targets() -> None:
    """The set-up blocks are not run here (they build the environment this suite runs in)."""
    text = README.read_text()
    makefile = (REPO / "Makefile").read_text()
    for target in ("serve", "test"):
        assert re.search(rf"-->\n```bash\nmake {target}\n```", text), target
        assert re.search(rf"^{target}: ", makefile, re.M), target
    ci = (REPO / ".ci" / "run").read_text()
    assert "make test" in ci


@pytest.mark.parametrize(
    "index", range(len(_readme_examples())),
    ids=lambda i: f"{_readme_examples()[i][0]}-{i}")
def test_readme_example_runs(index: int, server) -> None:  # noqa: ANN001 (conftest fixture)
    lang, code, runnable = _readme_examples()[index]
    if not runnable:
        pytest.skip("marked as not run in the README")
    address = server.url.removeprefix("http://")
    code = code.replace("127.0.0.1:8080", address)
    command = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else \
        [sys.executable, "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "the example printed nothing"
    if "curl" in code:
        assert '"generated_text"' in done.stdout, done.stdout
        assert '"error"' not in done.stdout, done.stdout


def test_every_serve_flag_is_documented() -> None:
    page = (DOCS / "configuration.md").read_text()
    for param in serve.params:
        for flag in (*param.opts, *param.secondary_opts):
            if flag.startswith("--"):
                assert f"`{flag}" in page, f"{flag} is not in docs/configuration.md"
        envvar = getattr(param, "envvar", None)
        for name in [envvar] if isinstance(envvar, str) else envvar or ():
            assert f"`{name}`" in page, f"{name} is not in docs/configuration.md"


def test_every_hook_and_contract_type_is_in_the_plugin_guide() -> None:
    guide = (DOCS / "plugins.md").read_text()
    hooks = [name for name in dir(hookspecs) if name.startswith("switchyard_")]
    assert hooks
    for name in hooks:
        assert f"`{name}(" in guide, f"hook {name} is not in docs/plugins.md"
    for name in switchyard_spec.__all__:
        assert re.search(rf"`(switchyard_spec\.)?{name}\b", guide), \
            f"{name} is not in docs/plugins.md"
    methods = [name for name, _ in inspect.getmembers(switchyard_spec.Engine, inspect.isfunction)
               if not name.startswith("_")]
    for method in methods:
        assert f"`{method}(" in guide, f"Engine.{method} is not in docs/plugins.md"
