"""What the embedding and rerank routes share: finding the model, reading `input`, and
shaping vectors (normalization, Matryoshka `dimensions`, base64).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import numpy as np
from litestar import Response
from switchyard_spec import PoolingTask

from switchyard.errors import ApiError, validation_error
from switchyard.models.pooling import PoolingModel
from switchyard.remote.forward import forward
from switchyard.remote.model import REMOTE_ENGINE, RemoteModel
from switchyard.state import Gateway
from switchyard.telemetry.pooling import PoolingRecord
from switchyard.text.pooling_inputs import Encoded

OFF_LOOP_CHARS = 20_000
"""Characters (or token ids) past which a request is tokenized off the event loop."""
ENCODING_FORMATS = ("float", "base64")
DIRECTIONS = ("right", "left")


def pooling_model(gw: Gateway, name: str | None, task: PoolingTask, record: PoolingRecord,
                  api: str = "openai") -> PoolingModel | RemoteModel:
    """The model a request names, ready, of the task the route serves (else a 4xx); or a
    TEI replica's model, which the route forwards (its replica checks the task)."""
    if gw.draining:
        raise ApiError(503, "The server is shutting down", "unhealthy")
    if not gw.ready:
        raise ApiError(503, f"Model is not ready: {gw.startup_error or 'still loading'}",
                       "unhealthy")
    what = "embeddings" if task is PoolingTask.EMBED else "reranking"
    model = gw.registry.resolve_pooling(name, task, what, api)
    if isinstance(model, RemoteModel):
        record.model, record.engine = model.name, REMOTE_ENGINE
        return model
    record.model, record.engine = model.name, model.engine_spec.name
    if model.task is not task:
        raise validation_error(f"Model `{model.name}` serves {model.routes}, not {what}",
                               param="model")
    return model


def parse_inputs(value: str | list[Any], param: str) -> tuple[list[str], list[list[int]]]:
    """(texts, token id rows): exactly one of the two is non-empty, else a 4xx."""
    if isinstance(value, str):
        return [value], []
    if not value:
        raise validation_error(f"`{param}` cannot be empty", param=param)
    if all(isinstance(x, str) for x in value):
        return list(value), []
    if all(_is_id(x) for x in value):
        return [], [list(value)]
    if all(isinstance(x, list) and all(_is_id(t) for t in x) for x in value):
        return [], [list(x) for x in value]
    raise validation_error(f"`{param}` must be a string, a list of strings, a list of token ids "
                           "or a list of lists of token ids", param=param)


def _is_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


async def encode(model: PoolingModel, value: str | list[Any], param: str,
                 prompt_name: str | None, truncate: bool | None,
                 direction: str) -> list[Encoded]:
    """A request's inputs as token ids: prompts first, then TEI's truncation rules.

    A large request is tokenized on a worker thread, so that the event loop keeps
    serving the others meanwhile."""
    size = len(value) if isinstance(value, str) else sum(
        len(x) if isinstance(x, str | list) else 1 for x in value)
    if size > OFF_LOOP_CHARS:
        return await asyncio.to_thread(_encode, model, value, param, prompt_name, truncate,
                                       direction)
    return _encode(model, value, param, prompt_name, truncate, direction)


def _encode(model: PoolingModel, value: str | list[Any], param: str, prompt_name: str | None,
            truncate: bool | None, direction: str) -> list[Encoded]:
    texts, rows = parse_inputs(value, param)
    model.check_count(len(texts) or len(rows), param)
    if rows:
        return model.tokenizer.token_ids(rows, param)
    direction = direction.lower()
    if direction not in DIRECTIONS:
        raise validation_error(f"`truncation_direction` must be one of {', '.join(DIRECTIONS)}",
                               param="truncation_direction")
    prompt = _prompt(model, prompt_name)
    if prompt and any(texts):
        texts = [prompt + t if t else t for t in texts]
    return model.tokenizer.texts(texts, bool(truncate), direction, param)


def _prompt(model: PoolingModel, name: str | None) -> str:
    """The text `prompt_name` (or the folder's default prompt) puts before each input."""
    prompts = model.folder.prompts
    if name is None:
        name = model.folder.default_prompt_name
        return prompts.get(name, "") if name else ""
    if name not in prompts:
        known = ", ".join(sorted(prompts)) or "none"
        raise validation_error(f"prompt_name {name!r} is not one of the model's prompts "
                               f"({known})", param="prompt_name")
    return prompts[name]


def check_dimensions(model: PoolingModel, dimensions: int | None) -> None:
    """`dimensions` only for a Matryoshka model, within its sizes."""
    if dimensions is None:
        return
    sizes = model.folder.matryoshka_dimensions
    if sizes is None:
        raise validation_error(f"Model `{model.name}` does not support Matryoshka "
                               "representation: `dimensions` cannot be set", param="dimensions")
    full = model.info.dimensions
    if not 1 <= dimensions <= full or (sizes and dimensions not in sizes):
        allowed = ", ".join(map(str, sizes)) if sizes else f"1 to {full}"
        raise validation_error(f"`dimensions` must be one of the model's sizes ({allowed}), "
                               f"not {dimensions}", param="dimensions")


def shape(vector: np.ndarray, normalize: bool, dimensions: int | None) -> np.ndarray:
    """The vector a client gets: cut to `dimensions` and renormalized (Matryoshka), or
    L2-normalized when asked."""
    if dimensions is not None:
        vector, normalize = vector[:dimensions], True
    if normalize:
        norm = float(np.linalg.norm(vector))
        vector = vector / max(norm, 1e-12)
    return vector.astype("<f4", copy=False)


def check_encoding(encoding_format: str) -> None:
    """`float` or `base64`, else a 4xx (a client reading the wrong one gets wrong vectors)."""
    if encoding_format not in ENCODING_FORMATS:
        raise validation_error(f"`encoding_format` must be one of {', '.join(ENCODING_FORMATS)},"
                               f" not {encoding_format!r}", param="encoding_format")


def encoded_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """A JSON list, or base64 of the little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def forward_tei(model: RemoteModel, path: str, raw: bytes, api: str = "tgi") -> Response:
    """A pooling request for a TEI replica's model, sent to the same route of one replica and
    answered with what it answers (`remote/forward.py`: retries, permits, balancing)."""
    return await forward(model, "openai" if api == "openai" else "tgi", path, raw, False)
