"""Vision-language models on the Gaudi engine (CPU device): Llava-Next and Llava 1.5.

Prompts are prepared as the gateway prepares them (its processor and
``encode_prompt``), and the engine's greedy tokens are compared with
transformers' ``generate`` on ``processor(text, images)``. The prompt
buckets start at ``BASE_IMAGE_TOKENS`` (set small: the tiny models' images
take a few dozen tokens), so text and image prompts share padded prefills.
One server, started by the test module, serves the seed's request shape
(``![](data:...)What is this a picture of?``) through TGI's route.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from switchyard.media import ImageSet, encode_prompt
from switchyard.media.decode import decode_image
from switchyard_gaudi.engine import GaudiEngine
from switchyard_gaudi.vision import VisionRunner
from switchyard_gaudi.warmup_plan import PREFILL, BucketSettings, Limits, Memory, plan_warmup
from switchyard_spec import EngineRequest, EngineStartError, SamplingParams, StoppingParams

from tests.support.engine_requests import Collector, greedy_request, token_ids
from tests.support.gaudi_config import SMALL_ENV, cpu_config
from tests.support.live_server import LiveServer, start_server, stop_server
from tests.support.vlm_model import IMAGE_TOKEN, png, reference_greedy, vlm_folder

TEXT = "What is in ![](http://h/picture.png) this picture?"
MAX_NEW = 10
BASE = 96
"""BASE_IMAGE_TOKENS for the tests: above every test prompt (an image takes up to ~90)."""
LIMITS = {"max_input_tokens": 144, "max_total_tokens": 160, "max_batch_prefill_tokens": 288}
"""Prompt buckets 96, 112, 128, 144 (steps of 16); 288 // 144 = 2 prefill rows."""
VISION_ENV = {"BASE_IMAGE_TOKENS": str(BASE)}


@pytest.fixture(scope="module", params=["llava_next", "llava"])
def vlm(request: pytest.FixtureRequest, default_model_path: Path,
        model_cache: Path) -> SimpleNamespace:
    return vlm_folder(request.param, default_model_path, model_cache)


@pytest.fixture(scope="module")
def llava_next(default_model_path: Path, model_cache: Path) -> SimpleNamespace:
    return vlm_folder("llava_next", default_model_path, model_cache)


@pytest.fixture
def start() -> Iterator[Callable[..., GaudiEngine]]:
    """``start(folder, env=..., warmup=..., **limits)``: a started engine (shut down after)."""
    engines: list[GaudiEngine] = []

    def build(path: Path, env: dict[str, str] | None = None, warmup: bool = False,
              **limits: int) -> GaudiEngine:
        engine = GaudiEngine(cpu_config(path, **{**LIMITS, **limits}),
                             env={**SMALL_ENV, **VISION_ENV, **(env or {})})
        engines.append(engine)
        engine.start()
        if warmup:
            engine.warmup()
        return engine

    yield build
    for engine in engines:
        engine.shutdown()


def _request(vlm: SimpleNamespace, rid: str, picture: bytes, eos: tuple[int, ...],
             text: str = TEXT) -> EngineRequest:
    images = ImageSet({"http://h/picture.png": vlm.vision.prepare(decode_image(picture, 10**7))})
    prompt = encode_prompt(vlm, text, images, add_special_tokens=True)
    return EngineRequest(request_id=rid, prompt_token_ids=tuple(prompt.ids),
                         sampling=SamplingParams(),
                         stopping=StoppingParams(max_new_tokens=MAX_NEW, eos_token_ids=eos),
                         images=prompt.images)


def _reference(vlm: SimpleNamespace, picture: bytes, text: str = TEXT) -> list[int]:
    prompt = text.replace("![](http://h/picture.png)", IMAGE_TOKEN)
    return reference_greedy(vlm.path, prompt, [picture], MAX_NEW)


# ---------------------------------------------------------------- the plan
def test_prompt_buckets_start_at_base_image_tokens_and_prefill_rows_follow_the_seed(
        vlm: SimpleNamespace, start: Callable[..., GaudiEngine]) -> None:
    engine = start(vlm.path)
    plan = engine.plan
    assert plan is not None and engine.info is not None and engine.info.takes_images
    assert list(plan.grid.prefill_seq) == [96, 112, 128, 144]
    assert plan.grid.prefill_batch.limit == 288 // 144  # max-batch-prefill / max-input
    lengths = sorted({s.length for s in plan.shapes if s.phase == PREFILL})
    assert lengths[0] == BASE and lengths[-1] == LIMITS["max_input_tokens"]


def test_the_seeds_llava_command_plans_from_2048_to_4096_with_4_prefill_rows() -> None:
    """tgi-gaudi's Llava-v1.6-Mistral-7B command: BASE_IMAGE_TOKENS at its default (2048),
    --max-input-tokens 4096, --max-batch-prefill-tokens 16384, PREFILL_BATCH_BUCKET_SIZE=1."""
    from switchyard_gaudi.model_dims import ModelDims

    dims = ModelDims("llava_next", 32, 4096, 14336, 32, 8, 128, 32064, 32768, 7_566_747_648,
                     text_model_type="mistral", takes_images=True)
    limits = Limits(max_input_tokens=4096, max_total_tokens=8192, max_batch_size=4,
                    max_batch_prefill_tokens=16384)
    buckets = BucketSettings(batch_step=1, prefill_batch_step=1, seq_step=128,
                             image_tokens=2048)
    plan = plan_warmup(limits, buckets, dims, 2, Memory(free=96 * 2**30))
    assert list(plan.grid.prefill_seq) == list(range(2048, 4097, 128))
    assert list(plan.grid.prefill_batch) == [1, 2, 3, 4]  # 16384 // 4096
    text = plan_warmup(limits, BucketSettings(1, 1, 128), dims, 2, Memory(free=96 * 2**30))
    assert text.grid.prefill_seq.sizes[0] == 128  # a text model's buckets are unchanged


def test_the_plan_command_plans_a_vision_model_from_base_image_tokens(
        llava_next: SimpleNamespace, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from switchyard_gaudi.__main__ import main

    for name, value in {**SMALL_ENV, **VISION_ENV}.items():
        monkeypatch.setenv(name, value)
    args = ["plan", "--model-id", str(llava_next.path), "--device-memory", "8GiB",
            "--dtype", "float32", *[f"--{k.replace('_', '-')}={v}" for k, v in LIMITS.items()]]
    assert main(args) == 0
    assert "prompt buckets [96, 112, 128, 144], prefill batch buckets [2]" \
        in capsys.readouterr().out
    assert main([*args, "--num-shard", "2"]) == 2
    assert "multi-card Llava inference is not supported" in capsys.readouterr().err


def test_a_published_llava_config_stating_only_non_defaults_is_read(
        llava_next: SimpleNamespace, tmp_path: Path) -> None:
    """llava-v1.6-mistral-7b-hf's text_config leaves out what equals Mistral's defaults
    (hidden_size, layers, heads): transformers' config class fills them in."""
    from switchyard_gaudi.model_dims import read_model_dims

    config = json.loads((llava_next.path / "config.json").read_text())
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "num_key_value_heads", "head_dim"):
        config["text_config"].pop(key)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(llava_next.path / "model.safetensors")
    dims = read_model_dims(tmp_path)
    assert (dims.hidden_size, dims.num_layers, dims.num_heads, dims.num_kv_heads,
            dims.head_dim, dims.intermediate_size) == (4096, 32, 32, 8, 128, 14336)
    assert dims.takes_images and dims.text_model_type == "mistral"
    assert dims.vocab_size == config["text_config"]["vocab_size"]


def test_max_input_tokens_below_base_image_tokens_is_refused(
        llava_next: SimpleNamespace, start: Callable[..., GaudiEngine]) -> None:
    with pytest.raises(EngineStartError) as err:
        start(llava_next.path, env={"BASE_IMAGE_TOKENS": "2048"})
    message = str(err.value)
    assert "--max-input-tokens (144)" in message and "BASE_IMAGE_TOKENS (2048)" in message


# ---------------------------------------------------------------- serving
def test_greedy_tokens_equal_generate_per_image(vlm: SimpleNamespace,
                                                start: Callable[..., GaudiEngine]) -> None:
    """Two images with one text, and a text-only request, in padded batches together: each
    gets what transformers gives it, the tower runs once per image, nothing compiles after
    warmup."""
    engine = start(vlm.path, warmup=True)
    info = engine.info
    runner = engine._runner
    assert isinstance(runner, VisionRunner)
    compiled = engine.compiles
    a, b = png(50, 70, 11), png(70, 50, 12)
    sink = Collector()
    first = _request(vlm, "a", a, info.eos_token_ids)
    assert len(first.prompt_token_ids) <= BASE  # all in the first bucket, the text one too
    engine.submit(first, sink)
    engine.submit(_request(vlm, "b", b, info.eos_token_ids), sink)
    engine.submit(greedy_request("text", vlm.tokenizer.encode("Hello there"), MAX_NEW), sink)
    got_a, got_b = token_ids(sink.wait("a")), token_ids(sink.wait("b"))
    assert got_a == _reference(vlm, a)
    assert got_b == _reference(vlm, b)
    assert got_a != got_b
    assert sink.wait("text")[-1].error is None
    assert sink.events("a")[0].prompt_tokens == len(first.prompt_token_ids)
    assert runner.images_encoded == 2
    # The same text with the other image, alone this time: its own answer again.
    engine.submit(_request(vlm, "b2", b, info.eos_token_ids), sink)
    assert token_ids(sink.wait("b2")) == got_b and runner.images_encoded == 3
    assert engine.compiles == compiled


def test_an_image_the_tower_disagrees_with_ends_only_its_sequence(
        llava_next: SimpleNamespace, start: Callable[..., GaudiEngine]) -> None:
    import msgspec

    engine = start(llava_next.path)
    eos = engine.info.eos_token_ids
    good = _request(llava_next, "good", png(50, 70, 11), eos)
    bad = _request(llava_next, "bad", png(50, 70, 12), eos)
    image = bad.images[0]
    # One placeholder fewer than the tower's features (the image's last one becomes text).
    short = msgspec.structs.replace(image, length=image.length - 1)
    bad = msgspec.structs.replace(bad, images=(short,))
    sink = Collector()
    engine.submit(bad, sink)
    engine.submit(good, sink)
    assert "image could not be encoded" in (sink.wait("bad")[-1].error or "")
    assert token_ids(sink.wait("good")) == _reference(llava_next, png(50, 70, 11))
    assert engine.healthy()


def test_images_sent_to_a_text_model_are_refused(default_model_path: Path,
                                                 llava_next: SimpleNamespace,
                                                 start: Callable[..., GaudiEngine]) -> None:
    engine = start(default_model_path, env={"BASE_IMAGE_TOKENS": ""})
    assert not engine.info.takes_images
    import msgspec

    request = _request(llava_next, "x", png(40, 40, 1), ())
    # Ids inside the text model's vocabulary: only the images are wrong for it.
    request = msgspec.structs.replace(
        request, prompt_token_ids=tuple(t % 100 for t in request.prompt_token_ids))
    sink = Collector()
    engine.submit(request, sink)
    assert sink.wait("x")[-1].error == "this model takes no images"


# ---------------------------------------------------------------- refusals
def test_sharding_a_vision_model_is_refused(llava_next: SimpleNamespace,
                                            start: Callable[..., GaudiEngine]) -> None:
    with pytest.raises(EngineStartError, match="multi-card Llava inference is not supported"):
        start(llava_next.path, num_shard=2)


def test_fp8_with_a_vision_model_is_refused(llava_next: SimpleNamespace, tmp_path: Path,
                                            start: Callable[..., GaudiEngine]) -> None:
    config = tmp_path / "maxabs_quant.json"
    config.write_text(json.dumps({"mode": "QUANTIZE", "observer": "maxabs"}))
    with pytest.raises(EngineStartError, match=r"QUANT_CONFIG \(FP8\) is not supported"):
        start(llava_next.path, env={"QUANT_CONFIG": str(config)})


def test_a_llava_with_an_unsupported_text_model_is_refused(
        llava_next: SimpleNamespace, tmp_path: Path, start: Callable[..., GaudiEngine]) -> None:
    folder = tmp_path / "llava-gpt2"
    folder.mkdir()
    config = json.loads((llava_next.path / "config.json").read_text())
    config["text_config"]["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").symlink_to(llava_next.path / "model.safetensors")
    with pytest.raises(EngineStartError, match="text model type 'gpt2' is not supported"):
        start(folder)


# ---------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def gaudi_vision_server(llava_next: SimpleNamespace, model_cache: Path,
                        tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    live = start_server(
        model_cache, tmp_path_factory.mktemp("logs"), "--model-id", str(llava_next.path),
        "--engine", "gaudi", "--engine-option", "device=cpu", "--engine-option", "num_threads=1",
        "--dtype", "float32", "--max-input-tokens", str(LIMITS["max_input_tokens"]),
        "--max-total-tokens", str(LIMITS["max_total_tokens"]), "--max-batch-size", "4",
        "--max-batch-prefill-tokens", str(LIMITS["max_batch_prefill_tokens"]),
        env={**SMALL_ENV, **VISION_ENV}, timeout=300)
    yield live
    stop_server(live)


@pytest.mark.e2e
def test_the_seeds_request_shape_through_tgis_stream(gaudi_vision_server: LiveServer,
                                                     llava_next: SimpleNamespace) -> None:
    """``![](data:...)What is this a picture of?\\n\\n`` on /generate_stream, as the seed
    sends it: the tokens are transformers'; /info and /v1/models say the model takes images."""
    picture = png(50, 70, 11)
    url = "data:image/png;base64," + base64.b64encode(picture).decode()
    text = "What is this a picture of?\n\n"
    ids = []
    with httpx.stream("POST", f"{gaudi_vision_server.url}/generate_stream", timeout=120, json={
            "inputs": f"![]({url}){text}",
            "parameters": {"max_new_tokens": MAX_NEW, "seed": 42}}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                assert "error" not in event, event
                ids.append(event["token"]["id"])
    assert ids == reference_greedy(llava_next.path, IMAGE_TOKEN + text, [picture], MAX_NEW)
    info = httpx.get(f"{gaudi_vision_server.url}/info", timeout=10).json()
    assert info["model_pipeline_tag"] == "image-text-to-text"
    cards = httpx.get(f"{gaudi_vision_server.url}/v1/models", timeout=10).json()["data"]
    assert cards[0]["input_modalities"] == ["text", "image"]
    assert "gaudi warmup:" in gaudi_vision_server.log()
