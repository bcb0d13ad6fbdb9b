"""vLLM's own routes beside OpenAI's: `/detokenize` and `/version`, in OpenAI's error format as
vLLM answers them; and vLLM's `/tokenize` bodies (`vllm_tokenize`), which TGI's `/tokenize`
route (`switchyard.routes.tgi`) hands here when the body is vLLM's."""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Router, get, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from switchyard import __version__, openapi
from switchyard.errors import ApiError, validation_error
from switchyard.openai_mapping.plans import chat_prompt
from switchyard.protocol import openai as oai
from switchyard.protocol import vllm
from switchyard.routes.auth import require_api_key
from switchyard.routes.content_type import require_json
from switchyard.routes.errors import openai_exception_handlers
from switchyard.state import Gateway
from switchyard.tools.openai import tool_setup


@post("/detokenize", status_code=200, summary="vLLM: token ids to text", tags=["vLLM"],
      guards=[require_api_key, require_json],
      **openapi.documented("openai", ok=vllm.DetokenizeResponse, errors=(400, 401, 404)))
async def detokenize(gw: NamedDependency[Gateway],
                     data: JSONBody[vllm.DetokenizeRequest]) -> vllm.DetokenizeResponse:
    """The text of `tokens` (special tokens included), as the model's tokenizer decodes it."""
    model = gw.model(data.model)
    vocab = model.info.vocab_size
    bad = [t for t in data.tokens if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"Invalid 'tokens': token id {bad[0]} is outside the vocabulary "
                            f"(ids 0 to {vocab - 1}).", "validation", param="tokens")
    return vllm.DetokenizeResponse(prompt=model.tokenizer.decode(data.tokens,
                                                                 skip_special_tokens=False))


@get("/version", summary="vLLM: server version", tags=["vLLM"],
     **openapi.documented("openai", ok=vllm.VersionResponse))
async def version() -> vllm.VersionResponse:
    """The server's version (vLLM's `/version`)."""
    return vllm.VersionResponse(version=__version__)


def decode_body(body: bytes, kind: type[Any]) -> Any:
    """``body`` read as ``kind``; a body that is not one is a 422 naming the field (the
    `/tokenize` route decodes its own body: two APIs share it)."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise validation_error(str(exc)) from None
    except msgspec.DecodeError:
        raise ApiError(400, "Input validation error: JSON is malformed", "validation") from None


def vllm_tokenize(gw: Gateway, body: bytes, shape: vllm.TokenizeShape) -> vllm.TokenizeResponse:
    """vLLM's `/tokenize`: a prompt's tokens (with BOS, as a completion's), or a chat's
    (templated as `/v1/chat/completions` renders it)."""
    if shape.messages is not msgspec.UNSET:
        chat = decode_body(body, vllm.TokenizeChatRequest)
        model = gw.model(chat.model)
        req = oai.ChatCompletionRequest(
            messages=chat.messages, tools=chat.tools,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
            chat_template_kwargs=chat.chat_template_kwargs)
        text = chat_prompt(model, req, tool_setup(model, req))
        ids = model.tokenizer.encode(text, chat.add_special_tokens)
        want_strs = chat.return_token_strs
    else:
        prompt = decode_body(body, vllm.TokenizeCompletionRequest)
        model = gw.model(prompt.model)
        ids = model.tokenizer.encode(prompt.prompt, prompt.add_special_tokens)
        want_strs = prompt.return_token_strs
    return vllm.TokenizeResponse(
        count=len(ids), max_model_len=model.limits.max_total_tokens, tokens=list(ids),
        # vLLM's token strings are the vocabulary's own (byte-level marks included).
        token_strs=model.tokenizer.hf_tokenizer.convert_ids_to_tokens(list(ids))
        if want_strs else None)


router = Router(path="/", route_handlers=[detokenize, version],
                exception_handlers=openai_exception_handlers())
