"""The Gaudi engine on the CPU device, as its tests run it: a small config and small bucket grids.

:func:`cpu_config` is a float32 engine config on the CPU device (one thread);
:data:`SMALL_ENV` sets the bucket variables small (prompt buckets of 16, prefill
batches of 2, decode batches of 4) so that warming every shape takes seconds on
two cores.
"""

from __future__ import annotations

from pathlib import Path

from switchyard_spec import EngineConfig

SMALL_ENV = {"PAD_SEQUENCE_TO_MULTIPLE_OF": "16", "PREFILL_BATCH_BUCKET_SIZE": "2",
             "BATCH_BUCKET_SIZE": "4"}
"""The seed's bucket variables, set small: prompts padded to 16s, batches to 2s and 4s."""
CPU_OPTIONS = {"device": "cpu", "num_threads": "1"}
"""The tiny models gain nothing from more threads; on a busy 2-core machine OpenMP
threads waiting at barriers for a descheduled peer make every step slower."""


def cpu_config(model_path: Path | str, options: dict[str, str] | None = None,
               **limits: int) -> EngineConfig:
    """A float32 engine config on the CPU device (96-token sequences, 48-token prompts, 8 rows)."""
    values = {"max_total_tokens": 96, "max_input_tokens": 48, "max_batch_size": 8,
              "max_batch_prefill_tokens": 128, **limits}
    return EngineConfig(model_path=str(model_path), dtype="float32",
                        options={**CPU_OPTIONS, **(options or {})},
                        **values)  # type: ignore[arg-type]
