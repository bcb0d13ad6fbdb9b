"""Which served model answers a request, by the name in its `model` field."""

from __future__ import annotations

from switchyard.errors import model_not_found
from switchyard.models.served import ServedModel

# Names TGI's own clients send when they mean "whatever is served":
# `huggingface_hub.InferenceClient` sends "dummy" when given a base URL.
PLACEHOLDER_NAMES = frozenset({"tgi", "dummy", ""})


class ModelRegistry:
    """Served models by name; the first one added is the default."""

    def __init__(self) -> None:
        self._by_name: dict[str, ServedModel] = {}
        self._models: list[ServedModel] = []

    def add(self, model: ServedModel) -> None:
        """Serve a model under its name and aliases."""
        for name in (model.name, *model.aliases):
            if name in self._by_name:
                raise ValueError(f"model name {name!r} is already served")
            self._by_name[name] = model
        self._models.append(model)

    @property
    def default(self) -> ServedModel | None:
        """The model placeholder names and absent names reach."""
        return self._models[0] if self._models else None

    def models(self) -> list[ServedModel]:
        """All served models, default first."""
        return list(self._models)

    def resolve(self, name: str | None) -> ServedModel:
        """The model for a request's `model` field; an unknown name is a 404."""
        if name is None or name in PLACEHOLDER_NAMES:
            if self.default is None:
                raise model_not_found(name or "")
            return self.default
        model = self._by_name.get(name)
        if model is None:
            raise model_not_found(name)
        return model
