"""Turning an EngineRequest into a GaudiSequence, or saying why it cannot be served.

The toolkit's checks (:mod:`switchyard_engine.admission`) first, then this
engine's own limit: a prompt longer than the last prompt bucket.
"""

from __future__ import annotations

from switchyard_engine.admission import make_sampler, request_problem
from switchyard_engine.watermark import WatermarkConfig
from switchyard_spec import EngineRequest, EventSink

from switchyard_gaudi.sequence import GaudiSequence
from switchyard_gaudi.warmup_plan import Limits


class Admission:
    """Validates requests against the engine's limits and builds their sequences.

    ``ignore_eos`` is ``TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN``: every
    sequence then runs to its length limit. ``takes_images``: the model is a
    vision-language one whose tower the engine runs; otherwise images are refused.
    """

    def __init__(self, limits: Limits, vocab_size: int, ignore_eos: bool = False,
                 watermark: WatermarkConfig | None = None, takes_images: bool = False) -> None:
        self.limits = limits
        self.vocab_size = vocab_size
        self.ignore_eos = ignore_eos
        self.takes_images = takes_images
        self.watermark = watermark if watermark is not None else WatermarkConfig()

    def build(self, request: EngineRequest, sink: EventSink) -> tuple[GaudiSequence | None, str]:
        """The sequence for ``request``, or None and the reason it cannot be served."""
        problem = request_problem(request, self.vocab_size, self.takes_images)
        if problem is not None:
            return None, problem
        n = len(request.prompt_token_ids)
        if n > self.limits.max_input_tokens:
            return None, (f"prompt of {n} tokens is longer than max_input_tokens "
                          f"{self.limits.max_input_tokens}")
        max_length = min(n + request.stopping.max_new_tokens, self.limits.max_total_tokens)
        seq = GaudiSequence(request, sink, make_sampler(request, self.vocab_size, self.watermark),
                            max_length=max_length,
                            ignore_eos=request.stopping.ignore_eos or self.ignore_eos)
        return seq, ""
