"""Engines in their own processes (`switchyard serve --engine-process`).

`EngineProcess` (in `proxy`) is an `Engine` that runs a plugin's engine in a
child process (`child`) and relays the contract over a socket pair in msgspec
msgpack frames (`wire`). The gateway's side stays what it is for an engine in
its own process: `ServedModel` holds an `Engine`. See docs/routing.md,
"Engine processes".
"""

from __future__ import annotations

from switchyard.engine_process.proxy import EngineProcess
from switchyard.engine_process.wire import parse_cpus

__all__ = ["EngineProcess", "parse_cpus"]
