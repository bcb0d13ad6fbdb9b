"""Xeon engines on folders converted from GGUF files, served as the gateway serves them.

:func:`started_as_served` starts an engine with the ``--quantize`` method the
gateway picks for the folder (``--quantize gguf`` where it kept blocks the
engine runs), :func:`greedy_tokens` takes one prompt's greedy tokens, and
:func:`weights_line` finds the start-up log's ``linear weights`` line.
"""

from __future__ import annotations

import re
from pathlib import Path

from switchyard.plugins import PluginHost
from switchyard_spec import EngineConfig
from switchyard_xeon.engine import XeonEngine

from tests.support.engine_requests import Collector, greedy_request, token_ids
from tests.support.xeon_options import TEST_OPTIONS


def started_as_served(folder: Path, dtype: str, quantize: str | None = "detect",
                      **options: str) -> XeonEngine:
    """A started engine on ``folder`` with the method the gateway picks (``detect``), or
    ``quantize``; ``options`` on top of the suite's engine options."""
    host = PluginHost.from_entry_points()
    xeon = host.engines()["xeon"]
    name = host.detect_quantization(None, folder, xeon) if quantize == "detect" else quantize
    engine = XeonEngine(EngineConfig(model_path=str(folder), dtype=dtype, quantize=name,
                                     quantization=host.resolve_quantization(name, xeon),
                                     options={**TEST_OPTIONS, **options}))
    engine.start()
    return engine


def greedy_tokens(engine: XeonEngine, prompt: list[int], new: int) -> list[int]:
    """The engine's greedy tokens for ``prompt`` (``new`` of them, EOS ignored)."""
    sink = Collector()
    engine.submit(greedy_request("r", prompt, new), sink)
    return token_ids(sink.wait("r"))


def weights_line(log: str) -> str:
    """What follows ``linear weights: `` in a start-up log (exactly one such line)."""
    [line] = re.findall(r"linear weights: (.*)", log)
    return line
