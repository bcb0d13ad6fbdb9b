"""The grouped low-rank product over fused projections, against a per-row float64 reference.

Each row's expected delta is computed alone, in float64, straight from the
definition (``scaling * B @ A @ x`` for every module its adapter adapts,
placed in that module's columns of the fused output), so neither the stacked
path nor the looped one is checked against the other.
"""

from __future__ import annotations

import pytest
import torch
from switchyard_engine.lora.config import AdapterConfig
from switchyard_engine.lora.folder import LoraAdapter, LoraModule
from switchyard_engine.lora.grouped import (
    Part,
    StepLora,
    add_grouped,
    add_looped,
    add_stacked,
    group_stack,
    row_gather,
    stack,
)

LAYOUT = (Part("q", 0, 8), Part("k", 8, 12), Part("v", 12, 16))
IN = 6


def _adapter(name: str, ranks: dict[str, int], seed: int) -> LoraAdapter:
    gen = torch.Generator().manual_seed(seed)
    modules = {}
    for part in LAYOUT:
        if part.module in ranks:
            r = ranks[part.module]
            modules[part.module] = LoraModule(
                a=torch.randn(r, IN, generator=gen), b=torch.randn(part.end - part.start, r,
                                                                   generator=gen),
                scaling=0.5 + seed)
    config = AdapterConfig(rank=1, alpha=1, target_modules=())
    return LoraAdapter(name=name, path="", modules=modules, config=config)


ADAPTERS = (_adapter("a", {"q": 2, "v": 3}, 1), _adapter("b", {"k": 4}, 2),
            _adapter("c", {"q": 1, "k": 1, "v": 5}, 3))


def _expected(x: torch.Tensor, groups: list[int]) -> torch.Tensor:
    out = torch.zeros(x.shape[0], LAYOUT[-1].end, dtype=torch.float64)
    for row, group in enumerate(groups):
        if group < 0:
            continue
        for part in LAYOUT:
            m = ADAPTERS[group].modules.get(part.module)
            if m is not None:
                delta = m.b.double() @ (m.a.double() @ x[row].double()) * m.scaling
                out[row, part.start:part.end] += delta
    return out


GROUPS = [0, -1, 2, 1, 0, 2, -1, 1, 1]


def test_stacked_matches_each_row_alone() -> None:
    x = torch.randn(len(GROUPS), IN, generator=torch.Generator().manual_seed(9))
    base = torch.randn(len(GROUPS), 16)
    out = base.clone()
    stacked = stack(ADAPTERS, LAYOUT)
    assert stacked is not None
    add_stacked(x, out, stacked, torch.tensor(GROUPS).unsqueeze(1))
    torch.testing.assert_close((out - base).double(), _expected(x, GROUPS), atol=1e-5, rtol=1e-5)


def test_looped_matches_each_row_alone() -> None:
    x = torch.randn(len(GROUPS), IN, generator=torch.Generator().manual_seed(9))
    out = torch.zeros(len(GROUPS), 16)
    flat = torch.tensor(GROUPS)
    add_looped(x, out, ADAPTERS, LAYOUT,
               [torch.nonzero(flat == g).view(-1) for g in range(len(ADAPTERS))])
    torch.testing.assert_close(out.double(), _expected(x, GROUPS), atol=1e-5, rtol=1e-5)


def test_grouped_matches_each_row_alone() -> None:
    x = torch.randn(len(GROUPS), IN, generator=torch.Generator().manual_seed(9))
    base = torch.randn(len(GROUPS), 16)
    out = base.clone()
    grouped = group_stack(ADAPTERS, LAYOUT)
    plan = row_gather(torch.tensor(GROUPS).unsqueeze(1), len(ADAPTERS))
    assert grouped is not None and plan is not None
    add_grouped(x, out, grouped, plan)
    torch.testing.assert_close((out - base).double(), _expected(x, GROUPS), atol=1e-5, rtol=1e-5)


def test_uneven_groups_are_not_padded() -> None:
    groups = torch.tensor([0] * 100 + [1]).unsqueeze(1)  # a long prompt beside one decode
    assert row_gather(groups, 2) is None


@pytest.mark.parametrize("kernel", ["grouped", "stacked", "looped"])
def test_step_row_blocks_and_bf16_outputs(kernel: str) -> None:
    x = torch.randn(len(GROUPS), IN, generator=torch.Generator().manual_seed(4))
    step = StepLora(adapters=ADAPTERS, groups=torch.tensor(GROUPS).unsqueeze(1), stacks={},
                    layouts={(0, "qkv"): LAYOUT}, kernel=kernel)
    out = torch.zeros(len(GROUPS), 16)
    for rows in (slice(0, 4), slice(4, len(GROUPS))):  # the decoder's row blocks
        step.add_(0, "qkv", x[rows], out[rows], rows)
    step.add_(1, "qkv", x, out)  # a layer no adapter adapts: nothing added
    torch.testing.assert_close(out.double(), _expected(x, GROUPS), atol=1e-5, rtol=1e-5)
    out = torch.zeros(len(GROUPS), 16)
    step.add_(0, "qkv", x, out)  # all rows at once
    torch.testing.assert_close(out.double(), _expected(x, GROUPS), atol=1e-5, rtol=1e-5)
    half = torch.zeros(len(GROUPS), 16, dtype=torch.bfloat16)
    step.add_(0, "qkv", x.bfloat16(), half)
    torch.testing.assert_close(half.double(), _expected(x.bfloat16().float(), GROUPS),
                               atol=0.05, rtol=0.02)


def test_a_layout_nobody_adapts_stacks_to_none() -> None:
    assert stack(ADAPTERS, (Part("o", 0, 4),)) is None
