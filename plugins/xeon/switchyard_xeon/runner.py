"""One forward step: pack the batch, run the model, sample the next tokens."""

from __future__ import annotations

import inspect
from collections.abc import Sequence as Seq

import torch

from switchyard.engine.sampling import SampledToken, sample
from switchyard_spec import EngineStartError

from switchyard_xeon.attention import STEP_KWARG, StepMetadata
from switchyard_xeon.kv_cache import KVCache
from switchyard_xeon.scheduler import Sequence


def check_supported(model: torch.nn.Module) -> None:
    """Raise EngineStartError unless the architecture can run on the packed path.

    The engine needs transformers' pluggable attention (to reach its cache)
    and ``logits_to_keep`` (to project only last tokens onto the vocabulary).
    """
    name = type(model).__name__
    if not getattr(type(model), "_supports_attention_backend", False):
        raise EngineStartError(f"{name} does not use transformers' attention interface")
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        raise EngineStartError(f"{name}.forward does not accept logits_to_keep")


class ModelRunner:
    """Runs a transformers causal LM over a packed batch against the engine's cache."""

    def __init__(self, model: torch.nn.Module, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device

    def step(self, seqs: Seq[Sequence]) -> list[SampledToken]:
        """Feed every sequence's new tokens and choose each one's next token.

        On success the fed tokens count as cached. On an exception nothing is
        committed; the caller fails these sequences.
        """
        logits = self.forward(seqs)
        out = sample(logits, [seq.sampler for seq in seqs])
        for seq in seqs:
            seq.num_cached = len(seq.tokens)
            self.cache.commit(seq.seq_id, seq.num_cached)
        return out

    def forward(self, seqs: Seq[Sequence]) -> torch.Tensor:
        """Last-token logits of every sequence, [len(seqs), vocab]."""
        ids: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        for seq in seqs:
            new = seq.new_tokens
            ids.extend(new)
            positions.extend(range(seq.num_cached, seq.num_cached + len(new)))
            starts.append(seq.num_cached)
            lens.append(len(new))
        meta = StepMetadata(self.cache, [s.seq_id for s in seqs], starts, lens)
        last = torch.tensor([o + n - 1 for o, n in zip(meta.offsets, lens)], device=self.device)
        out = self.model(
            input_ids=torch.tensor([ids], device=self.device),
            position_ids=torch.tensor([positions], device=self.device),
            use_cache=False,
            # Only the last position of each sequence reaches lm_head: no [T, vocab] logits.
            logits_to_keep=last,
            **{STEP_KWARG: meta},
        )
        return out.logits[0]
