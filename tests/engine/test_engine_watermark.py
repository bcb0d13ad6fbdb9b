"""switchyard_engine.watermark against TGI's, stated in ``tests/support/tgi_watermark.py``.

The statement there is written from TGI's processor (hash key, gamma and delta and
their environment variables, seeding, green list, bias), not from our module; the
sampler's whole logit pipeline is compared with TGI's processor here, and a
generation through the engine with transformers' in ``tests/xeon/test_xeon_sampling.py``.
"""

from __future__ import annotations

import pytest
import torch

from switchyard_engine.sampling import RowSampler, apply_watermarks
from switchyard_engine.watermark import (
    WatermarkConfig,
    apply_watermark,
    greenlist,
)
from switchyard_spec import SamplingParams

from tests.support.tgi_watermark import (
    TGI_DEFAULT_DELTA,
    TGI_DEFAULT_GAMMA,
    TGI_DELTA_ENV,
    TGI_GAMMA_ENV,
    TgiWatermark,
)


def _tgi_greenlist(previous: int, vocab: int, gamma: float) -> set[int]:
    return set(TgiWatermark(gamma=gamma).green_ids(previous, vocab).tolist())


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
    monkeypatch.delenv(TGI_GAMMA_ENV, raising=False)
    monkeypatch.delenv(TGI_DELTA_ENV, raising=False)
    assert WatermarkConfig.from_env() == WatermarkConfig(gamma=TGI_DEFAULT_GAMMA,
                                                         delta=TGI_DEFAULT_DELTA)
    monkeypatch.setenv(TGI_GAMMA_ENV, "0.25")
    monkeypatch.setenv(TGI_DELTA_ENV, "4")
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


@pytest.mark.parametrize(("vocab", "gamma", "delta"),
                         [(2048, TGI_DEFAULT_GAMMA, TGI_DEFAULT_DELTA), (2047, 0.25, 4.0),
                          (49152, TGI_DEFAULT_GAMMA, TGI_DEFAULT_DELTA)])
def test_sampler_rows_are_biased_as_tgis_processor_biases_them(monkeypatch, vocab, gamma, delta):
    """A batch of watermarked rows, each following its own context, against TGI's processor
    applied to each sequence alone; settings from TGI's environment variables."""
    monkeypatch.setenv(TGI_GAMMA_ENV, str(gamma))
    monkeypatch.setenv(TGI_DELTA_ENV, str(delta))
    gen = torch.Generator().manual_seed(vocab)
    contexts = [[5, 17], [vocab - 1], [3, 3, 0], [1234, 77, 9]]
    rows = [RowSampler(SamplingParams(watermark=True), ctx, vocab) for ctx in contexts]
    rows.append(RowSampler(SamplingParams(), [8], vocab))  # no watermark: untouched
    logits = torch.randn(len(rows), vocab, generator=gen)
    tgi = TgiWatermark(gamma=gamma, delta=delta)
    for step in range(3):
        ours = apply_watermarks(logits, rows)
        for i, ctx in enumerate(contexts):
            want = tgi(torch.tensor([ctx]), logits[i : i + 1])[0]
            assert torch.equal(ours[i], want), (step, i)
        assert torch.equal(ours[-1], logits[-1])
        # Each row goes on from a token of its own: the next list follows it.
        for i, (row, ctx) in enumerate(zip(rows, contexts, strict=False)):
            token = int(logits[i].argmax())
            row.record(token)
            ctx.append(token)
        logits = torch.randn(len(rows), vocab, generator=gen)
