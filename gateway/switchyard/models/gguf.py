"""GGUF files as a model source: converted once into a cached safetensors folder.

`--model-id` may name a ``.gguf`` file, or a folder that holds one (and no
``config.json``; with several, ``--gguf-file NAME`` picks one, as it picks
the GGUF of a folder that has both). The file is read through transformers
(``from_pretrained(..., gguf_file=...)``, which needs the ``gguf`` package):
the architecture and its settings, the tokenizer and the chat template come
from the file's metadata, and every quantized tensor is dequantized to
float32. The result is saved as a plain model folder (config.json,
safetensors, tokenizer, chat template) under
``$SWITCHYARD_CACHE/gguf/<sha256 prefix>-v1``, prepared atomically
(:func:`switchyard.models.cache.prepare_folder`), so that engines load a
normal folder and the next start reuses it. One log line names the GGUF
block types that were dequantized.

The folder is keyed by the file's sha256: a changed file is converted again.
Hashing a multi-gigabyte file takes seconds, so the digest is remembered
next to the folders, keyed by the file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import Counter
from pathlib import Path

from switchyard_spec import EngineStartError

from switchyard.models.cache import cache_root, prepare_folder

log = logging.getLogger("switchyard.models")

CONVERSION_VERSION = "1"
"""Bumped when the conversion below changes what it writes, so old folders are converted again."""
SOURCE_FILE = "switchyard-gguf.json"
"""What a converted folder records about its GGUF file (name, sha256, block types)."""
FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
"""GGUF tensor types that hold plain floats: copied, not dequantized."""


def find_gguf(model_id: str, gguf_file: str | None = None) -> Path | None:
    """The GGUF file `model_id` (with `--gguf-file`) names, or None when it names none.

    A ``.gguf`` path is the file; a folder gives the file ``gguf_file`` names in it,
    else its one ``.gguf`` file when it has no config.json. EngineStartError for a
    name that is not there, or a folder of several GGUF files and no ``gguf_file``.
    """
    path = Path(model_id)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise EngineStartError(
                f"--model-id {model_id!r} is a file, but not a .gguf file: pass a model folder "
                "(config.json, safetensors weights, tokenizer), a .gguf file, or a hub id")
        if gguf_file is not None and gguf_file != path.name:
            raise EngineStartError(f"--gguf-file {gguf_file!r} names another file than "
                                   f"--model-id {model_id!r}; pass the folder, or one of them")
        return path
    if not path.is_dir():
        return None
    files = sorted(p.name for p in path.glob("*.gguf") if p.is_file())
    if gguf_file is not None:
        if gguf_file not in files:
            listed = ", ".join(files) if files else "none"
            raise EngineStartError(f"--gguf-file {gguf_file!r} is not in {str(path)!r} "
                                   f"(its .gguf files: {listed})")
        return path / gguf_file
    if (path / "config.json").is_file() or not files:
        return None
    if len(files) > 1:
        raise EngineStartError(
            f"{str(path)!r} holds several GGUF files ({', '.join(files)}): pick one with "
            f"--gguf-file NAME, e.g. --gguf-file {files[0]}")
    return path / files[0]


def file_sha256(path: Path, cache: Path | None = None) -> str:
    """The sha256 of ``path`` (hex), remembered under ``cache`` by path, size and mtime."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    memo = (cache / ".hashes" / f"{key.hexdigest()[:32]}.json") if cache is not None else None
    if memo is not None:
        try:
            return str(json.loads(memo.read_text())["sha256"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            digest.update(chunk)
    value = digest.hexdigest()
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_suffix(f".tmp-{os.getpid()}")
            tmp.write_text(json.dumps({"path": str(path.resolve()), "sha256": value}))
            os.replace(tmp, memo)
        except OSError:  # a read-only cache only costs the next start a hash
            pass
    return value


def ensure_gguf_model(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """The converted folder of ``gguf_path``, converting it first if the cache lacks it."""
    root = (Path(cache_dir) if cache_dir is not None else cache_root()) / "gguf"
    try:
        digest = file_sha256(gguf_path, root)
    except OSError as exc:
        raise EngineStartError(f"cannot read the GGUF file {str(gguf_path)!r}: {exc}") from exc
    target = converted_folder(root, digest)
    if target.is_dir():
        log_converted(gguf_path.name, target)
        return target
    log.info("GGUF %s: converting to a safetensors folder in %s (once per file)",
             gguf_path.name, target)
    return prepare_folder(target, lambda out: convert_gguf(gguf_path, out, digest),
                          what=f"the GGUF file {gguf_path.name}")


def converted_folder(root: Path, sha256: str) -> Path:
    """Where the GGUF file of digest ``sha256`` is converted to, under ``root`` (``.../gguf``):
    the same bytes, one folder, whatever the file is called."""
    return root / f"{sha256[:16]}-v{CONVERSION_VERSION}"


def log_converted(name: str, folder: Path) -> None:
    """The log line of a start that finds a GGUF file converted already."""
    log.info("GGUF %s: %s; converted before, into %s", name, _describe(_read_source(folder)),
             folder)


def block_types(gguf_path: Path) -> Counter[str]:
    """How many tensors of each GGUF type (Q4_1, Q8_0, F32, ...) the file holds."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    return Counter(t.tensor_type.name for t in reader.tensors)


def convert_gguf(gguf_path: Path, out: Path, sha256: str | None = None) -> None:
    """Write the model of ``gguf_path`` into the empty folder ``out`` as float32 safetensors.

    EngineStartError when transformers cannot read the file (an architecture it
    does not convert, a missing package) or the load leaves weights missing or
    unused.
    """
    import torch
    import transformers

    from switchyard.engine.loading import check_loading_info

    try:
        import gguf  # noqa: F401 - transformers' GGUF reader needs it
    except ImportError:
        raise EngineStartError("reading GGUF files needs the gguf package: "
                               "pip install gguf") from None
    try:
        types = block_types(gguf_path)
    except (ValueError, OSError, KeyError, IndexError) as exc:  # gguf's reader on a bad file
        raise EngineStartError(f"{str(gguf_path)!r} is not a readable GGUF file: {exc}") from exc
    folder, name = str(gguf_path.parent), gguf_path.name
    kwargs: dict[str, object] = {"gguf_file": name, "dtype": torch.float32,
                                 "output_loading_info": True}
    if hasattr(transformers, "GgufConfig"):  # newer transformers may keep blocks packed
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, **kwargs)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, OSError, RuntimeError, KeyError, NotImplementedError) as exc:
        raise EngineStartError(f"cannot read the GGUF file {str(gguf_path)!r} with transformers "
                               f"{transformers.__version__}: {exc}") from exc
    check_loading_info(gguf_path, type(model).__name__, info)
    # The dequantized model is a plain one: drop the GGUF loader's record of the file, which
    # transformers refuses to save (and which would make the folder look quantized).
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    source = {
        "gguf_file": name,
        "sha256": sha256 or file_sha256(gguf_path),
        "architecture": type(model).__name__,
        "block_types": dict(sorted(types.items())),
        "dtype": "float32",
        "transformers": transformers.__version__,
        "conversion_version": CONVERSION_VERSION,
    }
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    log.info("GGUF %s: %s; saved as float32 safetensors", name, _describe(source))


def _read_source(folder: Path) -> dict[str, object]:
    try:
        return json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _describe(source: dict[str, object]) -> str:
    """"dequantized Q4_1 (210 tensors), Q8_0 (1 tensor) to float32; F32 (61 tensors) kept"."""
    types = source.get("block_types")
    if not isinstance(types, dict):
        return "block types unknown"
    quantized = {k: v for k, v in types.items() if k not in FLOAT_TYPES}
    floats = {k: v for k, v in types.items() if k in FLOAT_TYPES}

    def listed(counts: dict[str, object]) -> str:
        return ", ".join(f"{k} ({v} tensor{'s' if v != 1 else ''})" for k, v in counts.items())

    parts = [f"dequantized {listed(quantized)} to float32" if quantized
             else "no quantized blocks"]
    if floats:
        parts.append(f"{listed(floats)} kept")
    return "; ".join(parts)
