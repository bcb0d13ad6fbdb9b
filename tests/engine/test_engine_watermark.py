"""switchyard.engine.watermark: TGI's green list, the environment settings, the bias."""

from __future__ import annotations

import pytest
import torch

from switchyard.engine.watermark import (
    WatermarkConfig,
    apply_watermark,
    greenlist,
)


def _tgi_greenlist(previous: int, vocab: int, gamma: float) -> set[int]:
    """The green list recomputed from TGI's published recipe, independently of the module."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(15485863 * previous)
    return set(torch.randperm(vocab, generator=gen)[: int(vocab * gamma)].tolist())


@pytest.mark.parametrize(("previous", "vocab", "gamma"),
                         [(0, 50, 0.5), (7, 2048, 0.5), (1999, 2048, 0.25),
                          (151_000, 151_936, 0.5)])
def test_greenlist_is_tgis(previous, vocab, gamma):
    ids = greenlist(previous, vocab, gamma)
    assert ids.dtype == torch.int64 and len(ids) == int(vocab * gamma)
    assert set(ids.tolist()) == _tgi_greenlist(previous, vocab, gamma)


def test_greenlist_depends_on_the_previous_token():
    assert set(greenlist(3, 1000, 0.5).tolist()) != set(greenlist(4, 1000, 0.5).tolist())


def test_reused_generator_gives_the_same_list():
    gen = torch.Generator()
    first = greenlist(11, 500, 0.5, gen)
    greenlist(12, 500, 0.5, gen)
    assert torch.equal(greenlist(11, 500, 0.5, gen), first)


def test_config_from_env(monkeypatch):
    monkeypatch.delenv("WATERMARK_GAMMA", raising=False)
    monkeypatch.delenv("WATERMARK_DELTA", raising=False)
    assert WatermarkConfig.from_env() == WatermarkConfig(gamma=0.5, delta=2.0)
    monkeypatch.setenv("WATERMARK_GAMMA", "0.25")
    monkeypatch.setenv("WATERMARK_DELTA", "4")
    assert WatermarkConfig.from_env() == WatermarkConfig(gamma=0.25, delta=4.0)
    monkeypatch.setenv("WATERMARK_DELTA", "lots")
    with pytest.raises(ValueError, match="WATERMARK_DELTA"):
        WatermarkConfig.from_env()


def test_apply_adds_delta_to_each_rows_green_list_only():
    vocab = 40
    scores = torch.randn(3, vocab)
    scores[1, 5] = float("-inf")
    configs = [WatermarkConfig(0.5, 2.0), WatermarkConfig(0.25, 3.0), WatermarkConfig(0.5, 2.0)]
    out = apply_watermark(scores, [9, 9, 30], configs)
    for row, (prev, cfg) in enumerate(zip([9, 9, 30], configs, strict=True)):
        green = _tgi_greenlist(prev, vocab, cfg.gamma)
        for tok in range(vocab):
            want = scores[row, tok] + (cfg.delta if tok in green else 0.0)
            assert out[row, tok] == want or (torch.isinf(want) and torch.isinf(out[row, tok]))
    assert torch.isneginf(out[1, 5])
