"""Paged KV cache and attention over it.

The cache of each layer is [num_blocks, block_size, kv_heads, head_dim] for keys
and values. A token's K/V lives at a *slot* (block_id * block_size + offset); a
request's block table lists its blocks in order. The router (or the model itself
when no router hands blocks in) decides blocks and slots; attention only reads
them. Written with plain torch ops, so the same code runs on CPU and CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


class KVCache:
    """Per-layer key and value block pools."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache needs at least one block of size >= 1 (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def store(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        # key/value: [tokens, kv_heads, head_dim]; slots: [tokens]
        k = self.keys[layer]
        v = self.values[layer]
        k.view(-1, k.shape[2], k.shape[3]).index_copy_(0, slots, key.to(k.dtype))
        v.view(-1, v.shape[2], v.shape[3]).index_copy_(0, slots, value.to(v.dtype))


@dataclass
class AttentionMetadata:
    """What attention needs to know about the batch of one forward pass.

    Prefill: `cu_seqlens` [B+1] over the flattened new tokens (no cached prefix).
    Decode: one new token per sequence; `block_tables` [B, max_blocks] and
    `seq_lens` [B] (tokens in cache after this step, the new one included).
    """

    is_prefill: bool
    slots: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    prefill_lens: list[int] | None = None
    block_tables: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    max_seq_len: int = 0
    _decode_index: torch.Tensor | None = None
    _masks: dict = field(default_factory=dict)

    def decode_gather_index(self, block_size: int) -> tuple[torch.Tensor, int]:
        """Flattened block ids covering max_seq_len, shared by every layer of the step."""
        blocks_needed = (self.max_seq_len + block_size - 1) // block_size
        if self._decode_index is None:
            self._decode_index = self.block_tables[:, :blocks_needed].reshape(-1)
        return self._decode_index, blocks_needed * block_size

    def decode_mask(self, length: int, window: int | None) -> torch.Tensor:
        """[B, 1, 1, length] key mask, built once per step for each window size in use."""
        mask = self._masks.get(window)
        if mask is None:
            pos = torch.arange(length, device=self.seq_lens.device)
            mask = pos[None, :] < self.seq_lens[:, None]
            if window is not None:
                mask &= pos[None, :] >= (self.seq_lens[:, None] - window)
            mask = mask[:, None, None, :]
            self._masks[window] = mask
        return mask


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lens: list[int],
    scale: float,
    window: int | None,
) -> torch.Tensor:
    # q: [tokens, heads, D], k/v: [tokens, kv_heads, D] -> [tokens, heads, D]
    heads, kv_heads = q.shape[1], k.shape[1]
    gqa = heads != kv_heads
    out = torch.empty_like(q)
    start = 0
    for length in lens:
        end = start + length
        qs = q[start:end].transpose(0, 1)
        ks = k[start:end].transpose(0, 1)
        vs = v[start:end].transpose(0, 1)
        if window is not None and window < length:
            pos = torch.arange(length, device=q.device)
            diff = pos[:, None] - pos[None, :]
            mask = (diff >= 0) & (diff < window)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        out[start:end] = o.transpose(0, 1)
        start = end
    return out


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    # q: [B, heads, D]; caches: [blocks, block_size, kv_heads, D] -> [B, heads, D]
    batch, heads, dim = q.shape
    kv_heads = key_cache.shape[2]
    # index_select over the flattened table copies whole blocks; on CPU it is several times
    # faster than advanced indexing (cache[table]), and this gather is the largest copy of a step.
    index, length = meta.decode_gather_index(key_cache.shape[1])
    k = key_cache.index_select(0, index).view(batch, length, kv_heads, dim).transpose(1, 2)
    v = value_cache.index_select(0, index).view(batch, length, kv_heads, dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=meta.decode_mask(length, window), scale=scale,
        enable_gqa=heads != kv_heads,
    )
    return out.squeeze(2)
