"""Linear-kernel microbenchmark on the SmolLM2-135M shape: one "weight sweep".

A sweep runs every linear of the model once (30 layers x q,k,v,o,gate,up,down,
plus the tied lm_head unless --no-lm-head), each with its own weight, so the
weights stream from DRAM as in a real decode step (270 MB in bf16, far beyond
the 32 MB L3). Reported per kernel variant and batch size M:

  ms/sweep, GB/s of weight bytes streamed (vs 46 GB/s measured read bandwidth),
  GFLOP/s, and the tokens/s ceiling at batch 1 if the linears were the only cost.

  nice -n 5 .venv/bin/python benchmarks/cpu_path/gemv.py --m 1 32 [--variants ...]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from common import MEM_BW_GBS, SMALL, header, layer_linears, setup_threads, timeit, wait_idle


def make_weights(with_head: bool, dtype=torch.bfloat16, seed: int = 0, fuse: bool = False):
    g = torch.Generator().manual_seed(seed)
    ws = []
    shapes = layer_linears()
    if fuse:  # q|k|v and gate|up concatenated: 4 matmuls per layer instead of 7
        shapes = {"qkv": (shapes["q"][0] + shapes["k"][0] + shapes["v"][0], shapes["q"][1]),
                  "o": shapes["o"], "gate_up": (2 * shapes["gate"][0], shapes["gate"][1]),
                  "down": shapes["down"]}
    for _ in range(SMALL["layers"]):
        for n, k in shapes.values():
            ws.append((torch.randn(n, k, generator=g) * 0.02).to(dtype))
    if with_head:
        ws.append((torch.randn(SMALL["vocab"], SMALL["hidden"], generator=g) * 0.02).to(dtype))
    return ws


# ---- variants: prepare(weights fp32/bf16 list) -> (bytes, fn(m) -> callable)

def v_linear_bf16(ws):
    ws = [w.to(torch.bfloat16).contiguous() for w in ws]
    return ws, lambda x, w: F.linear(x, w)


def v_linear_fp32(ws):
    ws = [w.float().contiguous() for w in ws]
    return ws, lambda x, w: F.linear(x, w)


def v_matmul_t_bf16(ws):
    """x @ W^T with W stored transposed ([K, N] contiguous) — a different MKL/oneDNN path."""
    wt = [w.to(torch.bfloat16).t().contiguous() for w in ws]
    return wt, lambda x, w: torch.mm(x, w)


def v_mkldnn_bf16(ws):
    """oneDNN-packed bf16 weight (what inductor's weight_prepack uses for bf16)."""
    packed = [torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16).contiguous(), None)
              for w in ws]
    return packed, lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def v_mkl_fp32(ws, batch=1):
    """MKL-packed fp32 weight (inductor's fp32 weight_prepack); packed for one batch size."""
    items = [(torch.ops.mkl._mkl_reorder_linear_weight(w.float().contiguous(), batch), w.float())
             for w in ws]
    return items, lambda x, it: torch.ops.mkl._mkl_linear(x, it[0], it[1], None, x.shape[0])


def v_int8_wo(ws):
    """Per-channel symmetric int8 weights, bf16 activations: aten._weight_int8pack_mm."""
    items = []
    for w in ws:
        w = w.float()
        scale = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0
        q = torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8).contiguous()
        items.append((q, scale.to(torch.bfloat16)))
    return items, lambda x, it: torch._weight_int8pack_mm(x, it[0], it[1])


def v_int4_wo(ws, group=32, tiles=8):
    """Grouped asymmetric int4 weights: aten._weight_int4pack_mm_for_cpu (bf16 activations)."""
    items = []
    for w in ws:
        w = w.float()
        n, k = w.shape
        wg = w.reshape(n, k // group, group)
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / 15).clamp_min(1e-8)
        q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
        q = q.reshape(n, k)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, tiles)
        # tinygemm convention: w = (q - 8) * scale + zero, zero = lo + 8 * scale
        zero = lo + 8 * scale
        sz = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
        items.append((packed, sz))
    return items, lambda x, it: torch._weight_int4pack_mm_for_cpu(x, it[0], group, it[1])


def v_inductor_reduce_bf16(ws):
    """A GEMV written as a broadcast multiply + fp32 sum, compiled by inductor (weights as inputs)."""
    def gemv(x, w):
        return (x.float()[:, None, :] * w.float()[None]).sum(-1).to(torch.bfloat16)

    compiled = {}  # one compiled function per weight shape (no recompiles, no dynamic shapes)

    def call(x, w):
        key = (x.shape[0], *w.shape)
        if key not in compiled:
            compiled[key] = torch.compile(gemv, dynamic=False)
        return compiled[key](x, w)
    return [w.to(torch.bfloat16).contiguous() for w in ws], call


def v_inductor_linear_bf16(ws):
    """F.linear compiled by inductor with weights as inputs (no freezing): extern mm call."""
    compiled = {}

    def call(x, w):
        key = (x.shape[0], *w.shape)
        if key not in compiled:
            compiled[key] = torch.compile(lambda a, b: F.linear(a, b), dynamic=False)
        return compiled[key](x, w)
    return [w.to(torch.bfloat16).contiguous() for w in ws], call


VARIANTS = {
    "inductor_reduce_bf16": (v_inductor_reduce_bf16, 2.0),
    "inductor_linear_bf16": (v_inductor_linear_bf16, 2.0),
    "linear_bf16": (v_linear_bf16, 2.0),
    "linear_fp32": (v_linear_fp32, 4.0),
    "mm_wt_bf16": (v_matmul_t_bf16, 2.0),
    "mkldnn_packed_bf16": (v_mkldnn_bf16, 2.0),
    "mkl_packed_fp32": (v_mkl_fp32, 4.0),
    "int8_weight_only": (v_int8_wo, 1.0),
    "int4_weight_only_g32": (v_int4_wo, 0.5 + 4 / 32),
}


def check(name, items, call, ws):
    """Relative error of the variant against fp32 F.linear on a few weights."""
    x = torch.randn(4, ws[0].shape[1])
    ref = F.linear(x, ws[0].float())
    dtype = torch.float32 if "fp32" in name else torch.bfloat16
    out = call(x.to(dtype), items[0]).float()
    return float((out - ref).norm() / ref.norm())


def compiled_sweep(ws, ms, mode):
    """inductor on a module holding every weight: freezing + weight prepack (+ max-autotune)."""
    import torch._inductor.config as ic
    ic.freezing = True
    ic.cpp.weight_prepack = True

    class Sweep(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lins = torch.nn.ModuleList()
            for w in ws:
                lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
                lin.weight.data.copy_(w)
                self.lins.append(lin)

        def forward(self, x576, x1536):
            outs = []
            for lin in self.lins:
                outs.append(lin(x1536 if lin.in_features == 1536 else x576))
            return outs

    mod = Sweep().eval()
    res = {}
    for m in ms:
        torch._dynamo.reset()
        fn = torch.compile(mod, mode=mode, dynamic=False)
        a = torch.randn(m, 576, dtype=torch.bfloat16)
        b = torch.randn(m, 1536, dtype=torch.bfloat16)
        with torch.no_grad():
            fn(a, b)
            res[m] = timeit(lambda: fn(a, b), repeats=7, inner=3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--compile", nargs="*", default=[],
                    help="inductor modes to try, e.g. default max-autotune-no-cudagraphs")
    ap.add_argument("--no-lm-head", action="store_true")
    ap.add_argument("--fuse", action="store_true", help="q|k|v and gate|up as one weight each")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--gate", action="store_true",
                    help="start every timed round only when the machine is idle (common.wait_idle)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json")
    args = ap.parse_args()
    setup_threads(args.threads)
    header("gemv sweep, SmolLM2-135M linears")
    ws = make_weights(not args.no_lm_head, dtype=torch.float32, fuse=args.fuse)
    params = sum(w.numel() for w in ws)
    print(f"# {len(ws)} weights, {params / 1e6:.1f} M params")
    rows = []

    def report(name, m, t, bpp):
        gb = params * bpp / 1e9
        flops = 2 * params * m
        med = t["median"]
        best = t["min"]
        row = dict(variant=name, m=m, ms=med * 1e3, ms_min=best * 1e3, cpu_ms=t["cpu"] * 1e3,
                   gbs=gb / med, gbs_best=gb / best, gflops_best=flops / best / 1e9)
        rows.append(row)
        print(f"{name:24s} M={m:<4d} {med*1e3:8.2f} ms (min {best*1e3:7.2f}, cpu {t['cpu']*1e3:7.2f})  "
              f"{gb/med:5.1f} GB/s, best {gb/best:5.1f} ({100*gb/best/MEM_BW_GBS:3.0f}% of {MEM_BW_GBS})  "
              f"best {flops/best/1e9:6.1f} GFLOP/s", flush=True)

    import statistics
    import time
    with torch.inference_mode():
        prepared = {}
        for name in args.variants:
            prep, bpp = VARIANTS[name]
            items, call = prep(ws)
            for m in args.m:
                if name == "mkl_packed_fp32" and m != 1:
                    items, call = prep(ws, batch=m)  # MKL packs for one batch size
                if name.startswith("inductor_reduce") and m > 4:
                    continue  # a GEMV: only tiny M is meaningful
                dtype = torch.float32 if "fp32" in name else torch.bfloat16
                xs = {k: torch.randn(m, k, dtype=dtype) for k in (576, 1536)}
                prepared[(name, m)] = (items, call, xs, bpp)
            print(f"{name:24s} rel. error vs fp32: {check(name, items, call, ws):.2e}", flush=True)
        samples = {key: ([], []) for key in prepared}
        for key, (items, call, xs, _) in prepared.items():  # warm up (and compile)
            for it, w in zip(items, ws):
                call(xs[w.shape[1]], it)
        # Rounds interleave the variants so that load changes hit all of them alike.
        waited = 0.0
        for _ in range(args.rounds):
            for key, (items, call, xs, _) in prepared.items():
                if args.gate:
                    waited += wait_idle()
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(3):
                    for it, w in zip(items, ws):
                        call(xs[w.shape[1]], it)
                samples[key][0].append((time.perf_counter() - t0) / 3)
                samples[key][1].append((time.process_time() - c0) / 3)
        if args.gate:
            print(f"# waited {waited:.0f} s for idle windows")
        for key, (wall, cpu) in samples.items():
            t = {"median": statistics.median(wall), "min": min(wall), "cpu": statistics.median(cpu)}
            report(key[0], key[1], t, prepared[key][3])
    for mode in args.compile:
        wsb = [w.to(torch.bfloat16) for w in ws]
        for m, t in compiled_sweep(wsb, args.m, None if mode == "default" else mode).items():
            report(f"inductor[{mode}]", m, t, 2.0)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
