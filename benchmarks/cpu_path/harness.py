"""A self-contained copy of the engine's forward path, with the variants under study.

Kept independent of plugins/xeon (which is being rewritten) so the numbers stay
reproducible: the model is transformers' own ``LlamaForCausalLM`` with an
attention function registered through ``AttentionInterface``, over a paged
cache in the layout the engine is moving to (per layer
``[kv_heads, num_blocks, block_size, head_dim]``, slots = block * size + offset).

Variants (all keep transformers' model definition as the architecture source):

- attention ``loop``: the engine's current path (one cache write for the step,
  then per sequence: gather its blocks, one SDPA);
- attention ``batched``: decode rows of all sequences in one call: one gather of
  the padded block tables, then one SDPA (GQA heads folded into the query axis)
  with a key-padding mask; prefill rows still take the per-sequence path;
- attention ``batched_mm``: the same with two bmm and a float softmax instead of SDPA;
- attention ``cpp``: decode rows through the C++ kernel of ``paged_attn_ext`` (block
  tables walked in place, no gather copy, no padding);
- linears ``stock`` (nn.Linear), ``mkldnn`` (oneDNN-packed bf16), ``int8``
  (``aten._weight_int8pack_mm``, per-channel), ``int4`` (``_weight_int4pack_mm_for_cpu``);
- ``fuse``: q/k/v and gate/up weights concatenated into one matmul each;
- ``compile``/``freeze``: whole-model torch.compile, see compiled.py.

Sampling is one ``argmax`` + ``tolist()`` on the bf16 logits for every variant
(``sample="engine"`` uses the engine toolkit's ``sample_step`` instead).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import common  # noqa: F401  (sys.path)

ATTN_NAME = "cpu_path_bench"
STEP_KWARG = "cpu_path_step"
BLOCK = 16


# ----------------------------------------------------------------- paged cache
class PagedCache:
    def __init__(self, layers, kv_heads, head_dim, num_blocks, dtype, block=BLOCK):
        self.block = block
        self.num_blocks = num_blocks
        size = (kv_heads, num_blocks, block, head_dim)
        self.k = [torch.zeros(size, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(size, dtype=dtype) for _ in range(layers)]
        self.free = list(range(num_blocks - 1, 0, -1))  # block 0 stays as the padding block

    def write(self, layer, slots, k, v):
        heads, nb, bs, d = self.k[layer].shape
        self.k[layer].view(heads, nb * bs, d).index_copy_(1, slots, k)
        self.v[layer].view(heads, nb * bs, d).index_copy_(1, slots, v)

    def gather(self, pool, blocks, length):
        picked = pool.index_select(1, blocks)
        h, c, s, d = picked.shape
        return picked.reshape(h, c * s, d)[:, :length]


@dataclass
class Seq:
    tokens: list[int]
    num_cached: int = 0
    table: list[int] = field(default_factory=list)


@dataclass
class Step:
    cache: PagedCache
    slots: torch.Tensor
    query_lens: list[int]
    context_lens: list[int]
    tables: list[torch.Tensor]
    offsets: list[int]
    mode: str
    # batched decode metadata (built once per step, shared by all layers)
    decode_rows: torch.Tensor | None = None  # packed positions of decode rows
    decode_seq: list[int] = field(default_factory=list)
    padded_tables: torch.Tensor | None = None  # [Bd, max_blocks]
    key_mask: torch.Tensor | None = None  # [Bd, 1, 1, Lmax] bool (True = attend)
    key_bias: torch.Tensor | None = None  # same as additive float
    lmax: int = 0
    lens: torch.Tensor | None = None  # [Bd] context lengths of the decode rows


def _attend_one(q, k, v, scale):
    """The engine's per-sequence attention (decode: GQA heads folded into the query axis)."""
    heads, n, dim = q.shape
    kvh, length, _ = k.shape
    if n == 1:
        g = heads // kvh
        o = F.scaled_dot_product_attention(q.reshape(kvh, g, dim)[None], k[None], v[None], scale=scale)
        return o.reshape(heads, 1, dim)
    if n == length:
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale,
                                              enable_gqa=heads != kvh)[0]
    qpos = torch.arange(length - n, length)[:, None]
    mask = torch.arange(length)[None, :] <= qpos
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                          enable_gqa=heads != kvh)[0]


def bench_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    step: Step = kw[STEP_KWARG]
    layer = module.layer_idx
    cache = step.cache
    q, k, v = query[0], key[0], value[0]  # [heads, T, d], [kvh, T, d]
    heads, T, d = q.shape
    kvh = k.shape[0]
    cache.write(layer, step.slots, k, v)
    out = torch.empty(T, heads, d, dtype=q.dtype)
    done = set()
    if step.mode != "loop" and step.decode_rows is not None:
        rows = step.decode_rows
        B = rows.numel()
        g = heads // kvh
        # [heads, B, d] -> [B, kvh, g, d]
        if step.mode != "cpp":
            qd = q.index_select(1, rows).permute(1, 0, 2).reshape(B, kvh, g, d)
            nb = step.padded_tables.shape[1]
            flat = step.padded_tables.reshape(-1)
            # [kvh, B*nb, bs, d] -> [kvh, B, L, d] -> [B, kvh, L, d]
            kk = cache.k[layer].index_select(1, flat).view(kvh, B, nb * cache.block, d)[:, :, : step.lmax]
            vv = cache.v[layer].index_select(1, flat).view(kvh, B, nb * cache.block, d)[:, :, : step.lmax]
            kk, vv = kk.transpose(0, 1), vv.transpose(0, 1)
        if step.mode == "cpp":
            import paged_attn_ext
            o = paged_attn_ext.paged_decode(q.index_select(1, rows).transpose(0, 1).contiguous(),
                                            cache.k[layer], cache.v[layer], step.padded_tables,
                                            step.lens, scaling)
        elif step.mode == "batched":
            o = F.scaled_dot_product_attention(qd, kk, vv, attn_mask=step.key_mask, scale=scaling)
        else:  # batched_mm
            s = torch.matmul(qd, kk.transpose(-1, -2)).float() * scaling + step.key_bias
            p = torch.softmax(s, dim=-1).to(vv.dtype)
            o = torch.matmul(p, vv)
        out.index_copy_(0, rows, o.reshape(B, heads, d))
        done = set(step.decode_seq)
    for i, (n, length, off) in enumerate(zip(step.query_lens, step.context_lens, step.offsets)):
        if i in done:
            continue
        kk = cache.gather(cache.k[layer], step.tables[i], length)
        vv = cache.gather(cache.v[layer], step.tables[i], length)
        out[off:off + n] = _attend_one(q[:, off:off + n], kk, vv, scaling).transpose(0, 1)
    return out[None], None


def register():
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_NAME, bench_attention)
    return ATTN_NAME


# ----------------------------------------------------------------- linears
class PackedLinear(torch.nn.Module):
    """A drop-in nn.Linear replacement with a prepacked or quantized weight."""

    def __init__(self, weight: torch.Tensor, kind: str, bias=None):
        super().__init__()
        self.kind = kind
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        w = weight.detach()
        if kind == "mkldnn":
            self.w = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16).contiguous(), None)
        elif kind == "int8":
            wf = w.float()
            scale = wf.abs().amax(dim=1).clamp_min(1e-8) / 127.0
            self.w = torch.round(wf / scale[:, None]).clamp(-128, 127).to(torch.int8).contiguous()
            self.scale = scale.to(w.dtype)
        elif kind == "int4":
            group = 32
            wf = w.float()
            n, k = wf.shape
            wg = wf.reshape(n, k // group, group)
            lo, hi = wg.amin(-1), wg.amax(-1)
            scale = ((hi - lo) / 15).clamp_min(1e-8)
            q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
            self.w = torch._convert_weight_to_int4pack_for_cpu(q.reshape(n, k), 8)
            self.sz = torch.stack([scale.t(), (lo + 8 * scale).t()], -1).to(w.dtype).contiguous()
            self.group = group
        else:
            raise ValueError(kind)

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.kind == "mkldnn":
            y = torch.ops.mkldnn._linear_pointwise(x2, self.w, self.bias, "none", [], "")
        elif self.kind == "int8":
            y = torch._weight_int8pack_mm(x2, self.w, self.scale)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x2, self.w, self.group, self.sz)
        return y.reshape(*shape[:-1], self.out_features)


def replace_linears(model, kind: str, include_head: bool = True):
    if kind == "stock":
        return model
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, mod in list(parent.named_children()):
                if isinstance(mod, torch.nn.Linear):
                    setattr(parent, name, PackedLinear(mod.weight, kind, mod.bias))
    if include_head:
        model.lm_head = PackedLinear(model.lm_head.weight, kind)
    return model


def fuse_projections(model):
    """Replace q/k/v by one matmul and gate/up by one matmul, via forward hooks on the modules."""
    import types

    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        wq, wk, wv = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
        attn.qkv = torch.nn.Linear(wq.shape[1], wq.shape[0] + wk.shape[0] + wv.shape[0], bias=False,
                                   dtype=wq.dtype)
        attn.qkv.weight.data = torch.cat([wq, wk, wv]).contiguous()
        sizes = (wq.shape[0], wk.shape[0], wv.shape[0])

        def attn_forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                         past_key_values=None, _sizes=sizes, **kwargs):
            from transformers.models.llama.modeling_llama import ALL_ATTENTION_FUNCTIONS, apply_rotary_pos_emb
            input_shape = hidden_states.shape[:-1]
            hs = (*input_shape, -1, self.head_dim)
            q, k, v = self.qkv(hidden_states).split(_sizes, dim=-1)
            q, k, v = q.view(hs).transpose(1, 2), k.view(hs).transpose(1, 2), v.view(hs).transpose(1, 2)
            cos, sin = position_embeddings
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            fn = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
            o, w = fn(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs)
            return self.o_proj(o.reshape(*input_shape, -1).contiguous()), w

        attn.forward = types.MethodType(attn_forward, attn)
        del attn.q_proj, attn.k_proj, attn.v_proj
        wg, wu = mlp.gate_proj.weight, mlp.up_proj.weight
        mlp.gate_up = torch.nn.Linear(wg.shape[1], 2 * wg.shape[0], bias=False, dtype=wg.dtype)
        mlp.gate_up.weight.data = torch.cat([wg, wu]).contiguous()

        def mlp_forward(self, x):
            g, u = self.gate_up(x).chunk(2, dim=-1)
            return self.down_proj(self.act_fn(g) * u)

        mlp.forward = types.MethodType(mlp_forward, mlp)
        del mlp.gate_proj, mlp.up_proj
    return model


def load_model(path, dtype=torch.bfloat16):
    from transformers import AutoModelForCausalLM
    register()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=ATTN_NAME)
    model.eval()
    if model.config.tie_word_embeddings:
        # untie so that the head can be replaced without touching the embedding
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone(),
                                                  requires_grad=False)
    return model


# ----------------------------------------------------------------- runner
class Runner:
    def __init__(self, model, num_blocks=4096, attn_mode="loop", sample="argmax"):
        cfg = model.config
        self.model = model
        d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.cache = PagedCache(cfg.num_hidden_layers, cfg.num_key_value_heads, d, num_blocks,
                                next(model.parameters()).dtype)
        self.mode = attn_mode
        self.sample = sample

    def _ensure_blocks(self, seq: Seq, length: int):
        while len(seq.table) * self.cache.block < length:
            seq.table.append(self.cache.free.pop())

    def release(self, seq: Seq):
        self.cache.free.extend(reversed(seq.table))
        seq.table = []

    def build(self, seqs):
        ids, pos, slots, qlens, clens, tables, offsets = [], [], [], [], [], [], []
        bs = self.cache.block
        for s in seqs:
            new = s.tokens[s.num_cached:]
            start = s.num_cached
            end = start + len(new)
            self._ensure_blocks(s, end)
            offsets.append(len(ids))
            ids.extend(new)
            pos.extend(range(start, end))
            slots.extend(s.table[p // bs] * bs + p % bs for p in range(start, end))
            qlens.append(len(new))
            clens.append(end)
            tables.append(s.table)
        step = Step(self.cache, torch.tensor(slots), qlens, clens, [], offsets, self.mode)
        if self.mode == "loop" or not any(n == 1 for n in qlens):
            step.tables = [torch.tensor(t) for t in tables]
            step.mode = "loop"
        else:
            dec = [i for i, n in enumerate(qlens) if n == 1]
            step.tables = [torch.tensor(t) if qlens[i] != 1 else None for i, t in enumerate(tables)]
            step.decode_seq = dec
            step.decode_rows = torch.tensor([offsets[i] for i in dec])
            nb = max(len(tables[i]) for i in dec)
            pt = torch.zeros(len(dec), nb, dtype=torch.long)
            for r, i in enumerate(dec):
                pt[r, : len(tables[i])] = torch.tensor(tables[i])
            step.padded_tables = pt
            step.lmax = max(clens[i] for i in dec)
            lens = torch.tensor([clens[i] for i in dec])
            step.lens = lens
            m = torch.arange(step.lmax)[None, :] < lens[:, None]
            step.key_mask = m[:, None, None, :]
            step.key_bias = torch.zeros(m.shape, dtype=torch.float32).masked_fill_(~m, -math.inf)[:, None, None, :]
        keep = [o + n - 1 for o, n in zip(offsets, qlens)]
        return ids, pos, keep, step

    def forward(self, seqs):
        ids, pos, keep, step = self.build(seqs)
        out = self.model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]),
                         use_cache=False, logits_to_keep=torch.tensor(keep), **{STEP_KWARG: step})
        return out.logits[0]

    def step(self, seqs):
        logits = self.forward(seqs)
        if self.sample == "engine":
            from switchyard.engine.sampling import sample_step
            toks = [t.token_id for t in sample_step(logits, self.samplers(seqs, logits.shape[1])).tokens]
        else:
            toks = logits.argmax(-1).tolist()
        for s, t in zip(seqs, toks):
            s.num_cached = len(s.tokens)
            s.tokens.append(t)
        return toks

    def samplers(self, seqs, vocab):
        if not hasattr(self, "_samplers") or len(self._samplers) != len(seqs):
            from switchyard.engine.sampling import RowSampler
            from switchyard_spec import SamplingParams
            self._samplers = [RowSampler(SamplingParams(), s.tokens, vocab) for s in seqs]
        return self._samplers


def make_prompts(batch, prompt_len, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Seq(tokens=torch.randint(3, vocab, (prompt_len,), generator=g).tolist()) for _ in range(batch)]


def decode_bench(runner, batch, prompt_len, steps, warmup=3, prefill_chunk=8):
    """Prefill ``batch`` prompts, then time ``steps`` decode steps; returns per-step seconds."""
    vocab = runner.model.config.vocab_size
    seqs = make_prompts(batch, prompt_len, vocab)
    with torch.inference_mode():
        for i in range(0, batch, prefill_chunk):
            runner.step(seqs[i:i + prefill_chunk])
        for _ in range(warmup):
            runner.step(seqs)
        times, cpu = [], []
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            runner.step(seqs)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    for s in seqs:
        runner.release(s)
    return times, cpu, seqs
