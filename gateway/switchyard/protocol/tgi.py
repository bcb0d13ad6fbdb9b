"""TGI's wire types (text-generation-inference 3.x), as msgspec Structs.

Field names, defaults and which keys are omitted follow TGI's router so that
`text_generation` and `huggingface_hub` clients parse our answers unchanged.
Docstrings and `Meta(description=...)` become the descriptions of the OpenAPI
document (`switchyard openapi`); `tests/gateway/test_openapi.py` checks that
every field of TGI's own document is here with a compatible type.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta


class Grammar(msgspec.Struct, kw_only=True):
    """A constraint on the generated text: a JSON schema or a regular expression."""

    type: Annotated[
        Literal["json", "json_object", "regex", "json_schema"],
        Meta(description="`json`/`json_object`/`json_schema`: `value` is a JSON schema "
                         "(an object or its JSON text); `regex`: `value` is a pattern."),
    ]
    value: Annotated[Any, Meta(description="The schema or the pattern.")] = None


class GenerateParameters(msgspec.Struct, kw_only=True):
    """`parameters` of a TGI generate request. Unset fields take TGI's type defaults."""

    best_of: Annotated[int | None, Meta(
        description="Sample this many sequences and answer with the one whose tokens have the "
                    "highest mean log-probability; the others are in `details.best_of_sequences`. "
                    "At most `--max-best-of`; not when streaming.")] = None
    decoder_input_details: Annotated[bool, Meta(
        description="Return the prompt tokens in `details.prefill`. Not when streaming.")] = False
    details: Annotated[bool, Meta(
        description="Return `details`: finish reason, token count, seed and the tokens.")] = False
    do_sample: Annotated[bool, Meta(
        description="Sample instead of taking the most likely token. A request without "
                    "`parameters` samples.")] = False
    frequency_penalty: Annotated[float | None, Meta(
        description="Penalize tokens by how often they already appear, from -2.0 to 2.0.")] = None
    grammar: Annotated[Grammar | None, Meta(
        description="Constrain the output to a JSON schema or a regular expression.")] = None
    max_new_tokens: Annotated[int | None, Meta(
        description="Most tokens to generate (> 0). Default: what `--max-total-tokens` leaves "
                    "after the prompt.")] = None
    repetition_penalty: Annotated[float | None, Meta(
        description="Penalty (> 0) on tokens already in the prompt or the output; 1.0 is "
                    "none.")] = None
    return_full_text: Annotated[bool | None, Meta(
        description="Prepend the prompt to `generated_text`.")] = None
    seed: Annotated[int | None, Meta(
        description="Sampling seed, 0 to 2^64 - 1. Default: a random one.")] = None
    stop: Annotated[list[str], Meta(
        description="Stop when one of these strings is generated; it stays in the text. "
                    "At most `--max-stop-sequences`.")] = []
    temperature: Annotated[float | None, Meta(
        description="Divide the logits by this value (> 0) before sampling.")] = None
    top_k: Annotated[int | None, Meta(
        description="Sample among the k (> 0) most likely tokens only.")] = None
    top_n_tokens: Annotated[int | None, Meta(
        description="Also report the n most likely tokens of each step, at most "
                    "`--max-top-n-tokens`.")] = None
    top_p: Annotated[float | None, Meta(
        description="Nucleus sampling: keep the most likely tokens whose probabilities add up "
                    "to p (0 < p < 1).")] = None
    truncate: Annotated[int | None, Meta(
        description="Keep only the last this many prompt tokens.")] = None
    typical_p: Annotated[float | None, Meta(
        description="Typical decoding mass (0 < p < 1).")] = None
    watermark: Annotated[bool, Meta(
        description="Bias the output with a watermark (Kirchenbauer et al., 2023).")] = False
    adapter_id: Annotated[str | None, Meta(
        description="LoRA adapter to apply.")] = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    """Body of `POST /generate`, `POST /generate_stream` and `POST /tokenize`."""

    inputs: Annotated[str, Meta(description="The prompt.")]
    parameters: Annotated[GenerateParameters | None, Meta(
        description="Generation parameters. Absent, TGI's defaults apply with sampling on "
                    "(`do_sample` true).")] = None


class CompatGenerateRequest(GenerateRequest, kw_only=True):
    """Body of `POST /`: a generate request that may ask for a stream."""

    stream: Annotated[bool, Meta(
        description="Answer with server-sent events, as `/generate_stream` does.")] = False


class Token(msgspec.Struct):
    """A generated token as TGI reports it."""

    id: Annotated[int, Meta(description="Token id.")]
    text: Annotated[str, Meta(description="The token's text (empty for special tokens in "
                                          "the stream).")]
    logprob: Annotated[float | None, Meta(description="Log-probability of the token.")]
    special: Annotated[bool, Meta(description="Whether it is a special token (e.g. EOS).")]


class PrefillToken(msgspec.Struct):
    """A prompt token (`decoder_input_details`); the first one has no logprob."""

    id: Annotated[int, Meta(description="Token id.")]
    text: Annotated[str, Meta(description="The token's text.")]
    logprob: Annotated[float | None, Meta(
        description="Log-probability of the token given those before it; null for the "
                    "first.")]


FinishReasonWire = Literal["length", "eos_token", "stop_sequence"]

_FINISH = ("Why generation ended: `length` (max_new_tokens or the total budget), "
           "`eos_token`, or `stop_sequence`.")


class BestOfSequence(msgspec.Struct):
    """A `best_of` candidate that lost to the one in the response (lower mean logprob)."""

    generated_text: Annotated[str, Meta(description="The candidate's text.")]
    finish_reason: Annotated[FinishReasonWire, Meta(description=_FINISH)]
    generated_tokens: Annotated[int, Meta(description="Number of generated tokens.")]
    seed: Annotated[int | None, Meta(description="Seed the candidate sampled with.")]
    prefill: Annotated[list[PrefillToken], Meta(description="Prompt tokens, as in `details`.")]
    tokens: Annotated[list[Token], Meta(description="Generated tokens.")]
    top_tokens: Annotated[list[list[Token]] | msgspec.UnsetType, Meta(
        description="Most likely tokens of each step; only with `top_n_tokens`.")] = msgspec.UNSET


class Details(msgspec.Struct):
    """`details` of a non-streamed response. `top_tokens` is omitted unless asked for."""

    finish_reason: Annotated[FinishReasonWire, Meta(description=_FINISH)]
    generated_tokens: Annotated[int, Meta(description="Number of generated tokens.")]
    seed: Annotated[int | None, Meta(description="Seed used for sampling; null when greedy.")]
    prefill: Annotated[list[PrefillToken], Meta(
        description="Prompt tokens with their log-probabilities (`decoder_input_details`); "
                    "empty otherwise.")]
    tokens: Annotated[list[Token], Meta(description="Generated tokens.")]
    top_tokens: Annotated[list[list[Token]] | msgspec.UnsetType, Meta(
        description="Most likely tokens of each step; only with `top_n_tokens`.")] = msgspec.UNSET
    best_of_sequences: Annotated[list[BestOfSequence] | msgspec.UnsetType, Meta(
        description="The other candidates; present only when `best_of` > 1.")] = msgspec.UNSET


class GenerateResponse(msgspec.Struct):
    """Body of a `/generate` answer; `details` only when asked for."""

    generated_text: Annotated[str, Meta(
        description="The generated text (after the prompt when `return_full_text`); stop "
                    "strings stay in it.")]
    details: Annotated[Details | msgspec.UnsetType, Meta(
        description="Present when `details` or `decoder_input_details` was true.")] = msgspec.UNSET


class StreamDetails(msgspec.Struct):
    """`details` of the last stream event."""

    finish_reason: Annotated[FinishReasonWire, Meta(description=_FINISH)]
    generated_tokens: Annotated[int, Meta(description="Number of generated tokens.")]
    seed: Annotated[int | None, Meta(description="Seed used for sampling; null when greedy.")]
    input_length: Annotated[int, Meta(description="Number of prompt tokens.")]


class StreamResponse(msgspec.Struct):
    """One `/generate_stream` event, one per token. `generated_text` and `details` are
    null until the last event; `top_tokens` is present only when asked for. An error
    after the stream started arrives as an `ErrorResponse` event instead."""

    index: Annotated[int, Meta(description="Position of the token, from 1.")]
    token: Annotated[Token, Meta(description="The generated token.")]
    generated_text: Annotated[str | None, Meta(
        description="The whole text, on the last event only.")] = None
    details: Annotated[StreamDetails | None, Meta(
        description="On the last event, when `details` was true.")] = None
    top_tokens: Annotated[list[Token] | msgspec.UnsetType, Meta(
        description="Most likely tokens of this step; only with `top_n_tokens`.")] = msgspec.UNSET


class ErrorResponse(msgspec.Struct):
    """TGI's error body, on every TGI route."""

    error: Annotated[str, Meta(description="What went wrong, e.g. `Input validation error: ...`.")]
    error_type: Annotated[str, Meta(
        description="`validation`, `generation`, `overloaded`, `incomplete_generation`, "
                    "`unhealthy`, ...")]


class SimpleToken(msgspec.Struct):
    """One entry of `/tokenize`: id, text and offsets into the input."""

    id: Annotated[int, Meta(description="Token id.")]
    text: Annotated[str, Meta(description="The token's text.")]
    start: Annotated[int, Meta(description="Offset of the token's first byte in the input.")]
    stop: Annotated[int, Meta(description="Offset just past the token's last byte.")]


class ChatTokenizeResponse(msgspec.Struct):
    """Body of `POST /chat_tokenize`: the rendered chat template and its tokens."""

    tokenize_response: Annotated[list[SimpleToken], Meta(
        description="Tokens of `templated_text`.")]
    templated_text: Annotated[str, Meta(description="The messages rendered by the chat "
                                                    "template.")]


class Info(msgspec.Struct):
    """Body of `GET /info` (TGI 3.x fields)."""

    model_id: Annotated[str, Meta(description="The served model.")]
    model_sha: Annotated[str | None, Meta(description="Revision of the model, when known.")]
    model_pipeline_tag: Annotated[str | None, Meta(description="Hub pipeline tag.")]
    max_concurrent_requests: Annotated[int, Meta(
        description="Requests served at once; more get 429.")]
    max_best_of: Annotated[int, Meta(description="Largest `best_of`.")]
    max_stop_sequences: Annotated[int, Meta(description="Most `stop` strings per request.")]
    max_input_tokens: Annotated[int, Meta(description="Longest prompt, in tokens.")]
    max_total_tokens: Annotated[int, Meta(
        description="Prompt plus generated tokens per request.")]
    validation_workers: Annotated[int, Meta(description="Tokenizer workers.")]
    max_client_batch_size: Annotated[int, Meta(
        description="Most prompts in one `/v1/completions` request.")]
    router: Annotated[str, Meta(description="`text-generation-router`, as TGI answers.")]
    version: Annotated[str, Meta(description="Server version.")]
    sha: Annotated[str | None, Meta(description="Server commit, when known.")]
    docker_label: Annotated[str | None, Meta(description="Docker image label, when any.")]
