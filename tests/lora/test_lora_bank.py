"""The adapter bank: at most ``max_loras`` in memory, least recently used out, never one in use."""

from __future__ import annotations

from pathlib import Path

import pytest
from switchyard_engine.lora.bank import AdapterBank
from switchyard_engine.lora.layouts import llama_family
from switchyard_spec import AdapterError, UnknownAdapterError
from transformers import AutoConfig


@pytest.fixture
def bank(default_model_path: Path) -> AdapterBank:
    layouts = llama_family(AutoConfig.from_pretrained(default_model_path))
    return AdapterBank(layouts.shapes, layouts.layouts, max_loras=2)


def test_lru_eviction_and_reload(bank: AdapterBank, adapter_dirs: dict[str, Path]) -> None:
    a, b, c = (bank.register(n, str(adapter_dirs[n])) for n in ("attn-r4", "all-r8", "mlp-regex"))
    assert bank.held() == ["all-r8", "mlp-regex"]  # attn-r4, least recent, went out
    assert bank.loads_from_disk == 3
    # b and c are in use: a cannot come in without dropping one of theirs.
    assert bank.acquire(a, in_use={b, c}) is None
    # With c free, a comes back from its folder and c (least recently used) goes.
    assert bank.acquire(b, in_use={b}) is not None  # b is now the most recent
    adapter = bank.acquire(a, in_use={b})
    assert adapter is not None and adapter.name == "attn-r4"
    assert bank.held() == ["all-r8", "attn-r4"]
    assert bank.loads_from_disk == 4


def test_unregistered_names_keep_their_running_handles(bank: AdapterBank,
                                                       adapter_dirs: dict[str, Path]) -> None:
    handle = bank.register("x", str(adapter_dirs["attn-r4"]))
    bank.unregister("x")
    with pytest.raises(UnknownAdapterError, match="'x'"):
        bank.handle("x")
    with pytest.raises(UnknownAdapterError):
        bank.unregister("x")
    assert bank.acquire(handle, in_use=set()) is not None  # a sequence holding it finishes


def test_a_failed_load_changes_nothing(bank: AdapterBank, adapter_dirs: dict[str, Path],
                                       tmp_path: Path) -> None:
    bank.register("ok", str(adapter_dirs["attn-r4"]))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        bank.register("ok", str(tmp_path))
    assert bank.names() == {"ok": str(adapter_dirs["attn-r4"])}
    assert bank.held() == ["ok"]


def test_stacks_are_memoized_per_group_order(bank: AdapterBank,
                                             adapter_dirs: dict[str, Path]) -> None:
    a = bank.register("a", str(adapter_dirs["attn-r4"]))
    b = bank.register("b", str(adapter_dirs["all-r8"]))
    assert bank.stacks((a, b)) is bank.stacks((a, b))
    assert bank.stacks((b, a)) is not bank.stacks((a, b))
