"""LoRA adapters in PEFT's own format on a test model, and PEFT's own output as the reference.

:func:`make_adapter` wraps the model folder's model with
``peft.get_peft_model(LoraConfig(...))``, gives every ``lora_A`` and
``lora_B`` random values of a scale that moves the greedy tokens (PEFT
zero-initialises B, which would make the adapter a no-op), and saves the
folder with ``save_pretrained``. :func:`peft_greedy` runs that folder
through ``PeftModel.from_pretrained`` (unmerged) with transformers'
``generate``: the reference every engine and API test compares against.

:data:`ADAPTERS` are the shapes the tests use: different ranks, target
modules as a list or a regex, rank/alpha patterns, rsLoRA.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass(frozen=True)
class AdapterSpec:
    """What a test adapter looks like (fields of ``peft.LoraConfig``)."""

    r: int
    alpha: float
    targets: list[str] | str
    seed: int
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    rslora: bool = False
    scale: float = 0.5
    """Standard deviation of the random A and B entries."""


ADAPTERS: dict[str, AdapterSpec] = {
    "attn-r4": AdapterSpec(r=4, alpha=8, targets=["q_proj", "v_proj"], seed=1),
    "all-r8": AdapterSpec(r=8, alpha=16, seed=2, targets=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp-regex": AdapterSpec(r=2, alpha=4, seed=3, rslora=True,
                             targets=r".*\.mlp\.(gate_proj|down_proj)",
                             rank_pattern={"down_proj": 6}, alpha_pattern={"gate_proj": 3.0}),
    "kv-o-r16": AdapterSpec(r=16, alpha=16, targets=["k_proj", "o_proj", "up_proj"], seed=4),
}


SERVER_KEY = "lora-key"
"""The API key of the LoRA tests' live server (the ``live`` fixture of ``tests/lora``)."""

SERVER_ADAPTERS = {"attn": "attn-r4", "mlp": "mlp-regex"}
"""The adapters that server serves from ``--lora-adapters``: served name -> :data:`ADAPTERS` key."""


def _load_base(model_path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def make_adapter(model_path: Path, out: Path, spec: AdapterSpec) -> Path:
    """Save an adapter of shape ``spec`` for the model in ``model_path`` to ``out`` (PEFT's format)."""
    from peft import LoraConfig, get_peft_model

    if (out / "adapter_config.json").is_file():
        return out
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=spec.targets,
                        rank_pattern=spec.rank_pattern, alpha_pattern=spec.alpha_pattern,
                        use_rslora=spec.rslora, lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM")
    model = get_peft_model(_load_base(model_path), config)
    generator = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * spec.scale)
    model.save_pretrained(out, safe_serialization=True)
    return out


def edit_config(folder: Path, **changes: object) -> None:
    """Change fields of an adapter's ``adapter_config.json`` (for the refusal tests)."""
    path = folder / "adapter_config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


class PeftReference:
    """The base model with adapters loaded through PEFT (unmerged): greedy tokens and logprobs."""

    def __init__(self, model_path: Path, adapters: dict[str, Path]) -> None:
        from peft import PeftModel

        self.base = _load_base(model_path)
        names = list(adapters)
        self.model = PeftModel.from_pretrained(_load_base(model_path), adapters[names[0]],
                                               adapter_name=names[0]).eval()
        for name in names[1:]:
            self.model.load_adapter(adapters[name], adapter_name=name)

    def greedy(self, prompt: list[int], new: int, adapter: str | None
               ) -> tuple[list[int], list[float]]:
        """Greedy tokens and their log-probabilities for ``adapter`` (None: the plain base).

        A plain loop over full forwards (no cache, EOS not special): each token
        is the argmax of the raw logits, its log-probability their log-softmax.
        """
        model = self.base
        if adapter is not None:
            self.model.set_adapter(adapter)
            model = self.model
        ids = list(prompt)
        tokens: list[int] = []
        logprobs: list[float] = []
        # One thread: the tiny model gains nothing from more, and on a busy 2-core machine
        # OpenMP threads waiting for a descheduled peer made each forward ~40x slower.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                for _ in range(new):
                    logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
                    token = int(logits.argmax())
                    tokens.append(token)
                    logprobs.append(float(torch.log_softmax(logits, -1)[token]))
                    ids.append(token)
        finally:
            torch.set_num_threads(threads)
        return tokens, logprobs


def lora_engine(model_path: Path, adapters: dict[str, Path], max_loras: int = 0,
                max_lora_rank: int = 0, quantize: str | None = None, quantization=None,
                dtype: str = "float32", **options: str):  # -> XeonEngine
    """A started Xeon engine (fp32 unless ``dtype``) serving ``adapters`` on the model (small blocks, 16-token
    prefill chunks, as :func:`tests.support.xeon_engines.started_engine`), over a
    ``quantize``d base when given (``quantization`` is that method)."""
    from switchyard_spec import EngineConfig
    from switchyard_xeon.engine import XeonEngine

    from tests.support.xeon_options import TEST_OPTIONS

    engine = XeonEngine(EngineConfig(
        model_path=str(model_path), dtype=dtype, max_batch_prefill_tokens=16,
        lora_adapters={name: str(path) for name, path in adapters.items()},
        max_loras=max_loras, max_lora_rank=max_lora_rank, quantize=quantize,
        quantization=quantization, options={**TEST_OPTIONS, "block_size": "4", **options}))
    engine.start()
    return engine
