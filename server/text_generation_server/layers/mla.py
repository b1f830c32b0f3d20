"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latents.

Each token's keys and values for every head come from one compressed latent: c = RMSNorm of the
first kv_lora_rank (R) numbers of kv_a_proj_with_mqa(x), and a rotary key pe of
qk_rope_head_dim (P) numbers, shared by all heads. kv_b_proj maps c to each head's non-rotary
key (qk_nope_head_dim, Dn) and value (v_head_dim, Dv). The cache holds [c | pe], R + P numbers
per token per layer (576 for V3) instead of every head's K and V (128 x (192 + 128) = 40,960).

Prefill (prompt chunks) expands the latents of the sequence (its cached prefix included) into
per-head K = [W_UK c | pe] and V = W_UV c and runs causal attention over them: the arithmetic
transformers runs, and compute-bound work is cheaper on the per-head widths (192 and 128) than
on the 576-wide latents. Decode (one token per sequence, and one-token rows of a prefill step)
absorbs the up-projections instead, so nothing per head is ever read from the cache:
q.k = q_nope . (W_UK c) + q_pe . pe = (W_UK^T q_nope) . c + q_pe . pe, and
sum_t p_t (W_UV c_t) = W_UV (sum_t p_t c_t): each head's query moves into latent space, the
backend's `latent_decode` attends over the latents as multi-query attention of width R + P with
values their first R numbers, and W_UV maps the result back per head.

Tensor parallel splits heads: q_b_proj / q_proj and kv_b_proj are column-parallel by head, o_proj
row-parallel; q_a_proj and kv_a_proj_with_mqa are replicated, so every rank computes and caches
the same latent (its memory is not divided by the ranks, but it is 1/71 of a per-head cache).

kv_b_proj is read once, at load, as the [H x (Dn + Dv), R] weight its kernel applies (a quantized
checkpoint's is dequantized by applying the linear to the identity), and then only that matrix
runs: prefill's expansion and decode's absorption use the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from text_generation_server.layers.attention import (
    DEFAULT_BACKEND,
    AttentionMetadata,
    KVCache,
    read_cache,
    rows_as_decode,
    sequence_attention,
)
from text_generation_server.layers.context import ForwardContext
from text_generation_server.kernels.dense import DenseLinear
from text_generation_server.layers.norm import RMSNorm
from text_generation_server.layers.rotary import RotaryEmbedding
from text_generation_server.layers.tensor_parallel import TensorParallelColumnLinear, TensorParallelRowLinear
from text_generation_server.quantizers.dist import ProcessGroup
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights

# DeepSeek's q_a_layernorm and kv_a_layernorm are built without the config's rms_norm_eps.
LORA_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAOptions:
    hidden: int
    heads: int
    q_lora_rank: int | None  # None: one q_proj (V2-Lite); else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float  # softmax scale, yarn's mscale included
    bias: bool = False  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Numbers cached per token: the compressed K/V and the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def applied_weight(linear: torch.nn.Module, in_features: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    """[out, in]: the matrix a linear applies. A dense one's weight as stored; any other kernel's
    read by applying it to the identity, so the absorbed decode needs no knowledge of formats."""
    if isinstance(linear, DenseLinear):
        return linear.weight.data
    with torch.no_grad():
        return linear(torch.eye(in_features, dtype=dtype, device=device)).t().contiguous()


class MultiHeadLatentAttention(torch.nn.Module):
    # hidden: [tokens, hidden] -> [tokens, hidden]
    def __init__(self, opts: MLAOptions, weights: Weights, prefix: str, layer_id: int, rotary: RotaryEmbedding):
        super().__init__()
        world = weights.process_group.size
        if opts.heads % world:
            raise CheckpointError(f"config.json: num_attention_heads ({opts.heads}) must be divisible by the "
                                  f"{world} shards")
        if rotary.config.rotary_dim != opts.qk_rope_head_dim:
            raise ValueError(f"rotary dimension {rotary.config.rotary_dim} != qk_rope_head_dim {opts.qk_rope_head_dim}")
        self.opts = opts
        self.layer_id = layer_id
        self.rotary = rotary
        self.heads = opts.heads // world
        self.kv_heads = 1  # one latent per token, whatever the heads (the engine sizes the cache from it)
        # An fp8 cache's scales (models/kv_cache.py): one per layer, the latent's.
        self.kv_prefix, self.kv_heads_total, self.kv_head_ids = prefix, 1, (0,)
        self.latent_dim = opts.latent_dim
        self.scale = opts.scale
        r, dn, dv = opts.kv_lora_rank, opts.qk_nope_head_dim, opts.v_head_dim
        q_size = opts.heads * opts.qk_head_dim
        # The down-projections, replicated: every rank computes the whole latent (and q's low rank).
        down = [f"{prefix}.kv_a_proj_with_mqa"]
        sizes = [opts.latent_dim]
        if opts.q_lora_rank is not None:
            down, sizes = [f"{prefix}.q_a_proj", *down], [opts.q_lora_rank, *sizes]
        with weights.sharded_as(ProcessGroup(rank=0, size=1)):
            self.down = TensorParallelColumnLinear.load_multi(weights, down, opts.bias, sizes, opts.hidden)
        self.down_sizes = sizes
        if opts.q_lora_rank is not None:
            self.q_a_norm: RMSNorm | None = RMSNorm.load(weights, f"{prefix}.q_a_layernorm", opts.q_lora_rank,
                                                         LORA_NORM_EPS)
            self.q_up = TensorParallelColumnLinear.load(weights, f"{prefix}.q_b_proj", False, q_size,
                                                        opts.q_lora_rank)
        else:
            self.q_a_norm = None
            self.q_up = TensorParallelColumnLinear.load(weights, f"{prefix}.q_proj", False, q_size, opts.hidden)
        self.kv_a_norm = RMSNorm.load(weights, f"{prefix}.kv_a_layernorm", r, LORA_NORM_EPS)
        kv_b = TensorParallelColumnLinear.load(weights, f"{prefix}.kv_b_proj", False, opts.heads * (dn + dv), r)
        # [H_local x (Dn + Dv), R]: rows of head h are h*(Dn+Dv) .. +Dn for W_UK, the next Dv for W_UV.
        w_kv = applied_weight(kv_b.linear, r, weights.dtype, weights.device)
        self.w_kv = torch.nn.Parameter(w_kv, requires_grad=False)
        self.o_proj = TensorParallelRowLinear.load(weights, f"{prefix}.o_proj", opts.bias, opts.hidden,
                                                   opts.heads * dv)

    @property
    def w_uk(self) -> torch.Tensor:
        """[H, Dn, R]: each head's key up-projection (a view of w_kv)."""
        o = self.opts
        return self.w_kv.view(self.heads, o.qk_nope_head_dim + o.v_head_dim, -1)[:, :o.qk_nope_head_dim]

    @property
    def w_uv_t(self) -> torch.Tensor:
        """[H, R, Dv]: each head's value up-projection, transposed (a view of w_kv)."""
        o = self.opts
        return self.w_kv.view(self.heads, o.qk_nope_head_dim + o.v_head_dim, -1)[:, o.qk_nope_head_dim:].transpose(1, 2)

    # -- projections -----------------------------------------------------------------------------
    def project(self, hidden: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope [T, H, Dn], q_pe [T, H, P] rotated, latent [T, R + P] with pe rotated)."""
        tokens, o = hidden.shape[0], self.opts
        down = self.down(hidden)
        if self.q_a_norm is not None:
            q_low, kv = down.split(self.down_sizes, dim=-1)
            q = self.q_up(self.q_a_norm(q_low))
        else:
            kv = down
            q = self.q_up(hidden)
        q_nope, q_pe = q.view(tokens, self.heads, o.qk_head_dim).split([o.qk_nope_head_dim, o.qk_rope_head_dim], -1)
        c, k_pe = kv.split([o.kv_lora_rank, o.qk_rope_head_dim], dim=-1)
        cos, sin = ctx.cos_sin(self.rotary)
        q_pe = self.rotary.apply(q_pe, cos, sin)
        k_pe = self.rotary.apply(k_pe.unsqueeze(1), cos, sin).squeeze(1)
        return q_nope, q_pe, torch.cat([self.kv_a_norm(c), k_pe], dim=-1)

    def expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [L, R + P] -> per-head K [L, H, Dn + P] and V [L, H, Dv] (prefill's form)."""
        o = self.opts
        length = latent.shape[0]
        c, pe = latent.split([o.kv_lora_rank, o.qk_rope_head_dim], dim=-1)
        kv = F.linear(c, self.w_kv).view(length, self.heads, o.qk_nope_head_dim + o.v_head_dim)
        k_nope, v = kv.split([o.qk_nope_head_dim, o.v_head_dim], dim=-1)
        k = torch.cat([k_nope, pe.unsqueeze(1).expand(length, self.heads, o.qk_rope_head_dim)], dim=-1)
        return k, v

    def absorbed_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """[T, H, R + P]: each head's query in latent space (W_UK^T q_nope), then its rotary part."""
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [T, H, R]
        return torch.cat([q_latent, q_pe], dim=-1)

    def values_out(self, out_latent: torch.Tensor) -> torch.Tensor:
        """[T, H, R] attention-weighted latents -> [T, H, Dv] through each head's W_UV."""
        return torch.bmm(out_latent.transpose(0, 1), self.w_uv_t).transpose(0, 1)

    # -- attention -----------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        tokens = hidden.shape[0]
        q_nope, q_pe, latent = self.project(hidden, ctx)
        meta: AttentionMetadata = ctx.meta
        cache: KVCache = ctx.cache
        cache.store_latent(self.layer_id, meta.slots, latent)
        backend = meta.backend or DEFAULT_BACKEND
        pool = cache.keys[self.layer_id]
        kv_scales = cache.scales_of(self.layer_id)
        if meta.is_prefill:
            out = self._prefill(q_nope, q_pe, latent, pool, meta, backend, kv_scales)
        else:
            out = self._decode(q_nope, q_pe, pool, meta, backend, kv_scales)
        return self.o_proj(out.reshape(tokens, self.heads * self.opts.v_head_dim))

    def _decode(self, q_nope, q_pe, pool, meta: AttentionMetadata, backend, kv_scales=None) -> torch.Tensor:
        query = self.absorbed_query(q_nope, q_pe)
        kv = {} if kv_scales is None else {"kv_scales": kv_scales}  # only for fp8: older backends keep their signature
        return self.values_out(backend.latent_decode(query, pool, meta, self.scale, self.opts.kv_lora_rank, **kv))

    def _prefill(self, q_nope, q_pe, latent, pool, meta: AttentionMetadata, backend, kv_scales=None) -> torch.Tensor:
        """Per sequence: its latents (cached prefix gathered from the blocks) expanded per head and
        causal attention over them; one-token rows over a cache (decodes mixed into the step)
        together through the absorbed decode. An fp8 cache's latents are read as it holds them,
        this step's new ones included."""
        lens = meta.prefill_lens
        assert lens is not None, "a prefill step has prefill_lens"
        caches = meta.cache_lens if meta.has_prefix else None
        out = q_nope.new_empty(q_nope.shape[0], self.heads, self.opts.v_head_dim)
        starts = meta.memo("token_starts", lambda: [sum(lens[:i]) for i in range(len(lens))])
        single = meta.memo("single_rows", lambda: [
            i for i, n in enumerate(lens) if n == 1 and caches is not None and caches[i] > 0])
        if len(single) > 1:
            sub, tokens = meta.memo("single_meta", lambda: rows_as_decode(meta, single, starts, q_nope.device))
            out.index_copy_(0, tokens, self._decode(q_nope.index_select(0, tokens), q_pe.index_select(0, tokens),
                                                    pool, sub, backend, kv_scales))
        done = set(single) if len(single) > 1 else set()
        q = torch.cat([q_nope, q_pe], dim=-1)
        bs = pool.shape[1]
        if kv_scales is not None:
            latent = kv_scales.roundtrip(latent.unsqueeze(1), "key").squeeze(1)
        for row, n in enumerate(lens):
            if row in done:
                continue
            start, stop = starts[row], starts[row] + n
            cached = caches[row] if caches is not None else 0
            if cached:
                assert meta.block_tables is not None, "a cached prefix is read through the block tables"
                blocks = meta.block_tables[row, : (cached + n + bs - 1) // bs]
                seq_latent = read_cache(pool.index_select(0, blocks), kv_scales, "key", q.dtype)
                seq_latent = seq_latent.view(-1, self.latent_dim)[: cached + n]
            else:
                seq_latent = latent[start:stop]
            k, v = self.expand(seq_latent)
            out[start:stop] = sequence_attention(q[start:stop], k, v, cached, self.scale, None)
        return out

    def linear_stages(self) -> list[list[str]]:
        raise CheckpointError("quantize does not calibrate multi-head latent attention (DeepSeek) yet: its kv_b_proj "
                              "is absorbed into the attention at load; quantize the checkpoint with another tool")
