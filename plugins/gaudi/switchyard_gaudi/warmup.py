"""Running the warmup plan: every shape once, with a progress bar and an ETA.

Each shape's first run compiles its graph (an HPU graph, or torch.compile on
the CPU); after it, serving meets only shapes already compiled. With
``WARMUP_ENABLED=false`` nothing runs (the plan was still enumerated and its
memory checked at start-up), and each shape compiles on first use instead.
"""

from __future__ import annotations

import logging
import sys
import time

from tqdm import tqdm

from switchyard_gaudi.device import Device
from switchyard_gaudi.runner import StaticRunner
from switchyard_gaudi.warmup_plan import WarmupPlan

logger = logging.getLogger("switchyard.gaudi")


def run_warmup(plan: WarmupPlan, runner: StaticRunner, device: Device | None,
               enabled: bool = True) -> float:
    """Run every shape of ``plan`` once (largest memory first); return the seconds taken."""
    begin = time.perf_counter()
    if not enabled:
        logger.info("gaudi warmup skipped (WARMUP_ENABLED=false): %d shapes will compile on "
                    "first use", len(plan.shapes))
        return 0.0
    compiled = device.compiles if device is not None else 0
    # The largest shape first: if memory runs out, it does so at once, not after minutes.
    order = sorted(plan.shapes, key=lambda s: -s.batch * s.length)
    bar = tqdm(order, desc="gaudi warmup", unit="shape", file=sys.stderr, mininterval=1.0,
               disable=False)
    for shape in bar:
        bar.set_postfix_str(str(shape), refresh=False)
        runner.warm(shape)
    seconds = time.perf_counter() - begin
    graphs = (device.compiles - compiled) if device is not None else 0
    logger.info("gaudi warmup: %d shapes in %.1fs (%d graphs compiled); max batch total "
                "tokens %d", len(plan.shapes), seconds, graphs,
                plan.limits.max_batch_size * plan.limits.max_total_tokens)
    return seconds
