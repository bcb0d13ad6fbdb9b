"""Fixtures the engine toolkit's tests share: the test model's tokenizer and an xgrammar
compiler over it (module-scoped where used, built once per module)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    """The random-weight test model's tokenizer."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(default_model_path))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    """An xgrammar compiler over `tokenizer`'s vocabulary, one thread, no cache (so each
    test measures and checks its own compile)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
