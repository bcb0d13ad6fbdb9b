"""Mixture-of-experts layers on the engine's linears: tokens grouped by expert, one pass.

transformers 5 keeps a sparse MoE block's experts (Mixtral, Qwen2-MoE) as
one module holding stacked 3-D weights, ``gate_up_proj`` [E, 2I, H] and
``down_proj`` [E, H, I], called as ``experts(hidden, top_k_index,
top_k_weights)`` after the block's own router. Those weights are not
``nn.Linear`` layers, so :func:`~switchyard_xeon.linears.pack_linears`
never sees them: in ``--dtype bfloat16`` (a model loaded in fp32 for the
bf16 dot-product panels) the experts, most of an MoE model's weights, stay
fp32 and run on transformers' ``grouped_mm`` (PyTorch's CPU grouped matmul,
or its per-expert Python loop with ``experts_implementation="eager"``).
Measured on a Mixtral shape on 2 Zen 4 cores (``benchmarks/moe_decode.py``,
docs/xeon.md) that is 58-89% of a decode step.

:func:`group_experts` swaps each such experts module, keyed by its class
(:data:`GROUPED_EXPERTS`, the one place to add a class), for
:class:`GroupedExperts` before the linears are packed: every expert becomes
two plain linears, its ``gate|up`` (already one matrix) and its ``down``,
views of the stacked weights, so the engine packs them as it packs every
other linear (bf16 dot-product panels, oneDNN or stock, as ``linears``
chooses). A step's (token, expert) pairs are sorted by expert; each expert
hit runs its gate|up and down as one matmul over all its tokens, and the
weighted rows are summed back per token in the model's top-k order (as
transformers' ``grouped_mm`` implementation sums them). The block itself
is the model's own, so routing (Mixtral: softmax, top-k, renormalise;
Qwen2-MoE: ``norm_topk_prob``) and Qwen2-MoE's shared expert with its
sigmoid gate are computed by transformers' code, unchanged. Experts modules
of other classes, or of a known class in a layout this code does not
compute (biases, transposed or interleaved weights, a custom gate), keep
the model's own implementation, and start-up says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUPED_EXPERTS: frozenset[str] = frozenset({"MixtralExperts", "Qwen2MoeExperts"})
"""Experts classes (transformers 5) that :class:`GroupedExperts` computes, tested against
``generate`` (``tests/xeon/test_xeon_moe.py``)."""

MOE_CHOICES = ("grouped", "model")
"""Values of the ``moe`` engine option: ``grouped`` (the default) swaps in
:class:`GroupedExperts`, ``model`` keeps the model's own experts implementation."""


class GroupedExperts(torch.nn.Module):
    """A model's experts, each a ``gate|up`` and a ``down`` linear, run grouped by expert.

    Same call as transformers' experts modules: ``forward(hidden [T, H],
    top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``.
    """

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
        self.num_experts = gate_up.shape[0]
        self.source = type(experts).__name__
        self.act_fn = experts.act_fn
        # Views of the stacked weights: packing copies them, then the stack is let go.
        self.gate_up = torch.nn.ModuleList(_linear(gate_up[e]) for e in range(self.num_experts))
        self.down = torch.nn.ModuleList(_linear(down[e]) for e in range(self.num_experts))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = hidden.index_select(0, order // top_k)
        out = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            end = start + count
            gate, up = self.gate_up[expert](rows[start:end]).chunk(2, dim=-1)
            out[start:end] = self.down[expert]((self.act_fn(gate) * up).contiguous())
            start = end
        out.mul_(top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1).to(out.dtype))
        # Back in (token, slot) order, summed over the slots: grouped_mm's order of additions.
        pairs = torch.empty_like(out)
        pairs[order] = out
        return pairs.view(tokens, top_k, -1).sum(dim=1).to(hidden.dtype)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, from={self.source}, grouped by expert"


def _linear(weight: torch.Tensor) -> torch.nn.Linear:
    """A bias-free ``nn.Linear`` over ``weight`` [out, in] (shared, not copied)."""
    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False,
                            device="meta", dtype=weight.dtype)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    return layer


def layout_unsupported(experts: torch.nn.Module) -> str:
    """'' when :class:`GroupedExperts` computes ``experts`` exactly, else why not."""
    name = type(experts).__name__
    if name not in GROUPED_EXPERTS:
        return f"{name} is not one of {', '.join(sorted(GROUPED_EXPERTS))}"
    from transformers.integrations.moe import _default_apply_gate

    flags = {"has_gate": True, "has_bias": False, "is_transposed": False,
             "is_concatenated": True, "has_post_expert_norm": False}
    odd = [f for f, want in flags.items() if getattr(experts, f, want) != want]
    if odd:
        return f"{name} has {', '.join(odd)} set otherwise than the layout grouped here"
    if getattr(type(experts), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        return f"{name} gates its experts with its own function"
    gate_up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and gate_up.dim() == 3 and down.dim() == 3 and gate_up.shape[0] == down.shape[0]
            and gate_up.shape[1] == 2 * down.shape[2] and gate_up.shape[2] == down.shape[1]):
        return f"{name}'s weights are not stacked gate|up [E, 2I, H] and down [E, H, I]"
    return ""


def _is_experts(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a stacked-weights experts module (known to this code or not)."""
    return isinstance(getattr(module, "gate_up_proj", None), torch.Tensor) or (
        type(module).__name__.endswith("Experts")
        and isinstance(getattr(module, "down_proj", None), torch.Tensor))


@dataclass(frozen=True)
class MoeReport:
    """What :func:`group_experts` did, for the start-up log."""

    grouped: int = 0
    kept: int = 0
    experts: int = 0
    reason: str = ""
    """Why some experts modules kept the model's implementation ('' when none did)."""

    def describe(self) -> str:
        """The start-up log line's text ('' for a model without experts modules)."""
        if not self.grouped and not self.kept:
            return ""
        parts = []
        if self.grouped:
            parts.append(f"{self.grouped} experts layers ({self.experts} experts each) run "
                         "grouped by expert on the engine's linears, one gate|up and one down "
                         "matmul per expert hit")
        if self.kept:
            parts.append(f"{self.kept} keep the model's own experts implementation "
                         f"({self.reason})")
        return "; ".join(parts)


def group_experts(model: torch.nn.Module, mode: str = "grouped", why_not: str = "") -> MoeReport:
    """Swap every experts module :class:`GroupedExperts` computes for one, in place.

    ``mode`` is the ``moe`` engine option (:data:`MOE_CHOICES`); ``why_not``,
    when given, keeps every experts module as it is for that reason (e.g. a
    ``--quantize`` method, which these linears would otherwise take).
    """
    grouped = kept = experts = 0
    everywhere = why_not or ("moe=model" if mode == "model" else "")
    reason = ""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not _is_experts(child) or isinstance(child, GroupedExperts):
                continue
            why = everywhere or layout_unsupported(child)
            if why:
                kept += 1
                reason = reason or why  # the first, for the log
                continue
            replacement = GroupedExperts(child)
            setattr(parent, name, replacement)
            grouped += 1
            experts = replacement.num_experts
    return MoeReport(grouped=grouped, kept=kept, experts=experts, reason=reason)

