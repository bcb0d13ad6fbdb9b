"""Batched next-token choice for rows with different sampling parameters.

One call to :func:`sample` processes the last-token logits of every sequence in
a step at once: penalties, then (for sampled rows) temperature, top-k, top-p and
typical-p in TGI's order, then the choice itself and the log-probabilities. All
results travel to the host in a single ``tolist()`` at the end, so the cost of
leaving the device is paid once per step, not once per sequence.

Log-probabilities follow TGI: a sampled row reports ``log_softmax`` of its fully
processed logits (after temperature and filtering); a greedy row reports
``log_softmax`` of its logits after penalties only (temperature and filters do
not apply to greedy rows).

Reproducibility: every sampled row owns a ``torch.Generator`` seeded from its
request and draws exactly one noise vector per step from it, so its tokens do
not depend on which other rows share the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from switchyard_spec import SamplingParams, TopToken

_NEG_INF = float("-inf")


class RowSampler:
    """Sampling state of one sequence: its parameters, generator and penalty history.

    ``prompt_ids`` seed the repetition-penalty history (CTRL penalises tokens
    seen anywhere in the context); frequency and presence penalties count only
    generated tokens (OpenAI semantics). State tensors exist only when the
    matching penalty is on, so plain requests cost nothing extra.
    """

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        vocab_size: int,
        seed: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.params = params
        self.vocab_size = vocab_size
        self.seed: int | None = None
        self.generator: torch.Generator | None = None
        if params.do_sample:
            # The caller resolves a missing seed so that it can report it.
            if seed is None:
                raise ValueError("a sampled row needs a seed")
            self.seed = seed
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(seed)
        self.seen: torch.Tensor | None = None
        if params.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            ids = [i for i in prompt_ids if 0 <= i < vocab_size]
            if ids:
                self.seen[torch.tensor(ids, device=device)] = True
        self.counts: torch.Tensor | None = None
        if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
            self.counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)

    @property
    def has_penalty(self) -> bool:
        """Whether any penalty changes this row's logits."""
        return self.seen is not None or self.counts is not None

    def record(self, token_id: int) -> None:
        """Add a generated token to the penalty history."""
        if not 0 <= token_id < self.vocab_size:
            return
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


def sample(logits: torch.Tensor, rows: Sequence[RowSampler]) -> list[SampledToken]:
    """Choose the next token of every row of ``logits`` ([rows, vocab]).

    Row ``i`` of ``logits`` belongs to ``rows[i]``. Logits of any float dtype
    are processed in float32. Returns one :class:`SampledToken` per row.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(rows)} rows")
    scores = logits.float()
    vocab = scores.shape[1]
    device = scores.device
    scores = apply_penalties(scores, rows)

    sampled = [i for i, r in enumerate(rows) if r.params.do_sample]
    greedy_ids = scores.argmax(dim=-1)
    final = scores
    chosen = greedy_ids
    if sampled:
        idx = torch.tensor(sampled, device=device)
        warped = warp(scores[idx], [rows[i].params for i in sampled])
        picks = _draw(warped, [rows[i].generator for i in sampled])
        final = scores.index_copy(0, idx, warped)
        chosen = greedy_ids.index_copy(0, idx, picks)

    logprobs = torch.log_softmax(final, dim=-1)
    chosen_lp = logprobs.gather(1, chosen[:, None])
    top_n = min(max(r.params.top_n_tokens for r in rows), vocab)
    parts = [chosen[:, None].double(), chosen_lp.double()]
    if top_n > 0:
        top_lp, top_ids = logprobs.topk(top_n, dim=-1)
        parts += [top_ids.double(), top_lp.double()]
    # The one host transfer of the step: ids are exact in float64.
    table = torch.cat(parts, dim=1).tolist()

    out: list[SampledToken] = []
    for row, values in zip(rows, table, strict=True):
        n = min(row.params.top_n_tokens, top_n)
        tops = tuple(
            TopToken(int(values[2 + j]), values[2 + top_n + j]) for j in range(n)
        )
        out.append(SampledToken(int(values[0]), values[1], tops))
    return out


def apply_penalties(scores: torch.Tensor, rows: Sequence[RowSampler]) -> torch.Tensor:
    """Apply repetition, frequency and presence penalties row by row (batched per kind)."""
    rep = [i for i, r in enumerate(rows) if r.seen is not None]
    if rep:
        idx = torch.tensor(rep, device=scores.device)
        seen = torch.stack([rows[i].seen for i in rep])  # type: ignore[misc]
        pen = scores.new_tensor([rows[i].params.repetition_penalty for i in rep])[:, None]
        sub = scores[idx]
        # CTRL: make seen tokens less likely whatever the sign of their logit.
        penalised = torch.where(sub < 0, sub * pen, sub / pen)
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


def warp(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and typical-p for sampled rows; filtered entries become -inf."""
    device = scores.device
    temps = scores.new_tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
    scores = scores / temps[:, None]
    vocab = scores.shape[1]

    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    ps = [p.top_p for p in params]
    if any(ks) or any(p < 1.0 for p in ps):
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        remove = torch.zeros_like(sorted_scores, dtype=torch.bool)
        if any(ks):
            k = torch.tensor([k if k else vocab for k in ks], device=device)
            kth = sorted_scores.gather(1, (k - 1)[:, None])
            # Compare with the k-th value (not the rank) so ties with it stay, as in transformers.
            remove |= sorted_scores < kth
        if any(p < 1.0 for p in ps):
            top_p = scores.new_tensor(ps)[:, None]
            probs = torch.softmax(sorted_scores.masked_fill(remove, _NEG_INF), dim=-1)
            # Mass strictly before each entry; the first entry is always kept.
            before = probs.cumsum(dim=-1) - probs
            remove |= before >= top_p
        scores = scores.masked_fill(remove.scatter(1, order, remove), _NEG_INF)

    typical = [i for i, p in enumerate(params) if p.typical_p < 1.0]
    if typical:
        idx = torch.tensor(typical, device=device)
        mass = scores.new_tensor([params[i].typical_p for i in typical])
        scores = scores.index_copy(0, idx, _typical(scores[idx], mass))
    return scores


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


def _draw(scores: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Sample one id per row: argmax of p / E with E ~ Exp(1), each row from its own generator."""
    probs = torch.softmax(scores, dim=-1)
    noise = torch.empty_like(probs)
    for i, gen in enumerate(generators):
        noise[i].exponential_(generator=gen)
    # A zero draw would make 0/0 = nan, which argmax treats as the maximum.
    return (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)
