"""The bucketed forward passes: padded inputs in, logits of the real rows out.

:class:`StaticRunner` holds two captured functions, one per phase, each run
only on the shapes of the warmup plan:

- prefill ``[P, S]`` (rows and prompt length padded to their buckets) returns
  the logits of each row's last real token and the final hidden states, from
  which prompt log-probabilities are scored when a request asks;
- decode ``[B, 1]`` over cache rows ``0 .. B - 1`` returns every row's logits.

Padding rows feed token 0: in prefill they write to the cache's scratch row,
in decode to free rows, and their logits are never read. Sampling and
prompt scoring use the shared toolkit (``switchyard_engine``) on the real
rows, outside the captured graphs.

Sharded, every rank holds a runner over its part of the model and its own
cache; rank 0's (the one given a ``group``) sends each device operation
(:meth:`StaticRunner.forward_prefill`, :meth:`~StaticRunner.forward_decode`,
:meth:`~StaticRunner.project` for prompt scores, :meth:`~StaticRunner.move_row`)
to the other ranks before running it, and they run the same method on the
same host tensors.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch
from switchyard_engine.grammar import GrammarSupport, apply_grammars
from switchyard_engine.grammar_rows import GrammarRows
from switchyard_engine.logprobs import prompt_scores
from switchyard_engine.sampling import RowSampler, SampledToken, sample_step
from switchyard_spec import TopToken

from switchyard_gaudi.attention import STEP_KWARG, StepInputs
from switchyard_gaudi.device import Device
from switchyard_gaudi.kv_cache import StaticKVCache
from switchyard_gaudi.sequence import GaudiSequence
from switchyard_gaudi.shard_group import DECODE, MOVE, SCORE
from switchyard_gaudi.shard_group import PREFILL as PREFILL_OP
from switchyard_gaudi.warmup_plan import PREFILL, Shape

if TYPE_CHECKING:
    from switchyard_gaudi.shard_group import ShardGroup

SCORE_CHUNK = 256
"""Prompt positions projected onto the vocabulary at once when scoring a prompt."""


class StaticRunner:
    """Runs a causal LM's bucketed prefill and decode steps against a static cache.

    ``capture_prefill`` is False under ``LIMIT_HPU_GRAPH``: prefill then runs
    uncaptured (eagerly), to save the graphs' memory. ``group`` is set on rank
    0 of a sharded engine: each device operation is sent to the other ranks first.
    """

    def __init__(self, model: torch.nn.Module, cache: StaticKVCache, device: Device,
                 shapes: int, capture_prefill: bool = True,
                 group: ShardGroup | None = None, model_folder: str | None = None) -> None:
        self.model_folder = model_folder
        self.grammar_rows = GrammarRows(lambda: self.model_folder)
        """Constrained decoding for this model, built when the first constrained request
        arrives (or at warmup), from ``model_folder``."""
        """Where the tokenizer is, for constrained decoding (rank 0 only)."""
        """Built when the first constrained request arrives (the toolkit's masking)."""
        self.base = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.cache = cache
        self.device = device
        self.group = group
        self.keep_hidden = False
        """Set on ranks 1 .. N-1: they keep the last prefill's hidden states to project
        the same prompt positions as rank 0 (:meth:`project`)."""
        self.last_hidden: torch.Tensor | None = None
        self._prefill = device.capture(self._prefill_fn, shapes) if capture_prefill \
            else self._prefill_fn
        self._decode = device.capture(self._decode_fn, shapes)

    # ------------------------------------------------------- captured code
    def _prefill_fn(self, ids: torch.Tensor, rows: torch.Tensor,
                    last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._prefill_body({"input_ids": ids}, ids.shape, rows, last)

    def _prefill_body(self, inputs: dict[str, torch.Tensor], shape: torch.Size,
                      rows: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill forward on ``inputs`` (``input_ids``, or ``inputs_embeds`` for a vision
        model) of ``shape`` [P, S, ...]: the last real tokens' logits and the hidden states."""
        batch, length = shape[0], shape[1]
        positions = torch.arange(length, device=rows.device).expand(batch, length)
        step = StepInputs(self.cache, self.device, prefill=True, rows=rows)
        hidden = self.base(**inputs, position_ids=positions, use_cache=False,
                           **{STEP_KWARG: step}).last_hidden_state
        final = hidden[torch.arange(batch, device=rows.device), last]
        return self._head(final), hidden

    def _decode_fn(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        step = StepInputs(self.cache, self.device, prefill=False, positions=positions)
        hidden = self.base(input_ids=ids, position_ids=positions[:, None], use_cache=False,
                           **{STEP_KWARG: step}).last_hidden_state
        return self._head(hidden[:, 0])

    def _head(self, rows: torch.Tensor) -> torch.Tensor:
        """The LM head over ``rows`` [N, hidden], given as [1, N, hidden]: DeepSpeed's split
        head slices its input along the last dimension of a [batch, seq, hidden] tensor."""
        return self.head(rows[None])[0]

    # ----------------------------------------------------------- the steps
    def prefill(self, seqs: Sequence[GaudiSequence], shape: Shape) -> list[SampledToken]:
        """Prefill ``seqs`` (their ``row`` set) padded to ``shape``; sample their first tokens.

        Prompt log-probabilities of the sequences that ask are appended to
        their ``prompt_logprobs`` / ``prompt_top_tokens``.
        """
        ids = torch.zeros(shape.batch, shape.length, dtype=torch.long)
        rows = torch.full((shape.batch,), self.cache.scratch_row, dtype=torch.long)
        last = torch.zeros(shape.batch, dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids[i, : seq.prompt_len] = torch.tensor(seq.request.prompt_token_ids)
            rows[i] = seq.row
            last[i] = seq.prompt_len - 1
        logits, hidden, failed = self.run_prefill(seqs, ids, rows, last)
        carry, scored = self._score_prompts(seqs, hidden)
        rows = logits[: len(seqs)]
        samplers = [s.sampler for s in seqs]
        errors = self._constrain(seqs, rows, samplers)
        result = sample_step(rows, samplers, carry)
        if scored:
            _store_prompt_scores(scored, result.carried)
        if any(failed):
            errors = [f or e for f, e in zip(failed, errors or [None] * len(seqs), strict=True)]
        return _with_errors(result.tokens, errors)

    def run_prefill(self, seqs: Sequence[GaudiSequence], ids: torch.Tensor, rows: torch.Tensor,
                    last: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, list[str | None]]:
        """The padded prefill's logits and hidden states, and per sequence the error that
        ends it alone (none here; a vision model's image that cannot be encoded)."""
        logits, hidden = self.forward_prefill(ids, rows, last)
        return logits, hidden, [None] * len(seqs)

    def decode(self, seqs: Sequence[GaudiSequence], shape: Shape) -> list[SampledToken]:
        """One decode step over cache rows ``0 .. shape.batch - 1``: the next token of ``seqs``."""
        ids = torch.zeros(shape.batch, 1, dtype=torch.long)
        positions = torch.zeros(shape.batch, dtype=torch.long)
        for seq in seqs:
            ids[seq.row, 0] = seq.tokens[-1]
            positions[seq.row] = len(seq.tokens) - 1
        logits = self.forward_decode(ids, positions)
        picked = torch.tensor([seq.row for seq in seqs], device=logits.device)
        rows = logits.index_select(0, picked)
        samplers = [s.sampler for s in seqs]
        errors = self._constrain(seqs, rows, samplers)
        return _with_errors(sample_step(rows, samplers).tokens, errors)

    def _constrain(self, seqs: Sequence[GaudiSequence], logits: torch.Tensor,
                   samplers: list[RowSampler]) -> list[str | None]:
        """Mask the constrained rows of ``logits`` in place (before any other logit processing);
        per row, the error that ends it alone (its grammar failed), else None."""
        if all(seq.request.constraint is None for seq in seqs):
            return []
        for seq in seqs:
            self.grammar_rows.start(seq)
        return apply_grammars(self.grammar, logits, samplers)

    @property
    def grammar(self) -> GrammarSupport | None:
        """The model's grammar support, once the first constrained request built it."""
        return self.grammar_rows.support

    def warm(self, shape: Shape) -> None:
        """Run ``shape`` once on padding alone (padding rows write only to free rows)."""
        ids = torch.zeros(shape.batch, shape.length if shape.phase == PREFILL else 1,
                          dtype=torch.long)
        zeros = torch.zeros(shape.batch, dtype=torch.long)
        if shape.phase == PREFILL:
            rows = torch.full_like(zeros, self.cache.scratch_row)
            self.forward_prefill(ids, rows, zeros)
        else:
            self.forward_decode(ids, zeros)

    # ------------------------------------------- device operations (every rank)
    def forward_prefill(self, ids: torch.Tensor, rows: torch.Tensor,
                        last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured prefill on host tensors ``ids`` [P, S], ``rows`` [P], ``last`` [P]."""
        with self._lockstep(PREFILL_OP, ids, rows, last):
            dev = self.device.torch_device
            self.device.mark_step()
            logits, hidden = self._prefill(ids.to(dev), rows.to(dev), last.to(dev))
            self.device.mark_step()
        if self.keep_hidden:
            self.last_hidden = hidden
        return logits, hidden

    def forward_decode(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The captured decode on host tensors ``ids`` [B, 1] and ``positions`` [B]."""
        with self._lockstep(DECODE, ids, positions):
            dev = self.device.torch_device
            self.device.mark_step()
            logits = self._decode(ids.to(dev), positions.to(dev))
            self.device.mark_step()
        return logits

    def project(self, hidden: torch.Tensor, row: int, start: int, end: int) -> torch.Tensor:
        """Logits of ``hidden[row, start:end]``, for prompt scores (the LM head is split too)."""
        with self._lockstep(SCORE, row, start, end):
            logits = self._head(hidden[row, start:end])
        return logits

    def move_row(self, src: int, dst: int, columns: int) -> None:
        """Move a sequence's first ``columns`` cached tokens from row ``src`` to row ``dst``."""
        with self._lockstep(MOVE, src, dst, columns):
            self.cache.move(src, dst, columns)

    def _lockstep(self, op: str, *args: object) -> AbstractContextManager[None]:
        """Sharded rank 0: send the op to the other ranks, then run it (see ShardGroup.step)."""
        return self.group.step(op, *args) if self.group is not None else nullcontext()

    # ------------------------------------------------------ prompt scores
    def _score_prompts(self, seqs: Sequence[GaudiSequence], hidden: torch.Tensor
                       ) -> tuple[torch.Tensor | None, list[tuple[GaudiSequence, int, int]]]:
        """Score the prompts that ask, as one flat tensor for the step's one host transfer.

        Position ``p``'s logits score prompt token ``p + 1``, over the raw logits
        (no sampling parameter), so a prompt of n tokens has n - 1 scores.
        Returns the tensor (per sequence: its log-probs, then ``top_n`` ids and
        values per position) and, per scored sequence, (sequence, scores, top_n).
        """
        parts: list[torch.Tensor] = []
        scored = []
        for i, seq in enumerate(seqs):
            n = seq.prompt_len - 1
            if not seq.request.prompt_logprobs or n < 1:
                continue
            top_n = seq.request.sampling.top_n_tokens
            targets = torch.tensor(seq.request.prompt_token_ids[1:], device=hidden.device)
            chunks = [prompt_scores(self.project(hidden, i, a, min(a + SCORE_CHUNK, n)),
                                    targets[a : a + SCORE_CHUNK], top_n=top_n)
                      for a in range(0, n, SCORE_CHUNK)]
            top_n = chunks[0].top_ids.shape[1]
            parts += [torch.cat([c.logprobs for c in chunks]).double(),
                      torch.cat([c.top_ids for c in chunks]).flatten().double(),
                      torch.cat([c.top_logprobs for c in chunks]).flatten().double()]
            scored.append((seq, n, top_n))
        return (torch.cat(parts) if parts else None), scored


def _with_errors(tokens: list[SampledToken], errors: list[str | None]) -> list[SampledToken]:
    """Rows whose grammar failed become tokens that carry the error (the engine ends them)."""
    if not any(errors):
        return tokens
    return [tok if e is None else SampledToken(-1, 0.0, error=e)
            for tok, e in zip(tokens, errors, strict=True)]


def _store_prompt_scores(scored: list[tuple[GaudiSequence, int, int]],
                         carried: list[float]) -> None:
    """Hand each scored sequence its part of the carried values (see ``_score_prompts``)."""
    at = 0
    for seq, n, top_n in scored:
        seq.prompt_logprobs = carried[at : at + n]
        ids = carried[at + n : at + n + n * top_n]
        values = carried[at + n + n * top_n : at + n + 2 * n * top_n]
        seq.prompt_top_tokens = [
            tuple(TopToken(int(ids[p * top_n + j]), values[p * top_n + j]) for j in range(top_n))
            for p in range(n)] if top_n else []
        at += n + 2 * n * top_n
