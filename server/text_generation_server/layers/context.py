"""What every layer of one forward shares: positions, the KV cache, attention metadata, the
rotary cos/sin computed once per rotary embedding (a model may have two: Gemma 3's local
and global layers), and the phase the linear kernels see (kernels/phase.py)."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from text_generation_server.kernels.phase import forward_phase
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
            positions = self.positions
            if (positions.device.type == "cpu" and positions.shape[0] == 1 and not self.meta.is_prefill
                    and not torch._C._is_torch_function_mode_enabled()):
                # one decode row on the CPU: from the rotary's blocks (RotaryEmbedding.decode_cos_sin says
                # why). Not under a torch function mode: the CUDA-graph emulation's guard (engine/cuda_graphs.py)
                # records a forward that must read no position on the host, as a real graph replays any.
                position, bound = int(positions[0]), self.meta.max_position
                if position <= bound < rotary.max_positions:  # else cos_sin raises as it does
                    found = rotary.decode_cos_sin(position, self.dtype)
            if found is None:
                found = rotary.cos_sin(positions, self.dtype, self.meta.max_position, self.seq_lens)
            self._rope[key] = found
        return found

    def kernel_phase(self) -> AbstractContextManager[None]:
        """Run the layers inside this: kernels then take one path for every row count of a prompt,
        so a prompt computed in chunks or after a cached prefix gets the bits it gets computed
        whole, and decoding rows that ride along take their decode path (kernels/phase.py)."""
        return forward_phase(self.meta.is_prefill, self.meta.decode_rows, int(self.positions.shape[0]))
