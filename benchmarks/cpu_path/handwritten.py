"""A hand-written Llama decode forward over the same weights, to price transformers' module plumbing.

Same math as transformers' LlamaForCausalLM (RMSNorm, rotary, GQA attention,
SiLU-gated MLP, tied head), written as a flat loop over layers with fused
q|k|v and gate|up weights, oneDNN-packed (or int8) linears, the paged cache
and the C++ decode-attention kernel (paged_attn_ext) for decode rows. Only
decode steps (every sequence feeds one token) are supported: prefill goes
through the transformers model of the harness, which shares the cache.

  nice -n 5 .venv/bin/python benchmarks/cpu_path/handwritten.py --batch 1 32 --linear mkldnn
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import MODELS, header, setup_threads
import harness
import paged_attn_ext


class HandLlama:
    def __init__(self, model, linear: str = "mkldnn"):
        cfg = model.config
        self.cfg = cfg
        self.eps = cfg.rms_norm_eps
        self.H, self.KVH = cfg.num_attention_heads, cfg.num_key_value_heads
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        self.scale = self.D ** -0.5
        self.embed = model.model.embed_tokens.weight
        self.norm = model.model.norm.weight
        inv = model.model.rotary_emb.inv_freq.float()
        self.inv_freq = inv

        def lin(w):
            return harness.PackedLinear(w, linear) if linear != "stock" else (
                lambda x, w=w: torch.nn.functional.linear(x, w))
        self.layers = []
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous()
            gu = torch.cat([m.gate_proj.weight, m.up_proj.weight]).contiguous()
            self.layers.append(dict(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                qkv=lin(qkv), o=lin(a.o_proj.weight), gu=lin(gu), down=lin(m.down_proj.weight)))
        self.head = lin(model.lm_head.weight)

    def rms(self, x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * w

    def rope(self, x, cos, sin):  # x [T, heads, D]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def decode(self, step: harness.Step, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        H, KVH, D = self.H, self.KVH, self.D
        T = ids.shape[0]
        freqs = pos.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(self.embed.dtype)[:, None, :]
        sin = emb.sin().to(self.embed.dtype)[:, None, :]
        h = self.embed[ids]
        cache = step.cache
        for i, L in enumerate(self.layers):
            x = self.rms(h, L["ln1"])
            q, k, v = L["qkv"](x).split((H * D, KVH * D, KVH * D), dim=-1)
            q = self.rope(q.view(T, H, D), cos, sin)
            k = self.rope(k.view(T, KVH, D), cos, sin)
            cache.write(i, step.slots, k.transpose(0, 1), v.view(T, KVH, D).transpose(0, 1))
            o = paged_attn_ext.paged_decode(q.contiguous(), cache.k[i], cache.v[i],
                                            step.padded_tables, step.lens, self.scale)
            h = h + L["o"](o.view(T, H * D))
            x = self.rms(h, L["ln2"])
            g, u = L["gu"](x).chunk(2, dim=-1)
            h = h + L["down"](torch.nn.functional.silu(g) * u)
        return self.head(self.rms(h, self.norm))


class HandRunner(harness.Runner):
    """Prefill with the transformers model (shared cache), decode with HandLlama."""

    def __init__(self, model, linear="mkldnn"):
        super().__init__(model, attn_mode="cpp")
        self.hand = HandLlama(model, linear)

    def forward(self, seqs):
        if any(len(s.tokens) - s.num_cached != 1 for s in seqs):
            return super().forward(seqs)
        ids, pos, keep, step = self.build(seqs)
        return self.hand.decode(step, torch.tensor(ids), torch.tensor(pos))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(MODELS / "small"))
    ap.add_argument("--linear", nargs="+", default=["mkldnn"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--threads", type=int)
    args = ap.parse_args()
    setup_threads(args.threads)
    header("hand-written Llama decode")
    for linear in args.linear:
        model = harness.load_model(args.model)
        runner = HandRunner(model, linear)
        ref = harness.Runner(harness.load_model(args.model), attn_mode="cpp")
        harness.fuse_projections(ref.model)
        harness.replace_linears(ref.model, linear)
        for b in args.batch:
            out = {}
            for name, r in (("hf-eager", ref), ("hand", runner)):
                times, cpu, seqs = harness.decode_bench(r, b, args.prompt, args.steps)
                out[name] = [s.tokens[args.prompt:] for s in seqs]
                print(f"{name:9s} {linear:7s} B={b:<3d} {statistics.median(times)*1e3:7.2f} ms/step "
                      f"(cpu {statistics.median(cpu)*1e3:6.2f})  {b/statistics.median(times):6.1f} tok/s",
                      flush=True)
            same = sum(x == y for a, c in zip(out["hand"], out["hf-eager"]) for x, y in zip(a, c))
            print(f"          greedy agreement hand vs hf-eager: {same}/{sum(map(len, out['hand']))}")


if __name__ == "__main__":
    main()
