"""Batched next-token choice for rows with different sampling parameters.

One call to :func:`sample` processes the last-token logits of every sequence in
a step at once, in this order:

1. ``logit_bias``: fixed per-token offsets on the raw logits (OpenAI semantics),
2. the watermark: ``delta`` on the previous token's green list (TGI applies it
   before everything else it does, see :mod:`switchyard_engine.watermark`),
3. repetition, frequency and presence penalties,
4. ``min_new_tokens``: while a row has generated fewer tokens than its
   ``StoppingParams.min_new_tokens``, its EOS ids go to -inf (transformers'
   ``MinNewTokensLengthLogitsProcessor``), unless that would leave the row no
   finite logit at all (a grammar that allows only EOS): then the grammar wins
   and the row is left as it was (:func:`apply_eos_holds`),
5. for sampled rows only: temperature, top-k, top-p, min-p and typical-p (TGI's order,
   min-p where transformers puts it),

then the choice itself and the log-probabilities. All results travel to the
host in a single ``tolist()`` at the end, so the cost of leaving the device is
paid once per step, not once per sequence; :func:`sample_step` lets an engine
put other per-step values (prompt log-probs) on the same transfer.

Log-probabilities follow TGI: a sampled row reports ``log_softmax`` of its fully
processed logits (after temperature and filtering); a greedy row reports
``log_softmax`` of its logits after steps 1-4 only (temperature and filters do
not apply to greedy rows). Either way they are of the distribution the token
was chosen from: a logit bias shows in them, and a held EOS has -inf. When no
row of a step wants log-probabilities or alternatives, they are not computed
at all and reported as 0.0.

Top-k and top-p look at each row's few hundred best candidates, not its whole
vocabulary (:mod:`switchyard_engine.topk_filter`), with the same kept tokens as
a full sort.

Reproducibility: every sampled row owns a ``torch.Generator`` seeded from its
request and draws exactly one uniform per step from it, which picks its token
by inverse CDF over its kept probabilities, so its tokens do not depend on which
other rows share the batch. The watermark never draws from that generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from switchyard_spec import SamplingParams, TopToken

from switchyard_engine.inverse_cdf import inverse_cdf
from switchyard_engine.topk_filter import Filtered, filter_candidates
from switchyard_engine.watermark import WatermarkConfig, apply_watermark


class TokenAcceptor(Protocol):
    """What a sampler needs of a constrained row's grammar: to be told each token it
    emits (``switchyard_engine.grammar.GrammarState`` is one). Declared here so that
    the grammar module depends on sampling and not the other way round."""

    def accept(self, token_id: int) -> None:
        """Advance past ``token_id``."""
        ...

_NEG_INF = float("-inf")


class RowSampler:
    """Sampling state of one sequence: its parameters, generator and token history.

    ``prompt_ids`` seed the repetition-penalty history (CTRL penalises tokens
    seen anywhere in the context) and the watermark's previous token;
    frequency and presence penalties count only generated tokens (OpenAI
    semantics). State tensors exist only when the matching feature is on, so
    plain requests cost nothing extra. ``logprobs=False`` says the caller does
    not need the chosen token's log-probability. ``watermark`` overrides the
    environment's watermark settings for a row that asks for one.
    ``min_new_tokens`` and ``eos_token_ids`` are the request's
    ``StoppingParams``: the EOS ids are held at -inf until :meth:`record` has
    seen that many tokens (see :func:`apply_eos_holds`).
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        vocab_size: int,
        seed: int | None = None,
        device: torch.device | str = "cpu",
        logprobs: bool = True,
        watermark: WatermarkConfig | None = None,
        min_new_tokens: int = 0,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.logprobs = logprobs
        self.seed: int | None = None
        self.generator: torch.Generator | None = None
        if params.do_sample:
            # The caller resolves a missing seed so that it can report it.
            if seed is None:
                raise ValueError("a sampled row needs a seed")
            self.seed = seed
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)
        self.previous_token = int(prompt_ids[-1]) if len(prompt_ids) else 0
        """The last token of the context: it seeds the watermark's green list."""
        self.watermark: WatermarkConfig | None = None
        if params.watermark:
            self.watermark = watermark if watermark is not None else WatermarkConfig.from_env()
        self.bias_ids: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None
        pairs = [(int(t), float(b)) for t, b in params.logit_bias if 0 <= t < vocab_size]
        if pairs:
            self.bias_ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=device)
            self.bias_values = torch.tensor([b for _, b in pairs], dtype=torch.float32,
                                            device=device)
        self.seen: torch.Tensor | None = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            ids = [i for i in prompt_ids if 0 <= i < vocab_size]
            if ids:
                self.seen[torch.tensor(ids, device=device)] = True
        self.counts: torch.Tensor | None = None
        if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        self.generated = 0
        """Tokens recorded so far (:meth:`record`)."""
        self.min_new_tokens = min_new_tokens
        self.eos_ids: torch.Tensor | None = None
        """The EOS ids held at -inf while ``generated < min_new_tokens``; None when none are."""
        eos = sorted({int(t) for t in eos_token_ids if 0 <= t < vocab_size})
        if min_new_tokens > 0 and eos:
            self.eos_ids = torch.tensor(eos, dtype=torch.long, device=device)
        self.grammar: TokenAcceptor | None = None
        """The request's grammar (:mod:`switchyard_engine.grammar`), set by the engine
        for a constrained request; :meth:`record` advances it."""

    @property
    def holds_eos(self) -> bool:
        """Whether this row's EOS ids are masked at its next token (``min_new_tokens``)."""
        return self.eos_ids is not None and self.generated < self.min_new_tokens

    @property
    def has_penalty(self) -> bool:
        """Whether any penalty changes this row's logits."""
        return self.seen is not None or self.counts is not None

    def record(self, token_id: int) -> None:
        """Add a generated token to the history (penalties, watermark seed)."""
        if self.grammar is not None:
            self.grammar.accept(token_id)
        self.generated += 1
        if not 0 <= token_id < self.vocab_size:
            return
        self.previous_token = token_id
        if self.seen is not None:
            self.seen[token_id] = True
        if self.counts is not None:
            self.counts[token_id] += 1.0


@dataclass(frozen=True, slots=True)
class SampledToken:
    """The choice for one row: token id, its log-probability and the top alternatives."""

    token_id: int
    logprob: float
    top_tokens: tuple[TopToken, ...] = ()
    error: str | None = None
    """Set when the row could not be served (its grammar failed): the token is to be
    dropped and the sequence ended with this error."""
    more: tuple[SampledToken, ...] = ()
    """Tokens accepted after this one in the same step (speculative decoding), in order:
    the step emits this token, then these."""


@dataclass(frozen=True, slots=True)
class StepSample:
    """What :func:`sample_step` brings back: one choice per row and the carried values."""

    tokens: list[SampledToken]
    carried: list[float]


def sample(logits: torch.Tensor, rows: Sequence[RowSampler]) -> list[SampledToken]:
    """Choose the next token of every row of ``logits`` ([rows, vocab]).

    Row ``i`` of ``logits`` belongs to ``rows[i]``. Logits of any float dtype
    are processed in float32. Returns one :class:`SampledToken` per row.
    """
    return sample_step(logits, rows).tokens


def sample_step(
    logits: torch.Tensor, rows: Sequence[RowSampler], carry: torch.Tensor | None = None
) -> StepSample:
    """:func:`sample`, also bringing the 1-D tensor ``carry`` to the host on the same transfer.

    ``carry`` holds any other float values the step computed on the device
    (prompt log-probabilities); they come back as ``StepSample.carried`` in
    float64, which holds token ids and float32 values exactly.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
    scores = logits.float()
    vocab = scores.shape[1]
    device = scores.device
    scores = apply_logit_bias(scores, rows)
    scores = apply_watermarks(scores, rows)
    scores = apply_penalties(scores, rows)
    scores = apply_eos_holds(scores, rows)

    sampled = [i for i, r in enumerate(rows) if r.params.do_sample]
    final = scores
    if len(sampled) == len(rows):
        # An all-sampled batch (common) skips the greedy argmax and the row shuffles:
        # each of them is a pass over the whole [rows, vocab] tensor.
        warped = _warp(scores, [r.params for r in rows])
        chosen = _draw(warped, [r.generator for r in rows])
        final = warped.scores
    else:
        chosen = scores.argmax(dim=-1)
        if sampled:
            idx = torch.tensor(sampled, device=device)
            warped = _warp(scores[idx], [rows[i].params for i in sampled])
            picks = _draw(warped, [rows[i].generator for i in sampled])
            final = scores.index_copy(0, idx, warped.scores)
            chosen = chosen.index_copy(0, idx, picks)

    top_n = min(max(r.params.top_n_tokens for r in rows), vocab)
    with_logprobs = top_n > 0 or any(r.logprobs for r in rows)
    parts = [chosen[:, None].double()]
    if with_logprobs:
        logprobs = torch.log_softmax(final, dim=-1)
        parts.append(logprobs.gather(1, chosen[:, None]).double())
        if top_n > 0:
            top_lp, top_ids = logprobs.topk(top_n, dim=-1)
            parts += [top_ids.double(), top_lp.double()]
    width = sum(p.shape[1] for p in parts)
    flat = torch.cat(parts, dim=1).flatten()
    if carry is not None:
        flat = torch.cat([flat, carry.to(device=device, dtype=torch.float64).flatten()])
    # The one host transfer of the step: ids are exact in float64.
    values = flat.tolist()

    out: list[SampledToken] = []
    for i, row in enumerate(rows):
        base = i * width
        if not with_logprobs:
            out.append(SampledToken(int(values[base]), 0.0))
            continue
        n = min(row.params.top_n_tokens, top_n)
        tops = tuple(
            TopToken(int(values[base + 2 + j]), values[base + 2 + top_n + j]) for j in range(n)
        )
        out.append(SampledToken(int(values[base]), values[base + 1], tops))
    return StepSample(out, values[len(rows) * width :])


def final_scores(logits: torch.Tensor, row: RowSampler) -> torch.Tensor:
    """One row's scores as :func:`sample_step` ends up with them ([vocab], float32).

    Logit bias, watermark, penalties and EOS holds, then, for a sampled row,
    temperature, top-k/p and typical-p. Their softmax is the distribution the
    row draws from (greedy rows take its argmax), and their log-softmax gives
    the log-probabilities the row reports.
    """
    scores = logits.reshape(1, -1).float()
    scores = apply_eos_holds(apply_penalties(apply_watermarks(
        apply_logit_bias(scores, [row]), [row]), [row]), [row])
    if row.params.do_sample:
        scores = warp(scores, [row.params])
    return scores[0]


def scored_token(final: torch.Tensor, row: RowSampler, token_id: int) -> SampledToken:
    """``token_id`` reported as :func:`sample_step` reports its choice from ``final``
    (:func:`final_scores`): its log-probability and the row's top alternatives."""
    if not row.logprobs and row.params.top_n_tokens <= 0:
        return SampledToken(token_id, 0.0)
    logprobs = torch.log_softmax(final, dim=-1)
    top_n = min(row.params.top_n_tokens, final.shape[0])
    tops: tuple[TopToken, ...] = ()
    if top_n > 0:
        values, ids = logprobs.topk(top_n)
        tops = tuple(TopToken(int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist(),
                                                                 strict=True))
    return SampledToken(token_id, float(logprobs[token_id]), tops)


def apply_logit_bias(scores: torch.Tensor, rows: Sequence[RowSampler]) -> torch.Tensor:
    """Add every row's ``logit_bias`` to its raw logits (one scatter for the batch)."""
    row_idx: list[torch.Tensor] = []
    col_idx: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for i, row in enumerate(rows):
        if row.bias_ids is not None and row.bias_values is not None:
            row_idx.append(torch.full_like(row.bias_ids, i))
            col_idx.append(row.bias_ids)
            values.append(row.bias_values)
    if not values:
        return scores
    index = (torch.cat(row_idx).to(scores.device), torch.cat(col_idx).to(scores.device))
    return scores.index_put(index, torch.cat(values).to(scores.device), accumulate=True)


def apply_watermarks(scores: torch.Tensor, rows: Sequence[RowSampler]) -> torch.Tensor:
    """Bias the green list of every row that asked for a watermark (greedy rows too, as TGI)."""
    marked = [i for i, r in enumerate(rows) if r.watermark is not None]
    if not marked:
        return scores
    idx = torch.tensor(marked, device=scores.device)
    biased = apply_watermark(
        scores[idx],
        [rows[i].previous_token for i in marked],
        [rows[i].watermark for i in marked],  # type: ignore[misc]
    )
    return scores.index_copy(0, idx, biased)


def apply_penalties(scores: torch.Tensor, rows: Sequence[RowSampler]) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties row by row (batched per kind)."""
    rep = [i for i, r in enumerate(rows) if r.seen is not None]
    if rep:
        idx = torch.tensor(rep, device=scores.device)
        seen = torch.stack([rows[i].seen for i in rep])  # type: ignore[misc]
        pen = scores.new_tensor([rows[i].params.repetition_penalty for i in rep])[:, None]
        sub = scores[idx]
        # CTRL: make seen tokens less likely whatever the sign of their logit.
        # A tiny penalty (any value > 0 is valid) divides a logit past float32's
        # range: inf would make log_softmax NaN, so the largest finite value
        # stands in. Only these rows can overflow: a pass over the whole
        # [rows, vocab] tensor cost ~1 ms a step at 32 rows.
        divided = (sub / pen).clamp(max=torch.finfo(sub.dtype).max)
        penalised = torch.where(sub < 0, sub * pen, divided)
        scores = scores.index_copy(0, idx, torch.where(seen, penalised, sub))
    freq = [i for i, r in enumerate(rows) if r.counts is not None]
    if freq:
        idx = torch.tensor(freq, device=scores.device)
        counts = torch.stack([rows[i].counts for i in freq])  # type: ignore[misc]
        f = scores.new_tensor([rows[i].params.frequency_penalty for i in freq])[:, None]
        p = scores.new_tensor([rows[i].params.presence_penalty for i in freq])[:, None]
        delta = counts * f + (counts > 0).float() * p
        scores = scores.index_copy(0, idx, scores[idx] - delta)
    return scores


def apply_eos_holds(scores: torch.Tensor, rows: Sequence[RowSampler]) -> torch.Tensor:
    """Set the EOS ids of every row still short of its ``min_new_tokens`` to -inf.

    A row where that would leave no finite logit (its grammar, applied before,
    allows only EOS) keeps its logits: the grammar wins, and the sequence ends
    on EOS short of ``min_new_tokens`` rather than on a token the grammar
    forbids or on NaN. Rows not held cost nothing; held rows cost one pass over
    their own logits, without a host sync.
    """
    held = [i for i, r in enumerate(rows) if r.holds_eos]
    if not held:
        return scores
    device = scores.device
    ids = [rows[i].eos_ids for i in held]
    local = torch.cat([torch.full_like(t, j) for j, t in enumerate(ids)]).to(device)
    cols = torch.cat(ids).to(device)  # type: ignore[arg-type]
    idx = torch.tensor(held, device=device)
    sub = scores[idx]
    masked = sub.index_put((local, cols), sub.new_tensor(_NEG_INF))
    # False where nothing finite is left (and for a NaN row): keep those as they were.
    alive = masked.amax(dim=-1, keepdim=True) > _NEG_INF
    return scores.index_copy(0, idx, torch.where(alive, masked, sub))


def warp(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p and typical-p for sampled rows; filtered entries
    become -inf."""
    return _warp(scores, params).scores


@dataclass(frozen=True, slots=True)
class _Warped:
    """What :func:`_warp` hands to :func:`_draw`.

    ``scores`` ([n, vocab]) are the fully processed scores. ``filtered`` holds
    the candidate lists of the rows listed in ``filtered_rows`` (those with top-k
    or top-p); min-p or typical-p changed the rows in ``rewarped_rows`` after that,
    so their candidate lists no longer describe what they keep.
    """

    scores: torch.Tensor
    filtered: Filtered | None
    filtered_rows: list[int]
    rewarped_rows: list[int]


def _warp(scores: torch.Tensor, params: Sequence[SamplingParams]) -> _Warped:
    """:func:`warp`, keeping the candidate lists that let :func:`_draw` skip the vocabulary."""
    device = scores.device
    finfo = torch.finfo(scores.dtype)
    temps = scores.new_tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
    # In float32 a tiny temperature is 0 and a huge one inf; clamped, they stay usable.
    temps = temps.clamp(min=finfo.tiny, max=finfo.max)[:, None]
    top = scores.amax(dim=-1, keepdim=True)
    scaled = scores / temps
    # Division rounds monotonically, so a row overflows exactly when its maximum does.
    overflow = torch.isposinf(top / temps)
    if overflow.any():
        # inf would become inf - inf = NaN in softmax. Such a row is divided after its
        # maximum is subtracted (the same distribution): the maximum stays at 0 and the
        # rest goes to -inf, which is greedy, the limit of a tiny temperature.
        shifted = (scores - top) / temps
        scaled = torch.where(overflow, shifted, scaled)
    scores = scaled
    vocab = scores.shape[1]

    filtered: Filtered | None = None
    rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab or p.top_p < 1.0]
    if len(rows) == len(params):
        filtered = filter_candidates(scores, [p.top_k for p in params],
                                     [p.top_p for p in params])
        scores = filtered.scores
    elif rows:
        idx = torch.tensor(rows, device=device)
        filtered = filter_candidates(scores[idx], [params[i].top_k for i in rows],
                                     [params[i].top_p for i in rows])
        scores = scores.index_copy(0, idx, filtered.scores)

    min_p = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if min_p:
        idx = torch.tensor(min_p, device=device)
        ratio = scores.new_tensor([params[i].min_p for i in min_p])
        scores = scores.index_copy(0, idx, _min_p(scores[idx], ratio))
    typical = [i for i, p in enumerate(params) if p.typical_p < 1.0]
    if typical:
        idx = torch.tensor(typical, device=device)
        mass = scores.new_tensor([params[i].typical_p for i in typical])
        scores = scores.index_copy(0, idx, _typical(scores[idx], mass))
    return _Warped(scores, filtered, rows, sorted(set(min_p) | set(typical)))


def _min_p(scores: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """Min-p: drop tokens whose probability is below ``ratio`` times the row's largest
    (transformers' ``MinPLogitsWarper``, which always keeps the most likely token)."""
    probs = torch.softmax(scores, dim=-1)
    drop = probs < ratio[:, None] * probs.amax(dim=-1, keepdim=True)
    return scores.masked_fill(drop, _NEG_INF)


def _typical(scores: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling: keep tokens whose surprise is closest to the entropy."""
    logp = torch.log_softmax(scores, dim=-1)
    p = logp.exp()
    entropy = -(logp * p).nan_to_num().sum(dim=-1, keepdim=True)
    shift = (-logp - entropy).abs()
    sorted_shift, order = shift.sort(dim=-1)
    cum = p.gather(1, order).cumsum(dim=-1)
    last = (cum < mass[:, None]).sum(dim=-1, keepdim=True).clamp(max=scores.shape[1] - 1)
    remove_sorted = sorted_shift > sorted_shift.gather(1, last)
    return scores.masked_fill(remove_sorted.scatter(1, order, remove_sorted), _NEG_INF)


def _draw(warped: _Warped, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Sample one id per row by inverse CDF, with one uniform from each row's own generator.

    A row filtered on its candidates draws from their kept probabilities (in
    their canonical order); any other row (no filter, min-p, typical-p, refiltered
    exactly) from the softmax of its whole processed row. Which path a row takes
    depends only on its own scores and parameters, so its token does too.
    """
    scores = warped.scores
    device = scores.device
    n = len(generators)
    # float64: a float32 uniform (24 bits) could never land on a token rarer than 2**-24.
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64,
                              device=g.device if g is not None else "cpu")
                   for g in generators]).to(device)
    picks = torch.zeros(n, dtype=torch.long, device=device)
    f, filtered = warped.filtered, warped.filtered_rows
    # Rows that draw from their whole row, as far as the host knows.
    whole = sorted(set(range(n)).difference(filtered).union(warped.rewarped_rows))
    rest: torch.Tensor | None = None
    if f is not None:
        idx = torch.tensor(filtered, device=device)
        at = inverse_cdf(torch.softmax(f.cand_scores, dim=-1), u[idx])
        picks[idx] = f.cand_ids.gather(1, at[:, None])[:, 0]
        if f.any_exact:
            # Which rows the filter refiltered is known on the device only (one sync).
            mask = torch.zeros(n, dtype=torch.bool, device=device)
            mask[whole] = True
            mask[idx] |= f.exact
            rest = mask.nonzero()[:, 0]
    if rest is None:
        rest = torch.tensor(whole, dtype=torch.long, device=device)
    # Only these rows pay for a cumulative sum over the whole vocabulary.
    if rest.numel() == n:
        picks = inverse_cdf(torch.softmax(scores, dim=-1), u)
    elif rest.numel():
        picks[rest] = inverse_cdf(torch.softmax(scores[rest], dim=-1), u[rest])
    return picks
