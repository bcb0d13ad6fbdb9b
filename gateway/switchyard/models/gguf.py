"""GGUF files as a model source: converted once into a cached safetensors folder.

`--model-id` may name a ``.gguf`` file, or a folder that holds one (and no
``config.json``; with several, ``--gguf-file NAME`` picks one, as it picks
the GGUF of a folder that has both). The file is read through transformers
(``from_pretrained(..., gguf_file=...)``, which needs the ``gguf`` package):
the architecture and its settings, the tokenizer and the chat template come
from the file's metadata, and every quantized tensor is dequantized to
float32. The result is saved as a plain model folder (config.json,
safetensors, tokenizer, chat template) under
``$SWITCHYARD_CACHE/gguf/<sha256 prefix>-v3``, prepared atomically
(:func:`switchyard.models.cache.prepare_folder`), so that engines load a
normal folder and the next start reuses it. One log line names the GGUF
block types that were dequantized.

Beside the float32 weights the folder keeps the GGUF blocks of the linear
layers whose block type a weight format of the contract holds exactly
(``switchyard_spec.GGUF_BLOCK_TYPES``: Q4_0 and Q4_1), in
``switchyard_spec.GGUF_BLOCKS_FILE``, so that an engine can serve them as
they are (``--quantize gguf`` of the quant plugin) instead of widened; the
log line says how many bytes the kept linears take as blocks and in float32. Which
float weight a GGUF tensor became is found by content, not by name: its
rows, dequantized, must equal the weight's rows bit for bit, in some order
(transformers permutes the rows of Llama's q and k projections), so a block
is kept only where it is exactly the weight served without it.

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

from switchyard_spec import GGUF_BLOCKS_FILE, GGUF_BLOCK_TYPES, EngineStartError

from switchyard.models.cache import cache_root, prepare_folder

log = logging.getLogger("switchyard.models")

CONVERSION_VERSION = "3"
"""Bumped when the conversion below changes what it writes, so old folders are converted again.

Version 2 keeps the blocks of Q4_0 linears, version 3 those of Q4_1 too (``KEPT_SINCE``);
an older folder of a file with no tensor of a type kept since holds what this version
would, and is used as it is."""
KEPT_SINCE = {"Q4_0": 2, "Q4_1": 3}
"""The conversion version that first kept the blocks of each of ``GGUF_BLOCK_TYPES``."""
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
    found = find_converted(root, digest)
    if found is not None:
        log_converted(gguf_path.name, found)
        return found
    target = converted_folder(root, digest)
    log.info("GGUF %s: converting to a safetensors folder in %s (once per file)",
             gguf_path.name, target)
    return prepare_folder(target, lambda out: convert_gguf(gguf_path, out, digest),
                          what=f"the GGUF file {gguf_path.name}")


def converted_folder(root: Path, sha256: str) -> Path:
    """Where the GGUF file of digest ``sha256`` is converted to, under ``root`` (``.../gguf``):
    the same bytes, one folder, whatever the file is called."""
    return root / f"{sha256[:16]}-v{CONVERSION_VERSION}"


def find_converted(root: Path, sha256: str) -> Path | None:
    """The folder the GGUF file of digest ``sha256`` was converted to under ``root``, if any:
    this version's, or an older one of a file without tensors of the block types kept
    since (``KEPT_SINCE``: the same folder this version writes, so it is not converted
    again)."""
    current = converted_folder(root, sha256)
    if current.is_dir():
        return current
    for version in range(int(CONVERSION_VERSION) - 1, 0, -1):
        older = root / f"{sha256[:16]}-v{version}"
        types = _read_source(older).get("block_types") if older.is_dir() else None
        if isinstance(types, dict) and not any(
                KEPT_SINCE.get(kind, int(CONVERSION_VERSION)) > version
                for kind in set(types) & set(GGUF_BLOCK_TYPES)):
            return older
    return None


def log_converted(name: str, folder: Path) -> None:
    """The log line of a start that finds a GGUF file converted already."""
    log.info("GGUF %s: %s; converted before, into %s", name, _describe(_read_source(folder)),
             folder)


def block_types(reader: object) -> Counter[str]:
    """How many tensors of each GGUF type (Q4_1, Q8_0, F32, ...) a ``GGUFReader``'s file holds."""
    return Counter(t.tensor_type.name for t in reader.tensors)  # type: ignore[attr-defined]


def convert_gguf(gguf_path: Path, out: Path, sha256: str | None = None) -> None:
    """Write the model of ``gguf_path`` into the empty folder ``out`` as float32 safetensors.

    EngineStartError when transformers cannot read the file (an architecture it
    does not convert, a missing package) or the load leaves weights missing or
    unused.
    """
    import torch
    import transformers

    from switchyard_engine.loading import check_loading_info

    try:
        import gguf  # transformers' GGUF reader needs it too
    except ImportError:
        raise EngineStartError("reading GGUF files needs the gguf package: "
                               "pip install gguf") from None
    try:
        reader = gguf.GGUFReader(str(gguf_path))  # seconds for a large vocabulary: read once
        types = block_types(reader)
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
    kept = keep_blocks(reader, model, out)
    source = {
        "gguf_file": name,
        "sha256": sha256 or file_sha256(gguf_path),
        "architecture": type(model).__name__,
        "block_types": dict(sorted(types.items())),
        "kept_blocks": dict(sorted(kept.items())),
        "kept_bytes": kept_bytes(out) if kept else {},
        "dtype": "float32",
        "transformers": transformers.__version__,
        "conversion_version": CONVERSION_VERSION,
    }
    (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
    log.info("GGUF %s: %s; saved as float32 safetensors", name, _describe(source))


def keep_blocks(reader: object, model: object, out: Path) -> Counter[str]:
    """Write ``GGUF_BLOCKS_FILE`` into ``out``: the blocks of each linear of ``model`` that is a
    ``GGUF_BLOCK_TYPES`` tensor of the file ``reader`` (a ``GGUFReader``) reads, its rows in
    the weight's order.

    A tensor is matched to a linear weight of its shape by content: each row
    gets a 64-bit key from its float32 bits (dequantized for the tensor, as
    transformers dequantized it), equal sorted keys pair the rows, and the
    pairing is then checked bit for bit, so a key collision only costs the
    blocks of that weight (it is served dequantized). Returns how many
    linears of each type were kept; nothing is written when none is.
    """
    import numpy as np
    import torch
    from gguf import dequantize

    tensors = [t for t in reader.tensors  # type: ignore[attr-defined]
               if t.tensor_type.name in GGUF_BLOCK_TYPES and len(t.shape) == 2]
    kept: Counter[str] = Counter()
    if not tensors:
        return kept
    by_shape: dict[tuple[int, int], list[tuple[str, np.ndarray]]] = {}
    for module_name, module in model.named_modules():  # type: ignore[attr-defined]
        if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.float32:
            weight = module.weight.detach().numpy()
            by_shape.setdefault(weight.shape, []).append((f"{module_name}.weight", weight))
    signatures: dict[bytes, list[tuple[str, np.ndarray, np.ndarray]]] = {}
    keyed: set[tuple[int, int]] = set()
    blocks: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    for tensor in tensors:
        raw = np.asarray(tensor.data)
        values = dequantize(raw, tensor.tensor_type)
        if values.shape not in by_shape:
            continue
        if values.shape not in keyed:  # the weights of this shape, keyed once
            keyed.add(values.shape)
            for weight_name, weight in by_shape[values.shape]:
                keys = _row_keys(weight)
                signatures.setdefault(np.sort(keys).tobytes(), []).append(
                    (weight_name, weight, keys))
        keys = _row_keys(values)
        for weight_name, weight, weight_keys in signatures.get(np.sort(keys).tobytes(), []):
            rows = np.empty(len(keys), dtype=np.int64)  # weight row i is tensor row rows[i]
            rows[np.argsort(weight_keys, kind="stable")] = np.argsort(keys, kind="stable")
            if not np.array_equal(weight.view(np.uint32), values[rows].view(np.uint32)):
                continue
            blocks[weight_name] = torch.from_numpy(np.ascontiguousarray(raw[rows]))
            metadata[weight_name] = tensor.tensor_type.name
            kept[tensor.tensor_type.name] += 1
    if blocks:
        from safetensors.torch import save_file

        (out / GGUF_BLOCKS_FILE).parent.mkdir(parents=True, exist_ok=True)
        save_file(blocks, str(out / GGUF_BLOCKS_FILE), metadata=metadata)
    return kept


BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
"""Bytes of a block of 32 weights, by the types of ``GGUF_BLOCK_TYPES``."""


def kept_bytes(folder: Path) -> dict[str, int]:
    """What the linears of ``folder``'s ``GGUF_BLOCKS_FILE`` take: ``{"blocks": bytes as the
    file stores them, "float32": bytes as float32 weights}`` (from the file's header)."""
    from safetensors import safe_open

    blocks = floats = 0
    with safe_open(str(folder / GGUF_BLOCKS_FILE), framework="np") as fh:
        types = fh.metadata() or {}
        for name in fh.keys():  # noqa: SIM118 (safe_open is no mapping)
            rows, width = fh.get_slice(name).get_shape()
            blocks += rows * width
            floats += rows * width // BLOCK_BYTES[types[name]] * 32 * 4
    return {"blocks": blocks, "float32": floats}


_KEY_ROWS = 4096
"""Rows keyed per step (bounds the 8-byte-per-weight temporary)."""


def _row_keys(values: object) -> object:
    """A 64-bit key per row of a float32 ``[N, K]`` array: its bits times fixed odd numbers,
    summed modulo 2**64. Equal rows get equal keys; unequal ones almost never do."""
    import numpy as np

    bits = np.ascontiguousarray(values).view(np.uint32)  # type: ignore[call-overload]
    factors = np.random.default_rng(0).integers(1, 2**63, size=bits.shape[1],
                                                dtype=np.uint64) * 2 + 1
    keys = np.empty(bits.shape[0], dtype=np.uint64)
    for start in range(0, bits.shape[0], _KEY_ROWS):
        chunk = bits[start:start + _KEY_ROWS].astype(np.uint64)
        keys[start:start + _KEY_ROWS] = (chunk * factors).sum(axis=1, dtype=np.uint64)
    return keys


def _read_source(folder: Path) -> dict[str, object]:
    try:
        return json.loads((folder / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _describe(source: dict[str, object]) -> str:
    """"dequantized Q4_1 (210 tensors), Q8_0 (1 tensor) to float32; F32 (61 tensors) kept;
    blocks of Q4_1 (210 linears) kept as they are too (...): 61.9 MiB (...) as blocks, ..."."""
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
    kept = source.get("kept_blocks")
    if isinstance(kept, dict) and kept:
        linears = ", ".join(f"{k} ({v} linear{'s' if v != 1 else ''})" for k, v in kept.items())
        memory = ""
        sizes = source.get("kept_bytes")
        if isinstance(sizes, dict) and {"blocks", "float32"} <= set(sizes):
            memory = (f": {_mib(sizes['blocks'])} as blocks, {_mib(sizes['float32'])} in "
                      "float32")
        parts.append(f"blocks of {linears} kept as they are too ({GGUF_BLOCKS_FILE}){memory}")
    return "; ".join(parts)


def _mib(size: object) -> str:
    """``56.6 MiB (59,351,040 bytes)``."""
    return f"{int(size) / 2**20:.1f} MiB ({int(size):,} bytes)"  # type: ignore[call-overload]
