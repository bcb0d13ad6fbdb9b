"""The seed's profiler variables: a torch profiler trace of serving steps, on any device.

With ``PROF_STEP`` > 0, rank 0 (when listed in ``PROF_RANKS``; this engine
runs one rank) records the serving steps after warmup: it skips
``PROF_WAITSTEP`` steps, traces ``PROF_WARMUPSTEP`` more without keeping
them, records ``PROF_STEP`` steps (with operator input shapes when
``PROF_RECORD_SHAPES``) and writes a Chrome/TensorBoard trace into
``PROF_PATH``, as Habana's profiler does with the same variables. On an HPU
it records HPU activity as well as the CPU's.
"""

from __future__ import annotations

import logging
import os

import torch

from switchyard_gaudi.device import Device
from switchyard_gaudi.settings import GaudiSettings

logger = logging.getLogger("switchyard.gaudi")


class StepProfiler:
    """Calls ``step()`` once per engine step; does nothing when profiling is off."""

    def __init__(self, settings: GaudiSettings, device: Device, rank: int = 0) -> None:
        self._prof: torch.profiler.profile | None = None
        self.path = settings.prof_path
        if settings.prof_step <= 0 or rank not in settings.prof_ranks:
            return
        os.makedirs(self.path, exist_ok=True)
        schedule = torch.profiler.schedule(wait=settings.prof_waitstep,
                                           warmup=settings.prof_warmupstep,
                                           active=settings.prof_step, repeat=1)
        self._prof = torch.profiler.profile(
            activities=device.profiler_activities(), schedule=schedule,
            record_shapes=settings.prof_record_shapes,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.path))
        self._prof.start()
        logger.info("profiling steps %d to %d into %s", settings.prof_waitstep
                    + settings.prof_warmupstep + 1, settings.prof_waitstep
                    + settings.prof_warmupstep + settings.prof_step, self.path)

    @property
    def active(self) -> bool:
        """Whether a trace is being recorded or waited for."""
        return self._prof is not None

    def step(self) -> None:
        """Mark the end of one engine step."""
        if self._prof is not None:
            self._prof.step()

    def stop(self) -> None:
        """Stop profiling (writes the trace if its steps were reached)."""
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
