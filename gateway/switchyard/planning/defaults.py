"""Server-side defaults for the sampling fields a request leaves out (vLLM's
`--override-generation-config`).

Agent clients such as the Codex CLI send no `temperature`, so a small model
samples at OpenAI's default of 1, where it writes noise. An operator sets the
defaults the model should run at (e.g. `{"temperature": 0}` or SmolLM2's
recommended `{"temperature": 0.2, "top_p": 0.9}`); a field the request sets
always wins. They apply on the OpenAI routes (chat, completions, Responses);
TGI's routes keep TGI's defaults.
"""

from __future__ import annotations

import msgspec

from switchyard.planning.fields import PlanFields
from switchyard.planning.rules import check_fields


class GenerationDefaults(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The defaults `--override-generation-config` may set (None: OpenAI's own default)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None


def parse_defaults(text: str) -> GenerationDefaults:
    """The flag's JSON object, checked with OpenAI's ranges; ValueError says what is wrong."""
    try:
        defaults = msgspec.json.decode(text.encode() or b"{}", type=GenerationDefaults)
    except msgspec.DecodeError as exc:
        raise ValueError(f"{exc} (keys: "
                         f"{', '.join(GenerationDefaults.__struct_fields__)})") from None
    try:
        check_fields("openai", apply_defaults(PlanFields(), defaults))
    except Exception as exc:  # noqa: BLE001 - an ApiError: its message says the range
        raise ValueError(str(exc)) from None
    return defaults


def apply_defaults(fields: PlanFields, defaults: GenerationDefaults) -> PlanFields:
    """``fields`` with each field the request left out taken from ``defaults``."""
    changes = {name: getattr(defaults, name) for name in defaults.__struct_fields__
               if getattr(defaults, name) is not None and getattr(fields, name) is None}
    if not changes:
        return fields
    if "temperature" in changes:
        changes["do_sample"] = changes["temperature"] != 0.0
    return msgspec.structs.replace(fields, **changes)
