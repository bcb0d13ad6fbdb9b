"""`--lora-adapters` (TGI's forms), `lora_adapters` in a `--config` file, and folder lookup."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from switchyard.cli import main
from switchyard.models.config import ConfigError, ModelEntry, entries_from_settings
from switchyard.models.lora import parse_lora_adapters, resolve_adapter_source
from switchyard.settings import ServeSettings
from switchyard_spec import AdapterError


def test_the_flag_takes_tgis_forms() -> None:
    assert parse_lora_adapters("sql=/a/sql, chat=/a/chat,org/summaries@v2,org/plain") == {
        "sql": "/a/sql", "chat": "/a/chat", "org/summaries": "org/summaries@v2",
        "org/plain": "org/plain"}
    assert parse_lora_adapters("") == {}
    with pytest.raises(ValueError, match="given twice"):
        parse_lora_adapters("a=/x,a=/y")
    with pytest.raises(ValueError, match="expected NAME=PATH"):
        parse_lora_adapters("=/x")


def test_a_bad_flag_stops_the_command_line() -> None:
    result = CliRunner().invoke(main, ["serve", "--lora-adapters", "a=/x,a=/y"])
    assert result.exit_code == 2 and "given twice" in result.output


def test_flags_and_config_entries_carry_the_adapters(tmp_path: Path) -> None:
    [entry] = entries_from_settings(ServeSettings(lora_adapters={"a": "/x"}, max_loras=3,
                                                  max_lora_rank=32))
    assert isinstance(entry, ModelEntry)
    assert (entry.lora_adapters, entry.max_loras, entry.max_lora_rank) == ({"a": "/x"}, 3, 32)
    config = tmp_path / "models.toml"
    config.write_text('[[models]]\nname = "base"\nmodel_id = "/m"\n'
                      'lora_adapters = { sql = "/a/sql" }\nmax_loras = 2\n')
    [entry] = entries_from_settings(ServeSettings(config=str(config)))
    assert isinstance(entry, ModelEntry)
    assert (entry.lora_adapters, entry.max_loras) == ({"sql": "/a/sql"}, 2)


def test_an_adapter_name_may_not_take_a_models(tmp_path: Path) -> None:
    config = tmp_path / "models.toml"
    config.write_text('[[models]]\nname = "a"\nmodel_id = "/m"\n'
                      '[[models]]\nname = "b"\nmodel_id = "/n"\nlora_adapters = { a = "/x" }\n')
    with pytest.raises(ConfigError, match="the name 'a' is already used"):
        entries_from_settings(ServeSettings(config=str(config)))


def test_sources_resolve_to_folders(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_adapter_source("a", str(tmp_path)) == str(tmp_path.resolve())
    with pytest.raises(AdapterError, match="is not a folder"):
        resolve_adapter_source("a", str(tmp_path / "missing"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(AdapterError, match="neither a folder nor in the local hub cache"):
        resolve_adapter_source("a", "nobody/no-such-adapter@main")


def test_hub_ids_and_revisions_resolve_in_the_local_cache(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants as hub

    commit = "a" * 40
    repo = tmp_path / "models--org--sql"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "adapter_config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    (repo / "refs" / "v2").write_text(commit)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert Path(resolve_adapter_source("org/sql", "org/sql")) == snapshot
    assert Path(resolve_adapter_source("org/sql", "org/sql@v2")) == snapshot
    with pytest.raises(AdapterError, match="local hub cache"):
        resolve_adapter_source("org/sql", "org/sql@v3")
