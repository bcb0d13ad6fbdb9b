"""Mixture-of-experts models (Mixtral, Qwen2-MoE) with their experts grouped by expert.

:mod:`switchyard_xeon.moe` swaps transformers' stacked-weights experts
modules for :class:`~switchyard_xeon.moe.GroupedExperts` (per-expert linears
the engine packs; tokens sorted by expert, one gate|up and one down matmul
per expert hit). Checked here:

- the module alone against the model's own experts (``eager`` and
  ``grouped_mm`` implementations) on routes that leave an expert idle;
- which modules are swapped and which keep the model's implementation
  (another class, another layout, ``moe=model``, ``--quantize``);
- the engine, fp32, per family (tiny random models, 2 layers, 4 experts top-2;
  Qwen2-MoE with its shared expert and ``norm_topk_prob`` off and on):
  greedy tokens equal ``generate`` for three prompts submitted together,
  and sequences joining and leaving (one with prompt log-probs, one
  aborted) get each sequence's own transformers reference, tokens (near ties
  allowed), log-probs and top tokens, as the fallback batching test checks;
- ``--dtype bfloat16`` on the bf16 dot-product panels against the same model
  with bf16 matmuls, experts included (near ties allowed).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from switchyard_spec import FinishReason
from switchyard_xeon.engine import XeonEngine
from switchyard_xeon.moe import GroupedExperts, group_experts, layout_unsupported

from tests.support import kernel_paths
from tests.support.bf16_reference import with_bf16_matmuls
from tests.support.engine_requests import token_ids
from tests.support.greedy import assert_greedy_near, transformers_greedy
from tests.support.joining_sequences import check_against_alone, join_and_leave
from tests.support.tiny_models import IDS, LAYERS, MIXED_PROMPTS
from tests.support.xeon_engines import engine_tokens, started_engine, started_with_log

FAMILIES = ("mixtral", "qwen2_moe", "qwen2_moe_norm")


def _build(name: str) -> torch.nn.Module:
    import transformers as T

    layers = {**LAYERS, "num_key_value_heads": 2}
    if name == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(
            intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, **layers, **IDS))
    if name.startswith("qwen2_moe"):
        return T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            moe_intermediate_size=48, intermediate_size=96, shared_expert_intermediate_size=96,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=name.endswith("_norm"),
            **layers, **IDS))
    raise KeyError(name)


def _saved(name: str, folder: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = _build(name).eval()
    model.save_pretrained(folder)
    return model


def _experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Experts")]


# ------------------------------------------------------------------ the module alone

@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_grouped_experts_equal_the_models_own(name, implementation):
    """37 tokens routed top-2 among experts 0-2 (expert 3 idle): the model's experts' output."""
    torch.manual_seed(1)
    model = _build(name).eval()
    model.set_experts_implementation(implementation)
    experts = _experts(model)[0]
    before = experts.gate_up_proj.detach().clone()
    hidden = torch.randn(37, 64)
    index = torch.stack([torch.randperm(3)[:2] for _ in range(37)])
    weights = torch.softmax(torch.randn(37, 2), -1)
    grouped = GroupedExperts(experts)
    with torch.inference_mode():
        torch.testing.assert_close(grouped(hidden, index, weights), experts(hidden, index, weights),
                                   atol=1e-6, rtol=1e-5)
        one = grouped(hidden[:1], index[:1], weights[:1])  # a decode row: two experts hit
        torch.testing.assert_close(one, experts(hidden[:1], index[:1], weights[:1]),
                                   atol=1e-6, rtol=1e-5)
    assert torch.equal(experts.gate_up_proj, before)  # views, not moved or changed
    inner = 96 if name == "mixtral" else 48
    assert len(grouped.gate_up) == 4 and grouped.gate_up[0].weight.shape == (2 * inner, 64)
    assert grouped.down[3].weight.shape == (64, inner)


def test_which_experts_are_grouped_and_which_keep_their_own():
    torch.manual_seed(0)
    model = _build("mixtral").eval()
    report = group_experts(model)
    assert (report.grouped, report.kept, report.experts) == (2, 0, 4)
    assert all(isinstance(layer.mlp.experts, GroupedExperts) for layer in model.model.layers)
    assert "2 experts layers (4 experts each) run grouped by expert" in report.describe()
    assert group_experts(model).describe() == ""  # nothing left to swap

    for mode, why_not, reason in (("model", "", "moe=model"),
                                  ("grouped", "--quantize int8", "--quantize int8")):
        fresh = _build("mixtral").eval()
        report = group_experts(fresh, mode, why_not)
        assert (report.grouped, report.kept) == (0, 2) and report.reason == reason
        assert not any(isinstance(m, GroupedExperts) for m in fresh.modules())
        assert f"keep the model's own experts implementation ({reason})" in report.describe()

    # A known class in another layout, and a class this code does not know: kept, with why.
    odd = _build("mixtral").eval()
    odd.model.layers[0].mlp.experts.has_bias = True
    assert "has_bias" in layout_unsupported(odd.model.layers[0].mlp.experts)
    report = group_experts(odd)
    assert (report.grouped, report.kept) == (1, 1) and "has_bias" in report.reason

    class OtherExperts(torch.nn.Module):
        def __init__(self, experts):
            super().__init__()
            self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj

    other = _build("mixtral").eval()
    other.model.layers[1].mlp.experts = OtherExperts(other.model.layers[1].mlp.experts)
    report = group_experts(other)
    assert (report.grouped, report.kept) == (1, 1)
    assert report.reason.startswith("OtherExperts is not one of MixtralExperts, Qwen2MoeExperts")

    from transformers import LlamaConfig, LlamaForCausalLM

    dense = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=1, num_attention_heads=4, **IDS))
    assert group_experts(dense).describe() == ""


# ------------------------------------------------------------------ the engine, fp32

@pytest.fixture(scope="module", params=FAMILIES)
def served(request, tmp_path_factory) -> Iterator[tuple[torch.nn.Module, XeonEngine, list[str]]]:
    """One family's reference model, its started fp32 engine and the engine's start-up log."""
    folder = tmp_path_factory.mktemp(request.param)
    model = _saved(request.param, folder)
    engine, lines = started_with_log(folder)
    yield model, engine, lines
    engine.shutdown()


def _runner_model(engine: XeonEngine) -> torch.nn.Module:
    runner = engine._runner
    return runner._forward.model if hasattr(runner, "_forward") else runner.model


def test_start_up_logs_grouped_experts(served):
    _, engine, lines = served
    assert any(line.startswith("path: paged attention") for line in lines)
    assert ("mixture of experts: 2 experts layers (4 experts each) run grouped by expert on the "
            "engine's linears, one gate|up and one down matmul per expert hit") in lines
    grouped = [m for m in _runner_model(engine).modules() if isinstance(m, GroupedExperts)]
    assert len(grouped) == 2
    # Packed as every other linear of the model is (oneDNN on this fp32 engine, or panels).
    assert all(type(m).__name__ in ("PackedLinear", "PanelLinear")
               for g in grouped for m in [*g.gate_up, *g.down])


def test_greedy_tokens_equal_generate(served):
    """Three prompts submitted together (shared steps, chunked prefill): ``generate``'s tokens."""
    model, engine, _ = served
    assert engine_tokens(engine, MIXED_PROMPTS, 8) == transformers_greedy(model, MIXED_PROMPTS, 8)


def test_sequences_joining_and_leaving_get_what_each_gets_alone(served):
    """a runs 12 tokens; b joins at a's 2nd token and leaves after 4; c (a 33-token prompt in
    16-token chunks, prompt log-probs) joins at a's 4th; e runs from the start and is aborted
    at a's 6th; d joins when b finishes. Each against its own transformers reference."""
    model, engine, _ = served
    new = {"a": 12, "b": 4, "c": 7, "d": 5, "e": 60}
    prompts, events = join_and_leave(engine, new)
    assert events["e"][-1].finish_reason is FinishReason.ABORTED
    for rid, got in events.items():
        assert all(e.error is None for e in got), rid
        if rid != "e":
            assert len(token_ids(got)) == new[rid], rid
        check_against_alone(model, prompts[rid], got)
    prompt = prompts["c"]
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    want = logprobs[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(events["c"][0].prompt_logprobs), want,
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("options", [{"moe": "model"}, {"forward": "fallback"}])
def test_the_models_own_experts_and_the_fallback_path(tmp_path, options):
    """``moe=model`` keeps transformers' experts; ``forward=fallback`` groups them too; both
    give ``generate``'s tokens."""
    model = _saved("mixtral", tmp_path)
    engine = started_engine(tmp_path, **options)
    try:
        grouped = any(isinstance(m, GroupedExperts) for m in _runner_model(engine).modules())
        assert grouped == (options.get("moe") != "model")
        want = transformers_greedy(model, MIXED_PROMPTS, 6)
        assert engine_tokens(engine, MIXED_PROMPTS, 6) == want
    finally:
        engine.shutdown()


# ------------------------------------------------------------------ bf16 on the dot panels

class _Bf16Experts(torch.nn.Module):
    """The model's experts as bf16 matmuls (inputs and weights rounded, fp32 sums), eagerly."""

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.gate_up = experts.gate_up_proj.detach().bfloat16().float()
        self.down = experts.down_proj.detach().bfloat16().float()
        self.act_fn = experts.act_fn

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for expert in range(self.gate_up.shape[0]):
            token, slot = torch.where(top_k_index == expert)
            if not len(token):
                continue
            h = torch.nn.functional.linear(hidden[token].bfloat16().float(), self.gate_up[expert])
            gate, up = h.chunk(2, dim=-1)
            h = torch.nn.functional.linear((self.act_fn(gate) * up).bfloat16().float(),
                                           self.down[expert])
            out.index_add_(0, token, h * top_k_weights[token, slot, None])
        return out


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_bf16_on_dot_panels_matches_generate_with_bf16_matmuls(name, tmp_path):
    kernel_paths.require("panel_dot bf16")
    model = _saved(name, tmp_path)
    reference = with_bf16_matmuls(model)
    for parent in list(reference.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child).__name__.endswith("Experts"):
                setattr(parent, child_name, _Bf16Experts(child))
    prompts = MIXED_PROMPTS[:2]
    engine = started_engine(tmp_path, dtype="bfloat16")
    try:
        grouped = [m for m in _runner_model(engine).modules() if isinstance(m, GroupedExperts)]
        assert grouped and all(m.bf16_dot for g in grouped for m in [*g.gate_up, *g.down])
        assert_greedy_near(reference, prompts, engine_tokens(engine, prompts, 10), 10)
    finally:
        engine.shutdown()
