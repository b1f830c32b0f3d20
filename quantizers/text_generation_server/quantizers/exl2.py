"""EXL2 (exllamav2) checkpoints: per-group bit widths, act-order rows, 4-bit scale codes.

Layout (specs/formats.md; exllamav2 `conversion/adaptivegptq.py` pack(), `pack_tensor.cu`):
- q_weight int32 [R, N]: input rows in act-order (stored row j is original row q_perm[j];
  original row k is stored at q_invperm[k]). Groups follow each other down the rows, each
  with its own width b in {2, 3, 4, 5, 6, 8}, packed as one least-significant-first bit
  stream that starts on a word boundary (32 codes in 3 words at 3 bits, 32 in 5 at 5 bits).
- q_groups int16 [2G]: (width, first q_weight row) per group. A group's input-row count is
  its words * 32 / width; the last group takes the remaining K rows (K = len(q_invperm)).
- q_scale int32 [G, N/8]: 4-bit codes, column 8j+i in nibble i of word j, storing qs - 1;
  q_scale_max fp16 [G]. scale = (qs)^2 * q_scale_max / 256; w = (q - 2^(b-1)) * scale.
- N is padded to a multiple of 32 by the converter; padded columns dequantize to zero.

Canonical form. `QuantizedWeight` has one code width, EXL2 has one per group. Every EXL2
code is symmetric about 2^(b-1), so it is re-centred on a common width B at least as wide as
every group: q' = q - 2^(b-1) + 2^(B-1) in [0, 2^B), zero point 2^(B-1) (no zeros tensor).
That is exact for any B >= the widest group, and kernels see a plain symmetric B-bit weight
with act-order g_idx. B is 4 when no group is wider than 4 bits and 8 otherwise: those are
the widths the compact kernels run (cpu-int4pack takes 2- and 3-bit codes only as a subset
of 4-bit ones; 5- and 6-bit codes have no kernel of their own). A layer with 5- to 8-bit
groups runs as 8-bit codes: on CUDA the Triton kernel keeps them packed; on CPU, where
torch's int8 op takes only per-channel scales, it lands on the dense reference (speed
first) or, with `reference` disabled, on marlin-layout (8 bits per weight).
Per-group zero points at each group's own 2^(b-1) would be exact too, but cost a [G, N]
zeros tensor and the asymmetric kernel path for nothing.

Scales are what exllamav2 computes and quantizes against, in fp16: q_scale_max * 2^-8
rounded to fp16 (ext.py make_q_matrix, in place on the fp16 tensor), then times qs^2 and
rounded again (qdq_util.cuh dq_scale). For small q_scale_max the first product is an fp16
subnormal, so the rounding is visible; the codes were chosen against exactly these values.

Sharding. Columns split N by slicing q_weight's columns (not packed along N) and the decoded
scales; rows split K in original order: each rank unpacks the whole tensor, takes its rows
through q_invperm and keeps only the groups those rows use. Both are exact at any world size
that divides the dimension; TGI refuses EXL2 when sharded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch

from text_generation_server.kernels import packing
from text_generation_server.kernels.base import QuantizedWeight
from text_generation_server.kernels.select import build_linear
from text_generation_server.quantizers.config import QuantizerConfig
from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.sharding import layer_kind, part_sizes, rank_rows
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import DefaultWeightsLoader, Weights, WeightsLoader

WIDTHS = (2, 3, 4, 5, 6, 8)  # exllamav2 packs these widths only (pack_columns_kernel)
HEAD_BITS = (2, 3, 4, 5, 6, 8, 16)  # convert_exl2.py head options; 16: head left fp16
COLUMN_PAD = 32  # the converter pads N to a multiple of this (adaptivegptq.py pack())
REQUIRED = ("q_weight", "q_scale", "q_scale_max", "q_groups")


@dataclass(frozen=True)
class Exl2Config(QuantizerConfig):
    """What exllamav2's converter writes: the averages it aimed for; each tensor carries its own layout."""

    method: ClassVar[str] = "exl2"
    bits: float | None = None  # average bits per weight of the decoder layers
    head_bits: int | None = None
    version: str | None = None

    def describe(self) -> str:
        parts = ["exl2"]
        if self.bits is not None:
            parts.append(f"{self.bits:g} bpw")
        if self.head_bits is not None:
            parts.append(f"head {self.head_bits}-bit")
        if self.version:
            parts.append(f"(exllamav2 {self.version})")
        return " ".join(parts)

    @classmethod
    def from_config(cls, data: dict, source: str, prefix: str = "") -> "Exl2Config":
        keys = ConfigReader(data, source, prefix)
        bits = data.get("bits")
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, (int, float)) or bits <= 0):
            raise CheckpointError(f"{keys.where('bits')} must be a positive number (average bits per weight), "
                                  f"got {bits!r}")
        head_bits = keys.int("head_bits") if keys.has("head_bits") else None
        if head_bits is not None and head_bits not in HEAD_BITS:
            raise keys.unsupported("head_bits", head_bits, "exl2", ", ".join(map(str, HEAD_BITS)))
        version = data.get("version")
        return cls(source=source, bits=None if bits is None else float(bits), head_bits=head_bits,
                   version=None if version is None else str(version),
                   modules_to_not_convert=keys.names("modules_to_not_convert"))


class Group(NamedTuple):
    bits: int
    word: int  # first q_weight row
    words: int
    rows: int  # input rows (stored order)


def read_groups(q_groups: torch.Tensor, q_weight_rows: int, k: int, prefix: str) -> list[Group]:
    """The group layout q_groups describes, checked to tile q_weight and K exactly."""
    name = f"{prefix}.q_groups"
    if q_groups.dim() != 1 or q_groups.numel() == 0 or q_groups.numel() % 2 or q_groups.dtype.is_floating_point:
        raise CheckpointError(f"tensor '{name}' must be integer (width, first row) pairs, got {q_groups.dtype} "
                              f"{list(q_groups.shape)}")
    pairs = (q_groups.to(torch.int64) & 0xFFFF).view(-1, 2).tolist()  # exllamav2 reads them as uint16
    groups, row = [], 0
    for i, (bits, word) in enumerate(pairs):
        last = i == len(pairs) - 1
        if bits not in WIDTHS:
            raise CheckpointError(f"tensor '{name}': group {i} is {bits}-bit; EXL2 groups are "
                                  f"{', '.join(map(str, WIDTHS))}-bit")
        end = q_weight_rows if last else pairs[i + 1][1]
        if (i == 0 and word != 0) or not word < end <= q_weight_rows:
            raise CheckpointError(f"tensor '{name}': group {i} spans q_weight rows [{word}, {end}), but groups must "
                                  f"start at row 0, follow each other and end at '{prefix}.q_weight' row "
                                  f"{q_weight_rows}")
        words = end - word
        if last:
            rows = k - row
            if rows <= 0 or packing.packed_len(rows, bits) != words:
                held = row + words * 32 // bits
                raise CheckpointError(
                    f"tensor '{name}': its groups hold {held} input rows in '{prefix}.q_weight' ({q_weight_rows} "
                    f"rows), but '{prefix}.q_invperm' has {k} entries: groups must cover K exactly")
        else:
            if words * 32 % bits:
                raise CheckpointError(f"tensor '{name}': group {i} ({bits}-bit) has {words} words, not a whole "
                                      "number of input rows")
            rows = words * 32 // bits
        groups.append(Group(bits, word, words, rows))
        row += rows
    return groups


def decode_scales(q_scale: torch.Tensor, q_scale_max: torch.Tensor, n: int, prefix: str) -> torch.Tensor:
    """float32 [G, N]: exllamav2's fp16 scales, exactly (see the module docstring)."""
    groups = q_scale_max.shape[0] if q_scale_max.dim() == 1 else -1
    if not q_scale_max.dtype.is_floating_point or groups < 0:
        raise CheckpointError(f"tensor '{prefix}.q_scale_max' must be a 1-D float tensor, got "
                              f"{q_scale_max.dtype} {list(q_scale_max.shape)}")
    if q_scale.dtype != torch.int32 or list(q_scale.shape) != [groups, n // 8] or n % 8:
        raise CheckpointError(f"tensor '{prefix}.q_scale' has {q_scale.dtype} {list(q_scale.shape)}, expected int32 "
                              f"[{groups}, {n // 8}] for {groups} groups (q_scale_max) and {n} columns (8 per word)")
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q_scale.device)
    qs = ((q_scale.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF).reshape(groups, n) + 1
    base = (q_scale_max.float() / 256).half().float()  # exact in float32, one fp16 rounding
    return ((qs * qs).float() * base.unsqueeze(1)).half().float()  # product exact in float32, rounded once


@dataclass
class Exl2Weight:
    """One rank's EXL2 linear, unpacked: W[n, k] = scales[g_idx[k], n] * codes[k, n], rows in original order."""

    codes: torch.Tensor  # int8 [K, N]: q - 2^(b-1), the signed code of each weight
    scales: torch.Tensor  # float32 [G, N]
    g_idx: torch.Tensor  # int32 [K]
    widths: torch.Tensor  # int32 [G]: code width of each group (the widest part's, after fusing)
    prefix: str
    layer: str = ""
    act_dtype: torch.dtype = torch.float32
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        p = self.prefix
        if self.codes.dtype != torch.int8 or self.codes.dim() != 2:
            raise CheckpointError(f"'{p}': codes must be 2-D int8, got {self.codes.dtype} {list(self.codes.shape)}")
        k, n = self.codes.shape
        groups = self.widths.shape[0]
        if list(self.scales.shape) != [groups, n] or self.g_idx.shape != (k,):
            raise CheckpointError(f"'{p}': scales {list(self.scales.shape)} and g_idx {list(self.g_idx.shape)} do not "
                                  f"match {groups} groups and codes [{k}, {n}]")
        if k and (int(self.g_idx.min()) < 0 or int(self.g_idx.max()) >= groups):
            raise CheckpointError(f"'{p}': group indices outside [0, {groups})")
        if groups and not set(self.widths.tolist()) <= set(WIDTHS):
            raise CheckpointError(f"'{p}': group widths {sorted(set(self.widths.tolist()))} outside {WIDTHS}")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of this rank's partition, like a dense weight (N includes the converter's padding)."""
        return self.codes.shape[1], self.codes.shape[0]

    @property
    def bits(self) -> int:
        """The canonical code width: 4 when every group fits in 4 bits, else 8 (module docstring)."""
        widest = int(self.widths.max()) if self.widths.numel() else WIDTHS[0]
        return 4 if widest <= 4 else 8

    def to_quantized(self) -> QuantizedWeight:
        """Re-centres every group's codes on 2^(bits-1) of the canonical width: exact, symmetric."""
        mid = 2 ** (self.bits - 1)
        qweight = (self.codes.to(torch.int16) + mid).to(torch.uint8)
        counts = torch.bincount(self.g_idx.long(), minlength=self.widths.shape[0])
        used = counts[counts > 0].tolist()
        group_size = math.gcd(*used) if used else max(self.codes.shape[0], 1)
        return QuantizedWeight(qweight=qweight, scales=self.scales, zeros=None, g_idx=self.g_idx, bits=self.bits,
                               group_size=group_size)

    def get_linear(self, bias: torch.Tensor | None) -> torch.nn.Module:
        return build_linear(self.to_quantized(), bias, self.act_dtype, self.device_type, self.layer or self.prefix)


def keep_used_groups(w: Exl2Weight) -> Exl2Weight:
    """Drops the groups no row uses (a row shard under act-order uses a scattered subset)."""
    used, g_idx = torch.unique(w.g_idx.long(), return_inverse=True)
    return Exl2Weight(codes=w.codes, scales=w.scales.index_select(0, used).contiguous(), g_idx=g_idx.to(torch.int32),
                      widths=w.widths.index_select(0, used), prefix=w.prefix, layer=w.layer, act_dtype=w.act_dtype,
                      device_type=w.device_type)


def fuse_columns(parts: list[Exl2Weight], prefixes: list[str]) -> Exl2Weight:
    """Concatenates weights along N although each has its own act-order groups.

    A row's group in the fused weight is the tuple of its groups in the parts; each distinct
    tuple becomes one group whose scales are the parts' scales side by side. Exact for any
    parts; when they share their act-order (exllamav2 reuses one Hessian for q, k and v) the
    tuples are few.
    """
    first = parts[0]
    for prefix, part in zip(prefixes, parts):
        if part.shape[1] != first.shape[1]:
            raise CheckpointError(f"'{prefix}' has {part.shape[1]} inputs, '{prefixes[0]}' {first.shape[1]}: layers "
                                  "fused into one matmul must share their input")
    keys = torch.stack([p.g_idx.long() for p in parts], dim=1)  # [K, parts]
    combos, g_idx = torch.unique(keys, dim=0, return_inverse=True)
    scales = torch.cat([p.scales.index_select(0, combos[:, i]) for i, p in enumerate(parts)], dim=1)
    widths = torch.stack([p.widths.index_select(0, combos[:, i]) for i, p in enumerate(parts)], dim=1).amax(dim=1)
    return Exl2Weight(codes=torch.cat([p.codes for p in parts], dim=1), scales=scales.contiguous(),
                      g_idx=g_idx.to(torch.int32), widths=widths, prefix="+".join(prefixes),
                      layer=layer_kind(prefixes), act_dtype=first.act_dtype, device_type=first.device_type)


class Exl2Loader(WeightsLoader):
    """Unpacks at load; column layers take N slices, row layers K slices in original row order.

    A layer stored as a plain `.weight` in an EXL2 checkpoint loads dense, as exllamav2 does.
    """

    def __init__(self, config: Exl2Config):
        self.config = config
        self.dense = DefaultWeightsLoader()

    def describe(self) -> str:
        return f"Exl2Loader({self.config.describe()})"

    # -- reading -------------------------------------------------------------------------
    def _is_dense(self, weights: Weights, prefixes: list[str]) -> bool:
        quantized = [weights.has_tensor(f"{p}.q_weight") for p in prefixes]
        dense = [not q and weights.has_tensor(f"{p}.weight") for p, q in zip(prefixes, quantized)]
        if any(dense) and not all(dense):
            listed = [p for p, d in zip(prefixes, dense) if d]
            others = [p for p, d in zip(prefixes, dense) if not d]
            raise CheckpointError(f"{', '.join(listed)} stored dense but {', '.join(others)} EXL2-quantized "
                                  f"(in {weights.files_of(prefixes[0])}): layers fused into one matmul must be "
                                  "quantized alike")
        return all(dense)

    def _invperm(self, weights: Weights, prefix: str) -> torch.Tensor:
        """int64 [K]: where each original input row is stored, checked to be a permutation."""
        names = [f"{prefix}.q_invperm", f"{prefix}.q_perm"]
        present = [n for n in names if weights.has_tensor(n)]
        if not present:
            raise CheckpointError(f"tensor '{names[0]}' not found (in {weights.files_of(prefix)}): every EXL2 linear "
                                  "stores its act-order permutation")
        tensors = {}
        for name in present:
            t = weights.get_tensor(name)
            if t.dim() != 1 or t.dtype.is_floating_point:
                raise CheckpointError(f"tensor '{name}' must be a 1-D integer tensor, got {t.dtype} {list(t.shape)}")
            t = t.to(torch.int64)
            if not torch.equal(torch.sort(t).values, torch.arange(t.numel(), device=t.device)):
                raise CheckpointError(f"tensor '{name}' is not a permutation of 0..{t.numel() - 1} "
                                      f"(in {weights.files_of(name)})")
            tensors[name] = t
        if len(tensors) == 2 and not torch.equal(torch.argsort(tensors[names[0]]), tensors[names[1]]):
            raise CheckpointError(f"tensor '{names[1]}' is not the inverse of '{names[0]}' "
                                  f"(in {weights.files_of(prefix)})")
        return tensors[names[0]] if names[0] in tensors else torch.argsort(tensors[names[1]])

    def _read(self, weights: Weights, prefix: str, sizes: list[int] | None = None) -> Exl2Weight:
        """The whole layer (sizes None) or this rank's share of each output part (sizes in columns)."""
        for name in REQUIRED:
            if not weights.has_tensor(f"{prefix}.{name}"):
                raise CheckpointError(f"tensor '{prefix}.{name}' not found (in {weights.files_of(prefix)}): every "
                                      f"EXL2 linear stores {', '.join(REQUIRED)} and q_invperm")
        invperm = self._invperm(weights, prefix)
        k = invperm.numel()
        rows, n = weights.get_shape(f"{prefix}.q_weight")
        groups = read_groups(weights.get_tensor(f"{prefix}.q_groups"), rows, k, prefix)
        q_scale_max = weights.get_tensor(f"{prefix}.q_scale_max", to_dtype=False)  # fp16, never the model dtype
        scales = decode_scales(weights.get_tensor(f"{prefix}.q_scale"), q_scale_max, n, prefix)
        if scales.shape[0] != len(groups):
            raise CheckpointError(f"tensor '{prefix}.q_scale_max' has {scales.shape[0]} groups, '{prefix}.q_groups' "
                                  f"{len(groups)}")
        if sizes is None or weights.process_group.size == 1:
            q_weight = weights.get_tensor(f"{prefix}.q_weight")
        else:
            q_weight = weights.get_packed_sharded(f"{prefix}.q_weight", dim=1, block_sizes=sizes)
            scales = scales.index_select(1, self._rank_columns(weights, sizes, scales.device))
        if q_weight.dtype != torch.int32 or q_weight.dim() != 2:
            raise CheckpointError(f"tensor '{prefix}.q_weight' must be 2-D int32, got {q_weight.dtype} "
                                  f"{list(q_weight.shape)}")
        # Stored order: each group's words are one bit stream down the rows (pack_columns).
        stored = torch.cat([
            (packing.unpack_gptq_qweight(q_weight[g.word:g.word + g.words], g.bits, g.rows).to(torch.int16)
             - 2 ** (g.bits - 1)).to(torch.int8)
            for g in groups
        ])
        stored_group = torch.repeat_interleave(torch.arange(len(groups), device=stored.device),
                                               torch.tensor([g.rows for g in groups], device=stored.device))
        widths = torch.tensor([g.bits for g in groups], dtype=torch.int32, device=stored.device)
        return Exl2Weight(codes=stored.index_select(0, invperm), scales=scales,
                          g_idx=stored_group.index_select(0, invperm).to(torch.int32), widths=widths, prefix=prefix,
                          layer=layer_kind(prefix), act_dtype=weights.dtype, device_type=weights.device.type)

    @staticmethod
    def _rank_columns(weights: Weights, sizes: list[int], device: torch.device) -> torch.Tensor:
        """The columns get_packed_sharded gives this rank: its share of every part, parts in order."""
        world, rank = weights.process_group.size, weights.process_group.rank
        index, offset = [], 0
        for size in sizes:
            share = size // world
            index.append(torch.arange(offset + rank * share, offset + (rank + 1) * share, device=device))
            offset += size
        return torch.cat(index)

    def _sizes(self, weights: Weights, prefix: str, block_sizes: int | list[int]) -> list[int]:
        n = weights.get_shape(f"{prefix}.q_weight")[1]
        try:
            return part_sizes(n, block_sizes, f"{prefix}.q_weight")
        except CheckpointError as exc:
            wanted = sum(block_sizes) if isinstance(block_sizes, list) else None
            if wanted is not None and n % COLUMN_PAD == 0 and 0 < n - wanted < COLUMN_PAD:
                raise CheckpointError(f"{exc}: the converter padded {wanted} output features to {n} (a multiple of "
                                      f"{COLUMN_PAD}); padded fused EXL2 tensors are not supported") from exc
            raise

    # -- WeightsLoader ---------------------------------------------------------------------
    def get_weights(self, weights: Weights, prefix: str):
        if self._is_dense(weights, [prefix]):
            return self.dense.get_weights(weights, prefix)
        return self._read(weights, prefix)

    def get_weights_col_packed(self, weights: Weights, prefix: str, block_sizes: int | list[int]):
        if self._is_dense(weights, [prefix]):
            return self.dense.get_weights_col_packed(weights, prefix, block_sizes)
        return self._read(weights, prefix, self._sizes(weights, prefix, block_sizes))

    def get_multi_weights_col(self, weights: Weights, prefixes: list[str], dim: int):
        if dim != 0:
            raise ValueError(f"EXL2 weights fuse along the output dimension (dim 0), not dim {dim}")
        if self._is_dense(weights, prefixes):
            return self.dense.get_multi_weights_col(weights, prefixes, dim)
        return fuse_columns([self._read(weights, p, self._sizes(weights, p, 1)) for p in prefixes], prefixes)

    def get_weights_row(self, weights: Weights, prefix: str):
        if self._is_dense(weights, [prefix]):
            return self.dense.get_weights_row(weights, prefix)
        full = self._read(weights, prefix)
        if weights.process_group.size == 1:
            return full
        rows = rank_rows(weights, full.shape[1], f"{prefix}.q_invperm")
        return keep_used_groups(Exl2Weight(
            codes=full.codes[rows].contiguous(), scales=full.scales, g_idx=full.g_idx[rows].contiguous(),
            widths=full.widths, prefix=prefix, layer=full.layer, act_dtype=full.act_dtype,
            device_type=full.device_type))


CONFIGS = {"exl2": Exl2Config}
LOADERS = {Exl2Config: Exl2Loader}
