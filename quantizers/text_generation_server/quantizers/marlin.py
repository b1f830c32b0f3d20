"""Marlin and Marlin 2:4 checkpoints.

Who writes them: AutoGPTQ / GPTQModel (quant_method "gptq", checkpoint_format "marlin" or
"marlin_24", older files is_marlin_format: true), IST-DASLab's own tools and the checkpoints
TGI serves with `--quantize marlin` (quant_method "marlin"). Tensors per linear:
- marlin: B int32 [K/16, 2N], s float16 [G, N]
- marlin_24: B_24 int32 [K/32, N*bits/2], B_meta int16 [K/32, 2N], s float16 [G, N]
Always symmetric (implicit zero 2^(bits-1)), no act-order, group size -1 or 128 (the sizes
IST-DASLab Marlin, Sparse-Marlin and vLLM's gptq_marlin_24 accept); 4-bit, 2:4 also 8-bit.

Loading unpacks into the canonical QuantizedWeight, so every kernel serves these
checkpoints; the 2:4 structure is kept as a property of the codes, which a sparse kernel
uses where the device has one (kernels.marlin.Sparse24Weight).

Sharding reads, for each rank, the smallest window of whole layout blocks (16 input rows,
2:4: 32; 64 output columns) that covers its slice, unpacks the window and cuts the slice out
of the canonical form. Every permutation of the layout stays inside such a block, so this
is exact for every split the world size divides (also fused parts whose per-rank share is
not a multiple of 64 columns, which slicing the packed tensor directly would scramble), and a
rank reads at most one block beyond its share on each side instead of the whole tensor.

gptq_to_marlin / marlin_to_gptq / awq_to_marlin / marlin_to_awq repack checkpoint tensors
through the same canonical form (kernels.marlin holds the layout itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from text_generation_server.kernels import packing
from text_generation_server.kernels.base import QuantizedWeight
from text_generation_server.kernels.marlin import (
    BLOCK_N,
    TILE,
    MarlinPacked,
    marlin_to_quantized,
    quantized_to_marlin,
    sparse_24_weight,
    unpack_marlin24_weight,
    unpack_marlin_weight,
    unpermute_scales,
)
from text_generation_server.kernels.select import build_linear
from text_generation_server.quantizers.config import QuantizerConfig
from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.sharding import layer_kind, part_sizes
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights, WeightsLoader

FORMATS = ("marlin", "marlin_24")
FORMAT_BITS = {"marlin": (4,), "marlin_24": (4, 8)}
GROUP_SIZES = (-1, 128)


@dataclass(frozen=True)
class MarlinConfig(QuantizerConfig):
    method: ClassVar[str] = "marlin"
    bits: int = 4
    group_size: int = 128  # -1: one group over all of K
    checkpoint_format: str = "marlin"  # or "marlin_24"
    quant_method: str = "marlin"  # as the checkpoint says: "gptq" for AutoGPTQ / GPTQModel's Marlin layouts

    def __post_init__(self) -> None:
        if self.checkpoint_format not in FORMATS:
            raise CheckpointError(f"{self.source}: checkpoint format {self.checkpoint_format!r} is not a Marlin "
                                  f"format ({', '.join(FORMATS)})")
        if self.bits not in FORMAT_BITS[self.checkpoint_format]:
            raise CheckpointError(f"{self.source}: {self.bits}-bit {self.checkpoint_format} is not supported "
                                  f"(supported: {', '.join(map(str, FORMAT_BITS[self.checkpoint_format]))})")
        if self.group_size not in GROUP_SIZES:
            raise CheckpointError(f"{self.source}: group size {self.group_size} is not supported for "
                                  f"{self.checkpoint_format} (supported: -1, 128)")

    @property
    def sparse_24(self) -> bool:
        return self.checkpoint_format == "marlin_24"

    def describe(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        return f"marlin ({self.checkpoint_format}) {self.bits}-bit {group} sym"

    def accepts_flag(self, method: str) -> bool:
        """`--quantize gptq` on a checkpoint that says quant_method gptq, whatever its layout."""
        return method == self.quant_method

    @classmethod
    def from_config(cls, data: dict, source: str, prefix: str = "") -> "MarlinConfig":
        keys = ConfigReader(data, source, prefix)
        quant_method = (keys.str("quant_method", "gptq") or "gptq").lower()
        fmt = keys.str("checkpoint_format", aliases=("format",))
        if fmt is None:
            if keys.bool("is_marlin_format", False) or quant_method == "marlin":
                fmt = "marlin"
        if fmt not in FORMATS:
            raise keys.unsupported("checkpoint_format", fmt, quant_method, "marlin, marlin_24")
        # TGI's quant_method "marlin" configs may leave bits out: IST Marlin is 4-bit only.
        bits = keys.int("bits", 4 if quant_method == "marlin" else None)
        if bits not in FORMAT_BITS[fmt]:
            raise keys.unsupported("bits", bits, fmt, ", ".join(map(str, FORMAT_BITS[fmt])))
        group_size = keys.int("group_size", -1)
        if group_size not in GROUP_SIZES:
            raise keys.unsupported("group_size", group_size, fmt, "-1, 128")
        if not keys.bool("sym", True):
            raise keys.unsupported("sym", False, fmt, "true: Marlin codes have an implicit zero point")
        if keys.bool("desc_act", False):
            raise keys.unsupported("desc_act", True, fmt, "false: Marlin checkpoints store no g_idx")
        if keys.bool("lm_head", False):
            raise keys.unsupported("lm_head", True, fmt, "false: the head stays unquantized")
        return cls(source=source, bits=bits, group_size=group_size, checkpoint_format=fmt, quant_method=quant_method,
                   modules_to_not_convert=keys.names("modules_to_not_convert"))


@dataclass
class MarlinWeight:
    """One rank's Marlin (or Marlin 2:4) linear, already in the canonical form."""

    weight: QuantizedWeight
    sparse_24: bool
    prefix: str  # the checkpoint prefix(es), for errors
    layer: str = ""  # the kind of layer ("self_attn.o_proj"), for the kernel log
    act_dtype: torch.dtype = torch.float32
    device_type: str = "cpu"

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of this rank's partition, like a dense weight."""
        return self.weight.shape

    def to_quantized(self) -> QuantizedWeight:
        return self.weight

    def get_linear(self, bias: torch.Tensor | None) -> torch.nn.Module:
        weight = sparse_24_weight(self.weight) if self.sparse_24 else self.weight
        return build_linear(weight, bias, self.act_dtype, self.device_type, self.layer or self.prefix)


@dataclass(frozen=True)
class _Geometry:
    k: int
    n: int
    groups: int
    group_rows: int  # K for one group


class MarlinLoader(WeightsLoader):
    """Column layers split N, row layers split K; both read only the rank's window of layout blocks."""

    def __init__(self, config: MarlinConfig):
        self.config = config
        self.qweight = "B_24" if config.sparse_24 else "B"
        self.strip_rows = 2 * TILE if config.sparse_24 else TILE  # input rows per row of B / B_24

    def describe(self) -> str:
        return f"MarlinLoader({self.config.describe()})"

    # -- helpers ---------------------------------------------------------------------
    def _require(self, weights: Weights, name: str) -> list[int]:
        if not weights.has_tensor(name):
            raise CheckpointError(f"tensor '{name}' not found (in {weights.files_of(name.rpartition('.')[0])}): "
                                  f"every {self.config.checkpoint_format} linear stores it ({self.config.source})")
        return weights.get_shape(name)

    def _geometry(self, weights: Weights, prefix: str) -> _Geometry:
        c = self.config
        names = [self.qweight, "B_meta", "s"] if c.sparse_24 else [self.qweight, "s"]
        shapes = {name: self._require(weights, f"{prefix}.{name}") for name in names}
        where = f"(in {weights.files_of(prefix)})"
        s = shapes["s"]
        if len(s) != 2 or s[1] % BLOCK_N:
            raise CheckpointError(f"tensor '{prefix}.s' has shape {s}, expected [groups, N] with N a multiple of "
                                  f"{BLOCK_N} (the Marlin layout's column block) {where}")
        groups, n = s
        b = shapes[self.qweight]
        width = n * c.bits // 2  # 16 rows of codes per row of B, bits/32 words each
        if len(b) != 2 or b[1] != width:
            raise CheckpointError(f"tensor '{prefix}.{self.qweight}' has shape {b}, expected [K/{self.strip_rows}, "
                                  f"{width}] for N = {n} ('{prefix}.s') at bits = {c.bits} ({c.source}) {where}")
        k = b[0] * self.strip_rows
        if c.sparse_24 and shapes["B_meta"] != [b[0], 2 * n]:
            raise CheckpointError(f"tensor '{prefix}.B_meta' has shape {shapes['B_meta']}, expected [{b[0]}, "
                                  f"{2 * n}] to match '{prefix}.{self.qweight}' {b} {where}")
        if c.group_size != -1 and k % c.group_size:
            raise CheckpointError(f"tensor '{prefix}.{self.qweight}' {b} holds K = {k} input rows, not a multiple of "
                                  f"group_size = {c.group_size} ({c.source}) {where}")
        want = 1 if c.group_size == -1 else k // c.group_size
        if groups != want:
            raise CheckpointError(f"tensor '{prefix}.s' has {groups} groups, but K = {k} ('{prefix}.{self.qweight}' "
                                  f"{b}) with group_size = {c.group_size} ({c.source}) makes {want}: config and "
                                  f"tensors disagree {where}")
        return _Geometry(k=k, n=n, groups=groups, group_rows=k if c.group_size == -1 else c.group_size)

    def _window(self, weights: Weights, name: str, rows: slice, cols: slice,
                dtype: torch.dtype | None = None) -> torch.Tensor:
        """rows x cols of a 2-D tensor, reading nothing else; `dtype` None: any floating dtype."""
        tensor = weights.get_slice(name, (rows, cols))
        if (tensor.dtype != dtype) if dtype is not None else not tensor.dtype.is_floating_point:
            raise CheckpointError(f"tensor '{name}' must be {dtype or 'floating point'}, got {tensor.dtype} "
                                  f"(in {weights.files_of(name)})")
        return tensor

    def _read(self, weights: Weights, prefix: str, geo: _Geometry, k0: int, k1: int, n0: int,
              n1: int) -> QuantizedWeight:
        """Rows [k0, k1) x columns [n0, n1) of the canonical weight, from whole layout blocks only."""
        c, unit = self.config, self.strip_rows
        r0, r1 = k0 // unit, -(-k1 // unit)
        a0, a1 = n0 // BLOCK_N * BLOCK_N, -(-n1 // BLOCK_N) * BLOCK_N
        words = c.bits // 2  # int32 words per output column in one row of B / B_24
        b = self._window(weights, f"{prefix}.{self.qweight}", slice(r0, r1), slice(a0 * words, a1 * words),
                         torch.int32)
        try:
            if c.sparse_24:
                meta = self._window(weights, f"{prefix}.B_meta", slice(r0, r1), slice(2 * a0, 2 * a1), torch.int16)
                codes = unpack_marlin24_weight(b, meta, c.bits)
            else:
                codes = unpack_marlin_weight(b, c.bits)
        except ValueError as exc:
            raise CheckpointError(f"'{prefix}.{self.qweight}': {exc} (in {weights.files_of(prefix)})") from exc
        codes = codes[k0 - r0 * unit:k1 - r0 * unit, n0 - a0:n1 - a0].contiguous()
        g0, g1 = k0 // geo.group_rows, (k1 - 1) // geo.group_rows + 1
        s = self._window(weights, f"{prefix}.s", slice(g0, g1), slice(a0, a1)).float()
        scales = unpermute_scales(s, geo.groups > 1, c.sparse_24)[:, n0 - a0:n1 - a0]
        g_idx = (torch.arange(k0, k1, dtype=torch.int32, device=weights.device) // geo.group_rows - g0).to(torch.int32)
        return QuantizedWeight(qweight=codes, scales=scales.contiguous(), zeros=None, g_idx=g_idx, bits=c.bits,
                               group_size=geo.group_rows)

    def _weight(self, weights: Weights, prefix: str, parts: list[QuantizedWeight],
                prefixes: list[str] | None = None) -> MarlinWeight:
        first = parts[0]
        if len(parts) > 1:
            first = QuantizedWeight(qweight=torch.cat([p.qweight for p in parts], dim=1),
                                    scales=torch.cat([p.scales for p in parts], dim=1), zeros=None,
                                    g_idx=first.g_idx, bits=first.bits, group_size=first.group_size)
        return MarlinWeight(weight=first, sparse_24=self.config.sparse_24, prefix=prefix,
                            layer=layer_kind(prefixes or prefix), act_dtype=weights.dtype,
                            device_type=weights.device.type)

    def _column_share(self, weights: Weights, name: str, size: int) -> tuple[int, int]:
        world, rank = weights.process_group.size, weights.process_group.rank
        if size % world:
            raise CheckpointError(f"tensor '{name}': a part of {size} output features does not divide into "
                                  f"{world} shards (world size {world})")
        share = size // world
        return rank * share, (rank + 1) * share

    # -- WeightsLoader -----------------------------------------------------------------
    def get_weights(self, weights: Weights, prefix: str) -> MarlinWeight:
        geo = self._geometry(weights, prefix)
        return self._weight(weights, prefix, [self._read(weights, prefix, geo, 0, geo.k, 0, geo.n)])

    def get_weights_col_packed(self, weights: Weights, prefix: str, block_sizes: int | list[int]) -> MarlinWeight:
        geo = self._geometry(weights, prefix)
        parts, offset = [], 0
        for size in part_sizes(geo.n, block_sizes, f"{prefix}.s"):
            lo, hi = self._column_share(weights, f"{prefix}.s", size)
            parts.append(self._read(weights, prefix, geo, 0, geo.k, offset + lo, offset + hi))
            offset += size
        return self._weight(weights, prefix, parts)

    def get_multi_weights_col(self, weights: Weights, prefixes: list[str], dim: int) -> MarlinWeight:
        if dim != 0:
            raise ValueError(f"Marlin weights fuse along the output dimension (dim 0), not dim {dim}")
        parts, first = [], None
        for prefix in prefixes:
            geo = self._geometry(weights, prefix)
            if first is None:
                first = geo
            elif (geo.k, geo.groups) != (first.k, first.groups):
                raise CheckpointError(f"'{prefix}' ({geo.k} inputs, {geo.groups} groups) cannot be fused with "
                                      f"'{prefixes[0]}' ({first.k} inputs, {first.groups} groups)")
            lo, hi = self._column_share(weights, f"{prefix}.s", geo.n)
            parts.append(self._read(weights, prefix, geo, 0, geo.k, lo, hi))
        return self._weight(weights, "+".join(prefixes), parts, prefixes)

    def get_weights_row(self, weights: Weights, prefix: str) -> MarlinWeight:
        geo = self._geometry(weights, prefix)
        world, rank = weights.process_group.size, weights.process_group.rank
        if geo.k % world:
            raise CheckpointError(f"tensor '{prefix}.{self.qweight}': {geo.k} input features do not divide into "
                                  f"{world} shards (world size {world})")
        share = geo.k // world
        return self._weight(weights, prefix, [self._read(weights, prefix, geo, rank * share, (rank + 1) * share,
                                                         0, geo.n)])


# -- repacks between checkpoint formats, through the canonical form -------------------------------
def gptq_to_marlin(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                   bits: int, zero_offset: int = 1, group_size: int | None = None) -> MarlinPacked:
    """GPTQ tensors -> Marlin; symmetric checkpoints (every zero 2^(bits-1)) drop their zero points.

    zero_offset: 1 for checkpoint format "gptq" (v1 stores z - 1), 0 for "gptq_v2".
    """
    k, n = g_idx.shape[0], qweight.shape[1]
    codes = packing.unpack_gptq_qweight(qweight, bits, k)
    zeros = packing.unpack_gptq_qzeros(qzeros, bits, n).float() + zero_offset
    if bool((zeros == 2 ** (bits - 1)).all()):
        zeros = None
    if group_size is None:
        group_size = -(-k // scales.shape[0])
    return quantized_to_marlin(QuantizedWeight(qweight=codes, scales=scales.float(), zeros=zeros,
                                               g_idx=g_idx.to(torch.int32), bits=bits, group_size=group_size))


def marlin_to_gptq(packed: MarlinPacked, zero_offset: int = 1) -> dict[str, torch.Tensor]:
    """Marlin -> GPTQ tensors {qweight, qzeros, scales, g_idx} (v1 with zero_offset 1, v2 with 0)."""
    w = marlin_to_quantized(packed)
    stored = w.zero_points().round().to(torch.int64) - zero_offset
    if int(stored.min()) < 0:
        raise ValueError("a zero point of 0 cannot be stored in GPTQ v1 (it stores z - 1): use zero_offset=0")
    return {
        "qweight": packing.pack_gptq_qweight(w.qweight, packed.bits),
        "qzeros": packing.pack_gptq_qzeros(stored, packed.bits),
        "scales": w.scales.to(torch.float16),
        "g_idx": w.g_idx,
    }


def awq_to_marlin(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  group_size: int) -> MarlinPacked:
    """AWQ GEMM tensors (4-bit, zero points) -> Marlin with zp."""
    codes = packing.unpack_awq(qweight)
    k = codes.shape[0]
    g_idx = (torch.arange(k, dtype=torch.int32, device=codes.device) // group_size).to(torch.int32)
    return quantized_to_marlin(QuantizedWeight(qweight=codes, scales=scales.float(),
                                               zeros=packing.unpack_awq(qzeros).float(), g_idx=g_idx, bits=4,
                                               group_size=group_size))


def marlin_to_awq(packed: MarlinPacked) -> dict[str, torch.Tensor]:
    """Marlin (4-bit, natural groups) -> AWQ GEMM tensors {qweight, qzeros, scales}."""
    if packed.bits != 4 or packed.g_idx is not None:
        raise ValueError("AWQ GEMM stores 4-bit codes in natural group order")
    w = marlin_to_quantized(packed)
    return {"qweight": packing.pack_awq(w.qweight), "qzeros": packing.pack_awq(w.zero_points().round().to(torch.int64)),
            "scales": w.scales.to(torch.float16)}


CONFIGS = {"marlin": MarlinConfig}
LOADERS = {MarlinConfig: MarlinLoader}
