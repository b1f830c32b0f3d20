"""What every layer of one forward shares: positions, the KV cache, attention metadata, and
the rotary cos/sin computed once per rotary embedding (a model may have two: Gemma 3's local
and global layers)."""

from __future__ import annotations

import torch

from text_generation_server.layers.attention import AttentionMetadata, KVCache
from text_generation_server.layers.rotary import RotaryEmbedding


class ForwardContext:
    def __init__(self, positions: torch.Tensor, cache: KVCache, meta: AttentionMetadata, dtype: torch.dtype,
                 seq_lens: torch.Tensor | None = None):
        # positions: [tokens]; seq_lens: [tokens], each token's sequence length in this forward
        # (length-dependent rope only; None: position + 1)
        self.positions = positions
        self.cache = cache
        self.meta = meta
        self.dtype = dtype
        self.seq_lens = seq_lens
        self._rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin [tokens, 1, rotary_dim] for `rotary`, computed by the first layer asking."""
        key = id(rotary)
        found = self._rope.get(key)
        if found is None:
            found = self._rope[key] = rotary.cos_sin(self.positions, self.dtype, self.meta.max_position,
                                                     self.seq_lens)
        return found
