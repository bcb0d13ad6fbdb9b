"""Unit tests of the pooling pieces without a server: reading folders, the engine's batching,
tokenization limits and the vector shaping of the routes."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
from switchyard.errors import ApiError
from switchyard.models.pooling_folder import is_pooling_folder, read_pooling_folder
from switchyard.routes.pooling_common import parse_inputs, shape
from switchyard.text.pooling_inputs import PoolingTokenizer
from switchyard_spec import EngineConfig, PoolingRequest, PoolingResult, PoolingTask
from switchyard_xeon.pooling import make_pooling_engine
from switchyard_xeon.pooling.layout import LayoutError, read_layout

from tests.support.pooling_models import MATRYOSHKA


def test_folders_are_told_apart(pooling_models: dict[str, Path],
                                default_model_path: Path) -> None:
    assert not is_pooling_folder(default_model_path)
    assert all(is_pooling_folder(p) for p in pooling_models.values())
    mean = read_pooling_folder(pooling_models["bert-mean"])
    assert (mean.normalize, mean.matryoshka_dimensions, mean.max_seq_length) == \
        (True, MATRYOSHKA, 64)
    cls = read_pooling_folder(pooling_models["bert-cls"])
    assert (cls.normalize, cls.matryoshka_dimensions) == (False, None)
    assert cls.prompts == {"query": "query: ", "passage": "passage: "}
    assert read_pooling_folder(pooling_models["cross-encoder"]).reranker
    assert read_layout(pooling_models["decoder-last"]).modes == ("lasttoken",)
    assert read_layout(pooling_models["cross-encoder"]).reranker


def test_layout_reads_legacy_pooling_flags_and_refuses_unknown_modules(tmp_path: Path) -> None:
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 8, "pooling_mode_cls_token": True,
        "pooling_mode_max_tokens": True, "pooling_mode_mean_tokens": False}))
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert read_layout(tmp_path).modes == ("cls", "max")
    modules.append({"idx": 2, "name": "2", "path": "2_LSTM",
                    "type": "sentence_transformers.models.LSTM"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(LayoutError, match="LSTM"):
        read_layout(tmp_path)


def test_concurrent_requests_share_forwards(pooling_models: dict[str, Path]) -> None:
    """Sixteen requests submitted together run in fewer forwards, and each gets its own
    answer: the same vector as when it runs alone."""
    engine = make_pooling_engine(EngineConfig(model_path=str(pooling_models["bert-mean"]),
                                              dtype="float32",
                                              options={"batch_window_ms": "20"}))
    info = engine.start()
    assert info.task is PoolingTask.EMBED and info.dimensions == 32
    try:
        rows = [tuple(range(5, 5 + n)) for n in range(3, 19)]
        answers: dict[str, PoolingResult] = {}
        done = threading.Event()

        def collect(result: PoolingResult) -> None:
            # The engine's thread: nothing raised here reaches the test (the engine logs it),
            # so the test checks what it kept.
            answers[result.request_id] = result
            if len(answers) == len(rows):
                done.set()

        before = engine.stats().steps
        for i, row in enumerate(rows):
            engine.submit(PoolingRequest(request_id=str(i), token_ids=(2, *row, 3)), collect)
        assert done.wait(30)
        assert {rid: r.error for rid, r in answers.items() if r.error is not None} == {}
        results = {rid: np.frombuffer(r.values, "<f4") for rid, r in answers.items()}
        assert engine.stats().steps - before < len(rows)
        alone = threading.Event()
        single: list[PoolingResult] = []
        engine.submit(PoolingRequest(request_id="alone", token_ids=(2, *rows[-1], 3)),
                      lambda r: (single.append(r), alone.set()))
        assert alone.wait(30) and single[0].error is None, single
        np.testing.assert_allclose(results[str(len(rows) - 1)],
                                   np.frombuffer(single[0].values, "<f4"), atol=1e-5)
    finally:
        engine.shutdown()


def test_budget_cuts_a_batch_into_like_lengths(pooling_models: dict[str, Path]) -> None:
    engine = make_pooling_engine(EngineConfig(model_path=str(pooling_models["bert-mean"]),
                                              options={"max_batch_tokens": "64"}))
    from switchyard_xeon.pooling.engine import _Pending

    batch = [_Pending(PoolingRequest(request_id=str(n), token_ids=(1,) * n), print, 0.0)
             for n in (30, 4, 16, 5, 15, 6)]
    chunks = engine._chunks(batch)
    # Sorted by length; each forward padded to its longest row stays within 64 tokens.
    assert [[len(p.request.token_ids) for p in c] for c in chunks] == [[4, 5, 6, 15], [16, 30]]


def test_tokenizer_limits_and_truncation(pooling_models: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    folder = pooling_models["cross-encoder"]
    reference = AutoTokenizer.from_pretrained(folder)
    tok = PoolingTokenizer(folder, max_input_tokens=8, vocab_size=10)
    assert tok.vocab_size == len(reference)
    text = "the cat runs fast in the city of paris"
    with pytest.raises(ApiError, match="over the model's limit of 8"):
        tok.texts([text])
    full = reference(text, add_special_tokens=False)["input_ids"]
    right, = tok.texts([text], truncate=True, direction="right")
    left, = tok.texts([text], truncate=True, direction="left")
    cls, sep = reference.cls_token_id, reference.sep_token_id
    assert right.ids == (cls, *full[:6], sep) and left.ids == (cls, *full[-6:], sep)
    pair, = PoolingTokenizer(folder, 64, 10).pairs("what is paris", ["paris is a city"])
    want = reference("what is paris", "paris is a city")
    assert pair.ids == tuple(want["input_ids"])
    assert pair.type_ids == tuple(want["token_type_ids"])


def test_inputs_and_matryoshka_shaping() -> None:
    assert parse_inputs("a", "input") == (["a"], [])
    assert parse_inputs([1, 2], "input") == ([], [[1, 2]])
    assert parse_inputs([[1], [2, 3]], "input") == ([], [[1], [2, 3]])
    with pytest.raises(ApiError):
        parse_inputs([True, 1], "input")
    vector = np.array([3.0, 4.0, 12.0], dtype=np.float32)
    np.testing.assert_allclose(shape(vector, False, 2), [0.6, 0.8], rtol=1e-6)
    np.testing.assert_allclose(shape(vector, True, None), vector / 13, rtol=1e-6)
    np.testing.assert_array_equal(shape(vector, False, None), vector)


def test_transformer_module_in_a_subfolder(pooling_models: dict[str, Path],
                                           tmp_path: Path) -> None:
    """Older sentence-transformers folders keep the backbone and its tokenizer in
    `0_Transformer`: both sides read them there and agree with sentence-transformers."""
    import shutil

    from tests.support.embedding_reference import assert_same_vectors, sentence_transformer

    source, folder = pooling_models["bert-cls"], tmp_path / "st"
    shutil.copytree(source, folder)
    (folder / "0_Transformer").mkdir()
    for path in folder.iterdir():
        if path.is_file() and path.name not in ("modules.json", "README.md",
                                                "config_sentence_transformers.json"):
            path.rename(folder / "0_Transformer" / path.name)
    modules = json.loads((folder / "modules.json").read_text())
    modules[0]["path"] = "0_Transformer"
    (folder / "modules.json").write_text(json.dumps(modules))
    settings = read_pooling_folder(folder)
    assert settings.backbone == folder / "0_Transformer" and settings.max_seq_length == 64
    tok = PoolingTokenizer(settings.backbone, 64, 0)
    engine = make_pooling_engine(EngineConfig(model_path=str(folder), dtype="float32"))
    engine.start()
    try:
        got: list[np.ndarray] = []
        done = threading.Event()
        encoded, = tok.texts(["query: the cat runs"])
        engine.submit(PoolingRequest(request_id="a", token_ids=encoded.ids),
                      lambda r: (got.append(np.frombuffer(r.values, "<f4")), done.set()))
        assert done.wait(30)
    finally:
        engine.shutdown()
    want = sentence_transformer(source).encode(["the cat runs"], prompt_name="query")
    assert_same_vectors(np.stack(got), want)


@pytest.mark.parametrize("kind", ["bert-mean", "decoder-last"])
def test_bf16_backbone_stays_close(kind: str, pooling_models: dict[str, Path]) -> None:
    """`dtype` bfloat16 (the default where the CPU has it): the backbone in bf16, pooling in
    float32, within 1e-3 cosine distance of sentence-transformers in float32."""
    from tests.support.embedding_reference import cosine_distance, sentence_transformer

    model = sentence_transformer(pooling_models[kind])
    texts = ["hello world", "the cat runs fast in the city of paris and london", "what is it"]
    want = model.encode(texts)
    engine = make_pooling_engine(EngineConfig(model_path=str(pooling_models[kind]),
                                              dtype="bfloat16"))
    assert engine.start().dtype == "bfloat16"
    got: dict[str, np.ndarray] = {}
    done = threading.Event()

    def collect(result) -> None:
        got[result.request_id] = np.frombuffer(result.values, "<f4")
        if len(got) == len(texts):
            done.set()

    try:
        for i, text in enumerate(texts):
            ids = tuple(model.tokenizer(text)["input_ids"])
            engine.submit(PoolingRequest(request_id=str(i), token_ids=ids), collect)
        assert done.wait(30)
    finally:
        engine.shutdown()
    for i in range(len(texts)):
        assert cosine_distance(got[str(i)], want[i]) < 1e-3
