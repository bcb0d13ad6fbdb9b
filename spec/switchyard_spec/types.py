"""Records that cross the line between the gateway and an engine.

Everything here is a msgspec Struct: cheap to build, immutable where it can be,
and serialisable, so an engine may run its loop in another process and ship the
same records over a pipe. Nothing here imports torch.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from switchyard_spec.quantization import QuantizationMethod, WeightFormat

if TYPE_CHECKING:
    from switchyard_spec.engine import Engine
    from switchyard_spec.pooling import PoolingEngine


class FinishReason(str, enum.Enum):
    """Why a sequence stopped. Values are TGI's wire strings.

    An engine reports ``LENGTH`` and ``EOS_TOKEN``; the gateway adds
    ``STOP_SEQUENCE`` when it matches a stop string in the text, and an aborted
    sequence ends with ``ABORTED`` (never shown to clients).
    """

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
    ABORTED = "aborted"


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How the next token is chosen, per request.

    Greedy decoding is ``do_sample=False``; then only ``logit_bias``, ``watermark``
    and the penalties apply (TGI applies the watermark to greedy rows too). With
    ``do_sample=True`` the logits are processed in order: logit bias, watermark,
    penalties, the EOS mask of ``StoppingParams.min_new_tokens``, temperature,
    top-k, top-p, typical-p; then sampled. Reported log-probabilities: a greedy
    row's are ``log_softmax`` of its logits after logit bias, watermark,
    penalties and the EOS mask (so a bias shows in them); a sampled row's are
    those of its fully processed logits (after temperature and the filters).
    ``seed`` makes sampling reproducible for this request regardless of which
    other requests share its batch. Values arrive validated by the gateway.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    top_p: float = 1.0
    """1.0 disables nucleus sampling."""
    typical_p: float = 1.0
    """1.0 disables typical sampling."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely one (vLLM's
    ``min_p``, applied after top-k and top-p as transformers' ``MinPLogitsWarper``);
    0.0 disables it."""
    seed: int | None = None
    """None: the engine picks a seed and reports it in ``TokenEvent.seed``."""
    repetition_penalty: float = 1.0
    """CTRL-style multiplicative penalty on tokens seen in prompt or output; 1.0 is off."""
    frequency_penalty: float = 0.0
    """Subtracted once per earlier occurrence in the output (OpenAI semantics); 0 is off."""
    presence_penalty: float = 0.0
    """Subtracted once if the token occurred in the output (OpenAI semantics); 0 is off."""
    top_n_tokens: int = 0
    """How many most likely alternatives to report with each token."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the raw logits before any other processing
    (OpenAI's `logit_bias`; -100 effectively bans a token)."""
    watermark: bool = False
    """Bias sampling towards a green list seeded by the previous token (Kirchenbauer
    et al. 2023, as TGI: gamma `WATERMARK_GAMMA`=0.5, delta `WATERMARK_DELTA`=2.0)."""


class ConstraintKind(str, enum.Enum):
    """What language a ``Constraint`` holds its generated text to."""

    JSON_SCHEMA = "json_schema"
    """``Constraint.spec`` is a JSON schema: the text is one JSON value valid against it."""
    JSON_OBJECT = "json_object"
    """Any JSON object (OpenAI's ``json_object``); ``Constraint.spec`` is empty."""
    REGEX = "regex"
    """``Constraint.spec`` is a regular expression the whole text must match."""
    GRAMMAR = "grammar"
    """``Constraint.spec`` is a context-free grammar in xgrammar's EBNF (GBNF, with a
    ``root`` rule): the whole text is one sentence of it (vLLM's ``grammar``)."""
    STRUCTURAL_TAG = "structural_tag"
    """``Constraint.spec`` is an xgrammar structural tag (JSON,
    ``{"type": "structural_tag", "format": {...}}``, compiled with
    ``GrammarCompiler.compile_structural_tag``): tool calling. Its JSON parts are
    embedded as EBNF grammars (compact JSON, built by the gateway), and its
    ``triggered_tags`` format leaves text free until a trigger string, then
    holds it to one of the tags (a tool call) up to the tag's end string."""


class Constraint(msgspec.Struct, frozen=True, kw_only=True):
    """A grammar the generated text must follow (structured output).

    The gateway builds it from TGI's ``grammar``, OpenAI's ``response_format``
    or OpenAI's ``tools`` with ``tool_choice`` after checking that the spec
    compiles and uses nothing the grammar engine would silently ignore, so an
    engine may compile it without further checks.
    ``spec`` is canonical (a schema is re-serialised compactly with sorted
    keys), so equal constraints have equal ``spec`` and an engine may key a
    compile cache on ``(kind, spec)``.

    An engine that declares ``EngineSpec.constrained_decoding`` masks every
    token the grammar does not allow before any other logit processing (logit
    bias, penalties, temperature, top-k/p), so sampling parameters choose only
    among allowed tokens. JSON is produced compactly (no whitespace between
    tokens) with ``","`` and ``":"`` separators. When the grammar is complete
    and allows nothing more, only the request's EOS tokens are allowed; the
    sequence ends with ``FinishReason.EOS_TOKEN`` (the grammar ended the text)
    or ``LENGTH`` if ``max_new_tokens`` runs out first, in which case the text
    is a prefix of a valid one.
    """

    kind: ConstraintKind
    spec: str = ""
    """The schema's JSON text, the pattern or the structural tag's JSON text; empty for
    ``JSON_OBJECT``."""


class StoppingParams(msgspec.Struct, frozen=True, kw_only=True):
    """When the engine ends a sequence on its own.

    Stop *strings* are the gateway's business (they live in text, not ids);
    the engine stops on ``max_new_tokens`` and on any of ``eos_token_ids``
    unless ``ignore_eos`` is set, and never chooses an EOS id before
    ``min_new_tokens`` tokens exist.
    """

    max_new_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_new_tokens: int = 0
    """The fewest tokens to generate before the sequence may end on EOS (OpenAI's and
    vLLM's ``min_tokens``); 0, the default, is off.

    While fewer than ``min_new_tokens`` tokens have been generated, every id in
    ``eos_token_ids`` (those inside the vocabulary) has its logit set to -inf
    before the choice, as transformers' ``MinNewTokensLengthLogitsProcessor``
    (``generate(min_new_tokens=...)``) does: EOS cannot be chosen, greedy rows
    take the best other token and sampled rows draw among the others. The
    token generated once ``min_new_tokens`` tokens exist, and every later
    one, is chosen as usual. The mask holds whether or not ``ignore_eos`` is
    set, and it changes only the EOS ids: ``max_new_tokens`` (and the
    engine's ``max_total_tokens``) still end the sequence, so a value above
    ``max_new_tokens`` simply forbids EOS to the end. Stop strings are the
    gateway's and are not held back by it.

    Where it applies: after logit bias, the watermark and the penalties, and
    before temperature and top-k/p/typical-p, so those choose among the
    tokens left. The log-probabilities and ``top_tokens`` an engine reports
    are those of the distribution it actually sampled from, the EOS ids at
    -inf included: the same rule as ``SamplingParams.logit_bias``, whose
    bias shows in the reported log-probabilities too (see ``SamplingParams``).

    A grammar wins: when masking the EOS ids would leave no token with a
    finite logit (a ``Constraint`` that is complete and allows only EOS), the
    mask is skipped for that step, the grammar's EOS is taken and the
    sequence ends with ``FinishReason.EOS_TOKEN`` short of
    ``min_new_tokens`` (the text is complete and valid; nothing else could
    follow it). Where the grammar allows EOS among other tokens, EOS is masked
    and the text goes on within the grammar. No row ever goes to all -inf (no
    NaN, no crash). The toolkit's ``switchyard_engine.sampling`` does all of
    this for an engine that builds its rows with ``make_sampler``."""


class ImageInput(msgspec.Struct, frozen=True, kw_only=True):
    """One image of a prompt, preprocessed by the gateway with the model's own processor.

    The gateway fetches and decodes the image, runs the model folder's
    transformers processor on it (resizing, normalising, tiling: what the
    model was trained on) and expands the image's placeholder token into
    ``length`` copies at ``prompt_token_ids[offset : offset + length]``. The
    engine runs the model's vision tower (and projector) on ``pixel_values``
    once, and puts the resulting ``length`` feature vectors, in order, at
    those positions in place of the placeholders' embeddings.

    ``content_hash`` names the pixels (a SHA-256 over ``pixel_values``,
    ``shape`` and ``image_size``): equal hashes are equal images to the
    model. An engine with prefix caching must key every cached block that
    covers any placeholder position on the hashes of the images there as
    well as on the token ids (the placeholder ids are equal for every image),
    so two prompts with the same text and different images never share
    cached blocks.
    """

    offset: int
    """Index in ``EngineRequest.prompt_token_ids`` of the image's first placeholder token."""
    length: int
    """How many placeholder tokens (image features) the image takes; they count as prompt
    tokens everywhere (limits, ``TokenEvent.prompt_tokens``)."""
    content_hash: str
    """Hex SHA-256 of the preprocessed pixels (see above)."""
    pixel_values: bytes
    """The processor's ``pixel_values`` for this one image: float32, little-endian, C order."""
    shape: tuple[int, ...]
    """The shape of ``pixel_values``, batch axis of 1 included, as the processor returned it
    (Llava 1.5: ``(1, 3, H, W)``; Llava-Next: ``(1, tiles, 3, H, W)``)."""
    image_size: tuple[int, ...] = ()
    """The processor's ``image_sizes`` entry, ``(height, width)`` of the decoded image, for
    models that need it (Llava-Next); empty for those whose processor gives none."""


class EngineRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One sequence to generate: prompt token ids plus how to sample and stop.

    ``request_id`` is unique among the engine's live requests and names the
    sequence in every ``TokenEvent`` and in ``Engine.abort``.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stopping: StoppingParams
    logprobs: bool = True
    """Whether the engine must compute the chosen token's log-probability."""
    prompt_logprobs: bool = False
    """Whether the engine must report the log-probability of each prompt token
    (TGI's `decoder_input_details`), on the sequence's first event."""
    constraint: Constraint | None = None
    """A grammar the generated text must follow; None for free text. The gateway
    sends one only to engines whose ``EngineSpec.constrained_decoding`` is true."""
    images: tuple[ImageInput, ...] = ()
    """The prompt's images, in prompt order, their placeholders already in
    ``prompt_token_ids`` (see ``ImageInput``). The gateway sends images only to
    models whose ``ModelInfo.takes_images`` is true."""
    adapter_id: str | None = None
    """The LoRA adapter this sequence runs with: a name the engine was given in
    ``EngineConfig.lora_adapters`` or through ``Engine.load_adapter``; None runs
    the base model. An engine adds the adapter's low-rank delta to the base
    projections of this sequence's rows only (other rows of the same batch are
    untouched), and keys its prefix cache on it, so two adapters (or an adapter
    and the base) never share cached blocks for the same prompt. The gateway
    sends only names the engine knows; a name unknown to the engine ends the
    sequence with an ``error`` event."""


class TopToken(msgspec.Struct, frozen=True, array_like=True):
    """One alternative token and its log-probability."""

    id: int
    logprob: float


class TokenEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One generated token, or the end of a sequence.

    An engine emits one event per generated token, in order. The last event of
    a sequence carries ``finish_reason``. An event with ``error`` set ends the
    sequence without a token (``token_id`` is -1): the engine could not serve it.
    """

    request_id: str
    token_id: int
    logprob: float = 0.0
    top_tokens: tuple[TopToken, ...] = ()
    finish_reason: FinishReason | None = None
    seed: int | None = None
    """The seed that sampled this sequence; None for greedy."""
    prompt_tokens: int = 0
    """Length of the prompt as the engine saw it (set on the first event)."""
    cached_tokens: int = 0
    """Of ``prompt_tokens``, how many had their keys and values reused from the
    engine's prefix cache instead of computed (OpenAI's
    ``usage.prompt_tokens_details.cached_tokens``). Set on the first event,
    with ``prompt_tokens``; an engine may repeat the same value on later
    events of the sequence (the Xeon and Gaudi engines do), never a different
    one. It is the hit the sequence found when it was first scheduled (a
    sequence preempted and recomputed later does not count its own blocks). A
    paged cache shares whole blocks, so it is then a multiple of the engine's
    block size (``EngineStats.kv_block_size``); it is never the whole prompt
    (the last prompt token is always computed, to give the first token's
    logits). 0 on a cold cache, when prefix caching is off, when the request
    asks for ``prompt_logprobs`` (every position must be computed to be
    scored), and on engines without a prefix cache."""
    prompt_logprobs: tuple[float, ...] = ()
    """With ``EngineRequest.prompt_logprobs``, on the first event only: the
    log-probability of prompt token ``i + 1`` given tokens ``0..i``, so one fewer
    entry than the prompt has tokens (the first token has none)."""
    prompt_top_tokens: tuple[tuple[TopToken, ...], ...] = ()
    """With ``EngineRequest.prompt_logprobs`` and ``sampling.top_n_tokens`` > 0, on
    the first event only: for each entry of ``prompt_logprobs``, the
    ``top_n_tokens`` most likely tokens at that prompt position, most likely
    first, scored like ``prompt_logprobs`` (raw logits, no sampling parameter)
    so that the prompt token's own value equals its alternative's when it is
    among them. Empty otherwise."""
    error: str | None = None
    queue_seconds: float | None = None
    """On the first event only: seconds from ``submit`` until the sequence first
    entered a forward step (TGI's queue time)."""


class StepReport(msgspec.Struct, frozen=True, kw_only=True):
    """One forward step of an engine, for metrics and traces.

    ``method`` is "prefill" when the step only prefilled, "decode" when it only
    decoded, and "mixed" when it did both (chunked prefill).
    """

    method: str
    batch_size: int
    """Sequences in the step."""
    prefill_tokens: int
    decode_tokens: int
    seconds: float
    """Wall time of the forward pass and sampling."""
    ok: bool = True
    queue_size: int = 0
    """Sequences waiting after the step."""
    kv_tokens_used: int = 0
    kv_tokens_total: int = 0


StepObserver = Callable[[StepReport], None]
"""Receives a ``StepReport`` after every forward step, on the engine's thread:
it must be cheap, thread-safe and must not raise."""


EventSink = Callable[[TokenEvent], None]
"""Where an engine delivers events. Called from the engine's own thread; it must
be thread-safe and must not block (the gateway hands events to its event loop)."""


class EngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What the gateway asks of an engine when it builds one for a model.

    ``model_path`` is a local folder holding ``config.json`` and safetensors
    weights (the gateway resolves hub ids through the local cache first).
    Limits of 0 mean "choose for the machine".
    """

    model_path: str
    dtype: str = "auto"
    """"auto", "float32", "bfloat16" or "float16"."""
    max_total_tokens: int = 0
    """Largest prompt + generated length one sequence may reach."""
    max_input_tokens: int = 0
    """Longest prompt the gateway will send (``--max-input-tokens``); 0 means
    ``max_total_tokens - 1``. Engines that size shapes by prompt length (the
    Gaudi engine's prompt buckets) plan for this many."""
    max_batch_size: int = 0
    """Most sequences decoded together; 0 lets the engine decide."""
    max_batch_prefill_tokens: int = 0
    max_batch_total_tokens: int = 0
    num_shard: int = 1
    """Devices (ranks) one model is split over with tensor parallelism
    (``--sharded true --num-shard N``). An engine that cannot shard refuses
    more than 1 at start-up with EngineStartError."""
    quantize: str | None = None
    """Name of a quantization method declared through ``switchyard_quantization_methods``."""
    quantization: QuantizationMethod | None = None
    """The method ``quantize`` names, found by the gateway among the installed plugins
    and checked against this engine's ``EngineSpec.weight_formats``; None when
    ``quantize`` is. The engine quantizes weights with ``quantization.quantize``
    and packs each result by its format. (It holds functions: an engine that
    runs its loop in another process sends ``quantize`` and looks the method
    up there.)"""
    options: dict[str, str] = {}
    """Engine-specific settings, passed through as given."""
    lora_adapters: dict[str, str] = {}
    """LoRA adapters to serve on this model from the start: name -> local folder in
    PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``). The
    engine checks every folder at ``start`` and raises ``EngineStartError`` naming
    the adapter and the reason when one cannot be served exactly (an engine without
    adapter support raises it for any). ``EngineRequest.adapter_id`` names one."""
    max_loras: int = 0
    """Adapters held ready at once (the others are read again from their folder when
    a request needs them, least recently used out first); 0 lets the engine decide."""
    max_lora_rank: int = 0
    """The largest rank an adapter may have (any module's, ``rank_pattern``
    included); an adapter over it is refused at load. 0 lets the engine decide."""


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What an engine learned about the model while loading it."""

    model_type: str
    dtype: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    device: str
    takes_images: bool = False
    """Whether the engine runs this model's vision tower, and so takes
    ``EngineRequest.images`` (a vision-language model such as Llava-Next). The
    gateway then loads the model folder's processor to prepare images, and
    refuses images for models where this is false."""
    max_total_tokens: int = 0
    """The longest sequence, prompt plus generated tokens, the engine serves, as it
    resolved it: ``EngineConfig.max_total_tokens`` where that is set; otherwise the
    model's context (``max_position_embeddings``) where the KV cache holds one
    sequence of it, else the most it holds. The gateway enforces this when no
    ``--max-total-tokens`` is given. 0: the engine leaves the choice to the gateway
    (its default, the model's context capped at 4,096)."""
    max_total_tokens_reason: str = ""
    """Why ``max_total_tokens`` is what it is, for the start-up log ("the model's
    context", "the KV cache holds 5,000 tokens: 40% of 96 MiB free memory")."""


class WarmupReport(msgspec.Struct, frozen=True, kw_only=True):
    """What warmup measured: how long it took and the token capacity it settled on."""

    seconds: float
    max_batch_total_tokens: int
    max_batch_size: int


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of an engine's load, cheap enough to take per scrape."""

    running: int
    """Sequences in the running batch."""
    waiting: int
    """Sequences submitted and not yet admitted."""
    batch_tokens: int = 0
    """Tokens held in the KV cache by running sequences."""
    max_batch_total_tokens: int = 0
    steps: int = 0
    """Forward passes run since start."""
    kv_block_size: int = 0
    """Tokens per KV-cache block (a paged cache's page; a static cache's whole row); 0: unknown."""
    kv_blocks_total: int = 0
    """Blocks the KV cache has; 0: the engine does not report its cache in blocks."""
    kv_blocks_used: int = 0
    """Blocks held by live sequences (a block two sequences share counts once). The KV-cache
    utilisation that cluster routers read is ``kv_blocks_used / kv_blocks_total``."""
    spec_method: str = ""
    """The speculative decoding method the engine runs (``ngram``, ``draft_model``); empty:
    none."""
    spec_drafts: int = 0
    """Sequence steps that fed drafted tokens, since start."""
    spec_draft_tokens: int = 0
    """Drafted tokens fed to the model, since start."""
    spec_accepted_tokens: int = 0
    """Of ``spec_draft_tokens``, those kept (each one a token the step emitted for free)."""
    max_lora: int = 0
    """The most LoRA adapters the engine holds ready to serve a batch (``max_loras``):
    when that many are in use, a request for another adapter waits. 0: the engine
    serves no adapters now (none loaded, and no sequence runs or waits with one);
    the other ``*_lora_adapters`` fields are then empty."""
    running_lora_adapters: tuple[str, ...] = ()
    """Names of the adapters the running sequences use, each once, sorted (sequences
    without an adapter add none). Cluster routers read it to send a request where its
    adapter is already loaded."""
    waiting_lora_adapters: tuple[str, ...] = ()
    """Names of the adapters of the sequences waiting to be admitted, each once, sorted
    (a name may also be in ``running_lora_adapters``)."""


class DeviceInfo(msgspec.Struct, frozen=True, kw_only=True):
    """Answer of a device probe: is the hardware an engine needs present?"""

    available: bool
    name: str
    """Human name, e.g. "Intel Xeon (2 cores, avx512_bf16)"."""
    detail: str = ""
    """Why it is unavailable, or extra facts worth printing."""


class CommandSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A subcommand a plugin adds to the ``switchyard`` command line.

    Returned by ``switchyard_commands``. ``switchyard NAME ARGS...`` calls
    ``main`` with ``ARGS`` (the plugin parses them) and exits with its
    return value.
    """

    name: str
    """The subcommand, e.g. "warmup-plan"; unique among built-in and plugin commands."""
    help: str
    """One line for ``switchyard --help``."""
    main: Callable[[list[str]], int]
    """Runs the command on the arguments after its name; returns the exit status."""


class EngineSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A hardware plugin's declaration of one engine.

    Returned by ``switchyard_engines``. It is a record, not a live engine: the
    gateway calls ``probe`` to see whether the device is there and ``factory``
    only when it serves a model with this engine.
    """

    name: str
    """Unique across installed plugins, e.g. "xeon"."""
    description: str
    factory: Callable[[EngineConfig], Engine]
    """Builds an engine for one model; must not load weights yet (that is ``start``)."""
    probe: Callable[[], DeviceInfo]
    """Cheap check for the device; must not raise."""
    priority: int = 0
    """When no engine is named, the available engine with the highest priority serves."""
    weight_formats: tuple[WeightFormat, ...] = ()
    """The quantized weight formats the engine's kernels run (see
    ``switchyard_spec.quantization``). The gateway refuses, before calling
    ``factory``, a ``--quantize`` method none of whose formats is here, and
    lists the methods that are. Declare every format the engine has a kernel
    for; when this machine lacks one (an instruction set, a library),
    ``Engine.start`` raises ``EngineStartError`` saying so."""
    constrained_decoding: bool = False
    """Whether the engine honours ``EngineRequest.constraint`` (structured output).
    The gateway refuses a request with a grammar or a JSON ``response_format`` for
    a model whose engine does not, with a 422, rather than return unconstrained
    text. The toolkit's ``switchyard_engine.grammar`` does the masking."""
    pooling_factory: Callable[[EngineConfig], PoolingEngine] | None = None
    """Builds a ``PoolingEngine`` for an embedding or reranker model (see
    ``switchyard_spec.pooling``); None when the engine serves generation only."""
