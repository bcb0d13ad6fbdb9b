"""The prompts of a `/v1/completions` request, in every form OpenAI accepts, as token ids.

OpenAI's legacy API takes a prompt as a string, a list of strings, a list of
token ids (one prompt) or a list of token-id lists (several). Evaluation
harnesses send token ids (lm-evaluation-harness does by default), so that the
server scores exactly the tokens they counted. Token prompts are used as
given: no BOS or other special token is added, as OpenAI and vLLM do. Every
form is held to the same limits (`--max-client-batch-size` prompts; the token
limits are `build_plan`'s).
"""

from __future__ import annotations

import msgspec

from switchyard.errors import ApiError, validation_error
from switchyard.text.echo import EchoedPrompt, echo_from_ids, echo_from_offsets
from switchyard.text.tokenizer import TextTokenizer

RawPrompt = str | list[str | int | list[int]]
"""`CompletionRequest.prompt` as decoded."""

_FORMS = ("a string, a list of strings, a list of token ids or a list of token-id lists")


class CompletionPrompt(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt: its token ids, and what its echo is made from."""

    ids: tuple[int, ...]
    text: str | None = None
    """The prompt string as given; None for a token prompt."""
    spans: tuple[tuple[int, int], ...] = ()
    """Character offsets of each token in `text` (string prompts, when asked for)."""

    def echo_text(self, tokenizer: TextTokenizer) -> str:
        """The text `echo` puts before the completion: the string, or the decoded ids."""
        if self.text is not None:
            return self.text
        return tokenizer.decode(self.ids, skip_special_tokens=False)

    def echoed(self, tokenizer: TextTokenizer) -> EchoedPrompt:
        """The echo's text with each prompt token's text and offset in it."""
        if self.text is not None:
            return echo_from_offsets(self.text, self.spans)
        return echo_from_ids(tokenizer, self.ids)


def prompt_forms(prompt: RawPrompt) -> list[str] | list[list[int]]:
    """Each prompt of the request as a string or a token-id list; mixed lists are a 422."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise validation_error("`prompt` cannot be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [p for p in prompt if isinstance(p, str)]
    if all(isinstance(p, int) for p in prompt):
        return [[p for p in prompt if isinstance(p, int)]]
    if all(isinstance(p, list) for p in prompt):
        return [p for p in prompt if isinstance(p, list)]
    raise validation_error(
        f"`prompt` must be {_FORMS}; this list mixes them", param="prompt")


def check_batch_size(count: int, max_client_batch_size: int) -> None:
    """TGI's `--max-client-batch-size`: how many prompts one request may carry."""
    if count > max_client_batch_size:
        raise ApiError(
            422,
            f"Number of prompts exceeds the maximum allowed batch size of {max_client_batch_size}",
            "batch size exceeded",
            param="prompt",
        )


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    """Every id of a token prompt must name a token of the model (0 to vocab_size - 1)."""
    for position, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            raise validation_error(
                f"`prompt` token id {token_id} at position {position} is outside the "
                f"vocabulary (ids 0 to {vocab_size - 1})",
                param="prompt",
            )


def completion_prompts(
    prompt: RawPrompt,
    tokenizer: TextTokenizer,
    vocab_size: int,
    max_client_batch_size: int,
    with_spans: bool = False,
) -> list[CompletionPrompt]:
    """Validate and tokenize the request's prompts.

    String prompts are tokenized with the tokenizer's special tokens (BOS and
    the like), token prompts are taken as they are. `with_spans` keeps the
    string prompts' token offsets, which an echo with log-probabilities needs.
    """
    forms = prompt_forms(prompt)
    check_batch_size(len(forms), max_client_batch_size)
    prompts: list[CompletionPrompt] = []
    for form in forms:
        if not form:
            raise validation_error("`prompt` cannot be empty", param="prompt")
        if isinstance(form, str):
            ids, spans = tokenizer.encode_with_char_offsets(form, add_special_tokens=True)
            if not ids:
                raise validation_error("`prompt` has no tokens", param="prompt")
            prompts.append(CompletionPrompt(
                ids=tuple(ids), text=form, spans=tuple(spans) if with_spans else ()))
        else:
            check_token_ids(form, vocab_size)
            prompts.append(CompletionPrompt(ids=tuple(form)))
    return prompts
