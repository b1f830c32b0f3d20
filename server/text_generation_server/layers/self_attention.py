"""Self-attention over the paged KV cache, with the options the dense families need.

One module, configured by data: how the checkpoint stores q/k/v (separate tensors, one fused
tensor of [q | k | v] blocks, or per-KV-group [q.., k, v] as GPT-NeoX and Falcon do), biases,
a norm on q and k (per head or over the whole projection), rotary style and scaling, softmax
scale, logit soft-capping and a per-layer sliding window. Families choose options; they never
copy the module.

Tensor parallel splits heads. When there are fewer KV heads than ranks (multi-query models on
2 ranks), each rank keeps the KV head its query heads read: separate k/v tensors are loaded
through a narrower sharding view, a fused tensor is loaded whole and this rank's rows picked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from text_generation_server.kernels import cpu_pointwise
from text_generation_server.layers.attention import (
    DEFAULT_BACKEND,
    AttentionMetadata,
    KVCache,
    TorchAttention,
    native_decode_module,
)
from text_generation_server.layers.context import ForwardContext
from text_generation_server.kernels.dense import DenseLinear
from text_generation_server.layers.norm import ShardedRMSNorm, load_vector
from text_generation_server.layers.rotary import RotaryEmbedding
from text_generation_server.layers.tensor_parallel import TensorParallelColumnLinear, TensorParallelRowLinear
from text_generation_server.quantizers.dist import ProcessGroup
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights

SPLIT = "split"  # [q | k | v]: separate tensors, or one fused tensor of three blocks
GROUPED = "grouped"  # one fused tensor, per KV group [q x (heads / kv_heads), k, v] (GPT-NeoX, Falcon)


@dataclass(frozen=True)
class HeadNorm:
    """A norm on q and k before rotary.

    kind: "rms" (Qwen3, Gemma 3: per head over head_dim), "layer" (Phi-2's qk_layernorm, shared
    over heads; Cohere's, one weight row per head: `per_head`) or "rms_projection" (OLMo 2: over
    the whole q or k projection, across ranks).
    """

    kind: str
    eps: float
    q_name: str = "q_norm"
    k_name: str = "k_norm"
    offset: float = 0.0  # Gemma's 1 + w
    bias: bool = False
    per_head: bool = False


@dataclass(frozen=True)
class AttentionOptions:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    layout: str = SPLIT
    qkv_bias: bool = False
    o_proj: str = "o_proj"
    o_bias: bool = False
    window: int | None = None
    softcap: float | None = None
    head_norm: HeadNorm | None = None
    sinks: bool = False  # gpt-oss: a learned logit per head in each softmax ({prefix}.sinks)


class _HeadNormModule(torch.nn.Module):
    """HeadNorm's arithmetic for x [tokens, heads, head_dim] (per-head kinds)."""

    def __init__(self, spec: HeadNorm, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.spec = spec
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec, dim = self.spec, x.shape[-1]
        if spec.kind == "rms":
            normed = F.rms_norm(x.float(), (dim,), None, spec.eps)
            if spec.offset:
                return (normed * (self.weight.float() + spec.offset)).to(x.dtype)
            return self.weight * normed.to(x.dtype)
        if self.bias is not None or not spec.per_head:
            return F.layer_norm(x, (dim,), self.weight, self.bias, spec.eps)
        # Cohere: float32, centred, a weight row per head, cast at the end.
        return (self.weight.float() * F.layer_norm(x.float(), (dim,), None, None, spec.eps)).to(x.dtype)


class SelfAttention(torch.nn.Module):
    # hidden: [tokens, hidden] -> [tokens, hidden]
    def __init__(self, opts: AttentionOptions, weights: Weights, prefix: str, layer_id: int,
                 rotary: RotaryEmbedding | None):
        super().__init__()
        pg = weights.process_group
        world, rank = pg.size, pg.rank
        if opts.heads % opts.kv_heads:
            raise CheckpointError(f"config.json: num_attention_heads ({opts.heads}) must be a multiple of "
                                  f"num_key_value_heads ({opts.kv_heads})")
        if opts.heads % world:
            raise CheckpointError(f"config.json: num_attention_heads ({opts.heads}) must be divisible by the "
                                  f"{world} shards")
        self.replicated = opts.kv_heads < world
        if self.replicated and world % opts.kv_heads:
            raise CheckpointError(f"config.json: num_key_value_heads ({opts.kv_heads}) must divide, or be a multiple "
                                  f"of, the {world} shards")
        if not self.replicated and opts.kv_heads % world:
            raise CheckpointError(f"config.json: num_key_value_heads ({opts.kv_heads}) must be divisible by the "
                                  f"{world} shards")
        self.opts = opts
        self.layer_id = layer_id
        self.rotary = rotary
        self.heads = opts.heads // world
        self.kv_heads = 1 if self.replicated else opts.kv_heads // world
        # Where an fp8 KV cache's scales are stored, and which of the layer's KV heads this rank
        # caches (models/kv_cache.py reads them).
        self.kv_prefix = prefix
        self.kv_heads_total = opts.kv_heads
        first = rank // (world // opts.kv_heads) if self.replicated else rank * self.kv_heads
        self.kv_head_ids = tuple(range(first, first + self.kv_heads))
        self.head_dim = opts.head_dim
        self.window = opts.window
        self.scale = opts.scale
        self.softcap = opts.softcap
        self.sinks: torch.Tensor | None = None
        if opts.sinks:
            # One logit per head; this rank's heads, kept in float32 like the softmax.
            self.sinks = weights.get_sharded(f"{prefix}.sinks", dim=0, to_dtype=False).float()
            if self.sinks.shape != (self.heads,):
                raise CheckpointError(f"'{prefix}.sinks' has shape {list(self.sinks.shape)}, expected "
                                      f"[{opts.heads}] (one per head) (in {weights.files_of(prefix + '.sinks')})")
        d = opts.head_dim
        q_size, kv_size = opts.heads * d, opts.kv_heads * d
        names = [f"{prefix}.{n}" for n in opts.qkv]
        self.kv = None
        self._rows: torch.Tensor | None = None  # fused-and-replicated: the rows of this rank
        self._fused_layout: bool | None = None  # _fused_decode_layout's answer, once known
        if opts.layout == GROUPED:
            if len(names) != 1:
                raise ValueError("a grouped q/k/v layout is one fused tensor")
            if self.replicated:
                raise CheckpointError(f"{names[0]}: {opts.kv_heads} KV group(s) cannot be split over {world} shards")
            # Whole groups per rank: a plain column shard of the fused tensor.
            self.qkv = TensorParallelColumnLinear.load(weights, names[0], opts.qkv_bias, q_size + 2 * kv_size,
                                                       opts.hidden)
        elif len(names) == 1:
            if self.replicated:
                self.qkv = self._load_replicated_fused(weights, names[0], q_size, kv_size, pg)
            else:
                self.qkv = TensorParallelColumnLinear.load_packed(weights, names[0], opts.qkv_bias,
                                                                  [q_size, kv_size, kv_size], opts.hidden)
        elif self.replicated:
            self.qkv = TensorParallelColumnLinear.load(weights, names[0], opts.qkv_bias, q_size, opts.hidden)
            view = ProcessGroup(rank=rank // (world // opts.kv_heads), size=opts.kv_heads)
            with weights.sharded_as(view):
                self.kv = TensorParallelColumnLinear.load_multi(weights, names[1:], opts.qkv_bias,
                                                                [kv_size, kv_size], opts.hidden)
        else:
            self.qkv = TensorParallelColumnLinear.load_multi(weights, names, opts.qkv_bias,
                                                             [q_size, kv_size, kv_size], opts.hidden)
        self.o_proj = TensorParallelRowLinear.load(weights, f"{prefix}.{opts.o_proj}", opts.o_bias, opts.hidden,
                                                   q_size)
        self.q_norm = self.k_norm = None
        if opts.head_norm is not None:
            self.q_norm, self.k_norm = self._load_head_norms(opts.head_norm, weights, prefix, q_size, kv_size)

    def _load_replicated_fused(self, weights: Weights, name: str, q_size: int, kv_size: int, pg: ProcessGroup):
        """[q | k | v] in one tensor with fewer KV heads than ranks: read whole, keep this rank's
        query rows and the KV head they read (dense weights are cut at load; a quantized one keeps
        every row and its output is cut, since its packing fixes the rows together)."""
        opts = self.opts
        with weights.sharded_as(ProcessGroup(rank=0, size=1)):
            full = TensorParallelColumnLinear.load_packed(weights, name, opts.qkv_bias, [q_size, kv_size, kv_size],
                                                          opts.hidden)
        d, world = opts.head_dim, pg.size
        local_q = q_size // world
        kv_head = pg.rank // (world // opts.kv_heads)
        rows = torch.cat([
            torch.arange(pg.rank * local_q, (pg.rank + 1) * local_q),
            torch.arange(q_size + kv_head * d, q_size + (kv_head + 1) * d),
            torch.arange(q_size + kv_size + kv_head * d, q_size + kv_size + (kv_head + 1) * d),
        ])
        linear = full.linear
        if isinstance(linear, DenseLinear):
            bias = None if linear.bias is None else linear.bias.data[rows]
            full.linear = DenseLinear(linear.weight.data[rows].contiguous(), bias)
        else:
            self._rows = rows.to(weights.device)
        full.lora_layout = None  # rows picked per rank from the whole tensor: LoRA adapters are refused here
        return full

    def _load_head_norms(self, spec: HeadNorm, weights: Weights, prefix: str, q_size: int, kv_size: int):
        d = self.head_dim
        if spec.kind == "rms_projection":
            if self.replicated:
                raise CheckpointError(f"{prefix}: a norm over the whole k projection needs the KV heads split evenly "
                                      "over the shards")
            return (ShardedRMSNorm.load(weights, f"{prefix}.{spec.q_name}", q_size, spec.eps),
                    ShardedRMSNorm.load(weights, f"{prefix}.{spec.k_name}", kv_size, spec.eps))
        if spec.kind not in ("rms", "layer"):
            raise ValueError(f"unknown head norm kind {spec.kind!r}")
        norms = []
        for name, heads, local in ((spec.q_name, self.opts.heads, self.heads),
                                   (spec.k_name, self.opts.kv_heads, self.kv_heads)):
            full = f"{prefix}.{name}"
            if spec.per_head:
                load_vector(weights, f"{full}.weight", [heads, d])  # checks the shape, names the tensor
                if self.replicated and name == spec.k_name:
                    kv_head = weights.process_group.rank // (weights.process_group.size // heads)
                    weight = weights.get_slice(f"{full}.weight", (slice(kv_head, kv_head + 1),), to_dtype=True)
                else:
                    weight = weights.get_sharded(f"{full}.weight", dim=0)
                assert weight.shape[0] == local
            else:
                weight = load_vector(weights, f"{full}.weight", d)
            bias = load_vector(weights, f"{full}.bias", d) if spec.bias else None
            norms.append(_HeadNormModule(spec, weight, bias))
        return norms[0], norms[1]

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, KVH, D] of this rank, before norms and rotary."""
        tokens, d = hidden.shape[0], self.head_dim
        out = self.qkv(hidden)
        if self._rows is not None:
            out = out.index_select(1, self._rows)
        if self.opts.layout == GROUPED:
            group = self.heads // self.kv_heads
            grouped = out.view(tokens, self.kv_heads, group + 2, d)
            q = grouped[:, :, :group].reshape(tokens, self.heads, d)
            return q, grouped[:, :, group], grouped[:, :, group + 1]
        if self.kv is not None:
            kv = self.kv(hidden)
            q = out
            k, v = kv.split(self.kv_heads * d, dim=-1)
        else:
            q, k, v = out.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        return q.view(tokens, self.heads, d), k.view(tokens, self.kv_heads, d), v.view(tokens, self.kv_heads, d)

    def _fused_decode_layout(self) -> bool:
        """Whether this layer's q/k/v come out of one projection as [q | k | v] heads that rotate
        whole (rotate-half) with no norm between: the shape the CPU's one-call decode step takes."""
        fits = self._fused_layout
        if fits is None:
            rotary = self.rotary
            fits = self._fused_layout = (
                self.opts.layout == SPLIT and self.kv is None and self._rows is None and self.q_norm is None
                and self.softcap is None and self.sinks is None and rotary is not None
                and not rotary.config.interleaved)
        return fits

    def _cpu_decode(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """A decode step's attention on the CPU with fewer calls after the projection, the same bits
        as the eager calls below: in bfloat16 one native call (rotary on q and k, the K/V store, the
        paged attention: kernels/cpu_native_decode_src.py's `decode_attention_bf16`); in float32 one
        for rotary and the store (`rotary_store_f32`), then the backend's attention (torch's SDPA,
        transformers' arithmetic). None where it does not apply (the eager path then runs). Why: at
        one row those were ~10 torch calls a layer, more host time than a small model's whole layer
        of weights takes to read (issue #31)."""
        meta: AttentionMetadata = ctx.meta
        cache: KVCache = ctx.cache
        backend = meta.backend or DEFAULT_BACKEND
        if type(backend) is not TorchAttention or cache.scales_of(self.layer_id) is not None:
            return None
        key_cache, value_cache = cache.keys[self.layer_id], cache.values[self.layer_id]
        dtype = hidden.dtype
        if value_cache is None or dtype not in (torch.bfloat16, torch.float32):
            return None
        if dtype == torch.bfloat16:
            native = native_decode_module(hidden, key_cache, value_cache)
        else:  # float32 keeps torch's SDPA (the exactness reference); rotary and the store are fused
            native = cpu_pointwise.module_for_f32(hidden)
            if native is None or not (key_cache.dtype == value_cache.dtype == dtype and key_cache.is_contiguous()
                                      and value_cache.is_contiguous()):
                return None
        if native is None:
            return None
        cos, sin = ctx.cos_sin(self.rotary)
        shape = (hidden.shape[0], 1, self.head_dim)  # every dimension rotated
        if not (cos.dtype == sin.dtype == dtype and cos.shape == sin.shape == shape
                and cos.stride(-1) == 1 and sin.stride(-1) == 1):
            return None
        out = self.qkv(hidden)
        if out.stride(-1) != 1:  # the native calls read rows in place (a linear's output already is)
            out = out.contiguous()
        if dtype == torch.bfloat16:
            attn = native.decode_attention_bf16(out, cos, sin, key_cache, value_cache, meta.slots, meta.block_tables,
                                                meta.seq_lens, self.heads, self.kv_heads, self.scale,
                                                self.window or 0)
        else:
            q = native.rotary_store_f32(out, cos, sin, key_cache, value_cache, meta.slots, self.heads, self.kv_heads)
            attn = backend.decode(q, key_cache, value_cache, meta, self.scale, self.window).reshape(
                hidden.shape[0], self.heads * self.head_dim)
        return self.o_proj(attn)

    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if not ctx.meta.is_prefill and hidden.device.type == "cpu" and self._fused_decode_layout():
            fused = self._cpu_decode(hidden, ctx)
            if fused is not None:
                return fused
        tokens = hidden.shape[0]
        q, k, v = self.project(hidden)
        if self.q_norm is not None:
            if isinstance(self.q_norm, ShardedRMSNorm):
                q = self.q_norm(q.reshape(tokens, -1)).view_as(q)
                k = self.k_norm(k.reshape(tokens, -1)).view_as(k)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
        meta: AttentionMetadata = ctx.meta
        cache: KVCache = ctx.cache
        stored = None
        if self.rotary is not None:
            cos, sin = ctx.cos_sin(self.rotary)
            # On CUDA one launch rotates q and k and writes k and v into the cache (four otherwise).
            stored = self.rotary.apply_and_store(q, k, v, cos, sin, cache, self.layer_id, meta.slots)
            if stored is None:
                q, k = self.rotary.apply(q, cos, sin), self.rotary.apply(k, cos, sin)
            else:
                q, k = stored
        if stored is None:
            cache.store(self.layer_id, meta.slots, k, v)
        backend = meta.backend or DEFAULT_BACKEND
        key_cache, value_cache = cache.keys[self.layer_id], cache.values[self.layer_id]
        # Passed only for an fp8 cache: backends written before it keep their signature.
        kv = {} if (kv_scales := cache.scales_of(self.layer_id)) is None else {"kv_scales": kv_scales}
        if meta.is_prefill:
            out = backend.prefill(q, k, v, key_cache, value_cache, meta, self.scale, self.window,
                                  softcap=self.softcap, sinks=self.sinks, **kv)
        else:
            out = backend.decode(q, key_cache, value_cache, meta, self.scale, self.window, softcap=self.softcap,
                                 sinks=self.sinks, **kv)
        return self.o_proj(out.reshape(tokens, self.heads * self.head_dim))

    def linear_stages(self) -> list[list[str]]:
        """Module paths of this block's linears in the order `quantize` calibrates them."""
        first = ["qkv", "kv"] if self.kv is not None else ["qkv"]
        return [first, ["o_proj"]]

