"""`--config`: a TOML file of models; every mistake names the file, the entry and the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from switchyard.models.config import (
    ConfigError,
    ModelEntry,
    RemoteEntry,
    entries_from_settings,
    read_config,
)
from switchyard.settings import ServeSettings


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.toml"
    path.write_text(text)
    return path


def test_without_a_file_the_flags_are_the_one_model():
    flags = ServeSettings(model_id="/m", served_model_name="m", dtype="float32",
                          max_total_tokens=300, engine_options={"num_threads": "1"})
    [entry] = entries_from_settings(flags)
    assert (entry.model_id, entry.name, entry.dtype, entry.max_total_tokens) == \
        ("/m", "m", "float32", 300)
    assert entry.engine_options == {"num_threads": "1"} and entry.aliases == ()


def test_entries_override_the_flags_which_are_their_defaults(tmp_path):
    path = _write(tmp_path, """
[[models]]
name = "a"
aliases = ["first"]
model_id = "/models/a"
engine = "xeon"
max_total_tokens = 2048
engine_options = { num_threads = 1, prefix_caching = false }

[[models]]
model_id = "/models/b"
dtype = "bfloat16"
waiting_served_ratio = 1
""")
    flags = ServeSettings(config=str(path), dtype="float32", max_concurrent_requests=7)
    a, b = entries_from_settings(flags)
    assert isinstance(a, ModelEntry)
    assert (a.name, a.aliases, a.engine, a.max_total_tokens, a.dtype) == \
        ("a", ("first",), "xeon", 2048, "float32")
    # TOML's typed values become the strings `--engine-option KEY=VALUE` gives.
    assert a.engine_options == {"num_threads": "1", "prefix_caching": "false"}
    assert a.max_concurrent_requests == 7
    assert (b.name, b.dtype, b.waiting_served_ratio, b.engine) == \
        ("/models/b", "bfloat16", 1.0, None)


@pytest.mark.parametrize(("text", "message"), [
    ("", "no [[models]] table"),
    ("[server]\nport = 1\n[[models]]\nmodel_id = 'x'\n", "unknown top-level key server"),
    ("[[models]]\nname = 'a'\nmax_total_tokens = 'many'\n",
     "models[0] ('a'): field `max_total_tokens`: Expected `int`, got `str`"),
    ("[[models]]\nname = 'a'\n[[models]]\nname = 'b'\nmax_tokens = 3\n",
     "models[1] ('b'): unknown field `max_tokens`"),
    ("[[models]]\nname = 'a'\nengine_options = { threads = [2] }\n",
     "field `engine_options.threads` must be a string, number or boolean, not list"),
    ("[[models]]\nname = 'a'\ndtype = 'int8'\n", "field `dtype` must be one of"),
    ("[[models]]\nname = 'a'\nmax_concurrent_requests = 0\n",
     "field `max_concurrent_requests` is out of range"),
    ("[[models]]\nname = 'a'\n[[models]]\nname = 'b'\naliases = ['a']\n",
     "models[1]: the name 'a' is already used by models[0]"),
    ("[[models]\n", "not a readable TOML file"),
    ("[[models]]\nupstreams = ['http://a:1']\n",
     "models[0]: field `name` is required for a model with `upstreams`"),
    ("[[models]]\nname = 'r'\nupstreams = ['http://a:1']\ndtype = 'float32'\n",
     "models[0] ('r'): field `dtype` does not apply to a model served by `upstreams`"),
    ("[[models]]\nname = 'r'\nupstreams = []\n", "field `upstreams` lists no URL"),
    ("[[models]]\nname = 'r'\nupstreams = ['10.0.0.5:8080']\n",
     "field `upstreams[0]`: '10.0.0.5:8080' is not an http(s) URL"),
    ("[[models]]\nname = 'r'\nupstreams = ['http://a:x']\n", "has an invalid port"),
    ("[[models]]\nname = 'r'\nupstreams = ['http://a:1', 'http://a:1/']\n",
     "field `upstreams` lists a URL twice"),
    ("[[models]]\nname = 'r'\nupstreams = ['http://a:1']\napi = 'grpc'\n",
     "models[0] ('r'): field `api` must be one of tgi"),
    ("[[models]]\nname = 'r'\nupstreams = 'http://a:1'\n",
     "field `upstreams`: Expected `array`, got `str`"),
    ("[[models]]\nname = 'r'\nupstreams = ['http://a:1']\nmetrics_interval_s = 2\n",
     "field `metrics_interval_s` is out of range (must be [0.05, 0.5])"),
    ("[[models]]\nname = 'r'\nupstreams = ['http://a:1']\nmax_failures = 0\n",
     "field `max_failures` is out of range"),
    ("[[models]]\nname = 'r'\nupstreams = ['http://a:1']\nbalancing = 'random'\n",
     "field `balancing` must be one of prefix, load or round-robin, not 'random'"),
    ("[[models]]\nname = 'r'\nupstreams = ['http://a:1']\napi_key_env = 'SWITCHYARD_NO_SUCH_KEY'\n",
     "field `api_key_env`: the environment variable SWITCHYARD_NO_SUCH_KEY is not set"),
    ("[[models]]\nname = 'a'\n[[models]]\nname = 'r'\naliases = ['a']\n"
     "upstreams = ['http://a:1']\n", "models[1]: the name 'a' is already used by models[0]"),
])
def test_mistakes_name_the_file_the_entry_and_the_field(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        read_config(path, ServeSettings())
    assert str(err.value).startswith(str(path))
    assert message in str(err.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        entries_from_settings(ServeSettings(config=str(tmp_path / "nope.toml")))


def test_an_entry_with_upstreams_is_a_remote_model(tmp_path):
    path = _write(tmp_path, """
[[models]]
name = "local"

[[models]]
name = "far"
aliases = ["remote"]
upstreams = ["http://10.0.0.5:8080/", "https://replica.example/prefix"]
api = "openai"
upstream_model = "meta-llama/Llama-3.1-8B"
""")
    local, far = entries_from_settings(ServeSettings(config=str(path), max_concurrent_requests=9))
    assert isinstance(local, ModelEntry) and isinstance(far, RemoteEntry)
    assert (far.name, far.aliases, far.api, far.upstream_model) == \
        ("far", ("remote",), "openai", "meta-llama/Llama-3.1-8B")
    # A trailing slash is dropped, so that routes append cleanly; a path prefix stays.
    assert far.upstreams == ("http://10.0.0.5:8080", "https://replica.example/prefix")
    # Permits default to the flag, as a local model's do; the rest to their own defaults.
    assert (far.max_concurrent_requests, far.max_failures, far.cooldown_s) == (9, 3, 5.0)
