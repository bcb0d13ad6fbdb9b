"""Text handling for the gateway: tokenizers, chat templates, detokenizing, stop strings.

The gateway owns text; engines see only token ids. This package turns requests
into ids (`load_tokenizer`, `render_chat`) and token events back into text
(`IncrementalDetokenizer`, `StopMatcher`).
"""

from switchyard.text.chat import ChatMessage, ChatMessageLike, ChatTemplateError, render_chat
from switchyard.text.detokenizer import IncrementalDetokenizer
from switchyard.text.stops import StopMatcher, StopStep
from switchyard.text.tokenizer import TextTokenizer, TokenizerLoadError, TokenSpan, load_tokenizer

__all__ = [
    "ChatMessage",
    "ChatMessageLike",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "StopMatcher",
    "StopStep",
    "TextTokenizer",
    "TokenSpan",
    "TokenizerLoadError",
    "load_tokenizer",
    "render_chat",
]
