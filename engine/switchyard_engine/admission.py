"""Checks every engine makes of a request before it runs, and the sampler it gets.

Requests arrive validated by the gateway, but an engine still refuses what
would break a whole batch (a token id outside the vocabulary fails the
embedding lookup for every row) or what no step could serve. Each engine
adds its own limits (prompt buckets, cache capacity) after these.
"""

from __future__ import annotations

import secrets

from switchyard_spec import EngineRequest

from switchyard_engine.sampling import RowSampler
from switchyard_engine.watermark import WatermarkConfig


def request_problem(request: EngineRequest, vocab_size: int,
                    takes_images: bool = False) -> str | None:
    """Why no engine can serve ``request`` on a model of ``vocab_size`` tokens, or None.

    ``takes_images``: the engine runs this model's vision tower (``ModelInfo.takes_images``);
    otherwise a request with images is refused.
    """
    if not request.prompt_token_ids:
        return "the prompt is empty"
    if request.stopping.max_new_tokens < 1:
        return "max_new_tokens must be at least 1"
    if request.stopping.min_new_tokens < 0:
        return "min_new_tokens must not be negative"
    if any(not 0 <= t < vocab_size for t in request.prompt_token_ids):
        return f"prompt has token ids outside the vocabulary (size {vocab_size})"
    if request.images:
        return images_problem(request) if takes_images else "this model takes no images"
    return None


def images_problem(request: EngineRequest) -> str | None:
    """Why ``request.images`` do not fit its prompt (overlapping or outside it, pixel data of
    the wrong size), or None."""
    end = 0
    for image in request.images:
        if image.offset < end or image.length < 1:
            return "images overlap, are out of order or take no tokens"
        end = image.offset + image.length
        if end > len(request.prompt_token_ids):
            return "an image's placeholder tokens run past the prompt"
        count = 1
        for dim in image.shape:
            count *= dim
        if not image.shape or count * 4 != len(image.pixel_values):
            return (f"an image's pixel_values hold {len(image.pixel_values)} bytes, not the "
                    f"float32 values of shape {tuple(image.shape)}")
    return None


def make_sampler(request: EngineRequest, vocab_size: int,
                 watermark: WatermarkConfig) -> RowSampler:
    """The request's sampling state (its ``min_new_tokens`` EOS hold included); a sampled
    request without a seed draws one to report."""
    params = request.sampling
    seed = params.seed
    if params.do_sample and seed is None:
        seed = secrets.randbits(63)
    return RowSampler(params, request.prompt_token_ids, vocab_size, seed=seed,
                      logprobs=request.logprobs, watermark=watermark,
                      min_new_tokens=request.stopping.min_new_tokens,
                      eos_token_ids=request.stopping.eos_token_ids)
