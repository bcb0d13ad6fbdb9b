"""Every shape serving can meet, what each costs in device memory, and whether it all fits.

From the limits (``--max-input-tokens``, ``--max-total-tokens``,
``--max-batch-size``, ``--max-batch-prefill-tokens``) and the bucket settings,
:func:`make_grid` fixes the bucket sizes and :func:`enumerate_shapes` lists
every (phase, batch, length) the engine can run:

- prefill: ``batch`` rows (a prefill batch bucket) of ``length`` tokens (a
  prompt bucket), for every pair whose padded tokens fit
  ``--max-batch-prefill-tokens`` (the scheduler counts the budget the same
  way, so no other prefill shape can occur);
- decode: ``batch`` rows (a decode batch bucket), each attending over the
  whole cache row of ``--max-total-tokens`` (the KV layout, see kv_cache.py).

For a vision-language model (``BucketSettings.image_tokens``, the seed's
``BASE_IMAGE_TOKENS``) the prompt buckets run from ``BASE_IMAGE_TOKENS`` to
``--max-input-tokens``, and the prefill rows from one to
``--max-batch-prefill-tokens // --max-input-tokens``.

:func:`plan_warmup` estimates the device memory of the whole set before
anything is loaded: weights (exact, from the checkpoint's headers), the KV
cache, and the activations of the largest shape (shapes run one at a time).
A configuration that does not fit is refused with the setting to lower and a
value that fits. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from switchyard_spec import EngineStartError

from switchyard_gaudi.buckets import Buckets, choose
from switchyard_gaudi.model_dims import ModelDims
from switchyard_gaudi.settings import GaudiSettings

GIB = 2**30
PREFILL, DECODE = "prefill", "decode"


class PlanError(EngineStartError):
    """The limits and bucket settings cannot be served (or do not fit in memory)."""


@dataclass(frozen=True)
class Limits:
    """The engine's resolved limits (none 0)."""

    max_input_tokens: int
    max_total_tokens: int
    max_batch_size: int
    """Sequences decoded together: the KV cache holds this many rows."""
    max_batch_prefill_tokens: int
    """Padded tokens (rows x prompt bucket) of one prefill step."""


@dataclass(frozen=True)
class BucketSettings:
    """How the three bucketed dimensions grow (the seed's variables)."""

    batch_step: int = 8
    prefill_batch_step: int = 4
    seq_step: int = 128
    batch_base: int | None = None
    seq_base: int | None = None
    image_tokens: int | None = None
    """Vision-language models: ``BASE_IMAGE_TOKENS``, the least ``max_input_tokens`` and
    the first prompt bucket; prefill rows are then ``max_batch_prefill_tokens //
    max_input_tokens`` (the seed's Llava rule). None for text models."""

    @classmethod
    def from_settings(cls, s: GaudiSettings, takes_images: bool = False) -> BucketSettings:
        """The bucket part of the engine's settings (``takes_images``: a vision model's)."""
        return cls(s.batch_bucket_size, s.prefill_batch_bucket_size,
                   s.pad_sequence_to_multiple_of, s.batch_size_exponent_base,
                   s.seq_len_exponent_base,
                   s.base_image_tokens if takes_images else None)


@dataclass(frozen=True, order=True)
class Shape:
    """One static shape: ``batch`` rows of ``length`` tokens (decode: the cache length)."""

    phase: str
    batch: int
    length: int

    def __str__(self) -> str:
        return f"{self.phase} {self.batch}x{self.length}"


@dataclass(frozen=True)
class Grid:
    """The bucket sizes of each dimension, and the shape a batch is padded to."""

    prefill_batch: Buckets
    prefill_seq: Buckets
    decode_batch: Buckets
    cache_len: int
    max_prefill_tokens: int

    def prefill_shape(self, prompt_lengths: Sequence[int]) -> Shape | None:
        """The padded shape of a prefill of these prompts; None when over a limit."""
        n, longest = len(prompt_lengths), max(prompt_lengths)
        if n > self.prefill_batch.limit or longest > self.prefill_seq.limit:
            return None
        shape = Shape(PREFILL, self.prefill_batch.round_up(n), self.prefill_seq.round_up(longest))
        return shape if shape.batch * shape.length <= self.max_prefill_tokens else None

    def decode_shape(self, rows: int) -> Shape:
        """The padded shape of a decode step over cache rows ``0 .. rows - 1``."""
        return Shape(DECODE, self.decode_batch.round_up(rows), self.cache_len)


def make_grid(limits: Limits, buckets: BucketSettings) -> Grid:
    """The buckets for ``limits``; PlanError when the longest prompt cannot be prefilled."""
    if not 0 < limits.max_input_tokens < limits.max_total_tokens:
        raise PlanError(f"max_input_tokens ({limits.max_input_tokens}) must be positive and "
                        f"below max_total_tokens ({limits.max_total_tokens})")
    floor = buckets.image_tokens
    if floor is not None and limits.max_input_tokens < floor:
        raise PlanError(
            f"--max-input-tokens ({limits.max_input_tokens}) is below BASE_IMAGE_TOKENS "
            f"({floor}), the least a vision-language model is served with (an image takes "
            f"about that many tokens); raise --max-input-tokens to at least {floor} (and "
            f"--max-total-tokens above it), or set BASE_IMAGE_TOKENS to at most "
            f"{limits.max_input_tokens}")
    seq = choose(buckets.seq_step, buckets.seq_base, limits.max_input_tokens,
                 first=buckets.seq_step, floor=floor)
    # Text models: as many rows as the shortest bucket allows; vision models: the seed's
    # prefill_batch_size = max-batch-prefill-tokens / max-input-tokens.
    per_row = seq.sizes[0] if floor is None else seq.limit
    rows = max(1, min(limits.max_batch_size, limits.max_batch_prefill_tokens // per_row))
    prefill_batch = choose(buckets.prefill_batch_step, buckets.batch_base, rows)
    smallest = prefill_batch.sizes[0]
    if smallest * seq.limit > limits.max_batch_prefill_tokens:
        advice = [f"raise --max-batch-prefill-tokens to {smallest * seq.limit}"]
        rows_fit = limits.max_batch_prefill_tokens // seq.limit
        if buckets.batch_base is None and rows_fit >= 1:
            advice.append(f"set PREFILL_BATCH_BUCKET_SIZE to {rows_fit}")
        advice.append(f"lower --max-input-tokens to {limits.max_batch_prefill_tokens // smallest}")
        raise PlanError(
            f"the longest prompt cannot be prefilled: its smallest padded batch is {smallest} "
            f"rows x {seq.limit} tokens = {smallest * seq.limit} tokens, over "
            f"--max-batch-prefill-tokens {limits.max_batch_prefill_tokens}; "
            + ", or ".join(advice))
    decode = choose(buckets.batch_step, buckets.batch_base, limits.max_batch_size)
    return Grid(prefill_batch, seq, decode, limits.max_total_tokens,
                limits.max_batch_prefill_tokens)


def enumerate_shapes(grid: Grid) -> list[Shape]:
    """Every shape the engine can run with ``grid``: prefills then decodes, smallest first."""
    prefill = [Shape(PREFILL, b, s) for s in grid.prefill_seq for b in grid.prefill_batch
               if b * s <= grid.max_prefill_tokens]
    decode = [Shape(DECODE, b, grid.cache_len) for b in grid.decode_batch]
    return sorted(prefill, key=lambda s: (s.batch * s.length, s.length)) + decode


def activation_bytes(shape: Shape, dims: ModelDims, dtype_bytes: int) -> int:
    """An upper estimate of the bytes a forward pass of ``shape`` allocates beyond the weights.

    Counted as if alive at once: the residual stream and its normed copy, the
    attention output and the MLP output (4 x hidden), queries, keys and
    values, the MLP's gate, up and product (3 x intermediate), attention
    scores in float32 (as an unfused kernel materializes them) and float32
    logits twice over (the logits and their log-softmax) for the rows that
    reach the LM head.
    """
    rows, q_len = shape.batch, (shape.length if shape.phase == PREFILL else 1)
    tokens = rows * q_len
    kv_len = shape.length
    per_token = (4 * dims.hidden_size + (dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim
                 + 3 * dims.intermediate_size) * dtype_bytes
    scores = rows * dims.num_heads * q_len * kv_len * 4
    logits = 2 * rows * dims.vocab_size * 4
    return tokens * per_token + scores + logits


@dataclass(frozen=True)
class MemoryEstimate:
    """Device memory the plan needs against what is there, in bytes."""

    weights: int
    kv_cache: int
    activations: int
    """Of the largest shape: shapes run one at a time."""
    largest: Shape
    graphs: int
    """Reserved for captured graphs (HPU); 0 where graphs hold no memory of their own."""
    free: int
    usable: int
    """The share of ``free`` the plan may use."""

    @property
    def total(self) -> int:
        """What the plan needs."""
        return self.weights + self.kv_cache + self.activations + self.graphs

    @property
    def fits(self) -> bool:
        """Whether it fits in the usable memory."""
        return self.total <= self.usable

    def describe(self) -> str:
        """One line: each part's size and the total against what is usable."""
        return (f"weights {_size(self.weights)} + KV cache {_size(self.kv_cache)} + activations "
                f"{_size(self.activations)} ({self.largest}) + graphs {_size(self.graphs)} = "
                f"{_size(self.total)} of {_size(self.usable)} usable ({_size(self.free)} free)")


def _size(n: int) -> str:
    """Bytes in GiB, or in MiB below one GiB (small models, test devices)."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Memory:
    """The device memory the plan is checked against and the shares it may use."""

    free: int
    usable_fraction: float = 0.9
    """Of the free memory, what the engine may take (the rest is the runtime's)."""
    graph_fraction: float = 0.0
    """Of the usable memory, what is kept for captured graphs (HPU: 0.1, as TGI)."""


def estimate_memory(limits: Limits, grid: Grid, shapes: Sequence[Shape], dims: ModelDims,
                    dtype_bytes: int, memory: Memory) -> MemoryEstimate:
    """The :class:`MemoryEstimate` of serving ``shapes`` under ``limits``.

    The cache holds one row of ``max_total_tokens`` per decode row of the
    largest decode bucket, plus one scratch row that padding rows write to.
    """
    usable = int(memory.free * memory.usable_fraction)
    cache_rows = grid.decode_batch.limit + 1
    acts = [(activation_bytes(s, dims, dtype_bytes), s) for s in shapes]
    peak, largest = max(acts)
    return MemoryEstimate(
        weights=dims.weight_bytes(dtype_bytes),
        kv_cache=cache_rows * limits.max_total_tokens * dims.kv_bytes_per_token(dtype_bytes),
        activations=peak, largest=largest, graphs=int(usable * memory.graph_fraction),
        free=memory.free, usable=usable)


@dataclass(frozen=True)
class WarmupPlan:
    """The shapes to warm up, and the memory they need."""

    limits: Limits
    grid: Grid
    shapes: tuple[Shape, ...]
    memory: MemoryEstimate

    def describe(self) -> str:
        """A few lines for the start-up log and the dry run."""
        g = self.grid
        prefill = [s for s in self.shapes if s.phase == PREFILL]
        return "\n".join([
            (f"prompt buckets {list(g.prefill_seq)}, prefill batch buckets "
             f"{list(g.prefill_batch)}, decode batch buckets {list(g.decode_batch)}, "
             f"cache rows of {g.cache_len} tokens"),
            (f"{len(self.shapes)} shapes: {len(prefill)} prefill "
             f"({', '.join(f'{s.batch}x{s.length}' for s in prefill)}), "
             f"{len(self.shapes) - len(prefill)} decode"),
            f"memory: {self.memory.describe()}",
        ])

    def uncovered(self, shape: Shape) -> str:
        """Which setting would have put ``shape`` in this plan (for the one log line it gets)."""
        g = self.grid
        if shape.phase != PREFILL:
            return (f"decode batch buckets are {list(g.decode_batch)}: set BATCH_BUCKET_SIZE "
                    f"(or BATCH_SIZE_EXPONENT_BASE) so that {shape.batch} is one, or raise "
                    f"--max-batch-size to {shape.batch}")
        if shape.batch not in g.prefill_batch.sizes:
            return (f"prefill batch buckets are {list(g.prefill_batch)}: set "
                    f"PREFILL_BATCH_BUCKET_SIZE so that {shape.batch} is one")
        if shape.length not in g.prefill_seq.sizes:
            return (f"prompt buckets are {list(g.prefill_seq)}: set PAD_SEQUENCE_TO_MULTIPLE_OF "
                    f"(or SEQ_LEN_EXPONENT_BASE) so that {shape.length} is one, or raise "
                    f"--max-input-tokens to {shape.length}")
        return (f"{shape.batch}x{shape.length} = {shape.batch * shape.length} padded tokens is "
                f"over --max-batch-prefill-tokens {self.limits.max_batch_prefill_tokens}; raise "
                f"it to {shape.batch * shape.length}")


def build_plan(limits: Limits, buckets: BucketSettings, dims: ModelDims, dtype_bytes: int,
               memory: Memory) -> WarmupPlan:
    """The plan for ``limits`` whether or not it fits (PlanError only if it cannot be served)."""
    grid = make_grid(limits, buckets)
    shapes = enumerate_shapes(grid)
    return WarmupPlan(limits, grid, tuple(shapes),
                      estimate_memory(limits, grid, shapes, dims, dtype_bytes, memory))


def _largest_fitting(low: int, high: int, fits: Callable[[int], bool]) -> int | None:
    """The largest value in [low, high] for which ``fits`` holds (monotone), or None."""
    if low > high or not fits(low):
        return None
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def _fits(limits: Limits, buckets: BucketSettings, dims: ModelDims, dtype_bytes: int,
          memory: Memory) -> bool:
    try:
        return build_plan(limits, buckets, dims, dtype_bytes, memory).memory.fits
    except PlanError:
        return False


def plan_warmup(limits: Limits, buckets: BucketSettings, dims: ModelDims, dtype_bytes: int,
                memory: Memory) -> WarmupPlan:
    """The plan for ``limits``, or PlanError naming the settings to lower and values that fit."""
    plan = build_plan(limits, buckets, dims, dtype_bytes, memory)
    if plan.memory.fits:
        return plan
    est = plan.memory
    if est.weights + est.graphs >= est.usable:
        raise PlanError(f"the model does not fit: {est.describe()}; no limit makes the weights "
                        "smaller (use a device with more memory, a smaller --dtype, or sharding)")

    def fits_with(**change: int) -> bool:
        return _fits(replace(limits, **change), buckets, dims, dtype_bytes, memory)

    options = []
    batch = _largest_fitting(1, limits.max_batch_size - 1,
                             lambda v: fits_with(max_batch_size=v))
    if batch is not None:
        options.append((est.kv_cache, f"--max-batch-size to {batch}"))
    # Below one padded prefill of the longest prompt nothing can be served at all.
    least = plan.grid.prefill_batch.sizes[0] * plan.grid.prefill_seq.limit
    prefill = _largest_fitting(least, limits.max_batch_prefill_tokens - 1,
                               lambda v: fits_with(max_batch_prefill_tokens=v))
    if prefill is not None:
        options.append((est.activations if est.largest.phase == PREFILL else 0,
                        f"--max-batch-prefill-tokens to {prefill}"))
    total = _largest_fitting(limits.max_input_tokens + 1, limits.max_total_tokens - 1,
                             lambda v: fits_with(max_total_tokens=v))
    if total is not None:
        options.append((0, f"--max-total-tokens to {total}"))
    # The setting behind the largest part of the need comes first.
    advice = " or ".join(text for _, text in sorted(options, key=lambda o: -o[0]))
    raise PlanError(f"the configuration does not fit in device memory: {est.describe()}; "
                    + (f"lower {advice}" if advice else
                       "no one limit makes it fit: lower several of --max-batch-size, "
                       "--max-batch-prefill-tokens, --max-total-tokens and --max-input-tokens "
                       "together (`python -m switchyard_gaudi plan` tries them without a device)"))


def largest_batch_that_fits(limits: Limits, buckets: BucketSettings, dims: ModelDims,
                            dtype_bytes: int, memory: Memory) -> int | None:
    """The largest ``max_batch_size`` up to ``limits.max_batch_size`` that fits, or None."""
    return _largest_fitting(1, limits.max_batch_size, lambda v: _fits(
        replace(limits, max_batch_size=v), buckets, dims, dtype_bytes, memory))
