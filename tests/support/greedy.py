"""Greedy references: transformers ``generate``'s tokens, and the teacher-forced near-tie check.

The parity tests compare an engine's greedy tokens with transformers' on the
same weights: token for token in fp32 (:func:`transformers_greedy` for
several prompts, :func:`generate_greedy` for one), or, where bf16 rounding can
split a near tie, teacher-forced on the engine's own tokens
(:func:`assert_greedy_near`). :func:`hf_min_new_tokens` is ``generate``'s greedy
answer under ``min_new_tokens`` and an EOS bias, with each token's log-probability.
"""

from __future__ import annotations

import torch

BF16_TIE = 0.05
"""Logit margin within which a bf16 engine may break a near tie differently from its reference."""


def transformers_greedy(model: torch.nn.Module, prompts: list[list[int]],
                        new: int) -> list[list[int]]:
    """transformers ``generate``'s greedy continuation of each prompt, one at a time."""
    want = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                 dtype=torch.long), do_sample=False, max_new_tokens=new,
                                 eos_token_id=None, pad_token_id=0)
            want.append(out[0, len(prompt):].tolist())
    return want


def generate_greedy(model: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    """``generate``'s greedy continuation of one unpadded prompt, EOS ignored."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), do_sample=False, max_new_tokens=new,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_greedy_near(model: torch.nn.Module, prompts: list[list[int]],
                       got: list[list[int]], new: int, tol: float = BF16_TIE) -> None:
    """Each of ``got``'s tokens is ``model``'s greedy choice after the same prefix, or within
    ``tol`` of it.

    In bf16 every value that enters a matmul or the cache is rounded to 8
    bits of mantissa, so where our fp32 sums differ from the reference's in
    the last bit (a native kernel's summation order, -march=native code on
    another CPU) one rounding can move a logit by about 1e-2 and flip a near
    tie. The check is teacher-forced on our tokens: a flipped tie is one
    step, not every step after it, and any real error (a wrong weight, row or
    position) moves logits far more than ``tol``.
    """
    with torch.inference_mode():
        for prompt, tokens in zip(prompts, got, strict=True):
            assert len(tokens) == new
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
            chosen = logits.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
            margin = logits.max(-1).values - chosen
            assert float(margin.max()) <= tol, (prompt, tokens, margin.tolist())


def hf_min_new_tokens(model: torch.nn.Module, prompt: list[int], max_new: int, min_new: int,
                      eos: int, eos_bias: float) -> tuple[list[int], list[float]]:
    """``generate(do_sample=False, min_new_tokens=...)`` with ``eos_bias`` added to the EOS
    logit (transformers' ``SequenceBiasLogitsProcessor``), stopping at EOS.

    Returns the generated ids (EOS included when it ended them) and each one's
    log-probability under the processed scores it was chosen from (bias and the
    min-new-tokens mask applied), the distribution an engine reports.
    """
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=max_new, min_new_tokens=min_new,
            eos_token_id=eos, pad_token_id=0, sequence_bias={(eos,): eos_bias},
            output_scores=True, return_dict_in_generate=True)
    ids = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, ids,
                                                                                strict=True)]
    return ids, logprobs
