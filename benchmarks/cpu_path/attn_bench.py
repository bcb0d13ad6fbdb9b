"""Decode attention over B sequences on the paged layout, one layer: per-sequence loop vs one batched call.

Cache per layer: keys/values [kv_heads, num_blocks, block_size, head_dim]
(the engine's paged layout); blocks of each sequence are scattered (shuffled
pool). Context lengths are drawn around --ctx (+-50%). Query: one token per
sequence, 9 heads over 3 KV heads (SmolLM2-135M). Reported: microseconds per
layer call and the x30-layer cost per decode step.

  nice -n 5 .venv/bin/python benchmarks/cpu_path/attn_bench.py --batch 1 8 32 --ctx 192
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from common import SMALL, header, setup_threads, timeit

BS = 16


def setup(batch, ctx, heads=SMALL["heads"], kvh=SMALL["kv_heads"], d=SMALL["head_dim"], seed=0,
          dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(max(1, ctx // 2), ctx + ctx // 2 + 1, (batch,), generator=g).tolist()
    nblocks = [math.ceil(n / BS) for n in lens]
    total = sum(nblocks) + 1
    perm = (torch.randperm(total - 1, generator=g) + 1).tolist()  # block 0 = padding block
    tables, at = [], 0
    for nb in nblocks:
        tables.append(perm[at:at + nb])
        at += nb
    kpool = torch.randn(kvh, total, BS, d, generator=g).to(dtype)
    vpool = torch.randn(kvh, total, BS, d, generator=g).to(dtype)
    q = torch.randn(batch, heads, d, generator=g).to(dtype)  # packed decode rows
    return dict(lens=lens, tables=tables, k=kpool, v=vpool, q=q, heads=heads, kvh=kvh, d=d)


def meta(s):
    """Per-step metadata, built once and shared by the 30 layers."""
    lens = s["lens"]
    nb = max(len(t) for t in s["tables"])
    pt = torch.zeros(len(lens), nb, dtype=torch.long)
    for i, t in enumerate(s["tables"]):
        pt[i, : len(t)] = torch.tensor(t)
    lmax = max(lens)
    m = torch.arange(lmax)[None, :] < torch.tensor(lens)[:, None]
    return dict(flat=pt.reshape(-1), nb=nb, lmax=lmax, mask=m[:, None, None, :],
                bias=torch.zeros(m.shape).masked_fill_(~m, -math.inf)[:, None, None, :],
                tables=[torch.tensor(t) for t in s["tables"]])


def gather(pool, blocks, length):
    p = pool.index_select(1, blocks)
    h, c, b, d = p.shape
    return p.reshape(h, c * b, d)[:, :length]


def attn_loop(s, mt):
    """The engine today: per sequence, gather its blocks, one SDPA (heads folded per KV head)."""
    q, kvh, d = s["q"], s["kvh"], s["d"]
    g = s["heads"] // kvh
    out = torch.empty_like(q)
    for i, n in enumerate(s["lens"]):
        k = gather(s["k"], mt["tables"][i], n)
        v = gather(s["v"], mt["tables"][i], n)
        o = F.scaled_dot_product_attention(q[i].reshape(kvh, g, d)[None], k[None], v[None])
        out[i] = o.reshape(-1, d)
    return out


def _batched_kv(s, mt):
    kvh, d = s["kvh"], s["d"]
    B = len(s["lens"])
    k = s["k"].index_select(1, mt["flat"]).view(kvh, B, mt["nb"] * BS, d)[:, :, : mt["lmax"]]
    v = s["v"].index_select(1, mt["flat"]).view(kvh, B, mt["nb"] * BS, d)[:, :, : mt["lmax"]]
    return k.transpose(0, 1), v.transpose(0, 1)


def attn_batched_sdpa(s, mt):
    """One gather of the padded block tables, one SDPA with a key-padding mask."""
    B, kvh, d = len(s["lens"]), s["kvh"], s["d"]
    k, v = _batched_kv(s, mt)
    q = s["q"].view(B, kvh, -1, d)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mt["mask"])
    return o.reshape(B, -1, d)


def attn_batched_mm(s, mt):
    """One gather, then bmm / float softmax / bmm."""
    B, kvh, d = len(s["lens"]), s["kvh"], s["d"]
    k, v = _batched_kv(s, mt)
    q = s["q"].view(B, kvh, -1, d)
    sc = torch.matmul(q, k.transpose(-1, -2)).float() * (d ** -0.5) + mt["bias"]
    o = torch.matmul(torch.softmax(sc, -1).to(v.dtype), v)
    return o.reshape(B, -1, d)


def attn_batched_mm_fp32(s, mt):
    """One gather, K/V converted to float32, bmm / softmax / bmm in float32."""
    B, kvh, d = len(s["lens"]), s["kvh"], s["d"]
    k, v = _batched_kv(s, mt)
    q = s["q"].view(B, kvh, -1, d).float()
    sc = torch.matmul(q, k.float().transpose(-1, -2)) * (d ** -0.5) + mt["bias"]
    o = torch.matmul(torch.softmax(sc, -1), v.float())
    return o.reshape(B, -1, d).to(s["q"].dtype)


def _mm_attention(q, kpool, vpool, flat, bias, nb: int, lmax: int):
    kvh, _, bs, d = kpool.shape
    B = q.shape[0]
    k = kpool.index_select(1, flat).view(kvh, B, nb * bs, d)[:, :, :lmax].transpose(0, 1)
    v = vpool.index_select(1, flat).view(kvh, B, nb * bs, d)[:, :, :lmax].transpose(0, 1)
    qf = q.view(B, kvh, -1, d).float()
    sc = torch.matmul(qf, k.float().transpose(-1, -2)) * (d ** -0.5) + bias
    o = torch.matmul(torch.softmax(sc, -1), v.float())
    return o.reshape(B, -1, d).to(q.dtype)


_compiled_mm = None


def _reduce_attention(q, kpool, vpool, tables, lens, scale: float):
    """Decode attention as broadcast-multiply + sum reductions, the block-table gather inside.

    q [B, kvh, g, d]; pools [kvh, NB, bs, d]; tables [B, nb]; lens [B]. Written so that
    inductor can fuse the gather into the loads (no materialized K/V copy).
    """
    kvh, _, bs, d = kpool.shape
    B, nb = tables.shape
    L = nb * bs
    k = kpool[:, tables].reshape(kvh, B, L, d).transpose(0, 1)  # [B, kvh, L, d]
    v = vpool[:, tables].reshape(kvh, B, L, d).transpose(0, 1)
    s = (q.float()[:, :, :, None, :] * k.float()[:, :, None, :, :]).sum(-1) * scale
    pos = torch.arange(L, device=q.device)
    s = s.masked_fill((pos[None, :] >= lens[:, None])[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = (p[..., None] * v.float()[:, :, None, :, :]).sum(-2)
    return o.to(q.dtype)


_compiled_reduce = {}


def attn_compiled_reduce(s, mt, dynamic=False):
    """inductor on the reduction formulation (static shapes: one compile per (B, blocks))."""
    B, kvh, d = len(s["lens"]), s["kvh"], s["d"]
    key = dynamic
    if key not in _compiled_reduce:
        _compiled_reduce[key] = torch.compile(_reduce_attention, dynamic=dynamic)
    if "tables2d" not in mt:
        mt["tables2d"] = mt["flat"].view(B, -1)
        mt["lens_t"] = torch.tensor(s["lens"])
    o = _compiled_reduce[key](s["q"].view(B, kvh, -1, d), s["k"], s["v"], mt["tables2d"],
                              mt["lens_t"], d ** -0.5)
    return o.reshape(B, -1, d)


def attn_compiled_reduce_dyn(s, mt):
    """inductor on the reduction formulation, dynamic shapes (one compile for all B and lengths)."""
    return attn_compiled_reduce(s, mt, dynamic=True)


def attn_compiled_mm(s, mt):
    """The fp32 gather/bmm/softmax/bmm written in torch, compiled by inductor (dynamic shapes)."""
    global _compiled_mm
    if _compiled_mm is None:
        _compiled_mm = torch.compile(_mm_attention, dynamic=True)
    return _compiled_mm(s["q"], s["k"], s["v"], mt["flat"], mt["bias"], mt["nb"], mt["lmax"])


def attn_cpp(s, mt):
    """The hand-written C++ kernel of paged_attn_ext.py (no gather copy, no padding)."""
    import paged_attn_ext
    if "tables2d" not in mt:
        mt["tables2d"] = mt["flat"].view(len(s["lens"]), -1)
        mt["lens_t"] = torch.tensor(s["lens"])
    return paged_attn_ext.paged_decode(s["q"], s["k"], s["v"], mt["tables2d"], mt["lens_t"],
                                       s["d"] ** -0.5)


def attn_sdpa_nomask(s, mt):
    """Timing reference only (wrong result for padded rows): the batched SDPA without a mask."""
    B, kvh, d = len(s["lens"]), s["kvh"], s["d"]
    k, v = _batched_kv(s, mt)
    o = F.scaled_dot_product_attention(s["q"].view(B, kvh, -1, d), k, v)
    return o.reshape(B, -1, d)


def attn_gather_only(s, mt):
    """Timing reference: the batched gather alone (index_select of K and V)."""
    return _batched_kv(s, mt)[0][:, :, :1, :1].reshape(-1)[:0].sum() + s["q"] * 0


def attn_contiguous_sdpa(s, mt, cache={}):
    """Upper bound: K/V already contiguous per batch ([B, kvh, Lmax, d]); no gather at all."""
    key = id(s)
    if key not in cache:
        cache.clear()
        cache[key] = [t.contiguous() for t in _batched_kv(s, mt)]
    k, v = cache[key]
    B, kvh, d = len(s["lens"]), s["kvh"], s["d"]
    o = F.scaled_dot_product_attention(s["q"].view(B, kvh, -1, d), k, v, attn_mask=mt["mask"])
    return o.reshape(B, -1, d)


def make_flex(s, mt):
    """flex_attention compiled for CPU over the gathered padded K/V (mask_mod from lengths)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    B, kvh, d = len(s["lens"]), s["kvh"], s["d"]
    g = s["heads"] // kvh
    lens = torch.tensor(s["lens"])

    def mask_mod(b, h, qi, kv):
        return kv < lens[b]

    bm = create_block_mask(mask_mod, B, None, g, mt["lmax"], device="cpu")
    fa = torch.compile(flex_attention, dynamic=False)

    def run(s, mt):
        k, v = _batched_kv(s, mt)
        q = s["q"].view(B, kvh, g, d)
        o = fa(q, k, v, block_mask=bm)
        return o.reshape(B, -1, d)

    return run


VARIANTS = {
    "loop": attn_loop,
    "batched_sdpa": attn_batched_sdpa,
    "batched_mm": attn_batched_mm,
    "contiguous_sdpa": attn_contiguous_sdpa,
    "batched_mm_fp32": attn_batched_mm_fp32,
    "compiled_mm": attn_compiled_mm,
    "compiled_reduce": attn_compiled_reduce,
    "compiled_reduce_dyn": attn_compiled_reduce_dyn,
    "cpp": attn_cpp,
    "sdpa_nomask": attn_sdpa_nomask,
    "gather_only": attn_gather_only,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--ctx", type=int, default=192)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--flex", action="store_true")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--json")
    args = ap.parse_args()
    setup_threads(args.threads)
    header(f"paged decode attention, ctx ~{args.ctx}")
    rows = []
    with torch.inference_mode():
        for b in args.batch:
            s = setup(b, args.ctx)
            mt = meta(s)
            ref = attn_loop(s, mt).float()
            fns = {n: VARIANTS[n] for n in args.variants}
            if args.flex:
                try:
                    fns["flex_compiled"] = make_flex(s, mt)
                except Exception as exc:  # report, go on
                    print(f"flex: {type(exc).__name__}: {exc}"[:300])
            for name, fn in fns.items():
                try:
                    err = float((fn(s, mt).float() - ref).abs().max())
                    if name in ("sdpa_nomask", "gather_only"):
                        err = float("nan")  # timing references, not attention
                    t = timeit(lambda: fn(s, mt), repeats=9, inner=10)
                except Exception as exc:
                    print(f"{name}: {type(exc).__name__}: {exc}"[:300])
                    continue
                us = t["median"] * 1e6
                rows.append(dict(variant=name, batch=b, us=us, cpu_us=t["cpu"] * 1e6, max_err=err))
                print(f"{name:16s} B={b:<3d} {us:8.1f} us/layer (cpu {t['cpu']*1e6:8.1f})  "
                      f"x30 = {us*30/1e3:6.2f} ms/step  max|err| {err:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
