"""``--quantize smoothquant`` on the Xeon engine: the W8A8 kernels and the engine's greedy tokens.

Kernels (``kernels/panel_w8a8.cpp``): each path this CPU has (AMX, AVX512-VNNI,
AVX2, scalar; the others are skipped and named at the end of the run) against
a PyTorch reference written here from the format's definition: the
activations' integers and scales and the int32 sums equal, the outputs
within an fp32 rounding, over ragged shapes.

Engine: greedy tokens against transformers with every linear replaced by
W8A8 math in PyTorch, smoothed with factors computed here from statistics
recorded here (teacher-forced, near ties allowed: ``_assert_greedy_near``).
"""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch

from switchyard_spec import EngineConfig, EngineStartError
from switchyard_xeon.engine import XeonEngine

from tests import kernel_paths
from tests.kernel_paths import W8A8_PATH_NUMBERS
from tests.quant.methods import method
from tests.xeon.conftest import TEST_OPTIONS
from tests.xeon.test_xeon_decoder import _assert_greedy_near, _bf16_kv_sdpa, _engine_tokens

SQ = method("smoothquant")


def _quantize_rows(x: torch.Tensor, inv: torch.Tensor, static: float = 0.0):
    """The format's activation quantization: ``t = x * (1 / m)``, a scale per row, round to even."""
    t = x * inv
    if static > 0:
        scale = torch.full((x.shape[0],), static)
        step = torch.full((x.shape[0],), 1.0) / scale
    else:
        amax = t.abs().amax(1)
        scale = amax / 127
        step = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round((t * step[:, None]).clamp(-127, 127)).to(torch.int64), scale


def _random_layer(n: int, k: int, gen: torch.Generator):
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    q[0, 0] = -127  # the range's ends
    ws = torch.rand(n, generator=gen) / 40 + 1e-3
    m = torch.rand(k, generator=gen) * 4 + 0.05
    return q, ws, m


@pytest.fixture(params=list(W8A8_PATH_NUMBERS))
def w8a8_path(request):
    kernel_paths.require(request.param)
    return W8A8_PATH_NUMBERS[request.param]


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 16, 17, 31, 33, 48, 70])
@pytest.mark.parametrize("out_features,in_features", [(1, 9), (17, 63), (33, 130), (70, 577),
                                                      (48, 64)])
def test_w8a8_kernels_are_integer_exact(w8a8_path, rows, out_features, in_features):
    ops = torch.ops.switchyard_xeon
    gen = torch.Generator().manual_seed(rows * 1000 + out_features * 7 + in_features)
    q, ws, m = _random_layer(out_features, in_features, gen)
    x = torch.randn(rows, in_features, generator=gen) * 3
    x[0, -1] = 40.0  # an outlier feature
    if rows > 3:
        x[3] = 0.0  # a row of zeros: scale 0, output the bias
    bias = torch.randn(out_features, generator=gen)
    packed = ops.pack_panels_w8a8(q, ws, m, 0.0)
    inv = 1.0 / m
    xq, scale = _quantize_rows(x, inv)
    got_xq, got_scale = ops.w8a8_quantize_rows(x, packed)
    assert torch.equal(got_xq.long(), xq) and torch.equal(got_scale, scale)
    sums = xq @ q.long().T  # int64: exact
    raw = ops.w8a8_linear(x, packed, bias, out_features, w8a8_path, True)
    assert raw.dtype == torch.int32 and torch.equal(raw.long(), sums)
    y = ops.w8a8_linear(x, packed, bias, out_features, w8a8_path, False)
    want = (sums.double() * (scale[:, None] * ws[None, :]).double() + bias.double()).float()
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    if rows > 3:
        assert torch.equal(y[3], bias)


def test_w8a8_static_scale_clamps(w8a8_path):
    ops = torch.ops.switchyard_xeon
    gen = torch.Generator().manual_seed(9)
    q, ws, m = _random_layer(20, 70, gen)
    x = torch.randn(37, 70, generator=gen)
    static = 0.01  # small: many values clamp to +-127
    packed = ops.pack_panels_w8a8(q, ws, m, static)
    xq, scale = _quantize_rows(x, 1.0 / m, static)
    assert int((xq.abs() == 127).sum()) > 100
    got_xq, got_scale = ops.w8a8_quantize_rows(x, packed)
    assert torch.equal(got_xq.long(), xq) and torch.equal(got_scale, scale)
    raw = ops.w8a8_linear(x, packed, None, 20, w8a8_path, True)
    assert torch.equal(raw.long(), xq @ q.long().T)


def test_panel_linear_takes_w8a8_panels_and_refuses_bad_inputs():
    kernel_paths.require("w8a8 scalar")
    ops = torch.ops.switchyard_xeon
    gen = torch.Generator().manual_seed(3)
    q, ws, m = _random_layer(40, 100, gen)
    packed = ops.pack_panels_w8a8(q, ws, m, 0.0)
    x = torch.randn(45, 100, generator=gen)
    auto = ops.panel_linear(x, packed, None, 40)
    assert torch.equal(auto, ops.w8a8_linear(x, packed, None, 40, 4, False))
    with pytest.raises(RuntimeError, match="does not match"):
        ops.panel_linear(torch.zeros(3, 99), packed, None, 40)
    with pytest.raises(RuntimeError, match="does not match"):
        ops.panel_linear(x, packed, None, 41)
    with pytest.raises(RuntimeError, match="bias"):
        ops.panel_linear(x, packed, torch.zeros(39), 40)
    with pytest.raises(RuntimeError, match="smoothing"):
        ops.pack_panels_w8a8(q, ws, torch.zeros(100), 0.0)
    bad = q.clone()
    bad[1, 1] = -128
    with pytest.raises(RuntimeError, match="-127..127"):
        ops.pack_panels_w8a8(bad, ws, m, 0.0)
    with pytest.raises(RuntimeError, match="not available|path"):
        ops.w8a8_linear(x, packed, None, 40, 9, False)


# ------------------------------------------------------------------ engine


class _W8A8Matmul(torch.nn.Module):
    """A linear as W8A8 math: int8 weights of ``W * m`` per row, int8 activations of ``x / m``."""

    def __init__(self, linear: torch.nn.Linear, m: torch.Tensor, static: bool,
                 absmax: torch.Tensor) -> None:
        super().__init__()
        w = linear.weight.detach().float() * m
        self.ws = (w.abs().amax(1) / 127).clamp(min=1e-30)
        self.q = torch.round(w / self.ws[:, None]).clamp(-127, 127).long()
        self.inv = 1.0 / m
        self.static = float((absmax * self.inv).max()) / 127 if static else 0.0
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).float()
        xq, scale = _quantize_rows(flat, self.inv, self.static)
        y = (xq @ self.q.T).double() * (scale[:, None] * self.ws[None, :]).double()
        if self.bias is not None:
            y = y + self.bias.double()
        return y.float().view(*x.shape[:-1], -1)


def _statistics(model: torch.nn.Module, prompts: list[list[int]]) -> dict[str, torch.Tensor]:
    """Each linear's input absmax per feature over ``prompts`` (recorded here, not by the toolkit)."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            def record(_m, args, name=name):
                top = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0)
                seen[name] = top if name not in seen else torch.maximum(seen[name], top)
            handles.append(module.register_forward_pre_hook(record))
    with torch.inference_mode():
        for ids in prompts:
            model(torch.tensor([ids]))
    for h in handles:
        h.remove()
    return seen


GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _smoothquant_twin(model: torch.nn.Module, prompts: list[list[int]], alpha: float,
                      static: bool, bf16_cache: bool = True) -> torch.nn.Module:
    """``model`` with every linear W8A8 (q|k|v and gate|up share their factors, as fused), and
    attention over keys and values rounded to bf16 where the engine's cache is bf16
    (``--dtype auto`` on a CPU with AVX512_BF16; fp32 elsewhere)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    stats = _statistics(model, prompts)
    AttentionInterface.register("bf16_kv_sdpa", _bf16_kv_sdpa)
    AttentionMaskInterface.register("bf16_kv_sdpa", sdpa_mask)
    twin = copy.deepcopy(model)
    for prefix, parent in list(twin.named_modules()):
        children = dict(parent.named_children())
        groups = [g for g in GROUPS if all(n in children for n in g)]
        groups += [(n,) for n, c in children.items() if isinstance(c, torch.nn.Linear)
                   and not any(n in g for g in groups)]
        for group in groups:
            absmax = stats[f"{prefix}.{group[0]}" if prefix else group[0]].double()
            wmax = torch.cat([children[n].weight.detach() for n in group]).double().abs().amax(0)
            m = absmax.pow(alpha) / wmax.pow(1 - alpha)
            m = torch.where((absmax > 0) & (wmax > 0), m, torch.ones_like(m)).clamp(1e-5, 1e5)
            for n in group:
                setattr(parent, n, _W8A8Matmul(children[n], m.float(), static, absmax.float()))
    if bf16_cache:
        twin.set_attn_implementation("bf16_kv_sdpa")
    return twin


def _calibration_prompts(path, options) -> list[list[int]]:
    """The method's calibration texts, tokenized as the engine does (cut to its token limit)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = SQ.calibration.prompts(options)
    return [tokenizer(t).input_ids[: SQ.calibration.max_tokens] for t in texts]


def _engine(path, cache, **options: str) -> XeonEngine:
    engine = XeonEngine(EngineConfig(
        model_path=str(path), quantize="smoothquant", quantization=SQ,
        max_batch_prefill_tokens=16,
        options={**TEST_OPTIONS, "block_size": "4", "calibration_cache": str(cache), **options}))
    engine.start()
    return engine


@pytest.mark.parametrize("forward,options", [
    ("auto", {}), ("decoder", {}), ("transformers", {}),
    ("auto", {"smoothquant_alpha": "0.8", "smoothquant_activations": "static"})])
def test_engine_greedy_tokens_match_a_w8a8_reference(default_model_path, tmp_path, caplog,
                                                     forward, options):
    """Prefill in chunks of 16 rows and batched decode steps (the vnni path where the CPU has it)."""
    from transformers import AutoModelForCausalLM

    kernel_paths.note("w8a8 vnni")
    model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    alpha = float(options.get("smoothquant_alpha", 0.5))
    static = options.get("smoothquant_activations") == "static"
    prompts = [[(t * 37 + 11) % 2000 + 3 for t in range(n)] for n in (21, 6, 40)]
    with caplog.at_level(logging.INFO, logger="switchyard.xeon"):
        engine = _engine(default_model_path, tmp_path, forward=forward, **options)
    try:
        assert "W8A8 int8 weights and activations" in caplog.text
        assert ("static scale" if static else "per token") in caplog.text
        got = _engine_tokens(engine, prompts, 8)
        bf16_cache = engine.info.dtype == "bfloat16"  # the cache's dtype, as /info reports
    finally:
        engine.shutdown()
    reference = _smoothquant_twin(model, _calibration_prompts(default_model_path, options),
                                  alpha, static, bf16_cache)
    _assert_greedy_near(reference, prompts, got, 8)
    # The reference is W8A8, not bf16: its logits differ from the float model's.
    with torch.inference_mode():
        ids = torch.tensor([prompts[0]])
        assert (reference(ids).logits - model(ids).logits).abs().max() > 1e-3


def test_calibration_runs_once_and_bad_files_stop_start_up(default_model_path, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="switchyard.xeon"):
        _engine(default_model_path, tmp_path).shutdown()
        assert "calibrated on 16 prompts" in caplog.text
        caplog.clear()
        _engine(default_model_path, tmp_path, smoothquant_alpha="0.7").shutdown()
    assert "calibration statistics from" in caplog.text and "calibrated on" not in caplog.text
    cached = list(tmp_path.glob("*.safetensors"))
    assert len(cached) == 1
    cached[0].write_bytes(cached[0].read_bytes()[:100])  # truncated
    with pytest.raises(EngineStartError, match=f"calibration cache {cached[0]} is corrupt"):
        _engine(default_model_path, tmp_path)
    bad = tmp_path / "prompts.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n{not json\n")
    with pytest.raises(EngineStartError, match=f"calibration file {bad}: line 2 is not JSON"):
        _engine(default_model_path, tmp_path, calibration_file=str(bad))
    with pytest.raises(EngineStartError, match="smoothquant_alpha must be from 0 to 1"):
        _engine(default_model_path, tmp_path, smoothquant_alpha="1.5")
    with pytest.raises(EngineStartError, match="linears=onednn rules out"):
        _engine(default_model_path, tmp_path, linears="onednn")
