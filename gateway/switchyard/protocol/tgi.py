"""TGI's wire types (text-generation-inference 3.x), as msgspec Structs.

Field names, defaults and which keys are omitted follow TGI's router so that
`text_generation` and `huggingface_hub` clients parse our answers unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class GenerateParameters(msgspec.Struct, kw_only=True):
    """`parameters` of a TGI generate request. Unset fields take TGI's type defaults."""

    best_of: int | None = None
    decoder_input_details: bool = False
    details: bool = False
    do_sample: bool = False
    frequency_penalty: float | None = None
    grammar: dict[str, Any] | None = None
    max_new_tokens: int | None = None
    repetition_penalty: float | None = None
    return_full_text: bool | None = None
    seed: int | None = None
    stop: list[str] = []
    temperature: float | None = None
    top_k: int | None = None
    top_n_tokens: int | None = None
    top_p: float | None = None
    truncate: int | None = None
    typical_p: float | None = None
    watermark: bool = False
    adapter_id: str | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    """Body of `POST /generate` and `POST /generate_stream`."""

    inputs: str
    parameters: GenerateParameters | None = None
    """Absent parameters mean TGI's quirky defaults: sampling on."""


class CompatGenerateRequest(GenerateRequest, kw_only=True):
    """Body of `POST /`: a generate request that may ask for a stream."""

    stream: bool = False


class Token(msgspec.Struct):
    """A generated token as TGI reports it."""

    id: int
    text: str
    logprob: float | None
    special: bool


class PrefillToken(msgspec.Struct):
    """A prompt token (decoder_input_details); the first one has no logprob."""

    id: int
    text: str
    logprob: float | None


FinishReasonWire = Literal["length", "eos_token", "stop_sequence"]


class BestOfSequence(msgspec.Struct):
    """A `best_of` candidate that lost to the one in the response (lower mean logprob)."""

    generated_text: str
    finish_reason: FinishReasonWire
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | msgspec.UnsetType = msgspec.UNSET


class Details(msgspec.Struct):
    """`details` of a non-streamed response. `top_tokens` is omitted unless asked for."""

    finish_reason: FinishReasonWire
    generated_tokens: int
    seed: int | None
    prefill: list[PrefillToken]
    tokens: list[Token]
    top_tokens: list[list[Token]] | msgspec.UnsetType = msgspec.UNSET
    best_of_sequences: list[BestOfSequence] | msgspec.UnsetType = msgspec.UNSET
    """Present only when `best_of` > 1."""


class GenerateResponse(msgspec.Struct):
    """Body of a `/generate` answer; `details` only when asked for."""

    generated_text: str
    details: Details | msgspec.UnsetType = msgspec.UNSET


class StreamDetails(msgspec.Struct):
    """`details` of the last stream event."""

    finish_reason: FinishReasonWire
    generated_tokens: int
    seed: int | None
    input_length: int


class StreamResponse(msgspec.Struct):
    """One `/generate_stream` event. `generated_text`/`details` are null until the end;
    `top_tokens` is present only when asked for."""

    index: int
    token: Token
    generated_text: str | None = None
    details: StreamDetails | None = None
    top_tokens: list[Token] | msgspec.UnsetType = msgspec.UNSET


class ErrorResponse(msgspec.Struct):
    """TGI's error body."""

    error: str
    error_type: str


class SimpleToken(msgspec.Struct):
    """One entry of `/tokenize`: id, text and offsets into the input."""

    id: int
    text: str
    start: int
    stop: int


class ChatTokenizeResponse(msgspec.Struct):
    """Body of `POST /chat_tokenize`: the rendered chat template and its tokens."""

    tokenize_response: list[SimpleToken]
    templated_text: str


class Info(msgspec.Struct):
    """Body of `GET /info` (TGI 3.x fields)."""

    model_id: str
    model_sha: str | None
    model_pipeline_tag: str | None
    max_concurrent_requests: int
    max_best_of: int
    max_stop_sequences: int
    max_input_tokens: int
    max_total_tokens: int
    validation_workers: int
    max_client_batch_size: int
    router: str
    version: str
    sha: str | None
    docker_label: str | None
