"""LoRA adapters named on the command line or in a config file, and where their folders are.

TGI's `--lora-adapters` (and its `LORA_ADAPTERS` variable) is a comma-separated
list whose items are `name=/local/folder`, a hub id (`org/adapter`, served
under that id) or `id@revision`; hub ids are looked up in the local hub cache
only (nothing is downloaded). A config file's entry says the same as a table,
`lora_adapters = {name = "path"}`.
"""

from __future__ import annotations

from pathlib import Path

from switchyard_spec import AdapterError


def parse_lora_adapters(text: str) -> dict[str, str]:
    """`--lora-adapters`' value as name -> source (a folder, `id` or `id@revision`)."""
    adapters: dict[str, str] = {}
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        name, sep, source = item.partition("=")
        if sep:
            name, source = name.strip(), source.strip()
            if not name or not source:
                raise ValueError(f"--lora-adapters: expected NAME=PATH, got {item!r}")
        else:
            source = item
            name = item.partition("@")[0]
        if name in adapters:
            raise ValueError(f"--lora-adapters: the name {name!r} is given twice")
        adapters[name] = source
    return adapters


def resolve_adapter_source(name: str, source: str) -> str:
    """The local folder of an adapter source: the folder itself, or the hub cache's snapshot.

    Raises AdapterError naming the adapter when neither is there.
    """
    folder = Path(source).expanduser()
    if folder.is_dir():
        return str(folder.resolve())
    repo, _, revision = source.partition("@")
    if repo.count("/") == 1 and not folder.is_absolute():
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

        try:
            return snapshot_download(repo, revision=revision or None, local_files_only=True)
        except (LocalEntryNotFoundError, HfHubHTTPError, ValueError, OSError) as exc:
            raise AdapterError(f"adapter {name!r}: {source} is neither a folder nor in the "
                               f"local hub cache ({type(exc).__name__})") from None
    raise AdapterError(f"adapter {name!r}: {source} is not a folder")
