"""The plugin's hooks, entry point, probe and the pieces with no model behind them."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import torch

from switchyard_spec import ENTRY_POINT_GROUP, EngineConfig
from switchyard_xeon import machine, plugin
from switchyard_xeon.attention import _attend
from switchyard_xeon.engine import XeonEngine
from switchyard_xeon.kv_cache import CacheShape, KVCache


def test_entry_point_is_registered():
    names = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert names.get("xeon") == "switchyard_xeon.plugin"


def test_hook_declares_the_engine():
    (spec,) = plugin.switchyard_engines()
    assert spec.name == "xeon" and spec.priority == plugin.PRIORITY
    info = spec.probe()
    assert info.available and "cores" in info.name
    engine = spec.factory(EngineConfig(model_path="/nonexistent"))
    assert isinstance(engine, XeonEngine)  # built without touching the folder
    assert not engine.healthy()
    engine.shutdown()


def test_plugin_import_does_not_import_torch():
    code = (
        "import sys, switchyard_xeon.plugin as p; p.switchyard_engines()[0].probe(); "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_cpu_info_counts_physical_cores(tmp_path):
    fake = tmp_path / "cpuinfo"
    blocks = []
    for cpu in range(4):  # 2 cores x 2 hyper-threads
        blocks.append(
            f"processor\t: {cpu}\nvendor_id\t: GenuineIntel\nmodel name\t: Intel Xeon\n"
            f"physical id\t: 0\ncore id\t\t: {cpu % 2}\nflags\t\t: fpu avx512f amx_bf16\n"
        )
    fake.write_text("\n".join(blocks))
    info = machine.read_cpu_info(str(fake))
    allowed = machine.read_cpu_info().logical_cpus
    assert info.physical_cores == min(2, allowed) and info.has_bf16
    assert "amx_bf16" in info.describe()


def test_kv_cache_accounting():
    cache = KVCache(CacheShape(num_layers=2, num_kv_heads=1, head_dim=4), torch.float32,
                    num_blocks=4, block_size=16)
    assert cache.bytes_per_token() == 2 * 2 * 1 * 4 * 4
    assert cache.can_reserve(64) and not cache.can_reserve(65)
    cache.reserve(1, 20)  # two blocks
    assert cache.free_blocks == 2
    k = torch.randn(1, 3, 4)
    cache.write(1, 1, 0, k, -k)
    cache.commit(1, 3)
    keys, values = cache.read(1, 1, 3)
    assert torch.equal(keys, k) and torch.equal(values, -k)
    cache.release(1)
    cache.release(1)
    assert cache.free_blocks == 4


def test_attend_masks_match_full_causal_attention():
    """Chunked queries over cached context (explicit mask) equal one causal pass."""
    torch.manual_seed(0)
    q, k, v = torch.randn(4, 10, 8), torch.randn(2, 10, 8), torch.randn(2, 10, 8)
    full = _attend(q, k, v, None, None)
    tail = _attend(q[:, 6:], k, v, None, None)
    last = _attend(q[:, 9:], k, v, None, None)
    torch.testing.assert_close(tail, full[:, 6:])
    torch.testing.assert_close(last, full[:, 9:])
    windowed = _attend(q[:, 9:], k, v, None, 3)
    explicit = _attend(q[:, 8:], k, v, None, 3)[:, 1:]
    torch.testing.assert_close(windowed, explicit)
