"""Paged KV cache, the metadata of one forward, and the attention backends over them.

The cache of each layer is [num_blocks, block_size, kv_heads, head_dim] for keys and values;
a model with multi-head latent attention (DeepSeek-V2/V3) holds one latent vector per token
instead, in a single pool per layer (`KVLayout.latent`). A token's K/V lives at a *slot* (block_id * block_size + offset); a sequence's block table
lists its blocks in order. The router (or the model itself when no router hands blocks in)
decides blocks and slots; attention only reads them.

One forward covers any mix of sequences: each has `cache_len` tokens already in the cache
(a cached prefix, or the chunks of its prompt prefilled earlier, or everything generated so
far) and `q_len` new tokens whose K/V the layer stores before attending. A decode step is the
case q_len == 1 for every sequence; a plain prefill is cache_len == 0 for every sequence.

An fp8 cache (`serve --kv-cache-dtype`) holds each number as fp8(x / scale) with one scale per
layer or KV head (`KVCache.scales_of`, kernels/kv_fp8.py); every backend call then gets the
layer's `kv_scales` and reads keys and values, this forward's new ones included, as the cache
holds them, so a prompt gets the same numbers computed whole, in chunks or after a cached prefix.

Backends (`attention_backends.py` keeps the ordered registry, `triton-paged` among them) implement `prefill` (any
q_len, over the flattened new tokens) and `decode` (q_len == 1). This module holds the
torch backend, which runs everywhere and is the reference for the others.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from text_generation_server.kernels import lazy_zeros
from text_generation_server.kernels.kv_fp8 import KVScales, is_fp8, widen


@dataclass(frozen=True)
class KVLayout:
    """What one rank's paged cache holds for each token in each layer; the model says which
    (`DecoderModel.kv_layout`), and the cache's size, warmup's plan, the startup log and Info
    all read it from here, so they can never disagree with what the layers store.

    Per head (every family but DeepSeek's): a key and a value of `head_dim` for each of
    `kv_heads`. Latent (multi-head latent attention): one vector of `head_dim` numbers
    (kv_lora_rank + qk_rope_head_dim), shared by every head and replicated on every rank, kept
    as the key pool's single "head"; there is no value pool, since values are the latent's first
    kv_lora_rank numbers seen through each head's up-projection.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    latent: bool = False

    def __post_init__(self) -> None:
        if min(self.num_layers, self.kv_heads, self.head_dim) < 1:
            raise ValueError(f"KV layout needs positive sizes, got {self}")
        if self.latent and self.kv_heads != 1:
            raise ValueError(f"a latent KV layout holds one vector per token, got kv_heads={self.kv_heads}")

    def layer_dtypes(self, dtype: torch.dtype, scales: "list[KVScales | None] | None" = None,
                     wide: torch.dtype | None = None) -> list[torch.dtype]:
        """Each layer's cache dtype: `dtype`, except that in an fp8 cache a layer whose scales are
        None is kept in `wide` (the model's dtype: a layer fp8 cannot hold, models/kv_cache.py)."""
        if scales is None or not is_fp8(dtype):
            return [dtype] * self.num_layers
        if len(scales) != self.num_layers:
            raise ValueError(f"an fp8 KV cache needs one entry of scales per layer ({self.num_layers}), "
                             f"got {len(scales)}")
        if wide is None and any(s is None for s in scales):
            raise ValueError("an fp8 KV cache with layers kept unquantized (scales None) needs their dtype (wide)")
        kept = wide if wide is not None else dtype
        return [kept if s is None else dtype for s in scales]

    def bytes_per_token(self, dtype: torch.dtype, scales: "list[KVScales | None] | None" = None,
                        wide: torch.dtype | None = None) -> int:
        """A token's bytes over every layer, each in its own dtype (`layer_dtypes`)."""
        pools = 1 if self.latent else 2
        per_layer = pools * self.kv_heads * self.head_dim
        return sum(per_layer * t.itemsize for t in self.layer_dtypes(dtype, scales, wide))

    def bytes_per_block(self, block_size: int, dtype: torch.dtype, scales: "list[KVScales | None] | None" = None,
                        wide: torch.dtype | None = None) -> int:
        """What one block costs: every layer's share of it (blocks are one count for all layers)."""
        return block_size * self.bytes_per_token(dtype, scales, wide)

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                 scales: "list[KVScales | None] | None" = None, wide: torch.dtype | None = None) -> "KVCache":
        """dtype: the cache's (an fp8 dtype: `scales` gives each layer's, default all 1.0; a layer
        whose entry is None is held in `wide`)."""
        return KVCache(self.num_layers, num_blocks, block_size, self.kv_heads, self.head_dim, dtype, device,
                       latent=self.latent, scales=scales, wide=wide)

    def describe(self) -> str:
        if self.latent:
            return f"{self.num_layers} layers x one latent of {self.head_dim}"
        return f"{self.num_layers} layers x K and V of {self.kv_heads} heads x {self.head_dim}"

    def describe_dtypes(self, dtype: torch.dtype, scales: "list[KVScales | None] | None" = None,
                        wide: torch.dtype | None = None) -> str:
        """The cache's dtype for the startup line, naming the layers kept in `wide` if any."""
        name = str(dtype).removeprefix("torch.")
        kept = [i for i, t in enumerate(self.layer_dtypes(dtype, scales, wide)) if t != dtype]
        if not kept:
            return name
        return f"{name}; layers {','.join(map(str, kept))} in {str(wide).removeprefix('torch.')}"



class KVCache:
    """Per-layer key and value block pools (latent: one pool per layer, `values` all None).

    An fp8 cache (dtype float8_e4m3fn or float8_e5m2) keeps one `KVScales` per layer: `store`
    quantizes with them and every backend reads through them (`scales_of(layer)`, None for a
    16/32-bit cache, which holds values in the model's dtype). A layer whose scales are None in an
    fp8 cache is kept in `wide` (the model's dtype): each layer's pools have their own dtype
    (`dtypes`), and every backend call sees that layer as a 16/32-bit cache.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        latent: bool = False,
        scales: list[KVScales | None] | None = None,
        wide: torch.dtype | None = None,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache needs at least one block of size >= 1 (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.latent = latent
        self.dtype = dtype
        self.scales: list[KVScales | None] = [None] * num_layers
        if is_fp8(dtype):
            self.scales = list(scales) if scales is not None else [KVScales.ones(dtype, kv_heads, device)] * num_layers
            if len(self.scales) != num_layers or any(
                    s is not None and (s.dtype != dtype or s.key.shape != (kv_heads,)) for s in self.scales):
                raise ValueError(f"an fp8 KV cache needs one {dtype} KVScales of [{kv_heads}] per layer ({num_layers}; "
                                 "None: a layer kept in the model's dtype)")
            if wide is None and any(s is None for s in self.scales):
                raise ValueError("an fp8 KV cache with layers kept unquantized (scales None) needs their dtype (wide)")
            if wide is not None and is_fp8(wide):
                raise ValueError(f"the dtype of the layers an fp8 cache keeps unquantized cannot be fp8, got {wide}")
        elif scales is not None:
            raise ValueError(f"KV scales are for fp8 caches, not {dtype}")
        kept = wide if wide is not None and is_fp8(dtype) else dtype  # what a layer without scales holds
        self.dtypes = [dtype if s is not None else kept for s in self.scales]
        shape = (num_blocks, block_size, kv_heads, head_dim)
        # Lazily zeroed on a CPU (kernels/lazy_zeros.py): no start-up fill, resident as blocks are used.
        self.keys = [lazy_zeros.zeros(shape, t, device) for t in self.dtypes]
        self.values: list[torch.Tensor | None] = (
            [None] * num_layers if latent else [lazy_zeros.zeros(shape, t, device) for t in self.dtypes])

    def scales_of(self, layer: int) -> KVScales | None:
        return self.scales[layer]

    def store(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        # key/value: [tokens, kv_heads, head_dim]; slots: [tokens]
        k = self.keys[layer]
        v = self.values[layer]
        if v is None:
            raise ValueError("a latent KV cache has no value pool: multi-head latent attention calls store_latent")
        scales = self.scales[layer]
        if scales is not None:  # fp8 as bytes: torch has no index_copy_ for fp8 on every device
            k, v = k.view(torch.uint8), v.view(torch.uint8)
            key, value = scales.quantize(key, "key").view(torch.uint8), scales.quantize(value, "value").view(torch.uint8)
        k.view(-1, k.shape[2], k.shape[3]).index_copy_(0, slots, key.to(k.dtype))
        v.view(-1, v.shape[2], v.shape[3]).index_copy_(0, slots, value.to(v.dtype))

    def store_latent(self, layer: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        # latent: [tokens, width]; slots: [tokens]
        pool = self.keys[layer]
        scales = self.scales[layer]
        if scales is not None:  # as bytes, like `store`
            pool = pool.view(torch.uint8)
            latent = scales.quantize(latent.unsqueeze(1), "key").squeeze(1).view(torch.uint8)
        pool.view(-1, pool.shape[3]).index_copy_(0, slots, latent.to(pool.dtype))


@dataclass
class AttentionMetadata:
    """What attention needs to know about the sequences of one forward.

    Prefill (is_prefill): `prefill_lens` [B] new tokens per sequence, flattened in order;
    `cache_lens` [B] tokens each already has in the cache (None: all zero, and then the
    block tables are not needed). Decode: one new token per sequence; `block_tables`
    [B, max_blocks] and `seq_lens` [B] (tokens in cache after this step, the new one
    included). `max_seq_len` bounds seq_lens; host ints never need a device sync.
    `backend` is the attention backend the model's layers call (None: torch).
    """

    is_prefill: bool
    slots: torch.Tensor
    prefill_lens: list[int] | None = None
    cache_lens: list[int] | None = None
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    max_seq_len: int = 0
    backend: "AttentionBackend | None" = None
    # Prefill: the flattened rows that belong to decoding requests rather than prompts. Attention
    # does not need it; the linears run those rows on their decode path (kernels/phase.py).
    decode_rows: list[int] | None = None
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def has_prefix(self) -> bool:
        """Whether some sequence attends over K/V computed by an earlier forward."""
        return self.is_prefill and self.cache_lens is not None and any(self.cache_lens)

    @property
    def max_position(self) -> int:
        if self.is_prefill:
            caches = self.cache_lens or [0] * len(self.prefill_lens)
            return max(c + n for c, n in zip(caches, self.prefill_lens)) - 1
        return self.max_seq_len - 1

    def memo(self, key, build):
        """Per-forward values shared by every layer (gather indices, masks, device copies)."""
        value = self._memo.get(key)
        if value is None:
            value = self._memo[key] = build()
        return value

    def cu_seqlens_q(self, device: torch.device) -> torch.Tensor:
        def build() -> torch.Tensor:
            cu = [0]
            for n in self.prefill_lens:
                cu.append(cu[-1] + n)
            return torch.tensor(cu, dtype=torch.int32, device=device)

        return self.memo("cu_seqlens_q", build)


@dataclass(frozen=True)
class AttentionSpec:
    """What a backend must support for one model on one device (like kernels' LinearSpec)."""

    device_type: str
    dtype: torch.dtype
    heads: int  # per rank
    kv_heads: int  # per rank
    head_dim: int
    block_size: int
    windowed: bool
    device_capability: tuple[int, int] | None = None
    softcap: bool = False  # attention logit soft-capping (Gemma 2)
    sinks: bool = False  # a learned per-head logit in every softmax's denominator (gpt-oss)
    latent_dim: int = 0  # multi-head latent attention: the cached latent's width (0: per-head K/V)
    kv_dtype: torch.dtype | None = None  # the KV cache's, where it is not `dtype` (an fp8 cache)


class AttentionBackend:
    """Attention over the paged cache. Subclasses set `name` and implement the two calls.

    graph_safe: every call has shapes fixed by the batch size alone and no host syncs, so a
    decode step through it can be captured in a CUDA graph.
    """

    name = "abstract"
    graph_safe = False

    def __init__(self, spec: AttentionSpec | None = None):
        self.spec = spec

    @classmethod
    def can_implement(cls, spec: AttentionSpec) -> tuple[bool, str]:
        raise NotImplementedError

    def prefill(self, q, k, v, key_cache, value_cache, meta: AttentionMetadata, scale: float,
                window: int | None, softcap: float | None = None, sinks: torch.Tensor | None = None,
                kv_scales: KVScales | None = None) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, KVH, D] (the new tokens, already stored) -> [T, H, D].

        kv_scales: the layer's, when the cache is fp8 (`KVCache.scales_of`): every key and value
        attended over, this forward's new ones included, is read as the cache holds it.

        softcap: scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2).
        sinks: [H] float32 logits, one per head, that join every softmax's denominator and
        attend to nothing (gpt-oss): the weights of the real keys sum to less than one."""
        raise NotImplementedError

    def decode(self, q, key_cache, value_cache, meta: AttentionMetadata, scale: float,
               window: int | None, softcap: float | None = None, sinks: torch.Tensor | None = None,
               kv_scales: KVScales | None = None) -> torch.Tensor:
        """q: [B, H, D] -> [B, H, D]."""
        raise NotImplementedError

    def latent_decode(self, q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                      value_dim: int, kv_scales: KVScales | None = None) -> torch.Tensor:
        """Multi-head latent attention's absorbed decode: q [B, H, W] (each head's query already
        in latent space, then its rotary part) against the paged latents [blocks, block_size, 1, W];
        values are the latents' first `value_dim` numbers. -> [B, H, value_dim]. The torch form
        here is the reference; backends with a kernel for it override."""
        return padded_latent_decode(q, latent_cache, meta, scale, value_dim, kv_scales)

    def decode_transient_bytes(self, kv_cache_bytes: int, num_layers: int) -> int:
        """Memory a decode step may take beyond its activations, given the KV cache size
        (gathered copies of K/V): warmup keeps it free."""
        return 0

    def reserve_decode(self, max_batch: int, max_seq_len: int, device: torch.device) -> int:
        """Allocates, once at warmup, what decode steps up to these limits need beyond their
        activations (a split workspace); returns the bytes allocated."""
        return 0

    def capture_memo(self, batch: int, max_seq_len: int, device: torch.device) -> dict:
        """Per-forward values a captured decode graph of `batch` rows fixes (split counts,
        workspaces), put in the metadata's memo. Only graph-safe backends are captured."""
        raise NotImplementedError(f"attention backend {self.name} cannot be captured in a CUDA graph")


def _blocks_of(block_tables: torch.Tensor, row: int, length: int, block_size: int) -> torch.Tensor:
    return block_tables[row, : (length + block_size - 1) // block_size]


def _gather_sequence(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    # cache: [num_blocks, bs, KVH, D] -> [length, KVH, D]
    return cache.index_select(0, blocks).view(-1, cache.shape[2], cache.shape[3])[:length]


def read_cache(x: torch.Tensor, kv_scales: KVScales | None, which: str, dtype: torch.dtype) -> torch.Tensor:
    """Gathered cache entries [..., KVH, D] in the model's dtype: an fp8 cache's dequantized."""
    return x if kv_scales is None else kv_scales.dequantize(x, which, dtype)


def _band_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[q, k] bool: causal (key at or before the query), within the window when there is one."""
    diff = q_pos[:, None] - k_pos[None, :]
    mask = diff >= 0
    if window is not None:
        mask &= diff < window
    return mask


def sdpa(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, mask: torch.Tensor | None, scale: float,
         softcap: float | None = None, is_causal: bool = False, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """scaled_dot_product_attention on [B, H, L, D] inputs (K/V may have fewer heads: GQA); with
    a soft cap or sinks, the eager form transformers uses (Gemma 2: scores capped before the mask;
    gpt-oss: each head's sink logit joins the softmax as one more column, dropped after), with a
    float32 softmax. mask: bool, True where a key is visible."""
    gqa = q4.shape[1] != k4.shape[1]
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=gqa)
    if gqa:
        group = q4.shape[1] // k4.shape[1]
        k4, v4 = k4.repeat_interleave(group, dim=1), v4.repeat_interleave(group, dim=1)
    scores = torch.matmul(q4, k4.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        n, total = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(n, total, dtype=torch.bool, device=q4.device).tril(total - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        column = sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
        probs = probs.to(q4.dtype)
    else:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q4.dtype)
    if mask is not None:
        # A row that sees no key (a CUDA graph's padding row) gets zeros, not NaN: its output is
        # written to the cache's padding block, which other rows gather (and mask) when padded.
        probs = probs.masked_fill(~mask, 0.0)
    return torch.matmul(probs, v4)


def sequence_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_len: int,
    scale: float,
    window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's causal attention: q [n, H, D] at positions cache_len.., k/v [cache_len + n,
    KVH, D] -> [n, H, D]. 4-D inputs, so CUDA can take its fused kernels. With a window shorter
    than the context the queries are taken in tiles of `window` rows, each against the <= 2 *
    window keys it can see, so no [L, L] mask is ever built."""
    n, heads, _ = q.shape
    total = k.shape[0]
    q4 = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    k4 = k.transpose(0, 1).unsqueeze(0)
    v4 = v.transpose(0, 1).unsqueeze(0)
    if window is None or window >= total:
        if cache_len == 0:
            out = sdpa(q4, k4, v4, None, scale, softcap, is_causal=True, sinks=sinks)
        else:
            pos = torch.arange(total, device=q.device)
            mask = _band_mask(pos[cache_len:], pos, None)
            out = sdpa(q4, k4, v4, mask, scale, softcap, sinks=sinks)
        return out.squeeze(0).transpose(0, 1)
    out = torch.empty_like(q)
    for start in range(0, n, window):
        stop = min(start + window, n)
        first_pos = cache_len + start
        key_lo = max(0, first_pos - window + 1)
        key_hi = cache_len + stop
        q_pos = torch.arange(first_pos, cache_len + stop, device=q.device)
        k_pos = torch.arange(key_lo, key_hi, device=q.device)
        mask = _band_mask(q_pos, k_pos, window)
        o = sdpa(q4[:, :, start:stop], k4[:, :, key_lo:key_hi], v4[:, :, key_lo:key_hi], mask, scale, softcap,
                 sinks=sinks)
        out[start:stop] = o.squeeze(0).transpose(0, 1)
    return out


class TorchAttention(AttentionBackend):
    """torch.nn.functional.scaled_dot_product_attention per sequence: the CPU path and the
    reference for every other backend.

    Decode on CPU gathers every sequence's blocks padded to the longest and runs one SDPA (the
    fastest plain-torch form there). On CUDA that padded copy would dominate the step, so decode
    works block by block instead: scores for each (sequence, block) pair in one batched matmul,
    a softmax across a sequence's blocks with scatter reductions, no padding past the last block.
    """

    name = "torch-sdpa"

    @classmethod
    def can_implement(cls, spec: AttentionSpec) -> tuple[bool, str]:
        return True, ""

    def prefill(self, q, k, v, key_cache, value_cache, meta, scale, window, softcap=None, sinks=None,
                kv_scales=None):
        lens = meta.prefill_lens
        if kv_scales is not None:  # the new tokens as the cache holds them
            k, v = kv_scales.roundtrip(k, "key"), kv_scales.roundtrip(v, "value")
        caches = meta.cache_lens if meta.has_prefix else None
        out = torch.empty_like(q)
        bs = key_cache.shape[1]
        starts = meta.memo("token_starts", lambda: [sum(lens[:i]) for i in range(len(lens))])
        # Decode rows mixed into a prefill step (one new token over a cached sequence) run together,
        # as a decode step would; the rest (prompt chunks) one sequence at a time.
        single = meta.memo("single_rows", lambda: [
            i for i, n in enumerate(lens) if n == 1 and caches is not None and caches[i] > 0])
        if len(single) > 1:
            sub, tokens = meta.memo("single_meta", lambda: rows_as_decode(meta, single, starts, q.device))
            kv = {} if kv_scales is None else {"kv_scales": kv_scales}  # subclasses' decode may predate fp8
            out.index_copy_(0, tokens, self.decode(q.index_select(0, tokens), key_cache, value_cache, sub, scale,
                                                   window, softcap, sinks, **kv))
        done = set(single) if len(single) > 1 else set()
        for row, n in enumerate(lens):
            if row in done:
                continue
            start, stop = starts[row], starts[row] + n
            cached = caches[row] if caches is not None else 0
            if cached:
                blocks = _blocks_of(meta.block_tables, row, cached + n, bs)
                ks = read_cache(_gather_sequence(key_cache, blocks, cached + n), kv_scales, "key", q.dtype)
                vs = read_cache(_gather_sequence(value_cache, blocks, cached + n), kv_scales, "value", q.dtype)
            else:
                ks, vs = k[start:stop], v[start:stop]
            out[start:stop] = sequence_attention(q[start:stop], ks, vs, cached, scale, window, softcap, sinks)
        return out

    def decode(self, q, key_cache, value_cache, meta, scale, window, softcap=None, sinks=None, kv_scales=None):
        if q.device.type == "cuda" and softcap is None and sinks is None:
            return blockwise_decode(q, key_cache, value_cache, meta, scale, window, kv_scales)
        if softcap is None and sinks is None and kv_scales is None:
            module = native_decode_module(q, key_cache, value_cache)
            if module is not None:
                return module.paged_decode_attention(q.contiguous(), key_cache, value_cache, meta.block_tables,
                                                     meta.seq_lens, scale, window or 0)
        return padded_decode(q, key_cache, value_cache, meta, scale, window, softcap, sinks, kv_scales)

    def decode_transient_bytes(self, kv_cache_bytes: int, num_layers: int) -> int:
        # One layer's K and V of every live token gathered at once, and its scores; an fp8 cache's
        # gathered copy is dequantized too, to the model's dtype (spec.kv_dtype's 1 byte -> dtype's).
        widen = 1
        if self.spec is not None and self.spec.kv_dtype is not None and is_fp8(self.spec.kv_dtype):
            widen = 1 + self.spec.dtype.itemsize
        return 2 * widen * kv_cache_bytes // max(num_layers, 1)


NATIVE_DECODE_ENV = "TGS_CPU_NATIVE_ATTENTION"


def native_decode_module(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor):
    """The native CPU extension when it can run this decode step's attention, else None.

    Why: torch's SDPA on a padded copy of the cache costs 0.4-0.8 ms a layer with bfloat16 and one
    query row on the 2-core EPYC (more than the layer's int4 weights take to read);
    `paged_decode_attention` (kernels/cpu_native_decode_src.py) reads the blocks in place, each KV
    head once for its query heads. CPU only; bfloat16 caches of q's dtype (an fp8 cache,
    soft-capping and sinks keep the torch form). float32 keeps SDPA: it is fast there (a tenth of
    bfloat16's time) and it is the exactness tests' reference against transformers, whose greedy
    tokens the kernel's other summation order can flip at a near tie (tests/test_fp8_activations.py
    did). TGS_CPU_NATIVE_ATTENTION=0 keeps the torch form everywhere (read per call, so a benchmark
    can switch it between steps)."""
    if (q.device.type != "cpu" or q.dtype != torch.bfloat16 or key_cache.dtype != q.dtype
            or value_cache.dtype != q.dtype or not key_cache.is_contiguous() or not value_cache.is_contiguous()):
        return None
    if os.environ.get(NATIVE_DECODE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    from text_generation_server.kernels import cpu_native

    return cpu_native.native()


def rows_as_decode(meta: AttentionMetadata, rows: list[int], starts: list[int], device: torch.device):
    """Metadata of a decode step over some rows of a prefill step, and their token positions."""
    index = torch.tensor(rows, dtype=torch.long, device=device)
    lengths = [meta.cache_lens[r] + 1 for r in rows]
    sub = AttentionMetadata(
        is_prefill=False, slots=meta.slots.index_select(0, torch.tensor([starts[r] for r in rows], device=device)),
        block_tables=meta.block_tables.index_select(0, index),
        seq_lens=torch.tensor(lengths, dtype=torch.long, device=device), max_seq_len=max(lengths),
    )
    tokens = torch.tensor([starts[r] for r in rows], dtype=torch.long, device=device)
    return sub, tokens


def padded_decode(q, key_cache, value_cache, meta: AttentionMetadata, scale: float, window: int | None,
                  softcap: float | None = None, sinks: torch.Tensor | None = None,
                  kv_scales: KVScales | None = None):
    # q: [B, H, D]; caches: [blocks, block_size, KVH, D] -> [B, H, D]
    batch, heads, dim = q.shape
    kv_heads = key_cache.shape[2]
    bs = key_cache.shape[1]
    blocks_needed = (meta.max_seq_len + bs - 1) // bs
    length = blocks_needed * bs
    # index_select over the flattened table copies whole blocks; on CPU it is several times
    # faster than advanced indexing (cache[table]).
    index = meta.memo("padded_index", lambda: meta.block_tables[:, :blocks_needed].reshape(-1))
    # An fp8 cache's gathered copy is only widened; its scales fold into q (each KV head's query
    # heads) and the output, as the Triton kernels fold them: no pass of multiplies over the copy.
    k, v = key_cache.index_select(0, index), value_cache.index_select(0, index)
    v_fold = None
    if kv_scales is not None:
        (k, factor), (v, _) = widen(k, q.dtype), widen(v, q.dtype)  # the widened copy / factor
        if factor != 1.0 or not kv_scales.unit:
            group = heads // kv_heads
            q = (q.float() * (kv_scales.key * factor).repeat_interleave(group)[:, None]).to(q.dtype)
            v_fold = (kv_scales.value * factor).repeat_interleave(group)[:, None]
    k = k.view(batch, length, kv_heads, dim).transpose(1, 2)
    v = v.view(batch, length, kv_heads, dim).transpose(1, 2)

    def build_mask() -> torch.Tensor:
        pos = torch.arange(length, device=q.device)
        mask = pos[None, :] < meta.seq_lens[:, None]
        if window is not None:
            mask &= pos[None, :] >= (meta.seq_lens[:, None] - window)
        return mask[:, None, None, :]

    mask = meta.memo(("padded_mask", window), build_mask)
    out = sdpa(q.unsqueeze(2), k, v, mask, scale, softcap, sinks=sinks).squeeze(2)
    return out if v_fold is None else (out.float() * v_fold).to(out.dtype)


def padded_latent_decode(q: torch.Tensor, latent_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                         value_dim: int, kv_scales: KVScales | None = None) -> torch.Tensor:
    """`AttentionBackend.latent_decode` in torch: every sequence's latents gathered, padded to
    the longest, and one SDPA with a single shared KV "head" (values a view of the latents)."""
    # q: [B, H, W]; latent_cache: [blocks, block_size, 1, W] -> [B, H, value_dim]
    batch, heads, width = q.shape
    bs = latent_cache.shape[1]
    blocks_needed = (meta.max_seq_len + bs - 1) // bs
    length = blocks_needed * bs
    index = meta.memo("padded_index", lambda: meta.block_tables[:, :blocks_needed].reshape(-1))
    latents = read_cache(latent_cache.index_select(0, index), kv_scales, "key", q.dtype).view(batch, 1, length, width)

    def build_mask() -> torch.Tensor:
        pos = torch.arange(length, device=q.device)
        return (pos[None, :] < meta.seq_lens[:, None])[:, None, None, :]

    mask = meta.memo(("padded_mask", None), build_mask)
    return sdpa(q.unsqueeze(2), latents, latents[..., :value_dim], mask, scale).squeeze(2)


def _block_layout(meta: AttentionMetadata, block_size: int, device: torch.device):
    """Every (sequence, block) pair a decode step reads, flattened: the block ids, the row each
    belongs to and the block's index in its row. Sizes come from host-side lengths: no sync."""
    lengths = meta.memo("host_seq_lens", lambda: meta.seq_lens.tolist())
    counts = [(n + block_size - 1) // block_size for n in lengths]
    total = sum(counts)
    count_t = torch.tensor(counts, device=device)
    rows = torch.repeat_interleave(torch.arange(len(counts), device=device), count_t, output_size=total)
    starts = torch.cumsum(count_t, 0) - count_t
    index_in_row = torch.arange(total, device=device) - starts[rows]
    block_ids = meta.block_tables[rows, index_in_row]
    return block_ids, rows, index_in_row


def blockwise_decode(q, key_cache, value_cache, meta: AttentionMetadata, scale: float, window: int | None,
                     kv_scales: KVScales | None = None):
    # q: [B, H, D] -> [B, H, D]; reads each sequence's blocks once, no padding to the longest.
    batch, heads, dim = q.shape
    bs, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = heads // kv_heads
    block_ids, rows, index_in_row = meta.memo(("block_layout", bs), lambda: _block_layout(meta, bs, q.device))
    keys = read_cache(key_cache.index_select(0, block_ids), kv_scales, "key", torch.float32)  # [NB, bs, KVH, D]
    values = read_cache(value_cache.index_select(0, block_ids), kv_scales, "value", torch.float32)
    qb = q.view(batch, kv_heads, group, dim).index_select(0, rows).float()  # [NB, KVH, G, D]
    scores = torch.einsum("nkgd,nbkd->nkgb", qb, keys.float()) * scale  # [NB, KVH, G, bs]

    def build_valid() -> torch.Tensor:
        pos = index_in_row[:, None] * bs + torch.arange(bs, device=q.device)[None, :]  # [NB, bs]
        limit = meta.seq_lens.index_select(0, rows)[:, None]
        valid = pos < limit
        if window is not None:
            valid &= pos >= limit - window
        return valid[:, None, None, :]

    valid = meta.memo(("block_valid", window), build_valid)
    scores = scores.masked_fill(~valid, -math.inf)
    block_max = scores.amax(dim=-1)  # [NB, KVH, G]
    row_max = torch.full((batch, kv_heads, group), -math.inf, device=q.device)
    row_max = row_max.scatter_reduce(0, rows[:, None, None].expand_as(block_max), block_max, "amax")
    probs = torch.exp(scores - row_max.index_select(0, rows)[..., None])
    denom = torch.zeros(batch, kv_heads, group, device=q.device).index_add_(0, rows, probs.sum(-1))
    partial = torch.einsum("nkgb,nbkd->nkgd", probs, values.float())
    out = torch.zeros(batch, kv_heads, group, dim, device=q.device).index_add_(0, rows, partial)
    return (out / denom[..., None]).view(batch, heads, dim).to(q.dtype)


DEFAULT_BACKEND = TorchAttention()  # what a forward without a chosen backend (tools, tests) uses
