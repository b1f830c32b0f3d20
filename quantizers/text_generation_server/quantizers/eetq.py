"""EETQ: int8 weight-only, per-channel symmetric, quantized while a dense checkpoint loads.

W[n, k] ~= scales[n] * q[n, k] with q = round(W[n, k] * 127 / max_k |W[n, k]|) in [-127, 127]
and scales[n] = max_k |W[n, k]| / 127: the symmetric int8 grid of EETQ (FasterTransformer's
per-channel weight-only int8), and the same grid bitsandbytes' LLM.int8 stores (`SCB` is the
row absmax), which is why its int8 checkpoints reuse `ChannelInt8Weight` from here.

The weight runs as the canonical `QuantizedWeight` (8-bit codes, one group spanning K), so
build_linear picks torch's int8 weight-only kernel on CPU (`torch._weight_int8pack_mm`, the
"cpu-int8" kernel) or the reference where that kernel cannot run the shape.

Sharding: a column-parallel rank owns whole rows, so its scales are the unsharded ones. A
row-parallel rank owns K/world columns of every row, but the scale of a row depends on the
whole row: the loader reads the full rows (one shard-sized column chunk at a time) for their
absmax, so every rank quantizes on the unsharded grid and the sharded sum equals the
unsharded product.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from text_generation_server.kernels.base import QuantizedWeight
from text_generation_server.kernels.select import build_linear
from text_generation_server.quantizers.config import QuantizerConfig
from text_generation_server.quantizers.sharding import layer_kind, rank_rows
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights, WeightsLoader

INT8_MAX = 127


@dataclass(frozen=True)
class EetqConfig(QuantizerConfig):
    method: ClassVar[str] = "eetq"
    on_load: ClassVar[bool] = True

    def describe(self) -> str:
        return "eetq int8 weight-only per-channel symmetric (quantized on load)"

    @classmethod
    def from_config(cls, data: dict, source: str, prefix: str = "") -> "EetqConfig":
        raise CheckpointError(f"{source}: '{prefix}quant_method' = 'eetq': pre-quantized EETQ checkpoints are not yet "
                              "supported; load the dense checkpoint with --quantize eetq to quantize it on load")

    @classmethod
    def for_dense_checkpoint(cls, flag: str, folder: Path) -> "EetqConfig":
        return cls(source=f"--quantize {flag} (dense checkpoint {folder})")


@dataclass
class ChannelInt8Weight:
    """One rank's int8 weight with one scale per output channel: W = qweight * scales[:, None]."""

    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N]
    prefix: str
    layer: str = ""
    act_dtype: torch.dtype = torch.float32
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        if self.qweight.dtype != torch.int8 or self.qweight.dim() != 2:
            raise CheckpointError(f"'{self.prefix}': int8 weight must be 2-D int8, got "
                                  f"{self.qweight.dtype} {list(self.qweight.shape)}")
        if self.scales.shape != (self.qweight.shape[0],):
            raise CheckpointError(f"'{self.prefix}': {self.qweight.shape[0]} output channels but "
                                  f"{list(self.scales.shape)} scales")
        if not bool(torch.isfinite(self.scales).all()):
            raise CheckpointError(f"'{self.prefix}': per-channel scales are not all finite")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of this rank's partition."""
        return tuple(self.qweight.shape)  # type: ignore[return-value]

    def to_quantized(self) -> QuantizedWeight:
        """Canonical form: codes q + 128 (implied symmetric zero 128), one group spanning K."""
        n, k = self.qweight.shape
        codes = (self.qweight.t().to(torch.int16) + 128).to(torch.uint8)  # [K, N]
        return QuantizedWeight(qweight=codes, scales=self.scales.float().reshape(1, n), zeros=None,
                               g_idx=torch.zeros(k, dtype=torch.int32, device=self.qweight.device), bits=8,
                               group_size=max(k, 1))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.qweight.float() * self.scales.float()[:, None]).to(dtype)

    def get_linear(self, bias: torch.Tensor | None) -> torch.nn.Module:
        return build_linear(self.to_quantized(), bias, self.act_dtype, self.device_type, self.layer or self.prefix)


def quantize_rows(w: torch.Tensor, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and scales of `w` [N, K] on the grid of the given row absmax [N] (of the full rows).

    q = round(w * (127 / absmax)), bitsandbytes' rounding (int8_vectorwise_quant); an all-zero
    row gets scale 0 and codes 0 instead of NaN.
    """
    absmax = absmax.float()
    inv = torch.where(absmax > 0, INT8_MAX / absmax.clamp(min=torch.finfo(torch.float32).tiny), 0.0)
    q = torch.round(w.float() * inv[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, absmax / INT8_MAX


def dense_weight(weights: Weights, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Checks that a tensor quantized on load is a dense 2-D float weight."""
    if not tensor.is_floating_point() or tensor.dim() != 2 or tensor.element_size() < 2:
        raise CheckpointError(f"tensor '{name}' is {tensor.dtype} {list(tensor.shape)} (in {weights.files_of(name)}): "
                              "quantizing on load needs a dense float16/bfloat16/float32 [out, in] weight")
    return tensor


def matrix_shape(weights: Weights, name: str) -> tuple[int, int]:
    """(N, K) of a 2-D checkpoint tensor; CheckpointError naming the tensor when it is missing or not 2-D."""
    shape = weights.get_shape(name)
    if len(shape) != 2:
        raise CheckpointError(f"tensor '{name}' has shape {shape} (in {weights.files_of(name)}), "
                              "expected 2-D [out, in]")
    return shape[0], shape[1]


def read_block(weights: Weights, name: str, rows: slice = slice(None), cols: slice = slice(None)) -> torch.Tensor:
    """Rows x columns of a 2-D checkpoint tensor, reading only that block (safetensors slices), in its own dtype."""
    matrix_shape(weights, name)
    return weights.get_slice(name, (rows, cols))


def full_row_absmax(weights: Weights, name: str) -> torch.Tensor:
    """max |W[n, :]| over every column of the checkpoint tensor, read one rank-sized chunk at a time."""
    n, k = matrix_shape(weights, name)
    chunk = max(1, -(-k // weights.process_group.size))
    absmax = torch.zeros(n, dtype=torch.float32, device=weights.device)
    for start in range(0, k, chunk):
        part = dense_weight(weights, name, read_block(weights, name, cols=slice(start, min(k, start + chunk))))
        absmax = torch.maximum(absmax, part.float().abs().amax(dim=1))
    return absmax


class Int8OnLoadLoader(WeightsLoader):
    """Quantizes every dense linear to per-channel int8 as it loads (EETQ, bitsandbytes int8)."""

    def __init__(self, config: QuantizerConfig, label: str = "eetq"):
        self.config = config
        self.label = label

    def describe(self) -> str:
        return f"Int8OnLoadLoader({self.config.describe()})"

    def _weight(self, weights: Weights, prefix: str | list[str], w: torch.Tensor,
                absmax: torch.Tensor | None = None) -> ChannelInt8Weight:
        if absmax is None:
            absmax = w.float().abs().amax(dim=1)  # whole rows: this rank's absmax is the unsharded one
        q, scales = quantize_rows(w, absmax)
        label = prefix if isinstance(prefix, str) else "+".join(prefix)
        return ChannelInt8Weight(qweight=q, scales=scales, prefix=label, layer=layer_kind(prefix),
                                 act_dtype=weights.dtype, device_type=weights.device.type)

    def get_weights(self, weights: Weights, prefix: str) -> ChannelInt8Weight:
        name = f"{prefix}.weight"
        return self._weight(weights, prefix, dense_weight(weights, name, weights.get_tensor(name, to_dtype=False)))

    def get_weights_col_packed(self, weights: Weights, prefix: str, block_sizes: int | list[int]) -> ChannelInt8Weight:
        name = f"{prefix}.weight"
        w = weights.get_packed_sharded(name, dim=0, block_sizes=block_sizes, to_dtype=False)
        return self._weight(weights, prefix, dense_weight(weights, name, w))

    def get_multi_weights_col(self, weights: Weights, prefixes: list[str], dim: int) -> ChannelInt8Weight:
        if dim != 0:
            raise ValueError(f"{self.label} weights fuse along the output dimension (dim 0), not dim {dim}")
        parts = [dense_weight(weights, f"{p}.weight", weights.get_sharded(f"{p}.weight", dim=0, to_dtype=False))
                 for p in prefixes]
        if len({p.shape[1] for p in parts}) > 1:
            shapes = ", ".join(f"'{p}.weight' {list(t.shape)}" for p, t in zip(prefixes, parts))
            raise CheckpointError(f"tensors fused along dim 0 disagree in their input features: {shapes} "
                                  f"(in {weights.files_of(prefixes[0])})")
        return self._weight(weights, prefixes, torch.cat([p.float() for p in parts]))

    def get_weights_row(self, weights: Weights, prefix: str) -> ChannelInt8Weight:
        name = f"{prefix}.weight"
        if weights.process_group.size == 1:
            return self.get_weights(weights, prefix)
        k = matrix_shape(weights, name)[1]
        w = dense_weight(weights, name, read_block(weights, name, cols=rank_rows(weights, k, name)))
        return self._weight(weights, prefix, w, absmax=full_row_absmax(weights, name))


def _eetq_loader(config: EetqConfig) -> WeightsLoader:
    return Int8OnLoadLoader(config, "eetq")


CONFIGS: dict[str, type[QuantizerConfig]] = {"eetq": EetqConfig}
LOADERS = {EetqConfig: _eetq_loader}
