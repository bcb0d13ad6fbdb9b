"""`switchyard serve` refuses, on every engine, a checkpoint whose loading would invent weights.

A causal LM without its (untied) LM head, and a folder whose safetensors file
is cut short (`tests/support/bad_checkpoints.py`): one `--config` server lists
each on the xeon engine and on the gaudi engine (CPU device); none loads, so
the server exits, and its log names why for each. A single model's refusal is
what the CLI prints: one line, no traceback. (The BERT encoder of the same
module is refused as a generator by the engines, `tests/engine/test_engine_loading.py`;
the server serves such a folder as an embedding model, `tests/embeddings/`.)
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.bad_checkpoints import BAD_CHECKPOINTS, EXPECTED, build_bad_checkpoint
from tests.support.live_server import start_server, stop_server

GENERATOR_CHECKPOINTS = tuple(kind for kind in BAD_CHECKPOINTS if kind != "bert")
"""The bad folders of causal LMs: the server has no other use for them."""
ENGINES = {"xeon": "{ num_threads = 1 }", "gaudi": '{ device = "cpu", num_threads = 1 }'}


@pytest.fixture(scope="module")
def folders(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-checkpoints")
    return {kind: build_bad_checkpoint(kind, default_model_path, root / kind)
            for kind in GENERATOR_CHECKPOINTS}


def _exit_log(cache: Path, log_dir: Path, *args: str, timeout: float) -> str:
    """The log of a server that must exit at start-up; one that comes up instead is
    stopped (not left running past the test) and fails the test."""
    try:
        live = start_server(cache, log_dir, *args, timeout=timeout)
    except RuntimeError as exited:
        return str(exited)
    stop_server(live)
    pytest.fail(f"the server started: {' '.join(args)}")


def test_every_engine_refuses_each_checkpoint_at_start_up(folders, model_cache, tmp_path):
    config = tmp_path / "models.toml"
    config.write_text("".join(
        f'[[models]]\nname = "{kind}-{engine}"\nmodel_id = "{folders[kind]}"\n'
        f'engine = "{engine}"\nengine_options = {options}\n\n'
        for kind in GENERATOR_CHECKPOINTS for engine, options in ENGINES.items()))
    log = _exit_log(model_cache, tmp_path, "--config", str(config), "--dtype", "float32",
                    timeout=240)
    assert log.startswith("server exited with"), log[-3000:]
    for kind in GENERATOR_CHECKPOINTS:
        for engine in ENGINES:
            line = next((line for line in log.splitlines()
                         if f"model {kind}-{engine} failed to load" in line), None)
            assert line is not None, f"{kind} on {engine}:\n{log[-3000:]}"
            assert EXPECTED[kind] in line, line
    assert "no model could be loaded" in log
    assert "Traceback" not in log


def test_the_cli_says_why_in_one_line(folders, model_cache, tmp_path):
    folder = folders["no-lm-head"]
    log = _exit_log(model_cache, tmp_path, "--model-id", str(folder), timeout=120)
    (line,) = [line for line in log.splitlines() if "start-up failed" in line]
    assert f"ERROR switchyard: start-up failed: refusing to serve '{folder}'" in line, line
    assert EXPECTED["no-lm-head"] in line, line
    assert "Traceback" not in log
