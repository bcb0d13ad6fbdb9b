"""Rerank routes: TEI's `/rerank` and the Jina/Cohere shape at `/v1/rerank`.

Each (query, text) pair runs through the cross-encoder as one input with its
segment ids; the score is the classifier's logit put through the model's
activation (sigmoid for one label, as CrossEncoder.predict and TEI do),
or the raw logit with TEI's `raw_scores`. Both answers list the texts most
relevant first. The routers are assembled in `routes/embeddings.py`.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Annotated, Any

from litestar import Request, post
from litestar.di import NamedDependency
from litestar.params import HeaderParameter, JSONBody
from switchyard_spec import PoolingTask

from switchyard import openapi
from switchyard.errors import validation_error
from switchyard.models.pooling import PoolingModel
from switchyard.protocol import embeddings as emb
from switchyard.remote.model import RemoteModel
from switchyard.routes.auth import require_api_key
from switchyard.routes.content_type import require_json
from switchyard.routes.pooling_common import DIRECTIONS, forward_tei, pooling_model
from switchyard.state import Gateway
from switchyard.telemetry import Telemetry
from switchyard.telemetry.pooling import PoolingRecord

ModelHeader = Annotated[str | None, HeaderParameter(
    name="X-Model", required=False,
    description="Served model name or alias; absent: the first reranker model.")]
GUARDS = [require_api_key, require_json]
OPENAI_ERRORS = (400, 401, 404, 413, 422, 424, 429, 503)
"""What the OpenAI-side pooling routes answer besides a 200 (OpenAI's error body)."""
TEI_ERRORS = (400, 401, 413, 422, 424, 429, 503)
"""What TEI's routes answer besides a 200 (an unknown `X-Model` is a 422 there)."""
_ids = itertools.count()


async def _scores(model: PoolingModel, query: str, texts: list[str], truncate: bool | None,
                  direction: str, raw: bool, record: PoolingRecord) -> tuple[list[float], int]:
    """Each text's score against `query` and the tokens the pairs took."""
    model.check_count(len(texts), "texts")
    if direction.lower() not in DIRECTIONS:
        raise validation_error(f"`truncation_direction` must be one of {', '.join(DIRECTIONS)}",
                               param="truncation_direction")
    pairs = model.tokenizer.pairs(query, texts, bool(truncate), direction.lower())
    record.tokenized = time.perf_counter()
    pooled = await model.run(pairs)
    record.tokens = pooled.tokens
    record.queue_seconds, record.inference_seconds = pooled.queue_seconds, pooled.inference_seconds
    logits = [float(a[0]) for a in pooled.arrays]
    if raw or model.folder.activation == "identity":
        return logits, pooled.tokens
    return [1.0 / (1.0 + math.exp(-x)) for x in logits], pooled.tokens


def _ranked(scores: list[float]) -> list[int]:
    """Indices, highest score first (ties keep the input order)."""
    return sorted(range(len(scores)), key=lambda i: -scores[i])


@post("/rerank", status_code=200, summary="Rerank texts against a query (TEI)",
      tags=["Text Embeddings Inference"], guards=GUARDS,
      **openapi.documented("tgi", ok=list[emb.Rank], ok_description="Most relevant first",
                           errors=TEI_ERRORS))
async def rerank(gw: NamedDependency[Gateway], telemetry: NamedDependency[Telemetry],
                 data: JSONBody[emb.RerankRequest], request: Request[Any, Any, Any],
                 x_model: ModelHeader = None) -> list[emb.Rank]:
    """TEI's `/rerank`: `[{index, score, text?}]`, most relevant first."""
    with telemetry.pooling.observe("/rerank") as record:
        model = pooling_model(gw, x_model, PoolingTask.RERANK, record, api="tgi")
        if isinstance(model, RemoteModel):
            return await forward_tei(model, "/rerank", await request.body())
        scores, _ = await _scores(model, data.query, data.texts, data.truncate,
                                  data.truncation_direction, data.raw_scores, record)
        return [emb.Rank(index=i, score=scores[i],
                         text=data.texts[i] if data.return_text else None)
                for i in _ranked(scores)]


@post("/v1/rerank", status_code=200, summary="Rerank documents (Jina/Cohere shape)",
      tags=["OpenAI"], guards=GUARDS,
      **openapi.documented("openai", ok=emb.DocumentRerankResponse,
                           ok_description="Most relevant first", errors=OPENAI_ERRORS))
async def document_rerank(gw: NamedDependency[Gateway], telemetry: NamedDependency[Telemetry],
                          data: JSONBody[emb.DocumentRerankRequest],
                          ) -> emb.DocumentRerankResponse:
    """`results` sorted by `relevance_score`, the first `top_n` of them."""
    with telemetry.pooling.observe("/v1/rerank") as record:
        model = pooling_model(gw, data.model, PoolingTask.RERANK, record)
        if isinstance(model, RemoteModel):  # TEI has no /v1/rerank to forward to
            raise validation_error(f"model `{model.name}` is served by TEI replicas, which "
                                   "rerank on /rerank only; send it there", param="model")
        if data.top_n is not None and data.top_n < 1:
            raise validation_error("`top_n` must be at least 1", param="top_n")
        texts = [d if isinstance(d, str) else d.text for d in data.documents]
        scores, tokens = await _scores(model, data.query, texts, False, "right", False, record)
        order = _ranked(scores)[:data.top_n]
        return emb.DocumentRerankResponse(
            id=f"rerank-{next(_ids)}", model=model.name,
            results=[emb.RerankResult(
                index=i, relevance_score=scores[i],
                document=emb.RerankDocument(text=texts[i]) if data.return_documents else None)
                for i in order],
            usage=emb.RerankUsage(total_tokens=tokens))
