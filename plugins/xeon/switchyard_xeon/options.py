"""Reading the xeon engine's ``--engine-option`` values: numbers and flags, checked.

A value that does not parse or is out of range stops start-up with an
``EngineStartError`` that names the option and the value given.
"""

from __future__ import annotations

from switchyard_spec import EngineStartError


def number(options: dict[str, str], key: str, kind: type[int | float], default: float,
           minimum: float, maximum: float | None = None) -> float:
    """``options[key]`` as a number from ``minimum`` to ``maximum``, or ``default`` when unset."""
    raw = str(options.get(key, "")).strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise EngineStartError(f"xeon option {key}={raw!r} is not a valid {kind.__name__}"
                               ) from None
    if value < minimum:
        raise EngineStartError(f"xeon option {key}={raw!r} must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise EngineStartError(f"xeon option {key}={raw!r} must be at most {maximum}")
    return value


def flag(options: dict[str, str], key: str, default: bool) -> bool:
    """``options[key]`` as a yes/no flag, or ``default`` when unset."""
    raw = str(options.get(key, "")).strip().lower()
    if not raw:
        return default
    if raw not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
        raise EngineStartError(f"xeon option {key}={raw!r} is not a valid flag (true/false)")
    return raw in ("1", "true", "yes", "on")
