"""The fallback runner: the model's own attention over a transformers cache per sequence.

For causal LMs that cannot take the paged attention (see
:mod:`switchyard_xeon.model_paths`): ALiBi models (Bloom, MPT), models
whose attention does not go through transformers' attention interface
(StableLM, Falcon), soft-capped or sink attention (Gemma 2, gpt-oss). The
model runs exactly as transformers defines it, with its default attention
implementation; each sequence keeps the cache object its own forward creates
(a ``DynamicCache``, with whatever layer kinds the config asks for), so no
architecture needs code here.

It keeps the engine's continuous batching: the scheduler still decides every
step (who joins, who leaves, prefill chunks within the token budget,
preemption), and this runner feeds each scheduled sequence its tokens in one
forward call of its own, one after the other, then samples every row at once
with the paged runner's code (:meth:`ModelRunner.step` is inherited: the same
:func:`~switchyard_xeon.runner.plan_outputs`, prompt scoring, sampling and
single host transfer). Per-sequence forwards work for every cache kind the
model may create (plain, sliding-window, sink layers) with no code per kind;
``benchmarks/fallback_cost.py`` measured one padded forward over a merged
batch faster for decode rows (docs/xeon.md, "Models and paths"), which is
the next step for this runner.

Accounting: the block manager still holds a table per sequence, sized to
its tokens, but no paged storage backs it; the blocks count the tokens held
in the per-sequence caches, so ``--max-batch-total-tokens`` and the memory
sizing bound them as they bound the paged pool. Prefix caching is off (the
blocks hold nothing to share). A sequence's cache is dropped when the
sequence is (finished or aborted: the loop lets go of it after the step) or
when it no longer holds blocks at the next step (preempted), and rebuilt
from its tokens when it is prefilled again.
"""

from __future__ import annotations

import inspect
import itertools
import weakref
from collections.abc import Sequence as Seq

import torch

from switchyard_xeon.block_manager import BlockManager
from switchyard_xeon.runner import ModelRunner
from switchyard_xeon.sequence import Sequence


class _OwnForward:
    """The runner's ``_forward``: the model, for what reads it (its folder); never called."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, *args: object) -> torch.Tensor:
        raise RuntimeError("the fallback runner has no packed forward pass")


class _NoPagedCache:
    """What :class:`ModelRunner`'s constructor reads of its paged cache: the device only."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)


class FallbackRunner(ModelRunner):
    """A :class:`ModelRunner` whose forward runs ``model`` once per sequence on its own cache.

    ``step`` is the paged runner's; only :meth:`forward` differs. There is no
    paged cache (``cache`` is None) and no attention kernel.
    """

    def __init__(self, model: torch.nn.Module, blocks: BlockManager,
                 device: torch.device | str = "cpu") -> None:
        super().__init__(_OwnForward(model), _NoPagedCache(device), blocks)  # type: ignore[arg-type]
        self.cache = None  # type: ignore[assignment]
        self.model = model
        self._caches: dict[int, object] = {}
        params = inspect.signature(model.forward).parameters
        self._takes_positions = "position_ids" in params
        self._takes_keep = "logits_to_keep" in params
        # transformers 5 names the cache argument and output ``cache``; earlier releases
        # ``past_key_values``.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    @property
    def live_caches(self) -> int:
        """Sequences whose transformers cache is held."""
        return len(self._caches)

    def forward(self, seqs: Seq[Sequence], keep: Seq[int] | None = None) -> torch.Tensor:
        """Logits at the packed positions ``keep`` ([len(keep), vocab]), as the paged runner's.

        Sequence ``i``'s tokens are packed positions ``offsets[i] ..
        offsets[i] + num_scheduled``; ``keep`` defaults to each sequence's last.
        """
        self._drop_released()
        offsets = list(itertools.accumulate((s.num_scheduled for s in seqs), initial=0))
        if keep is None:
            keep = [end - 1 for end in offsets[1:]]
        keep_t = torch.as_tensor(list(keep), dtype=torch.long)
        parts: list[torch.Tensor] = []
        for seq, off, end in zip(seqs, offsets, offsets[1:], strict=False):
            mine = keep_t[(keep_t >= off) & (keep_t < end)] - off
            parts.append(self._run(seq, mine))
        return torch.cat(parts) if parts else torch.empty(0)

    def _run(self, seq: Sequence, rows: torch.Tensor) -> torch.Tensor:
        """Feed ``seq`` its scheduled tokens on its cache; logits at its local ``rows``."""
        start, n = seq.num_cached, seq.num_scheduled
        cache = self._caches.get(seq.seq_id) if start else None
        if start and cache is None:
            raise RuntimeError(f"sequence {seq.request_id} lost its cache after {start} tokens")
        if cache is not None and cache.get_seq_length() != start:
            raise RuntimeError(f"sequence {seq.request_id}: cache holds "
                               f"{cache.get_seq_length()} tokens, the scheduler says {start}")
        kwargs: dict[str, object] = {
            "input_ids": torch.tensor([seq.new_tokens], device=self.device),
            "attention_mask": torch.ones(1, start + n, dtype=torch.long, device=self.device),
            self._cache_arg: cache,
            "use_cache": True,
        }
        if self._takes_positions:
            kwargs["position_ids"] = torch.arange(start, start + n, device=self.device)[None]
        if self._takes_keep:
            # Only the kept rows reach lm_head (none for a chunk short of its prompt's end).
            kwargs["logits_to_keep"] = rows
        out = self.model(**kwargs)
        if cache is None:  # a new cache: forget it when the sequence is gone
            weakref.finalize(seq, self._caches.pop, seq.seq_id, None)
        self._caches[seq.seq_id] = out[self._cache_arg]
        logits = out.logits[0]
        return logits if self._takes_keep else logits[rows]

    def _drop_released(self) -> None:
        """Forget the caches of sequences that hold no blocks any more."""
        for seq_id in [s for s in self._caches if not self.blocks.table(s)]:
            del self._caches[seq_id]
