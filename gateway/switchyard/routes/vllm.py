"""vLLM's own routes beside OpenAI's: `/detokenize` and `/version` (its `/tokenize` shapes are
served on TGI's route, `switchyard.routes.tgi`, told apart by the body). Errors in OpenAI's
format, as vLLM answers them."""

from __future__ import annotations

from litestar import Router, get, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from switchyard import __version__, openapi
from switchyard.errors import ApiError
from switchyard.protocol import vllm
from switchyard.routes.auth import require_api_key
from switchyard.routes.content_type import require_json
from switchyard.routes.errors import openai_exception_handlers
from switchyard.state import Gateway


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


router = Router(path="/", route_handlers=[detokenize, version],
                exception_handlers=openai_exception_handlers())
