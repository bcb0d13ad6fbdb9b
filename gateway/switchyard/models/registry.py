"""Which served model answers a request, by the name in its `model` field.

A name reaches a local model (`ServedModel`, on an engine of this server, in its
process or in one of its own) or a remote one (`RemoteModel`, forwarded to its
replicas); both kinds share one namespace, and the first model of the config
file, of either kind, is the default.
"""

from __future__ import annotations

from switchyard_spec import PoolingTask

from switchyard.errors import ApiError, model_not_found, validation_error
from switchyard.models.pooling import PoolingModel
from switchyard.models.served import ServedModel
from switchyard.remote.model import RemoteModel

AnyModel = ServedModel | RemoteModel
"""What a name resolves to: a model on a local engine, or one other servers serve."""

# Names TGI's own clients send when they mean "whatever is served":
# `huggingface_hub.InferenceClient` sends "dummy" when given a base URL.
PLACEHOLDER_NAMES = frozenset({"tgi", "dummy", ""})


class ModelRegistry:
    """Served models by name; the first one added is the default.

    Models that failed to load keep their names here too (``fail``), so that
    a request for one gets its own 503 with the reason, not a 404.
    """

    def __init__(self) -> None:
        self._by_name: dict[str, AnyModel] = {}
        self._models: list[ServedModel] = []
        self._remotes: list[RemoteModel] = []
        self._all: list[AnyModel] = []
        # Embedding and reranker models: their own routes, the same namespace (TEI
        # replicas, remote models with `api = "tei"`, among them).
        self._pooling: dict[str, PoolingModel | RemoteModel] = {}
        self._pooling_models: list[PoolingModel] = []
        self.failed: dict[str, str] = {}
        """Name of each model that failed to load -> why (aliases included)."""

    def fail(self, names: tuple[str, ...], reason: str) -> None:
        """Record that the model known by ``names`` could not be loaded."""
        for name in names:
            self.failed.setdefault(name, reason)

    def add(self, model: AnyModel) -> None:
        """Serve a model under its name and aliases, and a local one's model id unless taken.

        Two models of a config file may share one folder under two names: the
        id then reaches the first of them.
        """
        if isinstance(model, RemoteModel) and model.pools:  # reached by the pooling routes
            for name in (model.name, *model.aliases):
                if name in self._by_name or name in self._pooling:
                    raise ValueError(f"model name {name!r} is already served")
                self._pooling[name] = model
            self._remotes.append(model)
            return
        for name in (model.name, *model.aliases):
            if name in self._by_name:
                raise ValueError(f"model name {name!r} is already served")
            self._by_name[name] = model
        if isinstance(model, RemoteModel):
            self._remotes.append(model)
        else:
            self._by_name.setdefault(model.model_id, model)
            self._models.append(model)
        self._all.append(model)

    @property
    def default(self) -> AnyModel | None:
        """The model placeholder names and absent names reach."""
        return self._all[0] if self._all else None

    def models(self) -> list[ServedModel]:
        """The local models (on this server's engines), in the order they were added."""
        return list(self._models)

    def remotes(self) -> list[RemoteModel]:
        """The models other servers serve."""
        return list(self._remotes)

    def everything(self) -> list[AnyModel]:
        """Every served model, local or remote, default first."""
        return list(self._all)

    def resolve(self, name: str | None, api: str = "openai") -> AnyModel:
        """The model for a request's `model` field (OpenAI) or model header (TGI, ``api="tgi"``).

        An unknown name is OpenAI's 404 `model_not_found`, or TGI's 422
        validation error; a model that failed to load is a 503 with the reason.
        """
        if name is None or name in PLACEHOLDER_NAMES:
            if self.default is None and self._pooling_models:
                served = ", ".join(f"`{m.name}` ({m.routes})" for m in self._pooling_models)
                raise validation_error(f"no text generation model is served here; this server "
                                       f"serves {served}", param="model")
            if self.default is None:
                raise model_not_found(name or "")
            return self.default
        model = self._by_name.get(name)
        if model is not None:
            return model
        adapted = self.adapter(name)
        if adapted is not None:
            return adapted
        if name in self._pooling:
            raise validation_error(f"Model `{name}` serves {_routes(self._pooling[name])}, "
                                   "not text generation", param="model")
        if name in self.failed:
            raise ApiError(503, f"Model `{name}` is not available: it failed to load: "
                                f"{self.failed[name]}", "unhealthy")
        if api == "tgi":
            listed = [n for m in self._all for n in (m.name, *sorted(m.aliases))]
            raise validation_error(f"Model `{name}` is not served here; served: "
                                   f"{', '.join(listed) or 'none'}", param="model")
        raise model_not_found(name)

    def add_pooling(self, model: PoolingModel) -> None:
        """Serve an embedding or reranker model under its name, aliases and model id."""
        for name in (model.name, *model.aliases):
            if name in self._by_name or name in self._pooling:
                raise ValueError(f"model name {name!r} is already served")
            self._pooling[name] = model
        if model.model_id not in self._by_name:
            self._pooling.setdefault(model.model_id, model)
        self._pooling_models.append(model)

    def pooling_models(self) -> list[PoolingModel]:
        """The embedding and reranker models, in the order they were added."""
        return list(self._pooling_models)

    def resolve_pooling(self, name: str | None, task: PoolingTask, what: str,
                        api: str = "openai") -> PoolingModel | RemoteModel:
        """The pooling model for a request of an embeddings or rerank route (``what`` names
        the route's kind for errors); absent and placeholder names reach the first model of
        the route's ``task``. A TEI replica's model (a remote model with `api = "tei"`)
        is reached by its name only, and forwarded as it is.

        A generation model's name is a 4xx naming what that model serves.
        """
        if name is None or name in PLACEHOLDER_NAMES:
            first = next((m for m in self._pooling_models if m.task is task), None)
            if first is None:
                raise validation_error(f"no {what} model is served here", param="model")
            return first
        model = self._pooling.get(name)
        if model is not None:
            return model
        if name in self._by_name:
            raise validation_error(f"Model `{name}` serves text generation (/v1/chat/completions,"
                                   f" /v1/completions, /generate), not {what}", param="model")
        if name in self.failed:
            raise ApiError(503, f"Model `{name}` is not available: it failed to load: "
                                f"{self.failed[name]}", "unhealthy")
        if api == "tgi":
            raise validation_error(f"Model `{name}` is not served here", param="model")
        raise model_not_found(name)

    def adapter(self, name: str) -> ServedModel | None:
        """The local model serving a LoRA adapter called ``name``, as that adapter; None if none."""
        for model in self._models:
            if name in model.adapters:
                return model.for_adapter(name)
        return None

    def taken(self, name: str) -> bool:
        """Whether ``name`` already reaches a model or an adapter (a new adapter may not take it)."""
        return name in self._by_name or self.adapter(name) is not None


def _routes(model: PoolingModel | RemoteModel) -> str:
    """The routes a pooling model serves, for error messages."""
    if isinstance(model, RemoteModel):
        return "embeddings or reranking on TEI's routes (/embed, /rerank, /v1/embeddings)"
    return model.routes
