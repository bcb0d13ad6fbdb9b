"""TGI's generation routes: `/generate`, `/generate_stream`, `/` and `/tokenize`.

Quirks kept on purpose because TGI clients rely on them: absent `parameters`
means sampling; the compat route answers a JSON array; stream errors arrive
in-stream with status 200; stop strings stay in the text.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import msgspec
from litestar import Response, Router, get, post
from litestar.response import ServerSentEvent

from switchyard.errors import ApiError
from switchyard.generation import Finished, GeneratedToken, generate
from switchyard.models.served import ServedModel
from switchyard.protocol import tgi
from switchyard.routes.errors import tgi_exception_handlers
from switchyard.routes.ops import health
from switchyard.state import Gateway
from switchyard.validation import GenerationPlan, build_plan, check_inputs, check_parameters

COMPUTE_TYPE = "cpu+optimized"


def _parameters(request: tgi.GenerateRequest) -> tgi.GenerateParameters:
    # TGI quirk: a request without `parameters` samples (do_sample defaults to true).
    return request.parameters or tgi.GenerateParameters(do_sample=True)


def plan_tgi(gw: Gateway, model: ServedModel, request: tgi.GenerateRequest) -> GenerationPlan:
    """Validate a TGI request in TGI's order and tokenize it."""
    params = _parameters(request)
    check_parameters(params, gw.settings)
    check_inputs(request.inputs, params, model.limits)
    ids = model.tokenizer.encode(request.inputs, add_special_tokens=True)
    return build_plan(ids, params, model.limits, model.info.eos_token_ids)


def _token(token: GeneratedToken) -> tgi.Token:
    return tgi.Token(id=token.id, text=token.text, logprob=token.logprob, special=token.special)


def _top_tokens(model: ServedModel, token: GeneratedToken) -> list[tgi.Token]:
    tok = model.tokenizer
    return [
        tgi.Token(id=t.id, text=tok.token_text(t.id), logprob=t.logprob, special=tok.is_special(t.id))
        for t in token.top_tokens
    ]


class _Collected(msgspec.Struct):
    tokens: list[GeneratedToken]
    finished: Finished


async def _collect(model: ServedModel, plan: GenerationPlan) -> _Collected:
    tokens: list[GeneratedToken] = []
    async for step in generate(model, plan, "tgi"):
        tokens.append(step.token)
        if step.finished is not None:
            return _Collected(tokens=tokens, finished=step.finished)
    raise ApiError(500, "Incomplete generation", "incomplete_generation")


async def run_generate(
    gw: Gateway, request: tgi.GenerateRequest
) -> tuple[tgi.GenerateResponse, dict[str, str]]:
    """Run one non-streamed generation; returns the body and TGI's timing headers."""
    start = time.perf_counter()
    model = gw.model()
    plan = plan_tgi(gw, model, request)
    validated = time.perf_counter()
    model.admission.acquire()
    try:
        result = await _collect(model, plan)
    finally:
        model.admission.release()
    end = time.perf_counter()
    done = result.finished
    text = done.generated_text
    if plan.return_full_text:
        text = request.inputs + text
    body = tgi.GenerateResponse(generated_text=text)
    if plan.details:
        top = [_top_tokens(model, t) for t in result.tokens] if plan.sampling.top_n_tokens else None
        body.details = tgi.Details(
            finish_reason=done.reason.value,
            generated_tokens=done.generated_tokens,
            seed=done.seed,
            prefill=[],
            tokens=[_token(t) for t in result.tokens],
            top_tokens=top if top is not None else msgspec.UNSET,
        )
    inference = end - validated
    headers = {
        "x-compute-type": COMPUTE_TYPE,
        "x-compute-time": f"{end - start:.6f}",
        "x-compute-characters": str(len(request.inputs)),
        "x-total-time": str(int((end - start) * 1000)),
        "x-validation-time": str(int((validated - start) * 1000)),
        "x-queue-time": "0",
        "x-inference-time": str(int(inference * 1000)),
        "x-time-per-token": str(int(inference * 1000 / max(done.generated_tokens, 1))),
        "x-prompt-tokens": str(done.prompt_tokens),
        "x-generated-tokens": str(done.generated_tokens),
    }
    return body, headers


def _error_event(exc: ApiError) -> str:
    return msgspec.json.encode(tgi.ErrorResponse(error=exc.message, error_type=exc.error_type)).decode()


async def stream_events(gw: Gateway, request: tgi.GenerateRequest) -> AsyncIterator[str]:
    """TGI's SSE events for one request; errors become an in-stream error event."""
    try:
        model = gw.model()
        params = _parameters(request)
        if params.best_of not in (None, 1):
            raise ApiError(422, "Input validation error: `best_of` != 1 is not supported when "
                           "streaming tokens", "validation")
        if params.decoder_input_details:
            raise ApiError(422, "Input validation error: `decoder_input_details` == true is not "
                           "supported when streaming tokens", "validation")
        plan = plan_tgi(gw, model, request)
        model.admission.acquire()
    except ApiError as exc:
        yield _error_event(exc)
        return
    try:
        index = 0
        async for step in generate(model, plan, "tgi-stream"):
            index += 1
            event = tgi.StreamResponse(index=index, token=_token(step.token))
            if plan.sampling.top_n_tokens:
                event.top_tokens = _top_tokens(model, step.token)
            done = step.finished
            if done is not None:
                text = done.generated_text
                event.generated_text = request.inputs + text if plan.return_full_text else text
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


@post("/generate", status_code=200, summary="Generate tokens", tags=["Text Generation Inference"])
async def generate_route(gw: Gateway, data: tgi.GenerateRequest) -> Response[tgi.GenerateResponse]:
    """Generate text for one input and answer when it is complete."""
    body, headers = await run_generate(gw, data)
    return Response(body, headers=headers, status_code=200)


@post("/generate_stream", status_code=200, summary="Generate a stream of tokens (SSE)", tags=["Text Generation Inference"])
async def generate_stream_route(gw: Gateway, data: tgi.GenerateRequest) -> ServerSentEvent:
    """Generate text for one input, one server-sent event per token."""
    return sse(stream_events(gw, data), len(data.inputs))


@post("/", status_code=200, summary="Generate tokens (compat)", tags=["Text Generation Inference"])
async def compat_route(
    gw: Gateway, data: tgi.CompatGenerateRequest
) -> Response[list[tgi.GenerateResponse]] | ServerSentEvent:
    """TGI's compatibility route: a JSON array, or a stream when `stream` is true."""
    if data.stream:
        return sse(stream_events(gw, data), len(data.inputs))
    body, headers = await run_generate(gw, data)
    return Response([body], headers=headers, status_code=200)


@get("/", summary="Readiness (TGI's GET /)", tags=["Text Generation Inference"],
     include_in_schema=False)
async def root_health(gw: Gateway) -> Response[tgi.ErrorResponse | bytes]:
    """TGI answers a GET on `/` like `/health`."""
    return await health.fn(gw)


@post("/tokenize", status_code=200, summary="Tokenize inputs", tags=["Text Generation Inference"])
async def tokenize_route(gw: Gateway, data: tgi.GenerateRequest) -> list[tgi.SimpleToken]:
    """Tokenize `inputs` as the model sees them, with offsets into the text."""
    model = gw.model()
    if not data.inputs:
        raise ApiError(422, "Input validation error: `inputs` cannot be empty", "validation")
    return [
        tgi.SimpleToken(id=t.id, text=t.text, start=t.start, stop=t.stop)
        for t in model.tokenizer.encode_with_offsets(data.inputs, add_special_tokens=True)
    ]


router = Router(
    path="/",
    route_handlers=[
        generate_route, generate_stream_route, compat_route, root_health, tokenize_route
    ],
    exception_handlers=tgi_exception_handlers(),
)
