"""Which served model answers a request, by the name in its `model` field."""

from __future__ import annotations

from switchyard.errors import ApiError, model_not_found, validation_error
from switchyard.models.served import ServedModel

# Names TGI's own clients send when they mean "whatever is served":
# `huggingface_hub.InferenceClient` sends "dummy" when given a base URL.
PLACEHOLDER_NAMES = frozenset({"tgi", "dummy", ""})


class ModelRegistry:
    """Served models by name; the first one added is the default.

    Models that failed to load keep their names here too (``fail``), so that
    a request for one gets its own 503 with the reason, not a 404.
    """

    def __init__(self) -> None:
        self._by_name: dict[str, ServedModel] = {}
        self._models: list[ServedModel] = []
        self.failed: dict[str, str] = {}
        """Name of each model that failed to load -> why (aliases included)."""

    def fail(self, names: tuple[str, ...], reason: str) -> None:
        """Record that the model known by ``names`` could not be loaded."""
        for name in names:
            self.failed.setdefault(name, reason)

    def add(self, model: ServedModel) -> None:
        """Serve a model under its name and aliases, and its model id unless taken.

        Two models of a config file may share one folder under two names: the
        id then reaches the first of them.
        """
        for name in (model.name, *model.aliases):
            if name in self._by_name:
                raise ValueError(f"model name {name!r} is already served")
            self._by_name[name] = model
        self._by_name.setdefault(model.model_id, model)
        self._models.append(model)

    @property
    def default(self) -> ServedModel | None:
        """The model placeholder names and absent names reach."""
        return self._models[0] if self._models else None

    def models(self) -> list[ServedModel]:
        """All served models, default first."""
        return list(self._models)

    def resolve(self, name: str | None, api: str = "openai") -> ServedModel:
        """The model for a request's `model` field (OpenAI) or model header (TGI, ``api="tgi"``).

        An unknown name is OpenAI's 404 `model_not_found`, or TGI's 422
        validation error; a model that failed to load is a 503 with the reason.
        """
        if name is None or name in PLACEHOLDER_NAMES:
            if self.default is None:
                raise model_not_found(name or "")
            return self.default
        model = self._by_name.get(name)
        if model is not None:
            return model
        if name in self.failed:
            raise ApiError(503, f"Model `{name}` is not available: it failed to load: "
                                f"{self.failed[name]}", "unhealthy")
        if api == "tgi":
            listed = [n for m in self._models for n in (m.name, *sorted(m.aliases))]
            raise validation_error(f"Model `{name}` is not served here; served: "
                                   f"{', '.join(listed) or 'none'}", param="model")
        raise model_not_found(name)
