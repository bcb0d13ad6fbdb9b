"""Turning an EngineRequest into a GaudiSequence, or saying why it cannot be served.

Requests arrive validated by the gateway, but the engine checks what would
break a whole padded batch (an id outside the vocabulary fails the embedding
lookup for every row) or could never be served under its limits.
"""

from __future__ import annotations

import secrets

from switchyard.engine.sampling import RowSampler
from switchyard.engine.watermark import WatermarkConfig
from switchyard_spec import EngineRequest, EventSink

from switchyard_gaudi.sequence import GaudiSequence
from switchyard_gaudi.warmup_plan import Limits


class Admission:
    """Validates requests against the engine's limits and builds their sequences.

    ``ignore_eos`` is ``TEXT_GENERATION_SERVER_IGNORE_EOS_TOKEN``: every
    sequence then runs to its length limit.
    """

    def __init__(self, limits: Limits, vocab_size: int, ignore_eos: bool = False,
                 watermark: WatermarkConfig | None = None) -> None:
        self.limits = limits
        self.vocab_size = vocab_size
        self.ignore_eos = ignore_eos
        self.watermark = watermark if watermark is not None else WatermarkConfig()

    def build(self, request: EngineRequest, sink: EventSink,
              queued_at: float) -> tuple[GaudiSequence | None, str]:
        """The sequence for ``request`` (queued since ``queued_at``), or None and the reason."""
        prompt = request.prompt_token_ids
        n = len(prompt)
        if n == 0:
            return None, "the prompt is empty"
        if request.stopping.max_new_tokens < 1:
            return None, "max_new_tokens must be at least 1"
        if any(not 0 <= t < self.vocab_size for t in prompt):
            return None, f"prompt has token ids outside the vocabulary (size {self.vocab_size})"
        if n > self.limits.max_input_tokens:
            return None, (f"prompt of {n} tokens is longer than max_input_tokens "
                          f"{self.limits.max_input_tokens}")
        params = request.sampling
        seed = params.seed
        if params.do_sample and seed is None:
            seed = secrets.randbits(63)
        sampler = RowSampler(params, prompt, self.vocab_size, seed=seed,
                             logprobs=request.logprobs, watermark=self.watermark)
        max_length = min(n + request.stopping.max_new_tokens, self.limits.max_total_tokens)
        seq = GaudiSequence(request, sink, sampler, max_length=max_length,
                            ignore_eos=request.stopping.ignore_eos or self.ignore_eos,
                            queued_at=queued_at)
        return seq, ""
