"""Constrained decoding for every engine: compile a request's grammar, mask its logits.

The gateway sends a validated :class:`~switchyard_spec.Constraint` with the
request; an engine that declares ``EngineSpec.constrained_decoding`` uses this
module, on its compute thread, with xgrammar as the grammar engine:

- :class:`GrammarSupport`, one per model: the model's tokenizer wrapped for
  xgrammar once (its vocabulary sized to the logits' width, so the padded
  columns of a padded vocabulary are masked too), a compiler, a small thread
  pool that compiles off the compute loop, and a cache of compiled grammars
  keyed by ``(kind, spec)`` (the spec is canonical, so equal schemas hit).
- :class:`GrammarState`, one per sequence: its compile (a future), then its
  matcher. ``RowSampler.record`` advances it with every accepted token, and
  :func:`~switchyard_engine.lifecycle.finish_reason` ends the sequence when the
  matcher has terminated.
- :meth:`GrammarSupport.apply`: before sampling, fills one preallocated bitmask
  for the constrained rows only and sets every token they may not take to -inf
  (:func:`mask_logits`), in place, before logit bias, penalties, temperature
  and top-k/p.

Compiling starts when the engine first sees the sequence (its prefill step), so
it overlaps the prefill forward pass; the sequence's first sample waits for
whatever is left of it (a cache hit costs ~0.05 ms, a small schema a few ms).

xgrammar is imported on first use: engines that never see a constraint never
load it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

import torch
from switchyard_spec import Constraint, ConstraintKind, EngineRequest

# The grammar's text is torch-free, so the gateway checks schemas with the same code.
from switchyard_engine.grammar_text import json_schema_ebnf

if TYPE_CHECKING:
    from switchyard_engine.sampling import RowSampler

logger = logging.getLogger("switchyard_engine.grammar")

CACHE_ENTRIES = 256
"""Compiled grammars kept per model (least recently used dropped first)."""
COMPILE_THREADS = 1
"""Compile workers per model: compiles are short and the cores run the forward pass."""
COMPILE_TIMEOUT_S = 60.0
"""How long a sequence's first sample waits for its grammar before the sequence fails."""


def compile_grammar(compiler: Any, constraint: Constraint) -> Any:
    """Compile ``constraint`` with an xgrammar ``GrammarCompiler`` (the options are fixed here)."""
    if constraint.kind is ConstraintKind.JSON_SCHEMA:
        return compiler.compile_grammar(json_schema_ebnf(constraint.spec))
    if constraint.kind is ConstraintKind.JSON_OBJECT:
        return compiler.compile_grammar(json_schema_ebnf('{"type":"object"}'))
    if constraint.kind is ConstraintKind.GRAMMAR:
        return compiler.compile_grammar(constraint.spec)
    if constraint.kind is ConstraintKind.REGEX:
        return compiler.compile_regex(constraint.spec)
    if constraint.kind is ConstraintKind.STRUCTURAL_TAG:
        return compiler.compile_structural_tag(constraint.spec)
    raise ValueError(f"unknown constraint kind {constraint.kind!r}")


class GrammarState:
    """One sequence's grammar: its compile, then the matcher that follows its tokens."""

    __slots__ = ("_pending", "_stop_ids", "error", "future", "matcher")

    def __init__(self, future: Future[Any], stop_ids: tuple[int, ...]) -> None:
        self.future = future
        self.matcher: Any = None
        self.error: str | None = None
        """Why the sequence cannot go on constrained (a failed compile, a dead end)."""
        self._stop_ids = stop_ids
        self._pending: list[int] = []
        """Tokens accepted before the matcher existed (none in practice: the first
        sample waits for the compile)."""

    def ready(self, timeout: float | None = 0.0) -> bool:
        """Whether the matcher exists (waiting up to ``timeout`` seconds for the compile)."""
        if self.matcher is not None or self.error is not None:
            return self.matcher is not None
        try:
            compiled = self.future.result(timeout=timeout)
        except TimeoutError:
            if timeout:  # a wait that ran out is a failure; a poll is not
                self.error = f"grammar compile took longer than {timeout:.0f}s"
            return False
        except Exception as exc:  # noqa: BLE001 - any compile failure ends this sequence only
            self.error = f"grammar compile failed: {exc}"
            return False
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(
            compiled, override_stop_tokens=list(self._stop_ids) or None)
        for token in self._pending:
            self.accept(token)
        self._pending = []
        return True

    def accept(self, token_id: int) -> None:
        """Advance the matcher with a sampled token."""
        if self.error is not None:
            return
        if self.matcher is None:
            self._pending.append(token_id)
            return
        if self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token_id):
            self.error = f"token {token_id} does not follow the grammar"

    @property
    def terminated(self) -> bool:
        """Whether the grammar is complete and took its stop token: the text is done."""
        return self.matcher is not None and bool(self.matcher.is_terminated())


class GrammarSupport:
    """Grammar compiling and masking for one model (one engine), used on its compute thread.

    ``tokenizer_source`` is the model folder (or a loaded Hugging Face
    tokenizer); ``vocab_size`` is the width of the model's logits, which may
    exceed the tokenizer's vocabulary (padded embeddings): every column past
    the tokenizer's tokens is always masked. The tokenizer is wrapped on first
    use (xgrammar: ~150 ms for a 49k vocabulary), or in the background when the
    engine calls :meth:`prepare` (the xeon engine does at warmup).
    ``mask`` writes the bitmasks onto the logits (:func:`mask_logits`'s
    contract); an engine with a native kernel for it passes that.
    """

    def __init__(self, tokenizer_source: Any, vocab_size: int,
                 cache_entries: int = CACHE_ENTRIES, threads: int = COMPILE_THREADS,
                 mask: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], list[int]]
                 | None = None) -> None:
        self.vocab_size = vocab_size
        self._mask = mask or mask_logits
        self.cache_entries = cache_entries
        self._source = tokenizer_source
        self._compiler: Any = None
        self._stop_ids: tuple[int, ...] = ()
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future[Any]] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._bitmask: torch.Tensor | None = None
        self.hits = 0
        """Compiles answered from the cache (for tests and logs)."""
        self.compiles = 0

    # ------------------------------------------------------------- compile
    def prepare(self) -> Future[Any]:
        """Wrap the tokenizer in the compile worker now (the first compile's cost, ~0.15-0.3 s
        for a 49k vocabulary), so the model's first constrained request does not wait for
        it; an engine calls this when it is warm. A failure surfaces on the first compile."""
        return self._pool.submit(self._compiler_ready)

    def _compiler_ready(self) -> Any:
        """The xgrammar compiler, built on first use (wraps the tokenizer once)."""
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                tok = self._source
                if isinstance(tok, str) or hasattr(tok, "__fspath__"):
                    import transformers

                    tok = transformers.AutoTokenizer.from_pretrained(str(tok))
                info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size)
                self._stop_ids = tuple(info.stop_token_ids)
                # Our cache (futures keyed by the canonical spec) replaces xgrammar's.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, constraint: Constraint) -> Future[Any]:
        """The compiled grammar of ``constraint``, from the cache or compiled in the pool."""
        key = (constraint.kind.value, constraint.spec)
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return future
            future = self._pool.submit(self._compile, constraint)
            self._cache[key] = future
            self.compiles += 1
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)
        return future

    def _compile(self, constraint: Constraint) -> Any:
        return compile_grammar(self._compiler_ready(), constraint)

    def start(self, request: EngineRequest) -> GrammarState | None:
        """Begin the request's compile and return its state (None for a free-text request)."""
        if request.constraint is None:
            return None
        return GrammarState(self.compile(request.constraint), request.stopping.eos_token_ids)

    def shutdown(self) -> None:
        """Stop the compile pool (pending compiles are dropped)."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- mask
    def _bitmask_rows(self, rows: int) -> torch.Tensor:
        """The preallocated bitmask, grown (doubling) when a step has more rows than before."""
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            import xgrammar as xgr

            size = max(rows, 2 * (self._bitmask.shape[0] if self._bitmask is not None else 4))
            self._bitmask = xgr.allocate_token_bitmask(size, self.vocab_size)
        return self._bitmask

    def apply(self, logits: torch.Tensor, rows: Sequence[RowSampler],
              wait: float = COMPILE_TIMEOUT_S) -> list[str | None]:
        """Mask, in place, the tokens each constrained row of ``logits`` may not take.

        Row ``i`` of ``logits`` ([rows, vocab], on the CPU) belongs to
        ``rows[i]``; rows without a grammar are left alone. A row whose grammar
        is still compiling waits for it (up to ``wait`` seconds). Returns one
        entry per row: None, or why that row cannot be served (failed compile,
        no allowed token); such a row is left unmasked and its token must be
        dropped.
        """
        errors: list[str | None] = [None] * len(rows)
        constrained: list[int] = []
        for i, row in enumerate(rows):
            state = grammar_of(row)
            if state is None:
                continue
            if not state.ready(timeout=wait):
                errors[i] = state.error or "grammar not ready"
                continue
            if state.error is not None:
                errors[i] = state.error
                continue
            if state.terminated:  # done: its sequence ends on this token; nothing to mask
                continue
            constrained.append(i)
        if not constrained:
            return errors
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits are {logits.shape[-1]} wide, the grammar's vocabulary "
                             f"{self.vocab_size}")
        bitmask = self._bitmask_rows(logits.shape[0])
        masked: list[int] = []
        for i in constrained:
            # False: every token is allowed here (a free string's middle), nothing to mask.
            state = grammar_of(rows[i])
            assert state is not None  # only constrained rows are here
            if state.matcher.fill_next_token_bitmask(bitmask, i):
                masked.append(i)
        if masked:
            index = torch.tensor(masked, dtype=torch.long)
            dead = self._mask(logits, bitmask.index_select(0, index), index)
            for j in dead:
                errors[masked[j]] = "the grammar allows no next token"
        return errors


SPARSE_WORDS = 64
"""A row whose bitmask has at most this many nonzero 32-token words (at most 2,048
allowed tokens: JSON punctuation, keys, enum values) may be masked sparsely: its
allowed logits are kept, the row is set to -inf, and they are put back. Denser
rows (numbers, the inside of a string) take the additive penalties."""
SPARSE_MIN_ROWS = 4
"""The sparse path costs a few small tensor operations whatever the rows; it is
taken when at least this many rows are sparse (each saves one penalty pass)."""
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def mask_logits(logits: torch.Tensor, words: torch.Tensor, index: torch.Tensor) -> list[int]:
    """Set ``logits[index[j], t]`` to -inf for every token ``t`` whose bit in ``words[j]``
    is 0, in place; the other logits are left exactly as they were.

    ``words`` are xgrammar bitmask rows (int32, bit ``t % 32`` of word ``t // 32`` set
    when token ``t`` is allowed), one per entry of ``index``, at least
    ``logits.shape[-1]`` bits wide (bits past it are ignored). Rows with no allowed
    token are left alone; their positions in ``index`` are returned.

    Why two paths: most grammar states allow a few tokens, and for those writing
    -inf over the whole row and restoring the allowed logits touches the row once;
    a row that allows many tokens takes additive penalties (one table lookup per
    mask byte, then one add), which touch it three times.
    """
    vocab = logits.shape[-1]
    words = words.to(logits.device)
    counts = (words != 0).sum(dim=1).tolist()
    dead = [j for j, n in enumerate(counts) if n == 0]
    sparse = [j for j, n in enumerate(counts) if 0 < n <= SPARSE_WORDS]
    if len(sparse) < SPARSE_MIN_ROWS:
        sparse = []
    dense = [j for j, n in enumerate(counts) if n > 0 and (n > SPARSE_WORDS or not sparse)]
    if sparse:
        pick = torch.tensor(sparse, dtype=torch.long, device=logits.device)
        rows = index.to(logits.device).index_select(0, pick)
        sparse_words = words.index_select(0, pick)
        row_of, word_of = sparse_words.nonzero(as_tuple=True)
        shifts = _BIT_SHIFTS.to(words.device)
        bits = (sparse_words[row_of, word_of].unsqueeze(1) >> shifts) & 1
        which, bit = bits.nonzero(as_tuple=True)
        tokens = word_of[which] * 32 + bit
        row_ids = rows[row_of[which]]
        if words.shape[1] * 32 > vocab:  # spare bits past the logits (xgrammar leaves them 0)
            inside = tokens < vocab
            tokens, row_ids = tokens[inside], row_ids[inside]
        kept = logits[row_ids, tokens]
        logits.index_fill_(0, rows, float("-inf"))
        logits[row_ids, tokens] = kept
    if dense:
        if len(dense) == len(counts):
            rows, dense_words = index.to(logits.device), words
        else:
            pick = torch.tensor(dense, dtype=torch.long, device=logits.device)
            rows, dense_words = index.to(logits.device)[pick], words[pick]
        logits.index_add_(0, rows, token_penalties(dense_words, vocab, logits.dtype))
    return dead


_BYTE_PENALTIES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def token_penalties(words: torch.Tensor, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Bitmask rows (xgrammar's int32 words, bit ``t`` = token ``t`` allowed) as additive
    penalties ``[rows, vocab_size]`` on the words' device: 0 where allowed, -inf where not.

    Adding these to the logits is the mask (``x + 0 == x``, ``x - inf == -inf``).
    One table lookup per mask byte (each byte's 8 penalties at once): ~0.6 ms for
    32 rows of a 49k vocabulary on one Zen 4 core, and the add ~0.3 ms, where
    ``xgrammar.apply_token_bitmask_inplace``'s CPU path, bit by bit, takes 4-6 ms
    and ``masked_fill_`` with an unpacked boolean mask ~2-3 ms.
    """
    key = (dtype, words.device)
    table = _BYTE_PENALTIES.get(key)
    if table is None:
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        table = torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf"))
        table = _BYTE_PENALTIES[key] = table.to(words.device)
    # Little-endian int32 words: byte b of word w holds tokens 32w + 8b .. 32w + 8b + 7.
    byte_codes = words.contiguous().view(torch.uint8).reshape(-1).long()
    penalties = table.index_select(0, byte_codes).view(words.shape[0], -1)
    return penalties[:, :vocab_size]


def grammar_settled(state: GrammarState | None) -> bool:
    """Whether a sequence's grammar has compiled or failed (either way it may be scheduled);
    True for a free-text sequence. Polls: never waits for the compile."""
    return state is None or state.ready(0.0) or state.error is not None


def failed_state(reason: str) -> GrammarState:
    """A sequence's grammar that can never be used: its rows fail with ``reason``."""
    future: Future[Any] = Future()
    future.set_exception(RuntimeError(reason))
    state = GrammarState(future, ())
    state.error = reason
    return state


def apply_grammars(support: GrammarSupport | None, logits: torch.Tensor,
                   rows: Sequence[RowSampler]) -> list[str | None]:
    """:meth:`GrammarSupport.apply`, also when the engine has none: then every
    constrained row fails with its state's error and none is masked."""
    if support is not None:
        return support.apply(logits, rows)
    states = [grammar_of(r) for r in rows]
    return [None if g is None else (g.error or "constrained decoding is unavailable")
            for g in states]


def grammar_of(row: RowSampler) -> GrammarState | None:
    """A row's grammar, as this module made it (the sampler knows it only as a
    :class:`~switchyard_engine.sampling.TokenAcceptor`)."""
    return cast("GrammarState | None", row.grammar)


def model_folder(obj: Any) -> str | None:
    """The folder a transformers model was loaded from, found on ``obj`` or its
    ``model``/``rotary`` attribute (the config's ``_name_or_path``); None if unknown."""
    for candidate in (obj, getattr(obj, "model", None), getattr(obj, "rotary", None)):
        config = getattr(candidate, "config", None)
        path = getattr(config, "_name_or_path", None)
        if path:
            return str(path)
    return None
