"""Rotary position embeddings in the Hugging Face Llama convention (rotate_half).

Supported scalings: none ("default"), "linear", and "llama3" (Llama 3.1's
frequency-dependent scaling). The cos/sin table is computed once in float32 at load for
every position the model supports, and cast once per compute dtype, so a step only
gathers rows by position: no allocation that grows with the context, and no host sync
when the caller passes the largest position (a decode step captured in a CUDA graph).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeConfig:
    head_dim: int
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0

    SUPPORTED = ("default", "linear", "llama3")

    def __post_init__(self) -> None:
        if self.rope_type not in self.SUPPORTED:
            raise ValueError(
                f"rope_scaling type '{self.rope_type}' is not supported (supported: {', '.join(self.SUPPORTED)})"
            )
        if self.factor <= 0:
            raise ValueError(f"rope_scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError("rope_scaling: high_freq_factor must be greater than low_freq_factor")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def inv_freq(self) -> torch.Tensor:
        dim = self.rotary_dim
        inv = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "llama3":
            old_len = self.original_max_position_embeddings
            low_wavelen = old_len / self.low_freq_factor
            high_wavelen = old_len / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv


def rope_config_from_hf(config: dict, head_dim: int) -> RopeConfig:
    """Reads rope settings from config.json (old `rope_scaling` or newer `rope_parameters`)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"config.json: rope_scaling must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    return RopeConfig(
        head_dim=head_dim,
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        partial_rotary_factor=float(config.get("partial_rotary_factor", 1.0)),
    )


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config: RopeConfig, max_positions: int, device: torch.device):
        super().__init__()
        if max_positions < 1:
            raise ValueError(f"rotary table needs at least one position, got {max_positions}")
        self.config = config
        self.max_positions = max_positions
        self.inv_freq = config.inv_freq().to(device)
        positions = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = torch.outer(positions, self.inv_freq)
        # sin is stored with the sign of rotate_half folded in: [-sin, sin], so rotation is
        # x * cos + roll(x, half) * signed_sin (see apply_rotary).
        self._cos32 = torch.cat([freqs, freqs], dim=-1).cos()
        self._sin32 = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {torch.float32: (self._cos32,
                                                                                              self._sin32)}

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos and signed-sin tables [max_positions, rotary_dim] in `dtype`, cast once."""
        cached = self._tables.get(dtype)
        if cached is None:
            cached = self._tables[dtype] = (self._cos32.to(dtype), self._sin32.to(dtype))
        return cached

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, max_position: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin: [tokens, 1, rotary_dim] in `dtype` for the given positions.

        max_position bounds `positions` (a host int the caller knows); without it the bound is
        read from the device (a sync: tools only, never the serving path).
        """
        if max_position is None:
            max_position = int(positions.max().item()) if positions.numel() else 0
        if max_position >= self.max_positions:
            raise ValueError(f"position {max_position} is past the rotary table of {self.max_positions} positions "
                             "(the model's max_position_embeddings)")
        cos, sin = self.tables(dtype)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF Llama's x * cos + rotate_half(x) * sin, with the sign of rotate_half inside `sin`."""
    # x: [tokens, heads, head_dim]; cos/sin: [tokens, 1, rotary_dim]
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return torch.addcmul(x * cos, x.roll(rot // 2, dims=-1), sin)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    rotated = torch.addcmul(x_rot * cos, x_rot.roll(rot // 2, dims=-1), sin)
    return torch.cat([rotated, x_pass], dim=-1)
