"""GPTQ checkpoints: qweight packed along K, qzeros packed along N, g_idx per input row.

Layout (specs/formats.md): qweight int32 [K*b/32, N], qzeros int32 [G, N*b/32],
scales [G, N], g_idx int32 [K]; W[k, n] = scales[g, n] * (q[k, n] - z[g, n]) with
g = g_idx[k]. Format "gptq" (v1) writers store z - 1, so one is added back;
"gptq_v2" stores z itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from text_generation_server.kernels import packing
from text_generation_server.kernels.base import QuantizedWeight
from text_generation_server.kernels.select import build_linear
from text_generation_server.quantizers.config import GPTQConfig
from text_generation_server.quantizers.sharding import (
    check_g_idx,
    layer_kind,
    natural_g_idx,
    packing_unit,
    part_sizes,
    rank_rows,
    shard_packed,
    shard_rows_packed,
    trim_groups,
)
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights, WeightsLoader


@dataclass
class GPTQWeight:
    """One rank's GPTQ linear, still packed as the checkpoint stores it."""

    qweight: torch.Tensor  # int32 [K*bits/32, N]
    qzeros: torch.Tensor  # int32 [G, N*bits/32]
    scales: torch.Tensor  # [G, N]
    g_idx: torch.Tensor  # int32 [K], values in [0, G)
    bits: int
    group_size: int  # -1: one group over all of K
    zero_offset: int  # 1 for v1 checkpoints
    sym: bool
    prefix: str  # the checkpoint prefix(es), for errors
    layer: str = ""  # the kind of layer ("self_attn.o_proj"), for the kernel log
    act_dtype: torch.dtype = torch.float32
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        p = self.prefix
        if self.bits not in (2, 3, 4, 8):
            raise CheckpointError(f"'{p}': {self.bits}-bit GPTQ is not yet supported (supported: 2, 3, 4, 8)")
        for name in ("qweight", "qzeros"):
            t = getattr(self, name)
            if t.dtype != torch.int32 or t.dim() != 2:
                raise CheckpointError(f"tensor '{p}.{name}' must be 2-D int32, got {t.dtype} {list(t.shape)}")
        values, words = packing_unit(self.bits)
        rows, n = self.qweight.shape
        if rows % words != 0:
            raise CheckpointError(
                f"tensor '{p}.qweight' has {rows} rows, not a multiple of {words} for {self.bits}-bit"
            )
        k = rows // words * values
        if self.g_idx.shape != (k,):
            raise CheckpointError(f"tensor '{p}.g_idx' has shape {list(self.g_idx.shape)}, but '{p}.qweight' "
                                  f"{list(self.qweight.shape)} holds {k} input rows at {self.bits} bits")
        if self.scales.dim() != 2 or self.scales.shape[1] != n:
            raise CheckpointError(f"tensor '{p}.scales' has shape {list(self.scales.shape)}, expected "
                                  f"[groups, {n}] to match '{p}.qweight' {list(self.qweight.shape)}")
        groups = self.scales.shape[0]
        if n % values != 0 or list(self.qzeros.shape) != [groups, n // values * words]:
            raise CheckpointError(f"tensor '{p}.qzeros' has shape {list(self.qzeros.shape)}, expected "
                                  f"[{groups}, {n * self.bits // 32}] for {n} columns at {self.bits} bits")
        check_g_idx(self.g_idx, groups, f"{p}.g_idx", f"{p}.scales")
        if self.sym:
            implied = 2 ** (self.bits - 1)
            stored = packing.unpack_gptq_qzeros(self.qzeros, self.bits, n).to(torch.int32) + self.zero_offset
            if not bool((stored == implied).all()):
                raise CheckpointError(
                    f"tensor '{p}.qzeros' holds zero points other than {implied}, but the config says sym: true "
                    f"(a symmetric {'v1' if self.zero_offset else 'v2'} checkpoint stores {implied - self.zero_offset})"
                )

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of this rank's partition, like a dense weight."""
        return self.qweight.shape[1], self.g_idx.shape[0]

    def to_quantized(self) -> QuantizedWeight:
        """Unpacks into the canonical form every kernel starts from."""
        k = self.g_idx.shape[0]
        codes = packing.unpack_gptq_qweight(self.qweight, self.bits, k)  # uint8 [K, N]
        zeros = None  # symmetric: implied 2^(bits-1), checked at construction
        if not self.sym:
            zeros = packing.unpack_gptq_qzeros(self.qzeros, self.bits, self.qweight.shape[1]).float() + self.zero_offset
        group_size = k if self.group_size == -1 else self.group_size
        return QuantizedWeight(qweight=codes, scales=self.scales.float(), zeros=zeros, g_idx=self.g_idx,
                               bits=self.bits, group_size=group_size)

    def get_linear(self, bias: torch.Tensor | None) -> torch.nn.Module:
        return build_linear(self.to_quantized(), bias, self.act_dtype, self.device_type, self.layer or self.prefix)


class GPTQLoader(WeightsLoader):
    """Column layers split N (qzeros by whole words), row layers split K (qweight by whole words)."""

    def __init__(self, config: GPTQConfig):
        self.config = config

    def describe(self) -> str:
        return f"GPTQLoader({self.config.describe()})"

    # -- helpers ---------------------------------------------------------------------
    def _k(self, weights: Weights, prefix: str) -> int:
        """K from qweight's rows at the configured bits, cross-checked against g_idx."""
        values, words = packing_unit(self.config.bits)
        rows = weights.get_shape(f"{prefix}.qweight")[0]
        if rows % words != 0:
            raise CheckpointError(f"tensor '{prefix}.qweight' has {rows} rows, not a multiple of {words} for "
                                  f"bits = {self.config.bits} ({self.config.source})")
        k = rows // words * values
        if weights.has_tensor(f"{prefix}.g_idx"):
            k_idx = weights.get_shape(f"{prefix}.g_idx")[0]
            if k_idx != k:
                raise CheckpointError(
                    f"tensor '{prefix}.qweight' has {rows} rows, which is K = {k} at bits = {self.config.bits} "
                    f"({self.config.source}), but '{prefix}.g_idx' has {k_idx} entries: config and tensors disagree"
                )
        return k

    def _g_idx(self, weights: Weights, prefix: str, k: int) -> torch.Tensor:
        name = f"{prefix}.g_idx"
        if weights.has_tensor(name):
            return weights.get_tensor(name).to(torch.int32)
        if self.config.desc_act:
            raise CheckpointError(f"tensor '{name}' not found (in {weights.files_of(prefix)}), but desc_act is "
                                  f"true in {self.config.source}: act-order checkpoints must store g_idx")
        return natural_g_idx(k, self.config.group_size, weights.device)

    def _check_groups(self, weights: Weights, prefix: str, k: int) -> int:
        for name in ("qzeros", "scales"):
            if not weights.has_tensor(f"{prefix}.{name}"):
                raise CheckpointError(f"tensor '{prefix}.{name}' not found (in {weights.files_of(prefix)}): "
                                      "every GPTQ linear stores it, symmetric or not")
        groups = weights.get_shape(f"{prefix}.scales")[0]
        g = self.config.group_size
        want = 1 if g == -1 else -(-k // g)
        if groups != want:
            raise CheckpointError(
                f"tensor '{prefix}.scales' has {groups} groups, but K = {k} with group_size = {g} "
                f"({self.config.source}) makes {want}: config and tensors disagree"
            )
        return groups

    def _weight(self, weights: Weights, prefix: str, qweight, qzeros, scales, g_idx) -> GPTQWeight:
        c = self.config
        return GPTQWeight(qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx, bits=c.bits,
                          group_size=c.group_size, zero_offset=c.zero_offset, sym=c.sym, prefix=prefix,
                          layer=layer_kind(prefix), act_dtype=weights.dtype, device_type=weights.device.type)

    # -- WeightsLoader -----------------------------------------------------------------
    def get_weights(self, weights: Weights, prefix: str) -> GPTQWeight:
        k = self._k(weights, prefix)
        self._check_groups(weights, prefix, k)
        return self._weight(weights, prefix, weights.get_tensor(f"{prefix}.qweight"),
                            weights.get_tensor(f"{prefix}.qzeros"),
                            weights.get_tensor(f"{prefix}.scales", to_dtype=False), self._g_idx(weights, prefix, k))

    def get_weights_col_packed(self, weights: Weights, prefix: str, block_sizes: int | list[int]) -> GPTQWeight:
        k = self._k(weights, prefix)
        self._check_groups(weights, prefix, k)
        n = weights.get_shape(f"{prefix}.scales")[1]
        sizes = part_sizes(n, block_sizes, f"{prefix}.scales")
        qweight = weights.get_packed_sharded(f"{prefix}.qweight", dim=1, block_sizes=sizes)
        scales = weights.get_packed_sharded(f"{prefix}.scales", dim=1, block_sizes=sizes, to_dtype=False)
        qzeros = shard_packed(weights, f"{prefix}.qzeros", 1, sizes, self.config.bits, "output features")
        return self._weight(weights, prefix, qweight, qzeros, scales, self._g_idx(weights, prefix, k))

    def get_multi_weights_col(self, weights: Weights, prefixes: list[str], dim: int) -> GPTQWeight:
        if dim != 0:
            raise ValueError(f"GPTQ weights fuse along the output dimension (dim 0), not dim {dim}")
        parts = [self.get_weights_col(weights, p) for p in prefixes]
        first = parts[0]  # each part's qzeros is whole words (checked on construction), so they concatenate
        for prefix, part in zip(prefixes, parts):
            if part.shape[1] != first.shape[1] or part.scales.shape[0] != first.scales.shape[0]:
                raise CheckpointError(
                    f"'{prefix}' ({part.shape[1]} inputs, {part.scales.shape[0]} groups) cannot be fused with "
                    f"'{prefixes[0]}' ({first.shape[1]} inputs, {first.scales.shape[0]} groups)"
                )
            if not torch.equal(part.g_idx, first.g_idx):
                raise CheckpointError(
                    f"tensor '{prefix}.g_idx' differs from '{prefixes[0]}.g_idx': layers fused into one matmul "
                    "must share their act-order"
                )
        return GPTQWeight(
            qweight=torch.cat([p.qweight for p in parts], dim=1), qzeros=torch.cat([p.qzeros for p in parts], dim=1),
            scales=torch.cat([p.scales for p in parts], dim=1), g_idx=first.g_idx, bits=first.bits,
            group_size=first.group_size, zero_offset=first.zero_offset, sym=first.sym,
            prefix="+".join(prefixes), layer=layer_kind(prefixes), act_dtype=first.act_dtype,
            device_type=first.device_type,
        )

    def get_weights_row(self, weights: Weights, prefix: str) -> GPTQWeight:
        k = self._k(weights, prefix)
        groups = self._check_groups(weights, prefix, k)
        qweight = shard_rows_packed(weights, f"{prefix}.qweight", k, self.config.bits)
        g_idx = self._g_idx(weights, prefix, k)
        check_g_idx(g_idx, groups, f"{prefix}.g_idx", f"{prefix}.scales")
        g_idx = g_idx[rank_rows(weights, k, f"{prefix}.qweight")]
        # Scales and zeros of the groups this rank's rows use (all of them under act-order).
        g_idx, (scales, qzeros) = trim_groups(g_idx, [
            (weights.get_tensor(f"{prefix}.scales", to_dtype=False), 0),
            (weights.get_tensor(f"{prefix}.qzeros"), 0),
        ])
        return self._weight(weights, prefix, qweight, qzeros, scales, g_idx)
