"""Checks of the native kernels against their PyTorch definitions, run once when they load.

Each returns '' when the kernel agrees with its reference, else what
differs; :func:`switchyard_xeon.kernels.load_kernels` leaves a kernel that
fails its check unused. Shapes are ragged on purpose: partial panels, odd K,
short groups, and row counts on both sides of every tiling threshold.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from switchyard_spec import (
    FP8_E4M3_PER_TENSOR,
    INT8_PER_CHANNEL,
    W8A8_SMOOTHQUANT,
    W8A8_SMOOTHQUANT_STATIC,
    QuantizedWeight,
    WeightFormat,
    uint4_group_asym,
    uint4_group_min,
)

from switchyard_xeon.quantized import (
    W8A8_PATHS,
    pack_quantized,
    reference_weight,
    uint4_words,
    w8a8_reference,
)

if TYPE_CHECKING:
    from switchyard_xeon.kernels import FusedOps, PagedDecodeFn, PagedPrefillFn


def check_decode(op: PagedDecodeFn) -> str:
    """Compare the attention kernel with plain SDPA on a small scattered cache; '' when they agree.

    Also soft-capped scores (Gemma 2) and ALiBi biases (Bloom, MPT, Falcon),
    against the written-out scores of the reference.
    """
    from switchyard_xeon.kernels.reference import paged_decode_reference

    gen = torch.Generator().manual_seed(0)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.7, 0.03])
    cases = ((torch.float32, torch.float32, 64, 0, 1e-4, 0.0, None),
             (torch.bfloat16, torch.bfloat16, 80, 7, 2e-2, 0.0, None),
             (torch.float32, torch.bfloat16, 64, 5, 1e-4, 0.0, None),  # bf16 pools, fp32 q
             (torch.float32, torch.bfloat16, 64, 5, 1e-4, 2.0, None),
             (torch.float32, torch.float32, 80, 0, 1e-4, 0.0, slopes))
    for dtype, pool_dtype, dim, window, tol, softcap, alibi in cases:
        kv_heads, heads, blocks, size = 2, 6, 12, 4
        k = torch.randn(kv_heads, blocks, size, dim, generator=gen).to(pool_dtype)
        v = torch.randn(kv_heads, blocks, size, dim, generator=gen).to(pool_dtype)
        q = torch.randn(3, heads, dim, generator=gen).to(dtype)
        tables = torch.tensor([[5, 2, 9], [1, 0, 0], [11, 3, 7]], dtype=torch.int32)
        lens = torch.tensor([10, 3, 12], dtype=torch.int32)
        try:
            got = op(q, k, v, tables, lens, dim**-0.5, window, softcap, alibi)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        want = paged_decode_reference(q, k, v, tables, lens, dim**-0.5, window, softcap, alibi)
        err = (got.float() - want.float()).abs().max().item()
        if not err <= tol:
            return (f"{dtype} q, {pool_dtype} pools, softcap {softcap}, alibi "
                    f"{alibi is not None}: max error {err:.3g} > {tol}")
    return ""


def check_fused(ops: FusedOps) -> str:
    """Compare the fused ops with their PyTorch definitions; '' when they agree."""
    from switchyard_xeon.kernels.reference import TorchFusedOps

    ref = TorchFusedOps()
    gen = torch.Generator().manual_seed(1)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(dtype)

        try:
            x, res, w = rand(5, 96), rand(5, 96), rand(96)
            pairs = [(ops.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))]
            got_x, got_r, want_x, want_r = x.clone(), res.clone(), x.clone(), res.clone()
            ops.add_rms_norm_(got_x, got_r, w, 1e-6)
            ref.add_rms_norm_(want_x, want_r, w, 1e-6)
            pairs += [(got_x, want_x), (got_r, want_r)]
            gate_up = rand(3, 64)
            pairs.append((ops.silu_and_mul(gate_up), ref.silu_and_mul(gate_up)))
            heads, kv_heads, dim, rot = 4, 2, 16, 12  # partial rotary, as Phi-3 may use
            qkv, cos, sin = rand(3, (heads + 2 * kv_heads) * dim), rand(3, rot), rand(3, rot)
            slots = torch.tensor([5, 0, 9])
            # fp32 qkv may store into bf16 pools (the bf16 matmul mode's cache).
            pool_dtypes = (dtype, torch.bfloat16) if dtype == torch.float32 else (dtype,)
            for pool_dtype in pool_dtypes:
                results = []
                for impl in (ops, ref):
                    buf = qkv.clone()
                    k_pool, v_pool = torch.zeros(2, kv_heads, 3, 4, dim, dtype=pool_dtype)
                    impl.rotary_store_(buf, cos, sin, k_pool, v_pool, slots, heads, kv_heads)
                    results.append((buf, k_pool, v_pool))
                pairs += list(zip(*results, strict=True))
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        for got, want in pairs:
            err = (got.float() - want.float()).abs().max().item()
            scale = max(1.0, want.float().abs().max().item())
            if not err <= tol * scale:
                return f"fused op {dtype} max error {err:.3g} > {tol * scale:.3g}"
    return ""


def check_prefill(op: PagedPrefillFn) -> str:
    """Compare paged prefill attention with the SDPA reference; '' when they agree.

    Fresh prompts, a chunk after cached context, rows shared by two sequences'
    neighbours, a sliding window, fp32 and bf16 pools, head_dim 64 and 128,
    soft-capped scores and ALiBi biases.
    """
    from switchyard_xeon.kernels.reference import paged_prefill_reference

    gen = torch.Generator().manual_seed(4)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.7, 0.03])
    for pool_dtype, dim, window, softcap, alibi in (
            (torch.float32, 64, 0, 0.0, None), (torch.bfloat16, 128, 5, 0.0, None),
            (torch.bfloat16, 64, 0, 0.0, None), (torch.bfloat16, 64, 5, 2.0, None),
            (torch.float32, 128, 0, 0.0, slopes)):
        kv_heads, heads, blocks, size = 2, 6, 14, 4
        k = torch.randn(kv_heads, blocks, size, dim, generator=gen).to(pool_dtype)
        v = torch.randn(kv_heads, blocks, size, dim, generator=gen).to(pool_dtype)
        q = torch.randn(30, heads, dim, generator=gen)
        tables = torch.tensor([[5, 2, 9, 0, 0], [1, 0, 0, 0, 0], [11, 3, 7, 13, 4]],
                              dtype=torch.int32)
        lens = torch.tensor([10, 3, 19], dtype=torch.int32)
        starts = torch.tensor([0, 12, 15], dtype=torch.int32)  # rows 10, 11 and 29+ unowned
        counts = torch.tensor([10, 3, 14], dtype=torch.int32)  # the last after 5 cached
        args = (q, k, v, tables, lens, starts, counts, dim**-0.5, window, softcap, alibi)
        try:
            got = op(*args)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        want = paged_prefill_reference(*args)
        owned = torch.cat([torch.arange(0, 10), torch.arange(12, 29)])
        err = (got[owned] - want[owned]).abs().max().item()
        if not err <= 1e-4:
            return (f"paged prefill ({pool_dtype}, D={dim}, softcap {softcap}, alibi "
                    f"{alibi is not None}) max error {err:.3g}")
    return ""


def check_panels() -> str:
    """Compare the panel linear with ``F.linear`` over ragged shapes; '' when they agree.

    Both weight storages: fp32, and bf16 (widened in registers below 96 rows,
    through a buffer above).
    """
    gen = torch.Generator().manual_seed(2)
    for storage in (torch.float32, torch.bfloat16):
        for case in ((1, 37, 24), (7, 50, 64), (13, 16, 9), (100, 33, 40)):
            error = _panel_case_error(lambda w: torch.ops.switchyard_xeon.pack_panels(
                w.to(storage)), case, gen, bf16_inputs=False)
            if error:
                return f"panel linear ({storage}): {error}"
    return ""


def check_bf16_dot() -> str:
    """Compare the dot-product panels with ``F.linear`` on bf16-rounded inputs; '' when they agree.

    Both weight storages: bf16, and int8 with per-feature scales (the
    reference uses the weight the int8 format defines). Ragged shapes: odd K
    (a padded k pair), N not a multiple of 16 (a masked last panel), an odd
    number of panels (one runs alone), 1-13 and 600 rows (int8: widened in
    registers up to 24 rows, through a per-thread buffer past that), and K of
    whole AMX k-steps (64: the panels read in place) beside K of part of one.
    Where AMX is granted (``bf16_amx_rows``), every case runs on both paths.
    """
    ops = torch.ops.switchyard_xeon
    crossover = amx_rows()
    routes = (crossover,) if crossover < 0 else (1 << 40, 0)
    try:
        for route in routes:
            if route >= 0:
                ops.bf16_amx_rows(route)
            path = "" if route < 0 else "AMX " if route == 0 else "row-kernel "
            gen = torch.Generator().manual_seed(3)
            for case in ((1, 37, 24), (7, 50, 65), (13, 16, 9), (600, 33, 40), (40, 64, 64)):
                error = _panel_case_error(ops.pack_panels_bf16_dot, case, gen, bf16_inputs=True)
                if error:
                    return f"bf16 dot panels ({path}path): {error}"
                weight = _random_quantized(INT8_PER_CHANNEL, case[1], case[2], gen)
                error = _panel_case_error(lambda _, w=weight: pack_quantized(w), case, gen,
                                          bf16_inputs=True,
                                          seen=lambda _, w=weight: reference_weight(w))
                if error:
                    return f"int8 dot panels ({path}path): {error}"
    finally:
        if crossover >= 0:
            ops.bf16_amx_rows(crossover)
    return ""


def amx_rows() -> int:
    """The row count from which the dot-product panels take AMX; -1 where they cannot
    (a build without AMX code, a CPU without AMX-BF16, a kernel that refused the tiles)."""
    ops = torch.ops.switchyard_xeon
    return int(ops.bf16_amx_rows(-1)) if hasattr(ops, "bf16_amx_rows") else -1


def check_uint4_dot() -> str:
    """Compare the uint4 panels with ``F.linear`` over the weight their format defines; '' if equal.

    Each group size of the asym format, and the min format (float mins of
    either sign, some groups with ``s == 0``); ragged shapes: K not a
    multiple of the group (a short last group) and odd, N not a multiple of
    16, 1-13 rows (widened in registers) and 70 (through the per-thread
    buffer).
    """
    gen = torch.Generator().manual_seed(5)
    for fmt, case in ((uint4_group_asym(32), (1, 37, 75)), (uint4_group_asym(64), (5, 50, 64)),
                      (uint4_group_asym(128), (70, 20, 130)), (uint4_group_asym(32), (13, 16, 33)),
                      (uint4_group_min(32), (3, 37, 75)), (uint4_group_min(32), (70, 20, 130))):
        weight = _random_quantized(fmt, case[1], case[2], gen)
        error = _panel_case_error(lambda _, w=weight: pack_quantized(w), case, gen,
                                  bf16_inputs=True, seen=lambda _, w=weight: reference_weight(w))
        if error:
            return f"uint4 dot panels ({fmt.name}): {error}"
    return ""


def check_quant_fma() -> str:
    """Compare the AVX2 + FMA panels (int8, uint4 of each group size and with float mins, FP8)
    with ``F.linear``
    over the weight their format defines, in fp32; '' if equal.

    Ragged: K odd and a short last group, N not a multiple of 16, 1-6 rows
    (widened in registers) and 40 (widened once into a buffer); FP8 codes
    over the whole finite range, subnormals included.
    """
    gen = torch.Generator().manual_seed(7)
    for fmt, case in ((INT8_PER_CHANNEL, (1, 37, 75)), (INT8_PER_CHANNEL, (40, 20, 33)),
                      (uint4_group_asym(32), (1, 37, 75)), (uint4_group_asym(64), (5, 50, 64)),
                      (uint4_group_asym(128), (40, 20, 130)), (uint4_group_min(32), (1, 37, 75)),
                      (uint4_group_min(32), (40, 20, 130)), (FP8_E4M3_PER_TENSOR, (6, 33, 47)),
                      (FP8_E4M3_PER_TENSOR, (40, 17, 256))):
        weight = _random_quantized(fmt, case[1], case[2], gen)
        seen = (fp8_reference_weight if fmt == FP8_E4M3_PER_TENSOR else reference_weight)(weight)
        error = _panel_case_error(lambda _, w=weight: pack_quantized(w, fma=True), case, gen,
                                  bf16_inputs=False, seen=lambda _, s=seen: s)
        if error:
            return f"quantized fma panels ({fmt.name}): {error}"
    return ""


def fp8_reference_weight(weight: QuantizedWeight) -> torch.Tensor:
    """The fp32 weight the fma panels of an FP8 record multiply inputs (already divided by
    the activation scale and rounded to E4M3) by: ``e4m3 * scales * activation_scale``."""
    return weight.data.float() * (weight.scales[:, None] * weight.activation_scale)


def _random_quantized(fmt: WeightFormat, out: int, inner: int,
                      gen: torch.Generator) -> QuantizedWeight:
    """A ``QuantizedWeight`` of ``fmt`` with random integers, scales and zero points."""
    if fmt == FP8_E4M3_PER_TENSOR:  # every finite code (0x7F and 0xFF are NaN)
        codes = torch.randint(0, 255, (out, inner), generator=gen).to(torch.uint8)
        codes[codes == 0x7F] = 0x7E
        return QuantizedWeight(format=fmt, out_features=out, in_features=inner,
                               data=codes.view(torch.float8_e4m3fn),
                               scales=torch.rand(out, generator=gen) / 50, activation_scale=1.0)
    low, high = fmt.levels
    q = torch.randint(low, high + 1, (out, inner), generator=gen)
    if fmt == INT8_PER_CHANNEL:
        return QuantizedWeight(format=fmt, out_features=out, in_features=inner,
                               data=q.to(torch.int8), scales=torch.rand(out, generator=gen) / 50)
    groups = -(-inner // fmt.group_size)
    scales = torch.rand(out, groups, generator=gen) / 5
    if fmt.group_min:  # float mins of either sign, and a few groups of one value (s == 0)
        scales[torch.rand(out, groups, generator=gen) < 0.1] = 0.0
        return QuantizedWeight(format=fmt, out_features=out, in_features=inner,
                               data=uint4_words(q), scales=scales,
                               mins=torch.randn(out, groups, generator=gen))
    return QuantizedWeight(
        format=fmt, out_features=out, in_features=inner, data=uint4_words(q), scales=scales,
        zero_points=torch.randint(0, high + 1, (out, groups), generator=gen).to(torch.uint8))


def _panel_case_error(pack: Callable[[torch.Tensor], torch.Tensor], case: tuple[int, int, int],
                      gen: torch.Generator, bf16_inputs: bool,
                      seen: Callable[[torch.Tensor], torch.Tensor] | None = None) -> str:
    """'' when ``panel_linear`` over ``pack(w)`` matches ``F.linear`` for (rows, out, inner).

    The reference sees the weight as packed: ``seen(w)`` when given, else
    ``w`` rounded to bf16 where the packing stores bf16; with
    ``bf16_inputs``, the input rounded to bf16 too.
    """
    rows, out, inner = case
    x = torch.randn(rows, inner, generator=gen)
    w = torch.randn(out, inner, generator=gen)
    b = torch.randn(out, generator=gen)
    try:
        packed = pack(w)
        got = torch.ops.switchyard_xeon.panel_linear(x, packed, b, out)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    if seen is not None:
        w = seen(w)
    elif packed.dtype == torch.bfloat16:
        w = w.bfloat16().float()
    if bf16_inputs:
        x = x.bfloat16().float()
    err = (got - torch.nn.functional.linear(x, w, b)).abs().max().item()
    return "" if err <= 1e-4 * max(1.0, inner ** 0.5) else f"max error {err:.3g}"


def random_w8a8(out: int, inner: int, gen: torch.Generator,
                activation_scale: float = 0.0) -> QuantizedWeight:
    """A W8A8 ``QuantizedWeight`` with random integers, scales and smoothing factors."""
    fmt = W8A8_SMOOTHQUANT_STATIC if activation_scale > 0 else W8A8_SMOOTHQUANT
    return QuantizedWeight(
        format=fmt, out_features=out, in_features=inner,
        data=torch.randint(-127, 128, (out, inner), generator=gen).to(torch.int8),
        scales=torch.rand(out, generator=gen) / 50 + 1e-3,
        smoothing=torch.rand(inner, generator=gen) * 4 + 0.05,
        activation_scale=activation_scale)


def check_w8a8() -> str:
    """Compare every W8A8 path this process has with the format's PyTorch definition.

    The int32 sums must be equal (the math is integer), and the outputs
    within an fp32 rounding. Ragged: K not a multiple of 4 or 64, N not of
    16, odd panel counts, 1-6 rows and 40 (two AMX row tiles, a short one),
    per-token and static activation scales.
    """
    ops = torch.ops.switchyard_xeon
    paths = ops.w8a8_paths()
    gen = torch.Generator().manual_seed(6)
    for rows, out, inner, static in ((1, 37, 75, 0.0), (6, 50, 64, 0.0), (40, 33, 130, 0.05)):
        weight = random_w8a8(out, inner, gen, static)
        x = torch.randn(rows, inner, generator=gen) * 2
        bias = torch.randn(out, generator=gen)
        want = w8a8_reference(x, weight, bias)
        packed = pack_quantized(weight)
        for path, name in W8A8_PATHS.items():
            if not paths >> path & 1:
                continue
            try:
                raw = ops.w8a8_linear(x, packed, bias, out, path, True)
                got = ops.w8a8_linear(x, packed, bias, out, path, False)
            except Exception as exc:
                return f"w8a8 {name}: {type(exc).__name__}: {exc}"
            xq, _ = ops.w8a8_quantize_rows(x, packed)
            if not torch.equal(raw.long(), xq.long() @ weight.data.long().T):
                return f"w8a8 {name}: int32 sums differ ({rows}x{inner} by {out})"
            err = (got - want).abs().max().item()
            if not err <= 1e-5 * max(1.0, want.abs().max().item()):
                return f"w8a8 {name}: max error {err:.3g}"
    return ""


def check_token_mask(mask: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], list[int]]
                     ) -> str:
    """Compare the native grammar mask with :func:`switchyard_engine.grammar.mask_logits`
    (a vocabulary with a partial last word, bitmasks wider than the logits, rows that
    allow nothing, all, a few or most tokens); '' when they agree exactly."""
    from switchyard_engine.grammar import mask_logits

    gen = torch.Generator().manual_seed(0)
    for vocab, width in ((77, 3), (100, 5), (1000, 32)):
        logits = torch.randn(6, vocab, generator=gen)
        words = torch.randint(-2**31, 2**31 - 1, (4, width), generator=gen,
                              dtype=torch.int64).to(torch.int32)
        words[1] = 0  # allows nothing: left alone, reported
        words[2] = -1  # allows everything
        words[3] = words[3] & 0x00010001  # a few
        words[:, -1] &= 0x7FFFFFFF  # bits past the vocabulary are ignored either way
        index = torch.tensor([5, 0, 3, 2])
        want, got = logits.clone(), logits.clone()
        try:
            dead_want = mask_logits(want, words, index)
            dead_got = mask(got, words, index)
        except Exception as exc:  # noqa: BLE001 - a kernel that raises is reported, not fatal
            return f"mask raised {type(exc).__name__}: {exc}"
        if dead_got != dead_want or not torch.equal(got, want):
            return f"vocab {vocab}: masked logits or dead rows differ from mask_logits"
    return ""


def check_lora() -> str:
    """Compare the native grouped LoRA product (``lora.cpp``) with the definition, row by
    row in float64, over fp32 and bf16 adapter weights; '' when they agree."""
    gen = torch.Generator().manual_seed(0)
    fan_in, ranks, cols = 45, (3, 9), ((0, 21), (21, 50))
    rows, starts = torch.tensor([4, 0, 2, 5, 1]), torch.tensor([0, 3, 5])
    x = torch.randn(6, fan_in, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        buffers, tables, mats = [], [], []
        for _ in range(2):  # two adapters, each over two parts of the output
            table = torch.zeros(1, 1, 3, 5, dtype=torch.long)
            chunks, offset, parts = [], 0, []
            for p, (rank, (start, end)) in enumerate(zip(ranks, cols, strict=True)):
                a = torch.randn(rank, fan_in, generator=gen).to(dtype)
                bt = torch.randn(rank, end - start, generator=gen).to(dtype)
                table[0, 0, p] = torch.tensor([offset, offset + a.numel(), rank, start, end])
                chunks += [a.view(-1), bt.view(-1)]
                offset += a.numel() + bt.numel()
                parts.append((a.double(), bt.double(), start, end))
            buffers.append(torch.cat(chunks))
            tables.append(table)
            mats.append(parts)
        out = torch.zeros(6, 50)
        want = torch.zeros(6, 50, dtype=torch.float64)
        for g in range(2):
            for row in rows[starts[g]:starts[g + 1]].tolist():
                for a, bt, start, end in mats[g]:
                    want[row, start:end] += (a @ x[row].double()) @ bt
        try:
            torch.ops.switchyard_xeon.lora_add_(x, out, rows, starts, buffers, tables, 0, 0)
        except Exception as exc:  # noqa: BLE001 - a kernel that raises is reported, not fatal
            return f"lora_add_ raised {type(exc).__name__}: {exc}"
        err = (out.double() - want).abs().max().item()
        if not err <= 1e-4 * max(1.0, want.abs().max().item()):
            return f"lora_add_ ({dtype}): max error {err:.3g}"
    return ""
