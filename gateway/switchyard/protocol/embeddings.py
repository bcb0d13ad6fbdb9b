"""Wire types of the embedding and rerank routes, as msgspec Structs.

- OpenAI's `POST /v1/embeddings` (`EmbeddingRequest`, `EmbeddingList`);
- TEI's `POST /embed`, `/embed_all`, `/similarity` and `/rerank`
  (text-embeddings-inference's router, `router/src/http/types.rs`);
- the Jina/Cohere rerank shape at `POST /v1/rerank` (`DocumentRerankRequest`), as
  vLLM and llama.cpp serve it.

`input`/`inputs` take a string, a list of strings, a list of token ids or a
list of lists of token ids; msgspec cannot tell those list kinds apart in one
union, so they arrive as `str | list[Any]` and `routes/embeddings.py` sorts
them out with a 4xx for anything else.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

Inputs = Annotated[str | list[Any], Meta(
    description="A string, a list of strings, a list of token ids or a list of lists of "
                "token ids.")]


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's embeddings request."""

    input: Inputs
    model: str | None = None
    encoding_format: Annotated[str, Meta(
        description="`float` (a JSON list) or `base64` (the little-endian float32 bytes, "
                    "base64-encoded: what the openai SDK asks for by default).")] = "float"
    dimensions: Annotated[int | None, Meta(
        description="Keep the first `dimensions` values and renormalize (Matryoshka models "
                    "only).")] = None
    user: str | None = None


class Embedding(msgspec.Struct, kw_only=True):
    """One input's vector: a list of floats, or a base64 string of float32 bytes."""

    embedding: list[float] | str
    index: int
    object: Literal["embedding"] = "embedding"


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    """Tokens the request's inputs took, special tokens included."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct, kw_only=True):
    """OpenAI's embeddings response."""

    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: Literal["list"] = "list"


Direction = Annotated[str, Meta(description="`right` (the default) or `left`: which end of "
                                            "an over-long input `truncate` cuts.")]


class EmbedRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """TEI's `/embed` request."""

    inputs: Inputs
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: Annotated[str | None, Meta(
        description="A key of the model's sentence-transformers `prompts`; its text is put "
                    "before each input.")] = None
    normalize: bool = True
    dimensions: int | None = None


class EmbedAllRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """TEI's `/embed_all` request: every token's hidden state, unpooled."""

    inputs: Inputs
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: str | None = None


class SimilarityInput(msgspec.Struct, kw_only=True):
    """A sentence and the sentences to compare it with."""

    source_sentence: str
    sentences: list[str]


class SimilarityParameters(msgspec.Struct, kw_only=True):
    """TEI's similarity parameters."""

    truncate: bool | None = None
    truncation_direction: Direction = "right"
    prompt_name: str | None = None


class SimilarityRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """TEI's `/similarity` request: cosine similarity of `source_sentence` to each sentence."""

    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None


class RerankRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """TEI's `/rerank` request."""

    query: str
    texts: list[str]
    truncate: bool | None = None
    truncation_direction: Direction = "right"
    raw_scores: Annotated[bool, Meta(
        description="The classifier's logit instead of its sigmoid.")] = False
    return_text: bool = False


class Rank(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One text's score, most relevant first."""

    index: int
    score: float
    text: str | None = None


class RerankDocument(msgspec.Struct, kw_only=True):
    """A document of the Jina/Cohere shape."""

    text: str


class DocumentRerankRequest(msgspec.Struct, kw_only=True):
    """The Jina/Cohere rerank request (`/v1/rerank`); unknown fields are ignored, as the
    clients of both services send their own extras."""

    query: str
    documents: list[str | RerankDocument]
    model: str | None = None
    top_n: int | None = None
    return_documents: bool = True


class RerankResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One document's relevance, most relevant first."""

    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct, kw_only=True):
    """Tokens of every (query, document) pair."""

    total_tokens: int


class DocumentRerankResponse(msgspec.Struct, kw_only=True):
    """The Jina/Cohere rerank response."""

    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage
