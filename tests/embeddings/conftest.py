"""Fixtures of the embedding tests: the tiny pooling models and one server serving them all.

The server's `--config` puts the three embedders and the reranker beside the
suite's tiny chat model, as a user would; `small-batch` is the mean-pooling
embedder again under a second name with a client batch limit of 4, for the
too-many-inputs errors.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.live_server import LiveServer, start_server, stop_server
from tests.support.pooling_models import ensure_pooling_model

EMBEDDERS = ("bert-mean", "bert-cls", "decoder-last")


@pytest.fixture(scope="session")
def pooling_models(model_cache: Path, default_model_path: Path) -> dict[str, Path]:
    """Each tiny pooling model's folder, by kind."""
    return {kind: ensure_pooling_model(kind, model_cache, default_model_path)
            for kind in (*EMBEDDERS, "cross-encoder")}


@pytest.fixture(scope="session")
def pooling_server(pooling_models: dict[str, Path], model_cache: Path,
                   tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server with the chat model first, then every pooling model under its kind's name."""
    folder = tmp_path_factory.mktemp("pooling-config")
    tables = ['[[models]]\nname = "chat"\nmodel_id = "switchyard/tiny-llama-random"\n']
    for kind, path in pooling_models.items():
        tables.append(f'[[models]]\nname = "{kind}"\nmodel_id = "{path}"\n')
    tables.append(f'[[models]]\nname = "small-batch"\nmodel_id = "{pooling_models["bert-mean"]}"'
                  '\nengine_options = { max_client_batch_size = 4 }\n')
    config = folder / "models.toml"
    config.write_text("\n".join(tables))
    live = start_server(model_cache, tmp_path_factory.mktemp("pooling-logs"), "--config",
                        str(config), "--dtype", "float32")
    yield live
    stop_server(live)
