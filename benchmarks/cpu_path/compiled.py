"""Whole-model torch.compile of transformers' Llama with the paged attention as an opaque custom op.

The attention function registered in ``AttentionInterface`` calls one
``torch.library.custom_op`` (``cpu_path::paged_attention``) that writes the
step's K/V into the paged cache and attends (batched decode rows in one SDPA,
prefill rows per sequence). Everything the op needs besides q/k/v (cache,
slots, block tables, lengths) lives in a per-step object the runner sets
before calling the model, so dynamo sees no Python metadata and the graph only
depends on the token count T (dynamic).

Everything else (embeddings, RMSNorm, rotary, projections, SiLU*up, residuals,
lm_head on the kept rows) is compiled by inductor; with ``--freezing`` the
weights become constants and bf16 linears are prepacked for oneDNN
(``_linear_pointwise``), i.e. the mkldnn variant of gemv.py plus fusion.

  nice -n 5 .venv/bin/python benchmarks/cpu_path/compiled.py --batch 1 32 --mode eager compile freeze
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from common import MODELS, header, setup_threads
import harness

CURRENT: dict = {}


@torch.library.custom_op("cpu_path::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    scale: float) -> torch.Tensor:
    """q [1, H, T, d], k/v [1, KVH, T, d] -> [1, T, H, d]; cache and step metadata from CURRENT."""
    step = CURRENT["step"]

    class _M:  # the shape of transformers' module argument that bench_attention reads
        layer_idx = layer

    out, _ = harness.bench_attention(_M, q, k, v, None, scaling=scale,
                                     **{harness.STEP_KWARG: step})
    return out


@paged_attention.register_fake
def _(q, k, v, layer, scale):
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])


def op_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    return torch.ops.cpu_path.paged_attention(query, key, value, module.layer_idx, scaling), None


def register():
    from transformers import AttentionInterface
    AttentionInterface.register("cpu_path_op", op_attention)
    return "cpu_path_op"


class CompiledRunner(harness.Runner):
    def __init__(self, model, attn_mode="batched", compiled=None):
        super().__init__(model, attn_mode=attn_mode)
        self.fn = model if compiled is None else compiled

    def forward(self, seqs):
        ids, pos, keep, step = self.build(seqs)
        CURRENT["step"] = step
        ids_t, pos_t, keep_t = torch.tensor([ids]), torch.tensor([pos]), torch.tensor(keep)
        out = self.fn(input_ids=ids_t, position_ids=pos_t, use_cache=False, logits_to_keep=keep_t)
        return out.logits[0]


def build(path, mode, linear="stock", fuse=False):
    from transformers import AutoModelForCausalLM
    import torch._inductor.config as ic
    name = register()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=name)
    model.eval()
    if fuse:
        harness.fuse_projections(model)
    harness.replace_linears(model, linear, include_head=linear != "stock")
    if mode == "eager":
        return model, model
    ic.freezing = mode in ("freeze", "freeze-ma")
    ic.cpp.weight_prepack = True
    kw = {"dynamic": True}
    if mode.endswith("-ma"):
        kw["mode"] = "max-autotune-no-cudagraphs"
    return model, torch.compile(model, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(MODELS / "small"))
    ap.add_argument("--mode", nargs="+", default=["eager", "compile", "freeze"])
    ap.add_argument("--linear", default="stock")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--json")
    args = ap.parse_args()
    setup_threads(args.threads)
    header(f"whole-model compile, prompt {args.prompt}, linears {args.linear}")
    rows, ref = [], {}
    for mode in args.mode:
        t0 = time.perf_counter()
        model, fn = build(args.model, mode, args.linear)
        runner = CompiledRunner(model, compiled=fn)
        # first calls compile: prefill shapes and decode shapes
        with torch.inference_mode():
            warm = harness.make_prompts(2, 16, model.config.vocab_size, seed=1)
            runner.step(warm)
            runner.step(warm)
            runner.step(warm[:1])
            for s in warm:
                runner.release(s)
        print(f"# {mode}: build + compile {time.perf_counter() - t0:.1f} s", flush=True)
        for b in args.batch:
            times, cpu, seqs = harness.decode_bench(runner, b, args.prompt, args.steps)
            toks = [s.tokens[args.prompt:] for s in seqs]
            ref.setdefault(b, toks)
            agree = sum(x == y for a, r in zip(toks, ref[b]) for x, y in zip(a, r))
            total = sum(len(a) for a in toks)
            med, cmed = statistics.median(times), statistics.median(cpu)
            rows.append(dict(mode=mode, linear=args.linear, batch=b, ms=med * 1e3,
                             ms_min=min(times) * 1e3, cpu_ms=cmed * 1e3, tok_s=b / med,
                             agree=agree / total))
            print(f"{mode:10s} B={b:<3d} {med*1e3:8.2f} ms/step (min {min(times)*1e3:7.2f}, "
                  f"cpu {cmed*1e3:7.2f})  {b/med:7.1f} tok/s  greedy agreement {agree}/{total}",
                  flush=True)
        del model, fn, runner
        torch._dynamo.reset()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
