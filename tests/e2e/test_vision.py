"""Images in prompts, end to end: tiny Llava-Next and Llava 1.5 served with the real clients.

One server (`--config`) serves `llava-next` (the default), `llava` and
`text` (the default text model), with image limits small enough to hit, and
prefill cut into chunks smaller than an image. Images come as `data:` URLs
and from a loopback HTTP server (the only host `--image-hosts` allows).
The vision models run on the xeon engine's paged path, prefix caching on.
Greedy answers are checked token for token against transformers' `generate`
on the model's own processor output; bad images are 4xx in each API's format.
"""

from __future__ import annotations

import base64
import functools
import io
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from huggingface_hub import InferenceClient
from PIL import Image
from text_generation import Client

from tests.support.image_server import Answer, ImageServer
from tests.support.live_server import LiveServer, start_server, stop_server
from tests.support.vlm_model import IMAGE_TOKEN, ensure_vlm, png, reference_greedy
from tests.support.waiting import eventually

MAX_NEW = 8
QUESTION = "What is in this picture?"
MAX_PIXELS = 250_000
MAX_BYTES = 300_000


@pytest.fixture(scope="module")
def images() -> Iterator[ImageServer]:
    with ImageServer() as server:
        for seed in (1, 2, 3):
            server.route(f"/{seed}.png", Answer(png(50, 70, seed)))
        server.route("/text.png", Answer(b"plain text, not a picture",
                                         headers={"Content-Type": "text/plain"}))
        huge = Image.new("RGB", (600, 600), (200, 10, 10))  # 360,000 pixels in a few KB
        server.route("/huge.png", Answer(_png_bytes(huge)))
        server.route("/heavy.png", Answer(bytes(MAX_BYTES + 1)))
        server.route("/slow.png", Answer(png(8, 8, 4), delay_s=4.0))
        yield server


def _png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def folders(default_model_path: Path, model_cache: Path) -> dict[str, Path]:
    return {kind: ensure_vlm(kind, default_model_path, model_cache)
            for kind in ("llava_next", "llava")}


@pytest.fixture(scope="module")
def vision_server(folders: dict[str, Path], model_cache: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = tmp_path_factory.mktemp("vision")
    config = folder / "models.toml"
    config.write_text(f"""
[[models]]
name = "llava-next"
model_id = "{folders['llava_next']}"
engine_options = {{ num_threads = 1 }}

[[models]]
name = "llava"
model_id = "{folders['llava']}"
engine_options = {{ num_threads = 1 }}

[[models]]
name = "text"
engine_options = {{ num_threads = 1 }}
""")
    live = start_server(model_cache, folder, "--config", str(config), "--dtype", "float32",
                        "--max-total-tokens", "512", "--max-batch-prefill-tokens", "32",
                        "--image-hosts", "127.0.0.1", "--image-max-pixels", str(MAX_PIXELS),
                        "--image-max-bytes", str(MAX_BYTES), "--image-fetch-timeout", "1",
                        "--max-images", "3", timeout=300)
    yield live
    stop_server(live)


def _data_url(seed: int) -> str:
    return "data:image/png;base64," + base64.b64encode(png(50, 70, seed)).decode()


@functools.cache
def _reference(folder: Path, prompt: str, seed: int) -> tuple[int, ...]:
    """transformers' greedy tokens for ``prompt`` (one `<image>`) with picture ``seed``."""
    return tuple(reference_greedy(folder, prompt, [png(50, 70, seed)], MAX_NEW))


def _chat_prompt(folder: Path, content: str) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


def _decode(folder: Path, ids: tuple[int, ...]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder).decode(list(ids), skip_special_tokens=True)


def _generate(live: LiveServer, inputs: str, model: str | None = None) -> httpx.Response:
    headers = {"X-Model": model} if model else {}
    return httpx.post(f"{live.url}/generate", headers=headers, timeout=60, json={
        "inputs": inputs, "parameters": {"max_new_tokens": MAX_NEW, "details": True}})


def _ids(response: httpx.Response) -> tuple[int, ...]:
    assert response.status_code == 200, response.text
    return tuple(t["id"] for t in response.json()["details"]["tokens"])


# ---------------------------------------------------------------- TGI
def test_tgi_markdown_images_from_a_host_and_a_data_url(vision_server: LiveServer,
                                                        images: ImageServer,
                                                        folders: dict[str, Path]) -> None:
    want = _reference(folders["llava_next"], f"{IMAGE_TOKEN}{QUESTION}", 1)
    fetched = _generate(vision_server, f"![]({images.url('/1.png')}){QUESTION}")
    assert _ids(fetched) == want
    inline = _generate(vision_server, f"![]({_data_url(1)}){QUESTION}")
    assert _ids(inline) == want
    # The image's placeholder tokens are prompt tokens.
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folders["llava_next"])
    picture = Image.open(io.BytesIO(png(50, 70, 1))).convert("RGB")
    count = processor(text=f"{IMAGE_TOKEN}{QUESTION}", images=[picture],
                      return_tensors="np")["input_ids"].shape[1]
    assert int(fetched.headers["x-prompt-tokens"]) == count


def test_tgi_clients_stream_an_image_prompt(vision_server: LiveServer, images: ImageServer,
                                            folders: dict[str, Path]) -> None:
    want = _reference(folders["llava_next"], f"{IMAGE_TOKEN}{QUESTION}", 2)
    prompt = f"![]({images.url('/2.png')}){QUESTION}"
    events = list(Client(vision_server.url, timeout=60).generate_stream(
        prompt, max_new_tokens=MAX_NEW))
    assert tuple(e.token.id for e in events) == want
    hub = InferenceClient(base_url=vision_server.url, timeout=60)
    out = hub.text_generation(f"![]({_data_url(2)}){QUESTION}", max_new_tokens=MAX_NEW,
                              details=True)
    assert tuple(t.id for t in out.details.tokens) == want


def test_two_images_with_one_text_get_their_own_answers(vision_server: LiveServer,
                                                        images: ImageServer,
                                                        folders: dict[str, Path]) -> None:
    """Sent together (one batch), then the first again, on the paged path with prefix
    caching on: the second image shares only the blocks before the image, the first again
    (same pixels from a `data:` URL, same content hash) its cached blocks, and each answer
    is transformers' for its own image."""
    prompt = f"{IMAGE_TOKEN}{QUESTION}"
    want = {seed: _reference(folders["llava_next"], prompt, seed) for seed in (1, 3)}
    assert want[1] != want[3]
    with ThreadPoolExecutor(4) as pool:
        jobs = {seed: pool.submit(_generate, vision_server,
                                  f"![]({images.url(f'/{seed}.png')}){QUESTION}")
                for seed in (1, 3)}
        got = {seed: _ids(job.result()) for seed, job in jobs.items()}
    assert got == want
    assert _ids(_generate(vision_server, f"![]({_data_url(1)}){QUESTION}")) == want[1]


def test_llava_1_5_takes_the_same_seam(vision_server: LiveServer, images: ImageServer,
                                       folders: dict[str, Path]) -> None:
    want = _reference(folders["llava"], f"{IMAGE_TOKEN}{QUESTION}", 1)
    assert _ids(_generate(vision_server, f"![]({images.url('/1.png')}){QUESTION}",
                          model="llava")) == want


# ---------------------------------------------------------------- OpenAI
def _openai_messages(url: str) -> list[dict[str, object]]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url, "detail": "high"}},
        {"type": "text", "text": QUESTION}]}]


@pytest.mark.parametrize("model", ["llava-next", "llava"])
def test_openai_sdk_image_url_parts(vision_server: LiveServer, images: ImageServer,
                                    folders: dict[str, Path], model: str) -> None:
    folder = folders[model.replace("-", "_")]
    want = _reference(folder, _chat_prompt(folder, f"{IMAGE_TOKEN}{QUESTION}"), 3)
    client = openai.OpenAI(base_url=f"{vision_server.url}/v1", api_key="-")
    for url in (images.url("/3.png"), _data_url(3)):
        reply = client.chat.completions.create(model=model, messages=_openai_messages(url),
                                               max_tokens=MAX_NEW, temperature=0)
        assert reply.choices[0].message.content == _decode(folder, want)
        assert reply.usage.completion_tokens == len(want)


def test_responses_input_image_parts(vision_server: LiveServer, images: ImageServer,
                                     folders: dict[str, Path]) -> None:
    """The Responses API's `input_image` part reaches the model as chat's `image_url` does:
    the same tokens as the processor's reference; a text-only model refuses it."""
    folder = folders["llava_next"]
    want = _reference(folder, _chat_prompt(folder, f"{IMAGE_TOKEN}{QUESTION}"), 3)
    client = openai.OpenAI(base_url=f"{vision_server.url}/v1", api_key="-", max_retries=0)
    content = [{"type": "input_image", "image_url": _data_url(3), "detail": "auto"},
               {"type": "input_text", "text": QUESTION}]
    reply = client.responses.create(model="llava-next", max_output_tokens=MAX_NEW,
                                    temperature=0,
                                    input=[{"role": "user", "content": content}])
    assert reply.output_text == _decode(folder, want)
    assert reply.usage.output_tokens == len(want)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="text", max_output_tokens=2,
                                input=[{"role": "user", "content": content}])


def test_hub_chat_completion_with_an_image(vision_server: LiveServer, images: ImageServer,
                                           folders: dict[str, Path]) -> None:
    folder = folders["llava_next"]
    want = _reference(folder, _chat_prompt(folder, f"{IMAGE_TOKEN}{QUESTION}"), 2)
    hub = InferenceClient(base_url=vision_server.url, timeout=60)
    out = hub.chat_completion(messages=_openai_messages(images.url("/2.png")),
                              max_tokens=MAX_NEW, temperature=0)
    assert out.choices[0].message.content == _decode(folder, want)


def test_info_and_models_say_which_models_take_images(vision_server: LiveServer) -> None:
    info = httpx.get(f"{vision_server.url}/info", timeout=10).json()
    assert info["model_pipeline_tag"] == "image-text-to-text"  # the default: llava-next
    cards = {c["id"]: c for c in httpx.get(f"{vision_server.url}/v1/models", timeout=10)
             .json()["data"]}
    assert cards["llava-next"]["input_modalities"] == ["text", "image"]
    assert cards["llava"]["input_modalities"] == ["text", "image"]
    assert cards["text"]["input_modalities"] == ["text"]


# ---------------------------------------------------------------- bad images
BAD = {
    "bad base64": ("data:image/png;base64,not*base64", "invalid_image_url"),
    "not an image": ("/text.png", "invalid_image"),
    "too many pixels": ("/huge.png", "image_too_large"),
    "too many bytes": ("/heavy.png", "image_too_large"),
    "host not allowed": ("http://10.1.2.3/x.png", "image_host_not_allowed"),
    "unreachable host": ("http://127.0.0.1:9/x.png", "image_fetch_failed"),
    "timeout": ("/slow.png", "image_fetch_failed"),
}


def _url(images: ImageServer, where: str) -> str:
    return images.url(where) if where.startswith("/") else where


@pytest.mark.parametrize("case", list(BAD))
def test_bad_images_are_4xx_in_each_apis_format(vision_server: LiveServer, images: ImageServer,
                                                case: str) -> None:
    url, code = _url(images, BAD[case][0]), BAD[case][1]
    tgi = _generate(vision_server, f"![]({url}){QUESTION}")
    assert tgi.status_code == 422, tgi.text
    assert tgi.json()["error_type"] == "validation" and "error" in tgi.json()
    chat = httpx.post(f"{vision_server.url}/v1/chat/completions", timeout=60, json={
        "model": "llava-next", "messages": _openai_messages(url), "max_tokens": 2})
    assert chat.status_code == 400, chat.text
    error = chat.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == code
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=f"{vision_server.url}/v1", api_key="-").chat.completions.create(
            model="llava-next", messages=_openai_messages(url), max_tokens=2)


def test_stream_errors_and_image_counts(vision_server: LiveServer, images: ImageServer) -> None:
    # TGI's stream reports validation errors in-stream, as TGI does.
    events = httpx.post(f"{vision_server.url}/generate_stream", timeout=60, json={
        "inputs": f"![](http://10.1.2.3/x.png){QUESTION}",
        "parameters": {"max_new_tokens": 2}}).text
    assert '"error_type":"validation"' in events and "--image-hosts" in events
    four = "".join(f"![]({images.url(f'/{s}.png')})" for s in (1, 2, 3, 1))
    too_many = _generate(vision_server, four + QUESTION)
    assert too_many.status_code == 422 and "at most 3" in too_many.json()["error"]


def test_a_text_model_refuses_image_parts_and_keeps_markdown(vision_server: LiveServer,
                                                             images: ImageServer) -> None:
    chat = httpx.post(f"{vision_server.url}/v1/chat/completions", timeout=60, json={
        "model": "text", "messages": _openai_messages(_data_url(1)), "max_tokens": 2})
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "images_not_supported"
    # Markdown is text to a model that takes no images (TGI's behaviour): nothing is fetched.
    hits = dict(images.hits)
    plain = _generate(vision_server, f"![]({images.url('/1.png')}) hello", model="text")
    assert plain.status_code == 200 and images.hits == hits


def test_a_slow_image_never_holds_up_other_requests(vision_server: LiveServer,
                                                    images: ImageServer) -> None:
    """Images are fetched before a request is queued: while one waits on a slow host,
    another is served, and the slow one ends at its time limit with a 422."""
    answers: dict[str, httpx.Response] = {}

    def slow() -> None:
        answers["slow"] = _generate(vision_server, f"![]({images.url('/slow.png')}){QUESTION}")

    thread = threading.Thread(target=slow)
    before = images.hits.get("/slow.png", 0)
    thread.start()
    eventually(lambda: images.hits.get("/slow.png", 0) > before,
               what="the slow image's fetch begun")
    answers["fast"] = _generate(vision_server, f"![]({_data_url(1)}){QUESTION}")
    thread.join()
    assert answers["fast"].status_code == 200
    assert answers["slow"].status_code == 422 and "--image-fetch-timeout" in \
        answers["slow"].json()["error"]
