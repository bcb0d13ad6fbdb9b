"""Checks every engine makes of a request before it runs, and the sampler it gets.

Requests arrive validated by the gateway, but an engine still refuses what
would break a whole batch (a token id outside the vocabulary fails the
embedding lookup for every row) or what no step could serve. Each engine
adds its own limits (prompt buckets, cache capacity) after these.
"""

from __future__ import annotations

import secrets

from switchyard_spec import EngineRequest

from switchyard.engine.sampling import RowSampler
from switchyard.engine.watermark import WatermarkConfig


def request_problem(request: EngineRequest, vocab_size: int) -> str | None:
    """Why no engine can serve ``request`` on a model of ``vocab_size`` tokens, or None."""
    if not request.prompt_token_ids:
        return "the prompt is empty"
    if request.stopping.max_new_tokens < 1:
        return "max_new_tokens must be at least 1"
    if any(not 0 <= t < vocab_size for t in request.prompt_token_ids):
        return f"prompt has token ids outside the vocabulary (size {vocab_size})"
    return None


def make_sampler(request: EngineRequest, vocab_size: int,
                 watermark: WatermarkConfig) -> RowSampler:
    """The request's sampling state; a sampled request without a seed draws one to report."""
    params = request.sampling
    seed = params.seed
    if params.do_sample and seed is None:
        seed = secrets.randbits(63)
    return RowSampler(params, request.prompt_token_ids, vocab_size, seed=seed,
                      logprobs=request.logprobs, watermark=watermark)
