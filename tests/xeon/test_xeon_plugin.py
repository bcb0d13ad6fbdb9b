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
from switchyard_xeon.block_manager import BlockManager
from switchyard_xeon.kv_cache import CacheShape, PagedKVCache, context


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


def test_paged_cache_writes_slots_and_gathers_blocks():
    cache = PagedKVCache(CacheShape(num_layers=2, num_kv_heads=2, head_dim=4), torch.float32,
                         num_blocks=6, block_size=4)
    assert cache.bytes_per_token() == 2 * 2 * 2 * 4 * 4 and cache.capacity_tokens == 24
    assert cache.nbytes == 24 * cache.bytes_per_token()
    blocks = BlockManager(6, 4)
    assert blocks.grow(7, 3) and blocks.grow(8, 4) and blocks.grow(7, 6)
    assert blocks.table(7) == [0, 2]  # interleaved with sequence 8's block 1
    k, v = torch.randn(2, 6, 4), torch.randn(2, 6, 4)
    cache.write(1, torch.tensor(blocks.slots(7, 0, 6)), k, v)
    cache.write(1, torch.tensor(blocks.slots(8, 0, 4)), k[:, :4] * 2, v[:, :4] * 2)
    both = torch.tensor(blocks.table(8) + blocks.table(7))
    keys, values = cache.gather(1, both)
    assert keys.shape == (2, 3, 4, 4)
    assert torch.equal(context(keys, 1, 2, 6), k) and torch.equal(context(values, 1, 2, 6), v)
    assert torch.equal(context(keys, 0, 1, 3), 2 * k[:, :3])


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
