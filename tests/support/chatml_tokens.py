"""The special tokens of the ChatML tokenizer the text tests train (``tests/text/conftest.py``),
and the ids the trainer gives them: their order in :data:`SPECIAL_TOKENS`."""

from __future__ import annotations

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ENDOFTEXT, IM_START, IM_END = 0, 1, 2
