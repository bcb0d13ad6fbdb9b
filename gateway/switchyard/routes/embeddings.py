"""Embedding routes: OpenAI's `/v1/embeddings`; TEI's `/embed`, `/embed_all`, `/similarity`.

The model is the request's `model` (OpenAI) or the `X-Model` header (TEI's
routes, as on TGI's), else the first embedding model served; a TEI replica's
model (`api = "tei"` in the config) is forwarded to the same route of one of
its replicas. OpenAI's route returns what sentence-transformers' `encode`
returns for the folder (unit vectors when it ends in Normalize); TEI's `/embed`
normalizes unless `normalize` is false, as TEI does. Errors come in each API's
own format. The rerank routes live in `routes/rerank.py`; both routers are
assembled here.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import numpy as np
from litestar import Request, Router, post
from litestar.di import NamedDependency
from litestar.params import HeaderParameter, JSONBody
from switchyard_spec import PoolingTask

from switchyard import openapi
from switchyard.errors import validation_error
from switchyard.models.pooling import Pooled
from switchyard.protocol import embeddings as emb
from switchyard.remote.model import RemoteModel
from switchyard.routes.auth import require_api_key
from switchyard.routes.content_type import require_json
from switchyard.routes.errors import openai_exception_handlers, tgi_exception_handlers
from switchyard.routes.pooling_common import (
    check_dimensions,
    check_encoding,
    encode,
    encoded_vector,
    forward_tei,
    pooling_model,
    shape,
)
from switchyard.routes.rerank import OPENAI_ERRORS, TEI_ERRORS, document_rerank, rerank
from switchyard.state import Gateway
from switchyard.telemetry import Telemetry
from switchyard.telemetry.pooling import PoolingRecord

ModelHeader = Annotated[str | None, HeaderParameter(
    name="X-Model", required=False,
    description="Served model name or alias; absent: the first embedding model.")]
TEI_TAGS = ["Text Embeddings Inference"]
GUARDS = [require_api_key, require_json]


@post("/v1/embeddings", status_code=200, summary="OpenAI embeddings", tags=["OpenAI"],
      guards=GUARDS, **openapi.documented("openai", ok=emb.EmbeddingList,
                                          ok_description="One vector per input",
                                          errors=OPENAI_ERRORS))
async def embeddings(gw: NamedDependency[Gateway], telemetry: NamedDependency[Telemetry],
                     data: JSONBody[emb.EmbeddingRequest],
                     request: Request[Any, Any, Any]) -> emb.EmbeddingList:
    """One vector per input, as floats or base64 float32 (the openai SDK's default)."""
    with telemetry.pooling.observe("/v1/embeddings") as record:
        model = pooling_model(gw, data.model, PoolingTask.EMBED, record)
        if isinstance(model, RemoteModel):
            return await forward_tei(model, "/v1/embeddings", await request.body(), "openai")
        check_encoding(data.encoding_format)
        check_dimensions(model, data.dimensions)
        inputs = await encode(model, data.input, "input", None, False, "right")
        record.tokenized = time.perf_counter()
        pooled = await model.run(inputs)
        _note(record, pooled)
        vectors = [shape(v, model.folder.normalize, data.dimensions) for v in pooled.arrays]
        return emb.EmbeddingList(
            data=[emb.Embedding(embedding=encoded_vector(v, data.encoding_format), index=i)
                  for i, v in enumerate(vectors)],
            model=model.name,
            usage=emb.EmbeddingUsage(prompt_tokens=pooled.tokens, total_tokens=pooled.tokens))


@post("/embed", status_code=200, summary="Embed inputs (TEI)", tags=TEI_TAGS, guards=GUARDS,
      **openapi.documented("tgi", ok=list[list[float]], ok_description="One vector per input",
                           errors=TEI_ERRORS))
async def embed(gw: NamedDependency[Gateway], telemetry: NamedDependency[Telemetry],
                data: JSONBody[emb.EmbedRequest], request: Request[Any, Any, Any],
                x_model: ModelHeader = None) -> list[list[float]]:
    """TEI's `/embed`: pooled vectors, normalized unless `normalize` is false."""
    with telemetry.pooling.observe("/embed") as record:
        model = pooling_model(gw, x_model, PoolingTask.EMBED, record, api="tgi")
        if isinstance(model, RemoteModel):
            return await forward_tei(model, "/embed", await request.body())
        check_dimensions(model, data.dimensions)
        inputs = await encode(model, data.inputs, "inputs", data.prompt_name, data.truncate,
                        data.truncation_direction)
        record.tokenized = time.perf_counter()
        pooled = await model.run(inputs)
        _note(record, pooled)
        return [shape(v, data.normalize, data.dimensions).tolist() for v in pooled.arrays]


@post("/embed_all", status_code=200, summary="Every token's hidden state (TEI)", tags=TEI_TAGS,
      guards=GUARDS, **openapi.documented("tgi", ok=list[list[list[float]]],
                                          ok_description="One vector per token of each input",
                                          errors=TEI_ERRORS))
async def embed_all(gw: NamedDependency[Gateway], telemetry: NamedDependency[Telemetry],
                    data: JSONBody[emb.EmbedAllRequest], request: Request[Any, Any, Any],
                    x_model: ModelHeader = None) -> list[list[list[float]]]:
    """TEI's `/embed_all`: the backbone's last hidden state of every token, unpooled."""
    with telemetry.pooling.observe("/embed_all") as record:
        model = pooling_model(gw, x_model, PoolingTask.EMBED, record, api="tgi")
        if isinstance(model, RemoteModel):
            return await forward_tei(model, "/embed_all", await request.body())
        inputs = await encode(model, data.inputs, "inputs", data.prompt_name, data.truncate,
                        data.truncation_direction)
        record.tokenized = time.perf_counter()
        pooled = await model.run(inputs, all_tokens=True)
        _note(record, pooled)
        return [a.tolist() for a in pooled.arrays]


@post("/similarity", status_code=200, summary="Cosine similarity of sentences (TEI)",
      tags=TEI_TAGS, guards=GUARDS,
      **openapi.documented("tgi", ok=list[float], ok_description="One similarity per sentence",
                           errors=TEI_ERRORS))
async def similarity(gw: NamedDependency[Gateway], telemetry: NamedDependency[Telemetry],
                     data: JSONBody[emb.SimilarityRequest], request: Request[Any, Any, Any],
                     x_model: ModelHeader = None) -> list[float]:
    """TEI's `/similarity`: the cosine similarity of `source_sentence` to each sentence."""
    with telemetry.pooling.observe("/similarity") as record:
        model = pooling_model(gw, x_model, PoolingTask.EMBED, record, api="tgi")
        if isinstance(model, RemoteModel):
            return await forward_tei(model, "/similarity", await request.body())
        params = data.parameters or emb.SimilarityParameters()
        if not data.inputs.sentences:
            raise validation_error("`sentences` cannot be empty", param="sentences")
        texts = [data.inputs.source_sentence, *data.inputs.sentences]
        inputs = await encode(model, texts, "inputs",
                        params.prompt_name, params.truncate, params.truncation_direction)
        record.tokenized = time.perf_counter()
        pooled = await model.run(inputs)
        _note(record, pooled)
        source, *others = [shape(v, True, None) for v in pooled.arrays]
        return [float(np.dot(source, v)) for v in others]


def _note(record: PoolingRecord, pooled: Pooled) -> None:
    record.tokens = pooled.tokens
    record.queue_seconds = pooled.queue_seconds
    record.inference_seconds = pooled.inference_seconds


openai_router = Router(path="/", route_handlers=[embeddings, document_rerank],
                       exception_handlers=openai_exception_handlers())
"""`/v1/embeddings` and `/v1/rerank`, answering errors in OpenAI's format."""
tei_router = Router(path="/", route_handlers=[embed, embed_all, similarity, rerank],
                    exception_handlers=tgi_exception_handlers())
"""TEI's routes, answering errors in TEI's (TGI's) `{"error", "error_type"}` format."""
