"""One forward step: pack the batch, run the model, sample the next tokens (and score prompts).

The runner reads what the scheduler decided (each sequence's ``num_cached``
and ``num_scheduled``, and its block table) and changes nothing but the cache
contents and ``Sequence.prompt_logprobs`` / ``Sequence.prompt_top_tokens``.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch
from switchyard_engine.grammar import GrammarSupport, apply_grammars, model_folder
from switchyard_engine.grammar_rows import GrammarRows
from switchyard_engine.logprobs import prompt_scores
from switchyard_engine.sampling import (
    RowSampler,
    SampledToken,
    final_scores,
    sample_step,
    scored_token,
)
from switchyard_engine.speculation.acceptance import accept_matching, accept_rejection
from switchyard_spec import EngineStartError, TopToken

from switchyard_xeon import alibi_attention
from switchyard_xeon.attention import DecodeRows, LongPrefill, PrefillRows, StepMetadata
from switchyard_xeon.block_manager import BlockManager, blocks_for
from switchyard_xeon.decoder import PackedForward
from switchyard_xeon.kernels import PagedDecodeFn, PagedPrefillFn, load_kernels
from switchyard_xeon.kv_cache import PagedKVCache
from switchyard_xeon.sequence import Sequence

if TYPE_CHECKING:
    from switchyard_xeon.lora import XeonAdapters


def check_supported(model: torch.nn.Module) -> None:
    """Raise EngineStartError unless the architecture can run on the packed path.

    The engine needs transformers' pluggable attention (to reach its cache),
    or an ALiBi model whose attention :mod:`switchyard_xeon.alibi_attention`
    replaced, and ``logits_to_keep`` (to project only last tokens onto the
    vocabulary); its attention does not support attention sinks.
    """
    name = type(model).__name__
    if alibi_attention.installed(model):
        return
    if not getattr(type(model), "_supports_attention_backend", False):
        raise EngineStartError(f"{name} does not use transformers' attention interface")
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        raise EngineStartError(f"{name}.forward does not accept logits_to_keep")
    # The packed attention has none: refuse the model now rather than fail every request.
    if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        raise EngineStartError(f"{name} uses attention sinks, which the engine does not support")


class PackedStep(NamedTuple):
    """One step's packed batch, as a :class:`PackedForward` takes it (see its docstring)."""

    ids: torch.Tensor
    positions: torch.Tensor
    keep: torch.Tensor
    step: StepMetadata


@dataclass
class OutputPlan:
    """Which packed positions reach ``lm_head`` in a step, and what each kept row is for.

    Normally only the last position of each sequence that samples is kept (a
    sequence in the middle of a chunked prefill keeps nothing). A sequence
    whose request asks for prompt log-probs keeps every position it feeds
    while its prompt is being scored: the logits at prompt position ``p``
    score prompt token ``p + 1``. Only those requests pay for [prompt, vocab]
    logits.
    """

    keep: list[int] = field(default_factory=list)
    """Packed positions whose logits are computed, ascending."""
    sample_rows: list[int] = field(default_factory=list)
    """Per sequence that samples this step: the kept row its next token is drawn from."""
    prompt_rows: list[int] = field(default_factory=list)
    """Kept rows scored for prompt log-probs, in sequence order."""
    prompt_targets: list[int] = field(default_factory=list)
    """The prompt token each of ``prompt_rows`` predicts."""
    prompt_counts: list[int] = field(default_factory=list)
    """Per sequence: how many of ``prompt_rows`` are its own."""
    prompt_top_n: list[int] = field(default_factory=list)
    """Per sequence: how many alternatives to report per scored prompt position (0 for a
    sequence that scores nothing this step)."""
    verify_rows: dict[int, range] = field(default_factory=dict)
    """Per sequence (by its index in the step) that fed drafts: the kept rows its newest
    token and each draft are sampled from, in order."""

    @property
    def only_last(self) -> bool:
        """Whether the kept rows are exactly the sampling rows."""
        return not self.prompt_rows and not self.verify_rows

    @property
    def top_n(self) -> int:
        """Alternatives computed per scored row: the most any scoring sequence asks for."""
        return max(self.prompt_top_n, default=0)


def plan_outputs(seqs: Seq[Sequence], offsets: Seq[int]) -> OutputPlan:
    """The :class:`OutputPlan` of a step whose sequence ``i`` starts at packed ``offsets[i]``."""
    plan = OutputPlan()
    for index, (seq, off) in enumerate(zip(seqs, offsets, strict=True)):
        n = seq.num_scheduled
        scored = 0
        if seq.drafts:  # every fed position samples: the newest token's, then each draft's
            base = len(plan.keep)
            plan.keep.extend(range(off, off + n))
            plan.verify_rows[index] = range(base, base + n)
        elif seq.wants_prompt_logprobs:
            # Keep every fed position: position p scores prompt token p + 1, and
            # the last fed one is also the sampling row, so nothing is wasted.
            base = len(plan.keep)
            plan.keep.extend(range(off, off + n))
            scored = min(n, seq.prompt_len - 1 - seq.num_cached)
            plan.prompt_rows.extend(range(base, base + scored))
            first_target = seq.num_cached + 1
            plan.prompt_targets.extend(seq.tokens[first_target : first_target + scored])
            if seq.samples:
                plan.sample_rows.append(len(plan.keep) - 1)
        elif seq.samples:
            plan.keep.append(off + n - 1)
            plan.sample_rows.append(len(plan.keep) - 1)
        plan.prompt_counts.append(scored)
        plan.prompt_top_n.append(seq.prompt_top_n if scored else 0)
    return plan


def _store_prompt_scores(seqs: Seq[Sequence], plan: OutputPlan, carried: list[float],
                         top_n: int) -> None:
    """Append each sequence's share of the step's prompt scores to it.

    ``carried`` is laid out as the runner packed it: one log-prob per scored
    row, then ``top_n`` ids per row, then ``top_n`` log-probs per row.
    """
    scored = len(plan.prompt_rows)
    ids_at, values_at = scored, scored + scored * top_n
    taken = 0
    for seq, count, own in zip(seqs, plan.prompt_counts, plan.prompt_top_n, strict=True):
        if not count:
            continue
        seq.prompt_logprobs.extend(carried[taken : taken + count])
        own = min(own, top_n)
        for row in range(taken, taken + count) if own else ():
            base = row * top_n
            seq.prompt_top_tokens.append(tuple(
                TopToken(int(carried[ids_at + base + j]), carried[values_at + base + j])
                for j in range(own)))
        taken += count


def _verify(seq: Sequence, rows: torch.Tensor) -> SampledToken:
    """The tokens a verifying step emits for ``seq``: the first, with the rest in
    ``SampledToken.more`` (see :func:`_verify_matching` and :func:`_verify_rejection`)."""
    if seq.draft_probs is not None:
        return verify_rejection(seq.sampler, seq.drafts, rows, seq.draft_probs)
    return _verify_matching(seq, rows)


def verify_rejection(sampler: RowSampler, drafts: Seq[int], rows: torch.Tensor,
                     q: torch.Tensor) -> SampledToken:
    """Keep a draft model's ``drafts``, sampled from ``q``, by the rejection rule
    (:func:`~switchyard_engine.speculation.acceptance.accept_rejection`).

    Row ``j``'s target distribution is the request's processing of its logits
    (:func:`~switchyard_engine.sampling.final_scores`) once the tokens kept
    before it are recorded; greedy rows put all of their mass on the argmax,
    so greedy output is the target's own. Each emitted token reports the
    log-probability and alternatives a step without drafts would.
    """
    finals: list[torch.Tensor] = []

    def target(j: int, kept: list[int]) -> torch.Tensor:
        if kept:
            sampler.record(kept[-1])
        final = final_scores(rows[j], sampler)
        finals.append(final)
        if not sampler.params.do_sample:
            return torch.nn.functional.one_hot(final.argmax(), final.shape[0]).double()
        return torch.softmax(final.double(), dim=-1)

    kept = accept_rejection(target, q, drafts, sampler.generator)
    first, *more = [scored_token(final, sampler, token)
                    for final, token in zip(finals, kept, strict=True)]
    return SampledToken(first.token_id, first.logprob, first.top_tokens, more=tuple(more))


def _verify_matching(seq: Sequence, rows: torch.Tensor) -> SampledToken:
    """Sample ``seq``'s newest-token row, then each draft's row while the samples agree
    with the drafts; the first token, with the rest in ``SampledToken.more``.

    Each row is sampled with the sequence's own rules after the sampler has
    recorded the tokens kept before it (penalties and seeds see what a step
    without drafts would); every kept token but the last is recorded here, and
    :func:`~switchyard_xeon.events.record_results` records the last one as it
    emits it.
    """
    picked: list[SampledToken] = []

    def sample(j: int, kept: list[int]) -> int:
        if kept:
            seq.sampler.record(kept[-1])
        token = sample_step(rows[j:j + 1], [seq.sampler]).tokens[0]
        picked.append(token)
        return token.token_id

    accept_matching(seq.drafts, sample)
    first, *more = picked
    return SampledToken(first.token_id, first.logprob, first.top_tokens, more=tuple(more))


class ModelRunner:
    """Runs a causal LM's forward pass over a packed batch against the paged cache.

    ``forward`` is transformers' own or the hand-written decoder (see
    :mod:`switchyard_xeon.decoder`). With a ``decode_kernel`` (see
    :mod:`switchyard_xeon.kernels`), every sequence that feeds one token after
    cached context is attended in one kernel call per layer; without one, each
    sequence takes the SDPA path.
    """

    def __init__(self, forward: PackedForward, cache: PagedKVCache, blocks: BlockManager,
                 decode_kernel: PagedDecodeFn | None = None,
                 prefill_kernel: PagedPrefillFn | None = None,
                 long_prefill: LongPrefill | None = None) -> None:
        self._forward = forward
        self.cache = cache
        self.blocks = blocks
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel
        self.long_prefill = long_prefill if prefill_kernel is not None else None
        """Which sequences leave the prefill kernel for SDPA (None: none do)."""
        self.device = cache.device
        self.adapters: XeonAdapters | None = None
        """The engine's LoRA adapters (:mod:`switchyard_xeon.lora`); None: the model has none."""
        # Constrained decoding for this model, built when the first constrained request
        # arrives (from the folder the model was loaded from); the native kernel, where
        # it loaded, writes the masks in one pass.
        self.grammar_rows = GrammarRows(lambda: model_folder(self._forward),
                                        mask=lambda: load_kernels().token_mask)

    def step(self, seqs: Seq[Sequence]) -> list[SampledToken | None]:
        """Feed every sequence its ``num_scheduled`` tokens; choose the next token where due.

        Returns, per sequence, the sampled token, or None for a sequence whose
        chunk stops short of its last token (it is still prefilling). Prompt
        log-probs are appended to ``Sequence.prompt_logprobs``. Nothing else
        about the sequences changes: the caller commits the step
        (``Scheduler.complete``) once it succeeded.
        """
        offsets = list(itertools.accumulate((s.num_scheduled for s in seqs), initial=0))[:-1]
        plan = plan_outputs(seqs, offsets)
        # A constrained sequence's grammar compiles in a worker during this forward pass.
        constrained = self._start_grammars(seqs)
        logits = self.forward(seqs, plan.keep)
        verified = {i: _verify(seqs[i], logits[rows.start:rows.stop])
                    for i, rows in plan.verify_rows.items()}
        carry = None
        top_n = 0
        if plan.prompt_rows:
            scores = prompt_scores(
                logits,
                torch.tensor(plan.prompt_targets, device=logits.device),
                rows=torch.tensor(plan.prompt_rows, device=logits.device),
                top_n=plan.top_n,
            )
            top_n = scores.top_ids.shape[1]
            # Log-probs, then the alternatives' ids and values, all on the step's one
            # host transfer (float64 holds the ids exactly).
            carry = torch.cat([scores.logprobs.double(), scores.top_ids.flatten().double(),
                               scores.top_logprobs.flatten().double()])
        if not plan.only_last:
            logits = logits[torch.tensor(plan.sample_rows, dtype=torch.long, device=logits.device)]
        samplers = [seq.sampler for seq in seqs if seq.samples and not seq.drafts]
        if samplers:
            errors: list[str | None] = []
            if constrained:
                # Before logit bias, penalties and warping: they choose among allowed tokens.
                errors = apply_grammars(self.grammar, logits, samplers)
            result = sample_step(logits, samplers, carry)
            sampled = result.tokens
            if any(errors):
                sampled = [tok if e is None else SampledToken(-1, 0.0, error=e)
                           for tok, e in zip(sampled, errors, strict=True)]
            tokens, carried = iter(sampled), result.carried
        else:
            tokens, carried = iter(()), (carry.tolist() if carry is not None else [])
        if carry is not None:
            _store_prompt_scores(seqs, plan, carried, top_n)
        return [verified[i] if i in verified else next(tokens) if seq.samples else None
                for i, seq in enumerate(seqs)]

    def _start_grammars(self, seqs: Seq[Sequence]) -> bool:
        """Start compiling the grammar of each constrained sequence seen for the first time.

        Returns whether any sequence of the step is constrained.
        """
        constrained = False
        for seq in seqs:
            if seq.request.constraint is not None:
                constrained = True
                self.grammar_rows.start(seq)
        return constrained

    @property
    def grammar(self) -> GrammarSupport | None:
        """The model's grammar support, once the first constrained request built it."""
        return self.grammar_rows.support

    def forward(self, seqs: Seq[Sequence], keep: Seq[int] | None = None) -> torch.Tensor:
        """Logits at the packed positions ``keep`` ([len(keep), vocab]).

        ``keep`` defaults to each sequence's last position ([len(seqs), vocab]).
        """
        return self._forward(*self.pack(seqs, keep))

    def pack(self, seqs: Seq[Sequence], keep: Seq[int] | None = None) -> PackedStep:
        """The step's packed inputs: what a :class:`PackedForward` takes."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        blocks: list[int] = []
        spans: list[tuple[int, int] | None] = []
        lens: list[int] = []
        context_lens: list[int] = []
        offsets: list[int] = []
        last: list[int] = []
        dec_rows: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        pre_tables: list[list[int]] = []
        pre_lens: list[int] = []
        pre_starts: list[int] = []
        pre_counts: list[int] = []
        by_kernel: list[bool] = []
        size = self.blocks.block_size
        long = self.long_prefill
        for seq in seqs:
            start, n = seq.num_cached, seq.num_scheduled
            off = len(ids)
            last.append(off + n - 1)
            ids.extend(seq.new_tokens)
            positions.extend(range(start, start + n))
            slots.extend(self.blocks.slots(seq.seq_id, start, n))
            if start and (n == 1 or seq.drafts) and self.decode_kernel is not None:
                # A verifying sequence's n positions are n decode rows over one table:
                # each query attends to the cache up to its own position, the rows
                # before it included (every row's keys are stored before attention).
                table = self.blocks.table(seq.seq_id)[: blocks_for(start + n, size)]
                dec_rows.extend(range(off, off + n))
                dec_tables.extend([table] * n)
                dec_lens.extend(range(start + 1, start + n + 1))
                continue
            # The prefill kernel reads its sequences' context in place; SDPA (a long
            # sequence's, or every one's without the kernel) from gathered blocks.
            kernel = self.prefill_kernel is not None and (
                long is None or n * (start + n) < long.pairs)
            if start and not kernel:  # context from earlier steps (or the prefix cache)
                count = blocks_for(start + n, size)
                spans.append((len(blocks), count))
                blocks.extend(self.blocks.table(seq.seq_id)[:count])
            else:
                spans.append(None)
            lens.append(n)
            context_lens.append(start + n)
            offsets.append(off)
            by_kernel.append(kernel)
            if kernel:
                pre_tables.append(self.blocks.table(seq.seq_id)[: blocks_for(start + n, size)])
                pre_lens.append(start + n)
                pre_starts.append(off)
                pre_counts.append(n)
        meta = StepMetadata(
            self.cache, torch.tensor(slots, device=self.device),
            torch.tensor(blocks, dtype=torch.long, device=self.device), spans,
            context_lens, lens, offsets, self._decode_rows(dec_rows, dec_tables, dec_lens, len(ids)),
            self._prefill_rows(pre_tables, pre_lens, pre_starts, pre_counts),
            # Each row's adapter group (None when every row runs the base model).
            self.adapters.step(seqs) if self.adapters is not None else None,
            by_kernel=None if all(by_kernel) else by_kernel,
            sdpa_dtype=long.dtype if long is not None else None,
        )
        if keep is None:
            keep = last
        return PackedStep(
            torch.tensor(ids, device=self.device),
            torch.tensor(positions, device=self.device),
            torch.tensor(keep, dtype=torch.long, device=self.device),
            meta,
        )

    def _prefill_rows(self, tables: list[list[int]], lens: list[int], starts: list[int],
                      counts: list[int]) -> PrefillRows | None:
        """The prefill kernel's inputs for the step's other sequences (tables padded with block 0)."""
        if not tables or self.prefill_kernel is None:
            return None
        width = max(len(t) for t in tables)

        def int32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=self.device)

        return PrefillRows(
            kernel=self.prefill_kernel,
            tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                device=self.device),
            lens=int32(lens), starts=int32(starts), counts=int32(counts),
        )

    def _decode_rows(self, rows: list[int], tables: list[list[int]], lens: list[int],
                     total: int) -> DecodeRows | None:
        """The kernel's inputs for the step's decode rows (tables padded with block 0)."""
        if not rows or self.decode_kernel is None:
            return None
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return DecodeRows(
            kernel=self.decode_kernel,
            rows=None if len(rows) == total else torch.tensor(rows, device=self.device),
            tables=torch.tensor(padded, dtype=torch.int32, device=self.device),
            lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
        )
