"""OpenAI routes: `/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/models`.

Requests are read into the plan's fields by each API's adapter
(`openai_mapping/plans.py`), then answered in OpenAI's shapes: real ids,
`finish_reason` "stop" for EOS and stop strings, stop text left out, `n`
choices, OpenAI's error objects (in-stream too, followed by `[DONE]`).
The chat and completion handlers live in their own modules; this one
assembles the router.
"""

from __future__ import annotations

from litestar import Router, get
from litestar.di import NamedDependency
from litestar.params import FromQuery

from switchyard import openapi
from switchyard.models.registry import AnyModel
from switchyard.remote.model import RemoteModel
from switchyard.protocol import openai as oai
from switchyard.routes.errors import openai_exception_handlers
from switchyard.routes.lora import ROUTES as LORA_ROUTES
from switchyard.routes.openai_chat import chat_completions
from switchyard.routes.openai_completions import completions
from switchyard.routes.responses import ROUTES as RESPONSES_ROUTES
from switchyard.state import Gateway


CODEX_INSTRUCTIONS = ("You are a coding assistant working in the user's terminal. Use the "
                      "tools you are given to look at and change files, and answer briefly.")
"""The base instructions the Codex catalog must carry (Codex reads its system prompt from it)."""
CODEX_TOOL_OUTPUT_TOKENS = 10_000
"""Tool output Codex keeps per call (its catalog's `truncation_policy`)."""


def _codex_model(m: AnyModel, name: str) -> oai.CodexModel:
    """A generation model as a Codex catalog entry: its context, no reasoning levels (no
    served model has a reasoning format), function tools through unified exec."""
    context = 0 if isinstance(m, RemoteModel) else m.limits.max_total_tokens
    return oai.CodexModel(
        slug=name, display_name=name, context_window=context, supported_reasoning_levels=[],
        shell_type="unified_exec", visibility="list", supported_in_api=True, priority=0,
        support_verbosity=False,
        truncation_policy=oai.TruncationPolicy(mode="tokens", limit=CODEX_TOOL_OUTPUT_TOKENS),
        experimental_supported_tools=[], base_instructions=CODEX_INSTRUCTIONS,
        input_modalities=_modalities(m), description=f"{name}, served by Switchyard")


@get("/v1/models", summary="Served models", tags=["OpenAI"],
     **openapi.documented("openai", ok=oai.ModelList, errors=(400,)))
async def list_models(gw: NamedDependency[Gateway],
                      client_version: FromQuery[str | None] = None) -> oai.ModelList:
    """The names clients may put in `model`: each model's name, its aliases, its adapters.

    (The model id a model also answers to is not listed: for a local folder
    it is a path.) With `client_version` (the Codex CLI's catalog request) the
    generation models are also listed in Codex's catalog shape, under `models`.
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
    if client_version is None:
        return oai.ModelList(data=cards)
    codex = [_codex_model(m, name) for m in gw.registry.everything()
             for name in (m.name, *sorted(m.aliases))]
    return oai.ModelList(data=cards, models=codex)


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
