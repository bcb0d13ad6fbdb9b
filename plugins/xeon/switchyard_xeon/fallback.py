"""The fallback runner: the model's own attention over transformers' cache, decode rows batched.

For causal LMs that cannot take the paged attention (see
:mod:`switchyard_xeon.model_paths`): ALiBi models (Bloom, MPT), models
whose attention does not go through transformers' attention interface
(StableLM, Falcon), soft-capped or sink attention (Gemma 2, gpt-oss). The
model runs exactly as transformers defines it, with its default attention
implementation and the cache object its own forward creates (a
``DynamicCache``, with whatever layer kinds the config asks for), so no
architecture needs code here.

It keeps the engine's continuous batching: the scheduler still decides every
step (who joins, who leaves, prefill chunks within the token budget,
preemption). Each step:

- **Prefill** (a prompt chunk, a re-prefill after preemption): the sequence
  runs alone, one forward over its chunk on a cache of its own.
- **Decode** (one new token after cached context, the step samples): every
  such sequence runs in *one* forward over a batched cache, left-padded
  (:mod:`switchyard_xeon.padded_cache`): the attention mask hides each row's
  padding, ``position_ids`` give each row its own positions (rotary models),
  and models without them read positions from the mask (Bloom, Falcon's
  ALiBi) or take ALiBi relative to the key column (MPT), which left padding
  keeps exact. A sequence whose prefill ended joins the batch at its first
  decode step (its cache is concatenated in, the narrower side padded on the
  left); a finished, aborted or preempted one is dropped from it at the next
  step (and the columns no remaining row needs are trimmed), or the whole
  batch is let go as soon as its last sequence is.

Then every row is sampled at once with the paged runner's code
(:meth:`ModelRunner.step` is inherited: the same
:func:`~switchyard_xeon.runner.plan_outputs`, prompt scoring, sampling and
single host transfer).

Start-up decides whether decode rows batch (:meth:`FallbackRunner.decode_mode`)
and logs the decision with its reason: only when the model's cache is a
plain ``DynamicCache`` of full and sliding-window layers, its positions are
known to follow ``position_ids`` or the mask, and a two-sequence probe (two
prompts of different lengths prefilled alone, then one padded decode step)
gives the per-sequence forwards' logits. Otherwise (quantized, static or
KV-sharing caches, linear attention, a forward that takes positions from the
cache length alone) each decode row keeps a forward of its own.
``benchmarks/fallback_cost.py`` measures both (docs/xeon.md, "Models and
paths").

Accounting: the block manager still holds a table per sequence, sized to
its tokens, but no paged storage backs it; the blocks count the tokens held
in the caches, so ``--max-batch-total-tokens`` and the memory sizing bound
them as they bound the paged pool. The batch's padding columns are not
counted; they are bounded apart, at :data:`PADDING_SHARE` of the pool (a
sequence whose joining would pass it decodes on its own cache that step).
Prefix caching is off (the blocks hold nothing to share). A preempted
sequence's cache or batch row is dropped and rebuilt from its tokens when
it is prefilled again.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
import weakref
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from switchyard_xeon import padded_cache
from switchyard_xeon.block_manager import BlockManager
from switchyard_xeon.runner import ModelRunner
from switchyard_xeon.sequence import Sequence

logger = logging.getLogger("switchyard.xeon")

POSITIONS_FROM_MASK = {
    "bloom": "ALiBi positions from the attention mask",
    "mpt": "ALiBi relative to the newest key, which left padding keeps",
}
"""Model types whose forward takes no ``position_ids`` but stays exact under left padding."""

PADDING_SHARE = 0.25
"""The most padding (zero columns, beyond the tokens the blocks count) the decode batch may
hold, as a share of the block pool's tokens: a sequence whose joining would pass it (one long
row among short ones pads every short row to its length) decodes on its own cache instead."""

PROBE_TOLERANCE = 1e-3
"""The start-up probe's bound on |padded - per-sequence| logits, relative to the logits'
size (fp32 sums in another order differ by ~1e-6; a position or mask error by far more)."""


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


@dataclass
class _Batch:
    """The decode batch: one left-padded cache, row ``i`` is sequence ``seq_ids[i]``."""

    cache: object
    seq_ids: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    """Tokens each row holds (its padding excluded)."""


@dataclass(frozen=True)
class DecodeMode:
    """How the fallback runs decode rows, and why."""

    padded: bool
    reason: str

    def describe(self) -> str:
        """The start-up log line's text."""
        if self.padded:
            return f"one padded forward over a batched cache per step ({self.reason})"
        return f"one forward per sequence per step ({self.reason})"


class FallbackRunner(ModelRunner):
    """A :class:`ModelRunner` whose forward runs the model on transformers' caches.

    ``step`` is the paged runner's; only :meth:`forward` differs. There is no
    paged cache (``cache`` is None) and no attention kernel. ``padded``
    (default :attr:`padded_decode`) False keeps per-sequence decode forwards.
    """

    padded_decode: bool = True
    """Whether decode rows may batch (the start-up checks still decide); False forces
    per-sequence forwards (the benchmark's comparison)."""

    def __init__(self, model: torch.nn.Module, blocks: BlockManager,
                 device: torch.device | str = "cpu", padded: bool | None = None) -> None:
        super().__init__(_OwnForward(model), _NoPagedCache(device),  # type: ignore[arg-type]
                         blocks)
        self.cache = None  # type: ignore[assignment]
        self.model = model
        self._own: dict[int, object] = {}
        """Per-sequence caches: prefilling sequences, and every sequence when not padded."""
        self._batch: _Batch | None = None
        self._gone: set[int] = set()
        """Sequences let go of (finalized) whose batch row may still be held."""
        self._watched: set[int] = set()
        self._lock = threading.Lock()
        params = inspect.signature(model.forward).parameters
        self._takes_positions = "position_ids" in params
        self._takes_keep = "logits_to_keep" in params
        # transformers 5 names the cache argument and output ``cache``; earlier releases
        # ``past_key_values``.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.padded_steps = 0
        """Decode steps run as one padded forward."""
        self.most_rows = 0
        """The most rows one padded forward has held."""
        self.rows_joined = 0
        """Sequences merged into a batch that already held rows."""
        self.rows_alone = 0
        """Decode rows run on their own because joining would pass the padding budget."""
        self.rows_left = 0
        """Rows taken out of a batch that kept others (finished, aborted, preempted, or
        not decoding that step)."""
        self.mode = self.decode_mode(self.padded_decode if padded is None else padded)
        logger.info("fallback decode: %s", self.mode.describe())

    @property
    def live_caches(self) -> int:
        """Sequences whose cache (own, or a row of the batch) is held."""
        batch = self._batch
        rows = 0 if batch is None else sum(1 for s in batch.seq_ids if s not in self._gone)
        return len(self._own) + rows

    @property
    def batch_rows(self) -> list[int]:
        """The ``seq_id`` of each row of the decode batch (empty when none is held)."""
        batch = self._batch
        return [] if batch is None else list(batch.seq_ids)

    # ------------------------------------------------------------ start-up
    def decode_mode(self, allowed: bool = True) -> DecodeMode:
        """Whether decode rows can batch on this model, and why (runs a probe: see the module)."""
        if not allowed:
            return DecodeMode(False, "padded decode turned off")
        name = type(self.model).__name__
        config = self.model.config
        alibi = getattr(config, "alibi", False)
        if self._takes_positions:
            positions = ("position_ids, ALiBi from the attention mask" if alibi
                         else "position_ids")
        elif config.model_type in POSITIONS_FROM_MASK:
            positions = POSITIONS_FROM_MASK[config.model_type]
        else:
            return DecodeMode(False, f"{name}.forward takes no position_ids and its positions "
                                     "are not known to follow the attention mask")
        try:
            with torch.inference_mode():
                why, kinds = self._probe()
        except Exception as exc:  # any failure keeps the path every model runs
            return DecodeMode(False, f"a padded probe step failed: {type(exc).__name__}: {exc}")
        if why:
            return DecodeMode(False, why)
        return DecodeMode(True, f"left padding; {kinds} cache layers; {positions}; "
                                "a probe step matched per-sequence forwards")

    def _probe(self) -> tuple[str, str]:
        """Two prompts prefilled alone, then a padded decode step against per-sequence ones."""
        vocab = self.model.get_input_embeddings().weight.shape[0]
        prompts = [[(7 * i + 3 + s) % vocab for i in range(n)] for n, s in ((3, 0), (6, 1))]
        caches = []
        for prompt in prompts:
            _, cache = self._call(torch.tensor([prompt], device=self.device), None,
                                  torch.arange(len(prompt), device=self.device)[None], 1,
                                  len(prompt))
            if why := padded_cache.unbatchable(cache):
                return why, ""
            caches.append(cache)
        kinds = padded_cache.layer_kinds(caches[0])
        lengths = [len(p) for p in prompts]
        last = [[p[-1]] for p in prompts]
        got, _ = self._call_batch(padded_cache.concat(caches), last, lengths)
        want = torch.cat([self._call(torch.tensor([t], device=self.device), cache,
                                     torch.tensor([[n]], device=self.device), 1, n + 1)[0]
                          for t, cache, n in zip(last, caches, lengths, strict=True)])
        error = float((got - want).abs().max())
        if error > PROBE_TOLERANCE * (1 + float(want.abs().max())):
            return (f"a padded probe step's logits differ from per-sequence forwards by "
                    f"{error:.3g}"), kinds
        return "", kinds

    # ------------------------------------------------------------- forward
    def forward(self, seqs: Seq[Sequence], keep: Seq[int] | None = None) -> torch.Tensor:
        """Logits at the packed positions ``keep`` ([len(keep), vocab]), as the paged runner's.

        Sequence ``i``'s tokens are packed positions ``offsets[i] ..
        offsets[i] + num_scheduled``; ``keep`` defaults to each sequence's last.
        """
        with self._lock:
            offsets = list(itertools.accumulate((s.num_scheduled for s in seqs), initial=0))
            if keep is None:
                keep = [end - 1 for end in offsets[1:]]
            keep_t = torch.as_tensor(list(keep), dtype=torch.long)
            decoding = [s for s in seqs if self.mode.padded and s.num_cached
                        and s.num_scheduled == 1 and s.samples and not self.feeds_embeds(s)]
            self._arrange(seqs, decoding)
            batched = self._run_batch(decoding) if self._batch is not None else {}
            parts: list[torch.Tensor] = []
            for seq, off, end in zip(seqs, offsets, offsets[1:], strict=False):
                mine = keep_t[(keep_t >= off) & (keep_t < end)] - off
                if seq.seq_id in batched:
                    parts.append(batched[seq.seq_id][mine])
                else:
                    parts.append(self._run(seq, mine))
            return torch.cat(parts) if parts else torch.empty(0)

    def _arrange(self, seqs: Seq[Sequence], decoding: Seq[Sequence]) -> None:
        """Bring the caches where this step needs them: drop what is gone, take rows out of
        the batch that do not decode now, and merge the sequences joining it."""
        gone = set(self._gone)  # (a finalizer on another thread may add to it meanwhile)
        for seq_id in gone:
            self._own.pop(seq_id, None)
        for seq in seqs:
            if not seq.num_cached:  # (re-)prefilled from its first token: nothing is kept
                self._own.pop(seq.seq_id, None)
        fresh = {s.seq_id for s in seqs if not s.num_cached}
        for seq_id in [s for s in self._own if not self.blocks.table(s)]:
            del self._own[seq_id]
        batch, joining = self._batch, list(decoding)
        if batch is not None:
            rows = {sid: r for r, sid in enumerate(batch.seq_ids)}
            wanted = {s.seq_id for s in decoding}
            kept = [r for r, sid in enumerate(batch.seq_ids) if sid in wanted]
            # Alive but not decoding this step (not seen so far): back on a cache of its own.
            for r, sid in enumerate(batch.seq_ids):
                if (sid not in wanted and sid not in fresh and sid not in gone
                        and self.blocks.table(sid)):
                    self._own[sid] = padded_cache.select(batch.cache, [r], batch.lengths[r])
            if kept:
                self.rows_left += len(batch.seq_ids) - len(kept)
                lengths = [batch.lengths[r] for r in kept]
                self._batch = _Batch(padded_cache.select(batch.cache, kept, max(lengths)),
                                     [batch.seq_ids[r] for r in kept], lengths)
            else:
                self._batch = None
            joining = [s for s in decoding if s.seq_id not in rows]
        for seq in decoding:
            if seq.seq_id in self._own or (self._batch is not None
                                           and seq.seq_id in self._batch.seq_ids):
                continue
            raise RuntimeError(f"sequence {seq.request_id} lost its cache after "
                               f"{seq.num_cached} tokens")
        if joining:
            self._join(joining)
        # What is gone holds nothing now (an own cache left without blocks went above).
        self._gone.intersection_update(self._batch.seq_ids if self._batch is not None else ())

    def _join(self, joining: Seq[Sequence]) -> None:
        """Merge the caches of ``joining`` into the batch, as far as the padding budget allows.

        A sequence whose joining would take the batch's padding past
        :data:`PADDING_SHARE` of the pool decodes on its own cache this step.
        """
        batch = self._batch
        ids = list(batch.seq_ids) if batch is not None else []
        lengths = list(batch.lengths) if batch is not None else []
        budget = int(PADDING_SHARE * self.blocks.num_blocks * self.blocks.block_size)
        taken: list[Sequence] = []
        for seq in joining:
            self._check_length(seq, self._own[seq.seq_id].get_seq_length())
            n = seq.num_cached
            if (len(lengths) + 1) * max(n, *lengths, 0) - (sum(lengths) + n) > budget:
                self.rows_alone += 1
                continue
            taken.append(seq)
            ids.append(seq.seq_id)
            lengths.append(n)
        if not taken:
            return
        self.rows_joined += len(taken) - (batch is None)
        parts = [self._own.pop(s.seq_id) for s in taken]
        self._batch = _Batch(padded_cache.concat(([batch.cache] if batch is not None else [])
                                                 + parts), ids, lengths)

    def _run_batch(self, decoding: Seq[Sequence]) -> dict[int, torch.Tensor]:
        """One padded forward over the batch: each decoding sequence's logits ([1, vocab])."""
        batch = self._batch
        assert batch is not None
        by_id = {s.seq_id: s for s in decoding}
        for sid, n in zip(batch.seq_ids, batch.lengths, strict=True):
            self._check_length(by_id[sid], n)
        ids = [[by_id[sid].tokens[n]] for sid, n in zip(batch.seq_ids, batch.lengths,
                                                          strict=True)]
        self._batch = None  # a forward that fails half-way leaves the cache inconsistent
        logits, cache = self._call_batch(batch.cache, ids, batch.lengths)
        self._batch = _Batch(cache, batch.seq_ids, [n + 1 for n in batch.lengths])
        self.padded_steps += 1
        self.most_rows = max(self.most_rows, len(batch.seq_ids))
        return {sid: logits[r:r + 1] for r, sid in enumerate(batch.seq_ids)}

    def _run(self, seq: Sequence, rows: torch.Tensor) -> torch.Tensor:
        """Feed ``seq`` its scheduled tokens on its own cache; logits at its local ``rows``."""
        start, n = seq.num_cached, seq.num_scheduled
        cache = self._own.get(seq.seq_id) if start else None
        if start and cache is None:
            raise RuntimeError(f"sequence {seq.request_id} lost its cache after {start} tokens")
        if cache is not None:
            self._check_length(seq, cache.get_seq_length())
        embeds = self.input_embeds(seq) if self.feeds_embeds(seq) else None
        logits, cache = self._call(
            torch.tensor([seq.new_tokens], device=self.device), cache,
            torch.arange(start, start + n, device=self.device)[None], rows, start + n, embeds)
        if seq.seq_id not in self._watched:  # forget its caches when the sequence is gone
            self._watched.add(seq.seq_id)
            weakref.finalize(seq, self._forget, seq.seq_id)
        self._own[seq.seq_id] = cache
        return logits

    @staticmethod
    def _check_length(seq: Sequence, held: int) -> None:
        if held != seq.num_cached:
            raise RuntimeError(f"sequence {seq.request_id}: its cache holds {held} tokens, "
                               f"the scheduler says {seq.num_cached}")

    def feeds_embeds(self, seq: Sequence) -> bool:
        """Whether ``seq``'s scheduled tokens enter as embeddings (:meth:`input_embeds`), not ids.

        False here. :class:`switchyard_xeon.vision.VisionRunner` says true for the
        chunks that hold image placeholders; such a chunk runs on the sequence's own
        cache, never in the padded decode batch.
        """
        return False

    def input_embeds(self, seq: Sequence) -> torch.Tensor:
        """The input embeddings of ``seq``'s scheduled tokens, ``[1, num_scheduled, hidden]``,
        for a step where :meth:`feeds_embeds` is true (never here: a runner that says true
        overrides both)."""
        raise NotImplementedError(f"{type(self).__name__} feeds token ids only")

    def _call(self, input_ids: torch.Tensor, cache: object, positions: torch.Tensor,
              rows: torch.Tensor | int | None, total: int,
              embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, object]:
        """One sequence's forward: logits at its local ``rows`` (all when None), its cache.
        ``embeds``, when given, enter in place of ``input_ids`` (see :meth:`feeds_embeds`)."""
        kwargs: dict[str, object] = {
            "input_ids": input_ids,
            "attention_mask": torch.ones(1, total, dtype=torch.long, device=self.device),
            self._cache_arg: cache,
            "use_cache": True,
        }
        if embeds is not None:
            del kwargs["input_ids"]
            kwargs["inputs_embeds"] = embeds
        if self._takes_positions:
            kwargs["position_ids"] = positions
        if self._takes_keep and rows is not None:
            # Only the kept rows reach lm_head (none for a chunk short of its prompt's end).
            kwargs["logits_to_keep"] = rows
        out = self.model(**kwargs)
        logits = out.logits[0]
        if rows is not None and not self._takes_keep:
            logits = logits[-rows:] if isinstance(rows, int) else logits[rows]
        return logits, out[self._cache_arg]

    def _call_batch(self, cache: object, ids: list[list[int]],
                    lengths: list[int]) -> tuple[torch.Tensor, object]:
        """One padded decode forward: the rows' next-token logits ([rows, vocab]), the cache."""
        kwargs: dict[str, object] = {
            "input_ids": torch.tensor(ids, device=self.device),
            "attention_mask": padded_cache.row_mask(lengths, 1, self.device),
            self._cache_arg: cache,
            "use_cache": True,
        }
        if self._takes_positions:
            kwargs["position_ids"] = torch.tensor([[n] for n in lengths], device=self.device)
        if self._takes_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs)
        return out.logits[:, -1], out[self._cache_arg]

    def _forget(self, seq_id: int) -> None:
        """A sequence was let go of: drop its own cache, and the batch once no row is alive.

        Called by a finalizer, on whatever thread let go last: it only takes the
        runner's lock if free (the next step does the rest otherwise).
        """
        self._gone.add(seq_id)
        self._watched.discard(seq_id)
        if not self._lock.acquire(blocking=False):
            return
        try:
            self._own.pop(seq_id, None)
            batch = self._batch
            if batch is None or seq_id not in batch.seq_ids:
                self._gone.discard(seq_id)
            elif all(s in self._gone for s in batch.seq_ids):
                self._batch = None
                self._gone.difference_update(batch.seq_ids)
        finally:
            self._lock.release()
