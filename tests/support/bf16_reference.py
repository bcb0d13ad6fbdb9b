"""A transformers model as the Xeon engine runs it in bf16: bf16 matmuls and a bf16 KV cache.

:func:`with_bf16_matmuls` copies an fp32 model with every linear a bf16 matmul
(or, given a quantization method, :class:`~tests.support.quantized_reference.QuantizedMatmul`)
and attention over keys and values rounded to bf16; :func:`bf16_kv_sdpa` is that
attention, registered under the name ``bf16_kv_sdpa`` for other references to use.
"""

from __future__ import annotations

import copy

import torch

from switchyard_spec import QuantizationMethod

from tests.support.quantized_reference import QuantizedMatmul


class Bf16Matmul(torch.nn.Module):
    """A linear as a bf16 matmul: input and weight rounded to bf16, fp32 sums and bias."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight.detach().bfloat16().float()
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.bfloat16().float(), self.weight, self.bias)


def bf16_kv_sdpa(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention over keys and values rounded to bf16, as a bf16 cache holds them."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key.bfloat16().float(), value.bfloat16().float(),
                                  attention_mask, **kwargs)


def register_bf16_kv_sdpa(name: str = "bf16_kv_sdpa") -> None:
    """Register :func:`bf16_kv_sdpa` (and SDPA's mask) as attention implementation ``name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, bf16_kv_sdpa)
    AttentionMaskInterface.register(name, sdpa_mask)


def with_bf16_matmuls(model: torch.nn.Module,
                      quantization: QuantizationMethod | None = None) -> torch.nn.Module:
    """A copy of fp32 ``model`` as the engine runs ``--dtype bfloat16`` on bf16 dot panels.

    Every linear is a bf16 matmul (over the weights ``quantization`` gives,
    ``--quantize``: :class:`~tests.support.quantized_reference.QuantizedMatmul`)
    and attention reads keys and values rounded to bf16 (the cache); the
    embedding, norms and the rest stay fp32.
    """
    register_bf16_kv_sdpa()
    twin = copy.deepcopy(model)
    for parent in list(twin.modules()):
        for name, child in parent.named_children():
            if type(child) is torch.nn.Linear:
                setattr(parent, name, Bf16Matmul(child) if quantization is None
                        else QuantizedMatmul(child, quantization))
    twin.set_attn_implementation("bf16_kv_sdpa")
    return twin
