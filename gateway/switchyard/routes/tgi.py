"""TGI's generation routes: `/generate`, `/generate_stream`, `/`, `/tokenize`, `/chat_tokenize`.

Quirks kept on purpose because TGI clients rely on them: absent `parameters`
means sampling; the compat route answers a JSON array; stream errors arrive
in-stream with status 200; stop strings stay in the text.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from litestar import Request, Response, Router, get, post
from litestar.di import NamedDependency
from litestar.params import HeaderParameter, JSONBody
from litestar.response import ServerSentEvent, Stream

from switchyard import openapi
from switchyard.constraints import engine_can_constrain, tgi_constraint
from switchyard.errors import ApiError, validation_error
from switchyard.generation import Completed, GeneratedToken, collect_all, start, start_all
from switchyard.media import ImageSet, encode_prompt, tgi_images
from switchyard.models.served import ServedModel
from switchyard.protocol import openai as oai
from switchyard.protocol import tgi, vllm
from switchyard.routes.vllm import decode_body, vllm_tokenize
from switchyard.remote import forward as remote
from switchyard.routes.auth import require_api_key
from switchyard.routes.content_type import require_json
from switchyard.routes.disconnect import unless_client_leaves
from switchyard.routes.errors import tgi_exception_handlers
from switchyard.openai_mapping.plans import chat_prompt
from switchyard.routes.ops import Degraded, health
from switchyard.state import Gateway
from switchyard.telemetry.request import note_error
from switchyard.planning.plan import GenerationPlan, fan_out
from switchyard.planning.tgi import check_inputs, check_parameters, plan_tgi_prompt

MODEL_HEADER = "X-Model"
"""The header that picks a served model on TGI's routes (their bodies have no `model`)."""
ModelHeader = Annotated[str | None, HeaderParameter(
    name=MODEL_HEADER, required=False,
    description="Served model name or alias (see /v1/models); absent: the default model.")]

COMPUTE_TYPE = "cpu+optimized"


def _parameters(request: tgi.GenerateRequest) -> tgi.GenerateParameters:
    # TGI quirk: a request without `parameters` samples (do_sample defaults to true).
    return request.parameters or tgi.GenerateParameters(do_sample=True)


def plan_tgi(gw: Gateway, model: ServedModel, request: tgi.GenerateRequest,
             images: ImageSet | None = None) -> GenerationPlan:
    """Validate a TGI request in TGI's order and tokenize it (with its `images`, fetched by
    `switchyard.media.tgi_images`)."""
    params = _parameters(request)
    check_parameters(params, gw.settings)
    check_inputs(request.inputs, params, model.limits)
    constraint = None
    if params.grammar is not None:
        if not engine_can_constrain(model):  # TGI's answer under --disable-grammar-support
            raise validation_error("grammar is not supported", param="grammar")
        constraint = tgi_constraint(params.grammar.type, params.grammar.value)
    prompt = encode_prompt(model, request.inputs, images, add_special_tokens=True)
    return plan_tgi_prompt(prompt.ids, params, model.limits, model.info.eos_token_ids,
                           constraint=constraint, images=prompt.images)


def _token(token: GeneratedToken) -> tgi.Token:
    return tgi.Token(id=token.id, text=token.text, logprob=token.logprob, special=token.special)


def _top_tokens(model: ServedModel, token: GeneratedToken) -> list[tgi.Token]:
    tok = model.tokenizer
    return [
        tgi.Token(id=t.id, text=tok.token_text(t.id), logprob=t.logprob,
                  special=tok.is_special(t.id))
        for t in token.top_tokens
    ]


def _prefill(model: ServedModel, plan: GenerationPlan, result: Completed) -> list[tgi.PrefillToken]:
    """`details.prefill`: each prompt token with its log-probability; the first has none.

    Empty when not asked for, or when the engine reported no prompt log-probabilities
    (what TGI answers without `--enable-prefill-logprobs`).
    """
    logprobs = result.finished.prompt_logprobs
    if not plan.prompt_logprobs or not logprobs:
        return []
    tok = model.tokenizer
    return [
        tgi.PrefillToken(id=token_id, text=tok.token_text(token_id), logprob=logprob)
        for token_id, logprob in zip(plan.prompt_ids, (None, *logprobs))
    ]


def _full_text(request: tgi.GenerateRequest, plan: GenerationPlan, text: str) -> str:
    return request.inputs + text if plan.return_full_text else text


def _details(
    model: ServedModel, plan: GenerationPlan, result: Completed, prefill: list[tgi.PrefillToken]
) -> tgi.Details:
    done = result.finished
    top = ([_top_tokens(model, s.token) for s in result.steps]
           if plan.sampling.top_n_tokens else msgspec.UNSET)
    return tgi.Details(
        finish_reason=done.reason.value,
        generated_tokens=done.generated_tokens,
        seed=done.seed,
        prefill=prefill,
        tokens=[_token(s.token) for s in result.steps],
        top_tokens=top,
    )


def _best_of_sequence(
    model: ServedModel,
    request: tgi.GenerateRequest,
    plan: GenerationPlan,
    result: Completed,
    prefill: list[tgi.PrefillToken],
) -> tgi.BestOfSequence:
    d = _details(model, plan, result, prefill)
    return tgi.BestOfSequence(
        generated_text=_full_text(request, plan, result.finished.generated_text),
        finish_reason=d.finish_reason,
        generated_tokens=d.generated_tokens,
        seed=d.seed,
        prefill=d.prefill,
        tokens=d.tokens,
        top_tokens=d.top_tokens,
    )


async def run_generate(
    gw: Gateway, request: tgi.GenerateRequest, model_name: str | None = None
) -> tuple[tgi.GenerateResponse, dict[str, str]]:
    """Run one non-streamed generation; returns the body and TGI's timing headers.

    With `best_of` = N, N sampled sequences run together; the one with the
    highest mean token log-probability answers and the others are reported in
    `details.best_of_sequences`.
    """
    start_time = time.perf_counter()
    model = gw.with_adapter(gw.model(model_name, "tgi"), _parameters(request).adapter_id)
    plan = plan_tgi(gw, model, request, await tgi_images(gw, model, request.inputs))
    best_of = _parameters(request).best_of or 1
    validated = time.perf_counter()
    model.admission.acquire()
    try:
        results = await collect_all(start_all(model, fan_out(plan, best_of), "tgi"))
    finally:
        model.admission.release()
    end = time.perf_counter()
    # max() keeps the first of equal scores: ties go to the lowest index, as in TGI.
    winner = max(range(len(results)), key=lambda i: results[i].mean_logprob)
    result = results[winner]
    done = result.finished
    body = tgi.GenerateResponse(generated_text=_full_text(request, plan, done.generated_text))
    if plan.details:
        # Prompt log-probabilities do not depend on sampling: the first run's serve all.
        prefill = _prefill(model, plan, results[0])
        body.details = _details(model, plan, result, prefill)
        if best_of > 1:
            body.details.best_of_sequences = [
                _best_of_sequence(model, request, plan, other, prefill)
                for i, other in enumerate(results) if i != winner
            ]
    inference = end - validated
    headers = {
        "x-compute-type": COMPUTE_TYPE,
        "x-compute-time": f"{end - start_time:.6f}",
        "x-compute-characters": str(len(request.inputs)),
        "x-total-time": str(int((end - start_time) * 1000)),
        "x-validation-time": str(int((validated - start_time) * 1000)),
        "x-queue-time": "0",
        "x-inference-time": str(int(inference * 1000)),
        "x-time-per-token": str(int(inference * 1000 / max(done.generated_tokens, 1))),
        "x-prompt-tokens": str(done.prompt_tokens),
        "x-generated-tokens": str(done.generated_tokens),
    }
    return body, headers


def _error_event(exc: ApiError) -> str:
    note_error(exc)  # in-stream errors never reach the exception handlers
    body = tgi.ErrorResponse(error=exc.message, error_type=exc.error_type)
    return msgspec.json.encode(body).decode()


def _check_streamable(params: tgi.GenerateParameters) -> None:
    if params.best_of not in (None, 1):
        raise validation_error("`best_of` != 1 is not supported when streaming tokens",
                               param="best_of")
    if params.decoder_input_details:
        raise validation_error(
            "`decoder_input_details` == true is not supported when streaming tokens",
            param="decoder_input_details",
        )


async def stream_events(gw: Gateway, request: tgi.GenerateRequest,
                        model_name: str | None = None) -> AsyncIterator[str]:
    """TGI's SSE events for one request; errors become an in-stream error event."""
    try:
        model = gw.with_adapter(gw.model(model_name, "tgi"), _parameters(request).adapter_id)
        _check_streamable(_parameters(request))
        plan = plan_tgi(gw, model, request, await tgi_images(gw, model, request.inputs))
        model.admission.acquire()
    except ApiError as exc:
        yield _error_event(exc)
        return
    run = start(model, plan, "tgi-stream")
    try:
        index = 0
        async for step in run.steps():
            index += 1
            event = tgi.StreamResponse(index=index, token=_token(step.token))
            if plan.sampling.top_n_tokens:
                event.top_tokens = _top_tokens(model, step.token)
            done = step.finished
            if done is not None:
                event.generated_text = _full_text(request, plan, done.generated_text)
                if plan.details:
                    event.details = tgi.StreamDetails(
                        finish_reason=done.reason.value,
                        generated_tokens=done.generated_tokens,
                        seed=done.seed,
                        input_length=done.prompt_tokens,
                    )
            yield msgspec.json.encode(event).decode()
    except ApiError as exc:
        yield _error_event(exc)
    finally:
        run.close()
        model.admission.release()


def sse(events: AsyncIterator[str], characters: int) -> ServerSentEvent:
    """Wrap events in TGI's SSE response with its headers."""
    return ServerSentEvent(
        events,
        headers={
            "x-compute-type": COMPUTE_TYPE,
            "x-compute-characters": str(characters),
            "X-Accel-Buffering": "no",
            "Cache-Control": "no-cache",
        },
    )


async def compat_response(
    gw: Gateway, data: tgi.CompatGenerateRequest, model_name: str | None = None,
    raw: bytes | None = None,
) -> Response[Any] | ServerSentEvent | Stream:
    """TGI's compatibility answer: a JSON array, or a stream when `stream` is true.

    ``raw``, the body as sent, is what a remote model's replica is sent.
    """
    target = remote.remote_target(gw, model_name, "tgi") if raw is not None else None
    if target is not None and raw is not None:
        return await remote.forward_tgi(target, "/", raw, data.stream)
    if data.stream:
        return sse(stream_events(gw, data, model_name), len(data.inputs))
    body, headers = await run_generate(gw, data, model_name)
    return Response([body], headers=headers, status_code=200)


@post("/generate", status_code=200, summary="Generate tokens", tags=["Text Generation Inference"],
      guards=[require_api_key, require_json], **openapi.GENERATE)
async def generate_route(
    gw: NamedDependency[Gateway], data: JSONBody[tgi.GenerateRequest],
    request: Request[Any, Any, Any], x_model: ModelHeader = None,
) -> Response[tgi.GenerateResponse]:
    """Generate text for one input and answer when it is complete."""
    target = remote.remote_target(gw, x_model, "tgi")
    if target is not None:
        return await unless_client_leaves(
            request, remote.forward_tgi(target, "/generate", await request.body(), False))
    body, headers = await unless_client_leaves(request, run_generate(gw, data, x_model))
    return Response(body, headers=headers, status_code=200)


@post("/generate_stream", status_code=200, summary="Generate a stream of tokens (SSE)",
      tags=["Text Generation Inference"], guards=[require_api_key, require_json],
      **openapi.GENERATE_STREAM)
async def generate_stream_route(
    gw: NamedDependency[Gateway], data: JSONBody[tgi.GenerateRequest],
    request: Request[Any, Any, Any], x_model: ModelHeader = None,
) -> ServerSentEvent:
    """Generate text for one input, one server-sent event per token."""
    target = remote.remote_target(gw, x_model, "tgi")
    if target is not None:
        return await remote.forward_tgi(target, "/generate_stream", await request.body(), True)
    return sse(stream_events(gw, data, x_model), len(data.inputs))


@post("/", status_code=200, summary="Generate tokens (compat)", tags=["Text Generation Inference"],
      guards=[require_api_key, require_json], **openapi.COMPAT)
async def compat_route(
    gw: NamedDependency[Gateway], data: JSONBody[tgi.CompatGenerateRequest],
    request: Request[Any, Any, Any], x_model: ModelHeader = None,
) -> Response[list[tgi.GenerateResponse]] | ServerSentEvent:
    """TGI's compatibility route: a JSON array, or a stream when `stream` is true."""
    return await unless_client_leaves(
        request, compat_response(gw, data, x_model, await request.body()))


@get("/", summary="Readiness (TGI's GET /)", tags=["Text Generation Inference"],
     include_in_schema=False)
async def root_health(
    gw: NamedDependency[Gateway]
) -> Response[tgi.ErrorResponse | Degraded | bytes]:
    """TGI answers a GET on `/` like `/health`."""
    return await health.fn(gw)


@post("/tokenize", status_code=200, summary="Tokenize inputs", tags=["Text Generation Inference"],
      guards=[require_api_key, require_json], **openapi.TOKENIZE)
async def tokenize_route(
    gw: NamedDependency[Gateway], request: Request[Any, Any, Any], x_model: ModelHeader = None,
) -> list[tgi.SimpleToken] | vllm.TokenizeResponse | Response[bytes]:
    """Tokenize `inputs` as the model sees them, with offsets into the text (TGI's body); or
    vLLM's body, a `prompt` or the `messages` of a chat (templated), answered in vLLM's shape.
    A remote model's replica tokenizes: it holds the tokenizer."""
    body = await request.body()
    shape = decode_body(body, vllm.TokenizeShape)
    if shape.inputs is msgspec.UNSET and (shape.prompt is not msgspec.UNSET
                                          or shape.messages is not msgspec.UNSET):
        return vllm_tokenize(gw, body, shape)
    data = decode_body(body, tgi.GenerateRequest)
    target = remote.remote_target(gw, x_model, "tgi")
    if target is not None:
        return await remote.forward_tgi(target, "/tokenize", body, False)
    model = gw.model(x_model, "tgi")
    if not data.inputs:
        raise validation_error("`inputs` cannot be empty", param="inputs")
    return [
        tgi.SimpleToken(id=t.id, text=t.text, start=t.start, stop=t.stop)
        for t in model.tokenizer.encode_with_offsets(data.inputs, add_special_tokens=True)
    ]


@post("/chat_tokenize", status_code=200, summary="Template and tokenize a chat request",
      tags=["Text Generation Inference"], guards=[require_api_key, require_json],
      **openapi.CHAT_TOKENIZE)
async def chat_tokenize_route(
    gw: NamedDependency[Gateway], data: JSONBody[oai.ChatCompletionRequest],
    request: Request[Any, Any, Any],
) -> tgi.ChatTokenizeResponse | Response[bytes]:
    """Render the chat template for `messages` and tokenize the result as chat requests are
    (a remote model's replica does both: it holds the template and the tokenizer)."""
    target = remote.remote_target(gw, data.model, "openai")
    if target is not None:
        if not target.speaks_tgi:  # OpenAI-only servers have no /chat_tokenize
            raise remote.refuse_tgi(target)
        return await remote.forward(target, "openai", "/chat_tokenize", await request.body(),
                                    False)
    model = gw.model(data.model)
    text = chat_prompt(model, data)
    spans = model.tokenizer.encode_with_offsets(text, add_special_tokens=False)
    return tgi.ChatTokenizeResponse(
        tokenize_response=[tgi.SimpleToken(id=t.id, text=t.text, start=t.start, stop=t.stop)
                           for t in spans],
        templated_text=text,
    )


router = Router(
    path="/",
    route_handlers=[
        generate_route, generate_stream_route, compat_route, root_health, tokenize_route,
        chat_tokenize_route,
    ],
    exception_handlers=tgi_exception_handlers(),
)
