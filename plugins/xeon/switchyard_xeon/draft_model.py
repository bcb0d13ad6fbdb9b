"""Drafts from a smaller model: the ``speculative_model`` engine option (``--speculative-model``).

A draft model proposes a sequence's next tokens by sampling them one at a
time from its own distribution q (the request's temperature, top-k, top-p and
typical-p applied to its logits; greedy requests draft its argmax). The
target verifies them in one step and keeps them by the rejection rule of
Leviathan et al. and Chen et al.
(:func:`~switchyard_engine.speculation.acceptance.accept_rejection`), so
every emitted token has exactly the target's distribution, whatever q is.

The draft model runs on the compute thread beside the target, in fp32, with
a transformers ``DynamicCache`` per sequence: it is meant to be a few times
smaller than the target, and at the batch sizes the load gate allows its
steps cost less than the target's. Its cache is cut back to the tokens the
target kept after every step, and dropped when the sequence ends.

Both models must share one vocabulary: the draft's token ids must mean the
target's. :func:`check_vocabulary` compares their tokenizers at start-up and
refuses the option, naming it, when they differ.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from switchyard_engine.sampling import warp
from switchyard_spec import EngineStartError

from switchyard_xeon.sequence import Sequence

log = logging.getLogger("switchyard.xeon")

OPTION = "speculative_model"
"""The engine option naming the draft model's folder."""


def _vocabulary(folder: Path) -> dict[str, int]:
    """A model folder's token -> id map, read from its ``tokenizer.json``."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise EngineStartError(f"engine option {OPTION}: {folder} has no tokenizer.json, so "
                               f"its vocabulary cannot be checked against the target's")
    data = json.loads(path.read_text(encoding="utf-8"))
    vocab = dict(data.get("model", {}).get("vocab", {}))
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = int(added["id"])
    return vocab


def check_vocabulary(target: Path, draft: Path) -> None:
    """Refuse a draft model whose tokenizer gives any token another id than the target's."""
    want, got = _vocabulary(target), _vocabulary(draft)
    if want != got:
        differ = sorted(set(want.items()) ^ set(got.items()), key=lambda kv: kv[1])
        example = ", ".join(f"{token!r}={i}" for token, i in differ[:3])
        raise EngineStartError(
            f"engine option {OPTION}={draft}: its tokenizer is not the target's "
            f"({len(got)} tokens against {len(want)}; {len(differ)} token/id pairs differ, "
            f"e.g. {example}); a draft model must share the target's vocabulary")


@dataclass
class _State:
    """A sequence's draft-model cache and how many of its tokens it holds."""

    cache: object
    length: int = 0


@dataclass
class DraftModel:
    """A draft model and its per-sequence caches; see the module docstring."""

    model: torch.nn.Module
    vocab_size: int
    """The target's vocabulary width: drafts and q stay within it."""
    method: str = "draft_model"
    _states: dict[int, _State] = field(default_factory=dict)
    _failed: bool = False
    """Whether a draft forward failed yet (logged once)."""

    @functools.cached_property
    def _cache_kwarg(self) -> str:
        """The forward's cache argument: ``cache`` in transformers 5.24 on, before it
        ``past_key_values`` (which newer versions still take, with a warning)."""
        params = inspect.signature(self.model.forward).parameters
        return "cache" if "cache" in params else "past_key_values"

    @classmethod
    def load(cls, folder: Path, target: Path, vocab_size: int) -> DraftModel:
        """Check the vocabulary, then load the draft model from ``folder`` in fp32."""
        from transformers import AutoModelForCausalLM

        if not folder.is_dir():
            raise EngineStartError(f"engine option {OPTION}={folder}: no such folder")
        check_vocabulary(target, folder)
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise EngineStartError(f"engine option {OPTION}={folder}: the draft model does "
                                   f"not load: {exc}") from exc
        return cls(model.eval(), vocab_size)

    def draft(self, seq: Sequence, room: int) -> list[int]:
        """Sample up to ``room`` drafts for ``seq``; their q rows go to ``seq.draft_probs``.

        A draft forward that fails (a sequence past the draft's positions, say)
        costs the sequence its drafts for this step, never its output: its
        draft cache is dropped and the step runs without drafts.
        """
        try:
            return self._draft(seq, room)
        except Exception:  # the drafts are an optimization: the target decides alone
            if not self._failed:
                log.warning("draft model forward failed; sequences draft nothing when it does",
                            exc_info=True)
            self._failed = True
            self._states.pop(seq.seq_id, None)
            seq.draft_probs = None
            return []

    def _draft(self, seq: Sequence, room: int) -> list[int]:
        from transformers import DynamicCache

        state = self._states.get(seq.seq_id)
        if state is None:
            state = self._states[seq.seq_id] = _State(DynamicCache())
        tokens = seq.tokens
        if state.length > len(tokens):  # never expected; start over rather than guess
            state.cache, state.length = DynamicCache(), 0
        feed = tokens[state.length:]
        drafts: list[int] = []
        rows: list[torch.Tensor] = []
        params = seq.sampler.params
        with torch.inference_mode():
            for _ in range(room):
                ids = torch.tensor([feed], dtype=torch.long)
                out = self.model(input_ids=ids, use_cache=True, **{self._cache_kwarg: state.cache})
                state.length += len(feed)
                logits = out.logits[0, -1:, : self.vocab_size].float()
                if logits.shape[1] < self.vocab_size:  # a narrower head: the rest is never drafted
                    logits = torch.nn.functional.pad(
                        logits, (0, self.vocab_size - logits.shape[1]), value=float("-inf"))
                q = self._distribution(logits, seq)
                token = (int(q.argmax()) if not params.do_sample else
                         int(torch.multinomial(q, 1, generator=seq.sampler.generator)))
                drafts.append(token)
                rows.append(q)
                feed = [token]
        # The last draft was never fed: the cache holds the sequence and all drafts but it.
        seq.draft_probs = torch.stack(rows) if rows else None
        return drafts

    @staticmethod
    def _distribution(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """q for one position: the request's warping applied to the draft's logits."""
        params = seq.sampler.params
        if not params.do_sample:
            return torch.nn.functional.one_hot(logits[0].argmax(), logits.shape[1]).double()
        return torch.softmax(warp(logits, [params])[0].double(), dim=-1)

    def settle(self, seq: Sequence, cached: int) -> None:
        """Cut ``seq``'s draft cache back to its first ``cached`` tokens (those the target
        kept), after a verifying step."""
        state = self._states.get(seq.seq_id)
        if state is not None and state.length > cached:
            # A negative count removes that many tokens from the end (transformers' crop).
            state.cache.crop(cached - state.length)  # type: ignore[attr-defined]
            state.length = cached

    def forget(self, seq: Sequence) -> None:
        """Drop an ended sequence's draft cache."""
        self._states.pop(seq.seq_id, None)
