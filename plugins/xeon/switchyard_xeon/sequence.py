"""One request's life in the engine: its tokens, how many are cached, what the next step feeds.

A sequence's ``tokens`` are its prompt followed by what it generated. The
first ``num_cached`` of them have their keys and values in the cache; the
scheduler sets ``num_scheduled``, how many of the rest the next forward pass
feeds (the whole remaining prompt, a chunk of it, or the one newest token).
When the fed tokens reach the end of ``tokens`` the step samples a new token.

Preemption drops the cache (``num_cached`` back to 0) but keeps ``tokens``
and the sampling state, so the sequence is re-prefilled from its prompt *and*
its generated tokens and continues exactly where it stopped.

A prompt with images names the images in its cached blocks' hashes:
:meth:`Sequence.block_keys` gives the block manager each full block's extra
key (empty for blocks that cover no image placeholder, so text hashes as
text).

Pure Python.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from switchyard_engine.sequence import BaseSequence
from switchyard_engine.speculation.ngram import NgramIndex
from switchyard_spec import ImageInput

from switchyard_xeon.block_manager import BlockKeys, rooted_keys

if TYPE_CHECKING:  # only named in annotations: the module stays free of torch
    import torch
    from switchyard_engine.lora.bank import Handle
    from switchyard_engine.lora.folder import LoraAdapter

_ids = itertools.count()


@dataclass(eq=False)
class Sequence(BaseSequence):
    """A request being served: the toolkit's sequence, plus its cache progress."""

    seq_id: int = field(default_factory=lambda: next(_ids))
    num_cached: int = 0
    """Tokens whose keys/values are in the cache."""
    num_scheduled: int = 0
    """Tokens the coming step feeds, from ``num_cached`` on (set by the scheduler)."""
    preemptions: int = 0
    """Times this sequence lost its cache and went back to the waiting queue."""
    drafts: list[int] = field(default_factory=list)
    """Tokens guessed for the coming step (speculative decoding): fed after the newest
    token, and kept only as far as the step's sampling agrees (``switchyard_xeon.speculation``).
    ``num_scheduled`` counts them."""
    draft_probs: torch.Tensor | None = None
    """The draft model's probabilities each draft was sampled from ([len(drafts), vocab]);
    None for n-gram drafts, which are kept while the target samples them."""
    ngrams: NgramIndex | None = None
    """The index its drafts come from (made at its first draft)."""
    lora: Handle | None = None
    """The LoRA adapter it runs with (``EngineRequest.adapter_id``, bound at submit: an
    unload afterwards lets it finish); None for the base model."""
    adapter: LoraAdapter | None = None
    """The adapter's matrices, set when the scheduler admits it (``XeonAdapters.admit``)."""
    draft_limit: int = 0
    """How many tokens its next draft may have (0: the engine's ``speculate``); it grows
    after a step kept every draft and shrinks after one that did not."""

    @property
    def remaining(self) -> int:
        """Tokens not yet in the cache: 1 while decoding, more while (re-)prefilling."""
        return len(self.tokens) - self.num_cached

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt tokens still need their log-probabilities computed.

        Only before the first generated token: a preempted sequence has
        delivered them already and does not score its prompt again.
        """
        return (self.request.prompt_logprobs and self.generated == 0
                and self.num_cached < self.prompt_len - 1)

    @property
    def prompt_top_n(self) -> int:
        """How many alternatives to report per scored prompt position (0: none)."""
        return self.request.sampling.top_n_tokens if self.request.prompt_logprobs else 0

    @property
    def new_tokens(self) -> list[int]:
        """Tokens the coming step feeds (its drafts last)."""
        return self.tokens[self.num_cached : self.num_cached + self.num_scheduled] + self.drafts

    @property
    def samples(self) -> bool:
        """Whether the coming step ends at the last token (or its drafts), and so samples."""
        return self.num_cached + self.num_scheduled == len(self.tokens) + len(self.drafts)

    def block_keys(self, block_size: int) -> BlockKeys | None:
        """The extra prefix-cache key of each full block (None for a prompt without images
        that runs on the base model).

        A block that covers any placeholder token of an image is keyed on that
        image's ``content_hash`` and its place in the prompt (offset and
        length), so the same text with different images parts at the image's
        first block, and blocks after it inherit the difference through the
        chained hash; blocks before the first image key on their ids alone.
        A sequence with a LoRA adapter roots its chain on the adapter (its
        keys and values differ from the base model's from the first token).
        """
        images = self.request.images
        keys: BlockKeys | None = None
        if images:
            def keys(index: int) -> bytes:
                return image_block_key(images, index * block_size, (index + 1) * block_size)
        if self.lora is not None:
            return rooted_keys(keys, self.lora.cache_key)
        return keys


def image_block_key(images: tuple[ImageInput, ...], start: int, end: int) -> bytes:
    """The extra key of the block of positions ``start .. end``: its images, in prompt order."""
    return b"".join(f"{i.offset}:{i.length}:{i.content_hash};".encode()
                    for i in images if i.offset < end and start < i.offset + i.length)
