"""OpenAI routes: `/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/models`.

Requests are mapped onto TGI's parameters and validated by the same rules
(`openai_mapping/plans.py`), then answered in OpenAI's shapes: real ids,
`finish_reason` "stop" for EOS and stop strings, stop text left out, `n`
choices, OpenAI's error objects (in-stream too, followed by `[DONE]`).
The chat and completion handlers live in their own modules; this one
assembles the router.
"""

from __future__ import annotations

from litestar import Router, get
from litestar.di import NamedDependency

from switchyard.models.registry import AnyModel
from switchyard.remote.model import RemoteModel
from switchyard.protocol import openai as oai
from switchyard.routes.errors import openai_exception_handlers
from switchyard.routes.lora import ROUTES as LORA_ROUTES
from switchyard.routes.openai_chat import chat_completions
from switchyard.routes.openai_completions import completions
from switchyard.routes.responses import ROUTES as RESPONSES_ROUTES
from switchyard.state import Gateway


@get("/v1/models", summary="Served models", tags=["OpenAI"])
async def list_models(gw: NamedDependency[Gateway]) -> oai.ModelList:
    """The names clients may put in `model`: each model's name, its aliases, its adapters.

    (The model id a model also answers to is not listed: for a local folder
    it is a path.)
    """
    cards = []
    for m in gw.registry.everything():
        cards += [oai.ModelCard(id=name, created=0, owned_by=_owner(m),
                                input_modalities=_modalities(m))
                  for name in (m.name, *sorted(m.aliases))]
        # Each LoRA adapter is a model of its own, its base named as `parent` (vLLM's lineage).
        adapters = {} if isinstance(m, RemoteModel) else m.adapters
        cards += [oai.ModelCard(id=name, created=0, owned_by=_owner(m),
                                input_modalities=_modalities(m), parent=m.name, root=path)
                  for name, path in sorted(adapters.items())]
    cards += [oai.ModelCard(id=name, created=0, owned_by=m.model_id.split("/")[0],
                            input_modalities=["text"])  # embedding and reranker models
              for m in gw.registry.pooling_models() for name in (m.name, *sorted(m.aliases))]
    return oai.ModelList(data=cards)


def _modalities(model: AnyModel) -> list[str]:
    """`text`, and `image` for a local model whose engine takes images."""
    takes = not isinstance(model, RemoteModel) and model.info.takes_images
    return ["text", "image"] if takes else ["text"]


def _owner(model: AnyModel) -> str:
    # A remote model's replicas are not named to clients (their addresses stay in the logs).
    return "remote" if isinstance(model, RemoteModel) else model.model_id.split("/")[0]


router = Router(
    path="/",
    route_handlers=[chat_completions, completions, list_models, *RESPONSES_ROUTES,
                    *LORA_ROUTES],
    exception_handlers=openai_exception_handlers(),
)
