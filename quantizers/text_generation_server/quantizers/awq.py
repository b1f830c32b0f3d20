"""AWQ (GEMM) checkpoints: qweight and qzeros packed along N with interleaved nibbles.

Layout (specs/formats.md): qweight int32 [K, N/8], qzeros int32 [K/g, N/8],
scales [K/g, N]; nibble i of word j holds column 8j + [0,2,4,6,1,3,5,7][i];
W = (q - z) * s with no zero-point offset. There is no act-order, so row k is in
group k // g.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from text_generation_server.kernels import packing
from text_generation_server.kernels.base import QuantizedWeight
from text_generation_server.kernels.select import build_linear
from text_generation_server.quantizers.config import AWQConfig
from text_generation_server.quantizers.sharding import (
    check_g_idx,
    layer_kind,
    natural_g_idx,
    part_sizes,
    rank_rows,
    shard_packed,
    trim_groups,
)
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights, WeightsLoader

PACK = 8  # 4-bit codes per int32 word


@dataclass
class AWQWeight:
    """One rank's AWQ linear, still packed as the checkpoint stores it."""

    qweight: torch.Tensor  # int32 [K, N/8]
    qzeros: torch.Tensor  # int32 [G, N/8]
    scales: torch.Tensor  # [G, N]
    g_idx: torch.Tensor  # int32 [K]: k // group_size, renumbered from 0 on row shards
    group_size: int
    prefix: str
    layer: str = ""
    act_dtype: torch.dtype = torch.float32
    device_type: str = "cpu"
    bits: int = 4

    def __post_init__(self) -> None:
        p = self.prefix
        for name in ("qweight", "qzeros"):
            t = getattr(self, name)
            if t.dtype != torch.int32 or t.dim() != 2:
                raise CheckpointError(f"tensor '{p}.{name}' must be 2-D int32, got {t.dtype} {list(t.shape)}")
        k, words = self.qweight.shape
        n = words * PACK
        if self.scales.dim() != 2 or self.scales.shape[1] != n:
            raise CheckpointError(f"tensor '{p}.scales' has shape {list(self.scales.shape)}, expected [groups, {n}] "
                                  f"to match '{p}.qweight' {list(self.qweight.shape)} (8 columns per word)")
        groups = self.scales.shape[0]
        if list(self.qzeros.shape) != [groups, words]:
            raise CheckpointError(f"tensor '{p}.qzeros' has shape {list(self.qzeros.shape)}, expected "
                                  f"[{groups}, {words}] to match '{p}.scales' and '{p}.qweight'")
        if self.g_idx.shape != (k,):
            raise CheckpointError(f"'{p}': {k} input rows in qweight but g_idx of shape {list(self.g_idx.shape)}")
        check_g_idx(self.g_idx, groups, f"{p} (k // group_size)", f"{p}.scales")

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[1], self.qweight.shape[0]

    def to_quantized(self) -> QuantizedWeight:
        codes = packing.unpack_awq(self.qweight)  # uint8 [K, N]
        zeros = packing.unpack_awq(self.qzeros).float()  # [G, N]
        return QuantizedWeight(qweight=codes, scales=self.scales.float(), zeros=zeros, g_idx=self.g_idx,
                               bits=4, group_size=self.group_size)

    def get_linear(self, bias: torch.Tensor | None) -> torch.nn.Module:
        return build_linear(self.to_quantized(), bias, self.act_dtype, self.device_type, self.layer or self.prefix)


class AWQLoader(WeightsLoader):
    """Column layers split whole words of qweight/qzeros (8 columns each); row layers split K."""

    def __init__(self, config: AWQConfig):
        self.config = config

    def describe(self) -> str:
        return f"AWQLoader({self.config.describe()})"

    def _check(self, weights: Weights, prefix: str) -> tuple[int, int]:
        for name in ("qweight", "qzeros", "scales"):
            if not weights.has_tensor(f"{prefix}.{name}"):
                raise CheckpointError(f"tensor '{prefix}.{name}' not found (in {weights.files_of(prefix)})")
        k = weights.get_shape(f"{prefix}.qweight")[0]
        groups, n = weights.get_shape(f"{prefix}.scales")
        g = self.config.group_size
        if k % g != 0 or groups != k // g:
            raise CheckpointError(
                f"tensor '{prefix}.scales' has {groups} groups, but K = {k} with group_size = {g} "
                f"({self.config.source}) needs {k / g:g}: config and tensors disagree"
            )
        return k, n

    def _weight(self, weights: Weights, prefix: str, qweight, qzeros, scales, g_idx, layer: str) -> AWQWeight:
        return AWQWeight(qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx,
                         group_size=self.config.group_size, prefix=prefix, layer=layer,
                         act_dtype=weights.dtype, device_type=weights.device.type)

    def get_weights(self, weights: Weights, prefix: str) -> AWQWeight:
        k, _ = self._check(weights, prefix)
        return self._weight(weights, prefix, weights.get_tensor(f"{prefix}.qweight"),
                            weights.get_tensor(f"{prefix}.qzeros"),
                            weights.get_tensor(f"{prefix}.scales", to_dtype=False),
                            natural_g_idx(k, self.config.group_size, weights.device), layer_kind(prefix))

    def get_weights_col_packed(self, weights: Weights, prefix: str, block_sizes: int | list[int]) -> AWQWeight:
        k, n = self._check(weights, prefix)
        sizes = part_sizes(n, block_sizes, f"{prefix}.scales")
        qweight = shard_packed(weights, f"{prefix}.qweight", 1, sizes, 4, "output features")
        qzeros = shard_packed(weights, f"{prefix}.qzeros", 1, sizes, 4, "output features")
        scales = weights.get_packed_sharded(f"{prefix}.scales", dim=1, block_sizes=sizes, to_dtype=False)
        return self._weight(weights, prefix, qweight, qzeros, scales,
                            natural_g_idx(k, self.config.group_size, weights.device), layer_kind(prefix))

    def get_multi_weights_col(self, weights: Weights, prefixes: list[str], dim: int) -> AWQWeight:
        if dim != 0:
            raise ValueError(f"AWQ weights fuse along the output dimension (dim 0), not dim {dim}")
        parts = [self.get_weights_col(weights, p) for p in prefixes]
        for prefix, part in zip(prefixes, parts):
            if part.shape[1] != parts[0].shape[1]:
                raise CheckpointError(f"'{prefix}' has {part.shape[1]} inputs, '{prefixes[0]}' has "
                                      f"{parts[0].shape[1]}: they cannot be fused")
        return AWQWeight(
            qweight=torch.cat([p.qweight for p in parts], dim=1), qzeros=torch.cat([p.qzeros for p in parts], dim=1),
            scales=torch.cat([p.scales for p in parts], dim=1), g_idx=parts[0].g_idx,
            group_size=self.config.group_size, prefix="+".join(prefixes), layer=layer_kind(prefixes),
            act_dtype=weights.dtype, device_type=weights.device.type,
        )

    def get_weights_row(self, weights: Weights, prefix: str) -> AWQWeight:
        k, _ = self._check(weights, prefix)
        rows = rank_rows(weights, k, f"{prefix}.qweight")
        qweight = weights.get_sharded(f"{prefix}.qweight", dim=0)  # K is not packed in AWQ
        g_idx = natural_g_idx(k, self.config.group_size, weights.device)[rows]
        # A group that straddles two ranks is kept by both, so every row keeps its own scale.
        g_idx, (scales, qzeros) = trim_groups(g_idx, [
            (weights.get_tensor(f"{prefix}.scales", to_dtype=False), 0),
            (weights.get_tensor(f"{prefix}.qzeros"), 0),
        ])
        return self._weight(weights, prefix, qweight, qzeros, scales, g_idx, layer_kind(prefix))
