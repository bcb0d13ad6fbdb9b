"""Tiny pooling models built locally with a fixed seed: embedders and a reranker.

No hub: each folder is built from random weights the way its kind is published,
so the server and the independent references (sentence-transformers, transformers)
read the same files.

- `bert-mean`: a sentence-transformers folder over a tiny `BertModel`: mean pooling,
  a Dense layer and Normalize; its config.json declares Matryoshka dimensions.
- `bert-cls`: the same encoder with CLS pooling and no Normalize, not Matryoshka, and
  prompts (`query: `) in config_sentence_transformers.json.
- `decoder-last`: the suite's tiny Llama (`switchyard/tiny-llama-random`) as an
  embedder: last-token pooling and Normalize, as Qwen- and Mistral-based embedders do.
- `cross-encoder`: a tiny `BertForSequenceClassification` with one label.
- `roberta-mean`: a sentence-transformers folder over a tiny `XLMRobertaModel` (mean
  pooling, Normalize), whose position ids start after its padding id.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SEED = 39
BUILD_VERSION = "3"
_WORDS = (  # the vocabulary beyond single characters
    "the a an of to in and is are was were be for on with as by at from that this it "
    "what which who how when where why query passage document answer question text "
    "cat cats dog dogs bird fish tree trees house car road city river sea sky sun moon "
    "star red green blue black white big small fast slow good bad new old hot cold "
    "run runs ran eat eats walk walks swim swims fly flies read reads write writes "
    "paris london france england capital country population people language model "
    "models vector vectors search rank ranking embedding embeddings server gateway "
    "python code data batch token tokens number one two three four five six seven "
    "eight nine ten hello world machine learning deep neural network retrieval"
)
MATRYOSHKA = (32, 16, 8)
HIDDEN = 32
INIT_RANGE = 0.3
"""Far above BERT's 0.02: a random encoder's outputs then depend clearly on its input (with
small weights every text's [CLS] vector is nearly the same, and so is every score)."""


def _vocab() -> list[str]:
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789.,?!'-:;")
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *(f"##{c}" for c in letters),
            *_WORDS.split()]


def _bert_config(**extra: object):  # -> transformers.BertConfig
    from transformers import BertConfig

    return BertConfig(vocab_size=len(_vocab()), hidden_size=HIDDEN, num_hidden_layers=2,
                      num_attention_heads=4, intermediate_size=64, max_position_embeddings=128,
                      type_vocab_size=2, initializer_range=INIT_RANGE, **extra)


def _tokenizer(folder: Path):  # -> transformers.BertTokenizerFast
    from transformers import BertTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {word: i for i, word in enumerate(_vocab())}
    tok = BertTokenizerFast(vocab=vocab, model_max_length=128)
    tok.save_pretrained(folder)
    return tok


def _encoder(folder: Path, seed: int) -> Path:
    import torch
    from transformers import BertModel

    torch.manual_seed(seed)
    _tokenizer(folder)
    BertModel(_bert_config()).eval().save_pretrained(folder, safe_serialization=True)
    return folder


def _st_folder(out: Path, base: Path, pooling: str, dense: bool, normalize: bool,
               max_seq_length: int, prompts: dict[str, str] | None = None) -> None:
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import modules as models

    torch.manual_seed(SEED)
    transformer = models.Transformer(str(base), max_seq_length=max_seq_length)
    dim = transformer.get_embedding_dimension()
    modules = [transformer, models.Pooling(dim, pooling_mode=pooling)]
    if dense:
        modules.append(models.Dense(dim, HIDDEN, activation_function=torch.nn.Tanh()))
    if normalize:
        modules.append(models.Normalize())
    model = SentenceTransformer(modules=modules, device="cpu", prompts=prompts)
    model.save(str(out))


def _build(kind: str, out: Path, work: Path, llama: Path | None) -> None:
    if kind == "bert-mean":
        _st_folder(out, _encoder(work / "base", SEED), "mean", dense=True, normalize=True,
                   max_seq_length=64)
        config = json.loads((out / "config.json").read_text())
        config["matryoshka_dimensions"] = list(MATRYOSHKA)
        (out / "config.json").write_text(json.dumps(config, indent=2))
    elif kind == "bert-cls":
        _st_folder(out, _encoder(work / "base", SEED + 1), "cls", dense=False, normalize=False,
                   max_seq_length=64, prompts={"query": "query: ", "passage": "passage: "})
    elif kind == "decoder-last":
        assert llama is not None, "decoder-last is built from the tiny Llama"
        # Without the chat model's template: sentence-transformers would wrap each text in
        # it, where decoder embedders take plain text (and a prompt).
        base = work / "llama"
        shutil.copytree(llama, base, ignore=shutil.ignore_patterns("chat_template.jinja"))
        config = json.loads((base / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (base / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
        _st_folder(out, base, "lasttoken", dense=False, normalize=True, max_seq_length=256)
    elif kind == "roberta-mean":
        import torch
        from transformers import XLMRobertaConfig, XLMRobertaModel

        base = work / "base"
        _tokenizer(base)
        torch.manual_seed(SEED + 3)
        # XLM-R's layout: padding id 1, positions offset past it (max_position_embeddings
        # counts the offset), one token type. The WordPiece tokenizer's [UNK] is id 1 too.
        config = XLMRobertaConfig(vocab_size=len(_vocab()), hidden_size=HIDDEN,
                                  num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=130,
                                  type_vocab_size=1, pad_token_id=1,
                                  initializer_range=INIT_RANGE)
        XLMRobertaModel(config).eval().save_pretrained(base, safe_serialization=True)
        _st_folder(out, base, "mean", dense=False, normalize=True, max_seq_length=128)
    elif kind == "cross-encoder":
        import torch
        from transformers import BertForSequenceClassification

        torch.manual_seed(SEED + 2)
        _tokenizer(out)
        model = BertForSequenceClassification(_bert_config(num_labels=1)).eval()
        model.save_pretrained(out, safe_serialization=True)
    else:
        raise ValueError(kind)


def ensure_pooling_model(kind: str, cache: Path, llama: Path | None = None) -> Path:
    """The folder of the tiny pooling model `kind` under `cache`, built on first use."""
    target = cache / f"pooling-{kind}-v{BUILD_VERSION}"
    if target.is_dir():
        return target
    work = cache / f".building-{kind}"
    shutil.rmtree(work, ignore_errors=True)
    _build(kind, work / "out", work, llama)
    (work / "out").rename(target)
    shutil.rmtree(work, ignore_errors=True)
    return target
