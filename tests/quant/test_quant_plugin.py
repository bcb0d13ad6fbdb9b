"""switchyard-quant as a plugin: cheap hooks, the methods it declares, and its import boundaries."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import torch

from switchyard_quant import plugin
from switchyard_spec import INT8_PER_CHANNEL, uint4_group_asym, uint4_group_min

REPO = Path(__file__).resolve().parents[2]


def test_importing_the_hooks_imports_no_torch():
    code = ("import sys, switchyard_quant.plugin as p; p.switchyard_quantization_methods(); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_it_declares_int8_and_three_int4_group_sizes():
    methods = {m.name: m for m in plugin.switchyard_quantization_methods()}
    assert sorted(methods) == ["awq", "fp8", "gguf", "gptq", "int4", "int4-g32", "int4-g64",
                               "int8", "ipex-lowp", "smoothquant"]
    # Checkpoint methods read weights (load); the RTN ones quantize them.
    assert [n for n, m in sorted(methods.items()) if m.load is not None] == [
        "awq", "gguf", "gptq", "ipex-lowp"]
    assert [methods[n].config_quant_method for n in ("gptq", "awq", "gguf")] == [
        "gptq", "awq", "gguf"]
    assert methods["gguf"].formats == (uint4_group_asym(32), uint4_group_min(32))
    assert methods["int8"].formats == (INT8_PER_CHANNEL,)
    for name, group in (("int4", 128), ("int4-g64", 64), ("int4-g32", 32)):
        assert methods[name].formats == (uint4_group_asym(group),)
        weight = torch.randn(8, 100)
        quantized = methods[name].quantize(weight)
        assert quantized.format == uint4_group_asym(group)
        restored = methods[name].dequantize(quantized)
        assert restored.shape == weight.shape and (restored - weight).abs().max() < 0.5
    quantized = methods["int8"].quantize(torch.randn(3, 5))
    assert quantized.format == INT8_PER_CHANNEL
    assert methods["int8"].dequantize(quantized).shape == (3, 5)


def _imported_packages(root: Path) -> set[str]:
    found = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module.split(".")[0])
    return found


def test_the_quant_and_xeon_plugins_do_not_import_each_other():
    """They meet in the contract (weight formats), found by the gateway, never by import."""
    quant = _imported_packages(REPO / "plugins" / "quant" / "switchyard_quant")
    xeon = _imported_packages(REPO / "plugins" / "xeon" / "switchyard_xeon")
    assert "switchyard_xeon" not in quant and "switchyard_gaudi" not in quant
    assert "switchyard" not in quant  # nor the gateway: the contract and torch only
    assert "switchyard_quant" not in xeon
