"""The Marlin and Marlin 2:4 layouts: exact pack/unpack, canonical <-> Marlin, and two kernels.

Layout facts (IST-DASLab/marlin `marlin/__init__.py` Layer.pack and _get_perms; vLLM
`quantization/utils/marlin_utils.py`, `marlin_utils_test.py`, `marlin_utils_test_24.py`):
- Marlin B int32 [K/16, 16N*bits/32]: codes [K, N] cut into 16x16 tiles, each tile row of
  the matrix laid out tile after tile (256 values each, row-major inside the tile); every
  1024 values (4 tiles: 16 rows x 64 columns) permuted to the order the tensor-core fragments
  are loaded in, then packed least significant first (8 codes per word at 4 bits, 4 at 8).
  Codes are unsigned with an implicit zero of 2^(bits-1).
- Scales s [G, N], columns permuted in blocks of 64 (grouped) or 32 (one group over K).
- Marlin 2:4: along K every 4 codes hold at most 2 non-zero values (code != zero). The 2
  kept values of each quad form the compressed matrix [K/2, N], tiled like Marlin with its
  own 1024-entry permutation into B_24 [K/32, 16N*bits/32]; the positions go to B_meta int16
  [K/32, 2N] in CUTLASS's interleaved metadata order (2 bits per kept value, 4 quads per
  int16). Scales keep the uncompressed group size, permuted with the 2:4 scale order.
- Zero points (vLLM's AWQ-on-Marlin) zp int32 [G, N*bits/32]: grouped scale order, then
  the interleave inside each word.

Every permutation stays inside a block of 16 (2:4: 32) input rows and 64 output columns,
so any window of whole blocks unpacks on its own: loaders read only a rank's blocks.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import ClassVar

import torch

from text_generation_server.kernels import packing
from text_generation_server.kernels.base import LinearSpec, QuantizedWeight, QuantKernel, dequantize

TILE = 16  # rows of K (2:4: of compressed K) and columns of N per tile
BLOCK_N = 64  # output columns every permutation stays inside
MARLIN_BITS = (4, 8)
SPARSE_24_FORMAT = "int-2:4"  # LinearSpec.weight_format of a QuantizedWeight known to be 2:4 along K

_INTERLEAVE = {4: (0, 2, 4, 6, 1, 3, 5, 7), 8: (0, 2, 1, 3)}


def _check_bits(bits: int) -> None:
    if bits not in MARLIN_BITS:
        raise ValueError(f"the Marlin layout packs 4- or 8-bit codes, got {bits}-bit")


# -- permutations ------------------------------------------------------------------------------
def _interleaved(entries: torch.Tensor, bits: int) -> torch.Tensor:
    order = torch.tensor(_INTERLEAVE[bits])
    return entries.view(-1, len(order))[:, order].reshape(-1)


@lru_cache(maxsize=None)
def weight_perm(bits: int, sparse_24: bool = False) -> torch.Tensor:
    """int64 [1024]: packed position p of a 4-tile block holds tiled value perm[p].

    Thread t of a warp (32) loads, for two 8-column halves ("block"), rows 2(t%4), 2(t%4)+1,
    2(t%4)+8, 2(t%4)+9 of column t//4; Marlin repeats that for the 4 tiles (+256 each), the
    2:4 variant for 4 adjacent columns (+1 each) with its columns split across tile pairs.
    """
    _check_bits(bits)
    lane = torch.arange(32)
    quad, col = lane % 4, lane // 4
    rows = torch.stack([2 * quad, 2 * quad + 1, 2 * quad + 8, 2 * quad + 9], dim=1)  # [32, 4]
    block = torch.arange(2).view(1, 2, 1)
    if sparse_24:
        base = 16 * rows.unsqueeze(1) + (256 * (col // 2) + 8 * (col % 2)).view(32, 1, 1) + 4 * block
        step = 1
    else:
        base = 16 * rows.unsqueeze(1) + col.view(32, 1, 1) + 8 * block
        step = 256
    base = base.reshape(32, 1, 8)  # (lane, block, row) flattened
    entries = base + step * torch.arange(4).view(1, 4, 1)  # [lane, repeat, 8]
    return _interleaved(entries.reshape(-1), bits)


@lru_cache(maxsize=None)
def scale_perm(grouped: bool, sparse_24: bool = False) -> torch.Tensor:
    """Column order of s inside each block: grouped (64), one group over K (32; 2:4: 64, identity)."""
    i = torch.arange(8).view(8, 1)
    if sparse_24:
        if not grouped:
            return torch.arange(64)
        return (8 * i + torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])).reshape(-1)
    if grouped:
        return (i + 8 * torch.arange(8)).reshape(-1)  # an 8x8 transpose
    return (2 * torch.arange(4).view(4, 1) + torch.tensor([0, 1, 8, 9, 16, 17, 24, 25])).reshape(-1)


@lru_cache(maxsize=16)  # a model has a handful of distinct N; each entry is O(16N)
def _tile_index(bits: int, sparse_24: bool, n: int) -> torch.Tensor:
    """int64 [16n]: for each (row r, column c) of a 16-row tile strip, its packed position."""
    perm = weight_perm(bits, sparse_24)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel())
    r = torch.arange(TILE).view(TILE, 1)
    c = torch.arange(n).view(1, n)
    tiled = (c // TILE) * TILE * TILE + r * TILE + c % TILE  # position in the strip's tile-after-tile order
    return ((tiled // 1024) * 1024 + inverse[tiled % 1024]).reshape(-1)


@lru_cache(maxsize=16)  # a model has a handful of distinct N; each entry is O(16N)
def _byte_index(bits: int, sparse_24: bool, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 [16n] byte of the strip's words holding each (r, c), uint8 [16n] its shift in that byte).

    Gathering bytes and shifting once decodes a strip in two passes (unpacking every word and
    then gathering the codes takes three, over four times the bytes).
    """
    value = _tile_index(bits, sparse_24, n)
    per_word = 32 // bits
    bit = (value % per_word) * bits
    byte = bit // 8 if sys.byteorder == "little" else 3 - bit // 8
    return (value // per_word) * 4 + byte, (bit % 8).to(torch.uint8)


def _strip_codes(words: torch.Tensor, bits: int, byte_index: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """int32 [R, 16n*bits/32] -> uint8 [R*16, n]: decode R strips (indices from _byte_index, on words' device)."""
    codes = words.contiguous().view(torch.uint8).index_select(1, byte_index)
    if bits < 8:
        codes = (codes >> shift) & ((1 << bits) - 1)
    return codes.view(words.shape[0] * TILE, -1)


def _check_strip_shape(codes: torch.Tensor, rows: int, name: str) -> tuple[int, int]:
    if codes.dim() != 2:
        raise ValueError(f"{name} must be 2-D [K, N], got shape {list(codes.shape)}")
    k, n = codes.shape
    if k % rows or n % BLOCK_N:
        raise ValueError(f"{name} [{k}, {n}]: the Marlin layout needs K a multiple of {rows} "
                         f"and N a multiple of {BLOCK_N}")
    return k, n


def _pack_strips(codes: torch.Tensor, bits: int, sparse_24: bool, chunk: int = 64) -> torch.Tensor:
    # codes: [R*16, N] -> int32 [R, 16N*bits/32]; `chunk` strips at a time bounds the int64 temporaries.
    k, n = codes.shape
    index = _tile_index(bits, sparse_24, n).to(codes.device)
    out = []
    for r0 in range(0, k // TILE, chunk):
        flat = codes[r0 * TILE:(r0 + chunk) * TILE].to(torch.int64).reshape(-1, TILE * n)  # (r, c) per strip
        strip = torch.empty_like(flat)
        strip[:, index] = flat
        out.append(packing.pack_bits(strip, bits))
    return torch.cat(out) if out else torch.empty(0, n * bits // 2, dtype=torch.int32, device=codes.device)


def _unpack_strips(words: torch.Tensor, bits: int, sparse_24: bool) -> torch.Tensor:
    # int32 [R, 16N*bits/32] -> uint8 [R*16, N]
    n = words.shape[1] * (32 // bits) // TILE
    if n % BLOCK_N or n * TILE * bits != words.shape[1] * 32:
        raise ValueError(f"packed width {words.shape[1]} is not a whole number of {BLOCK_N}-column blocks "
                         f"at {bits} bits")
    byte_index, shift = (t.to(words.device) for t in _byte_index(bits, sparse_24, n))
    return _strip_codes(words, bits, byte_index, shift)


# -- Marlin ------------------------------------------------------------------------------------
def pack_marlin_weight(codes: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Unsigned codes [K, N] -> B int32 [K/16, N*bits/2]."""
    _check_bits(bits)
    _check_strip_shape(codes, TILE, "codes")
    return _pack_strips(codes, bits, sparse_24=False)


def unpack_marlin_weight(b: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """B int32 [K/16, N*bits/2] (or any window of whole 16x64 blocks) -> codes uint8 [K, N]."""
    _check_bits(bits)
    if b.dtype != torch.int32 or b.dim() != 2:
        raise ValueError(f"B must be 2-D int32, got {b.dtype} {list(b.shape)}")
    return _unpack_strips(b, bits, sparse_24=False)


def permute_scales(s: torch.Tensor, grouped: bool, sparse_24: bool = False) -> torch.Tensor:
    """Canonical [G, N] -> Marlin column order. `grouped`: the checkpoint has more than one group over K."""
    perm = scale_perm(grouped, sparse_24).to(s.device)
    if s.dim() != 2 or s.shape[1] % perm.numel():
        raise ValueError(f"scales {list(s.shape)}: N must be a multiple of {perm.numel()}")
    return s.reshape(-1, perm.numel())[:, perm].reshape(s.shape).contiguous()


def unpermute_scales(s: torch.Tensor, grouped: bool, sparse_24: bool = False) -> torch.Tensor:
    """Marlin column order -> canonical [G, N]; any window of whole 64-column blocks."""
    perm = scale_perm(grouped, sparse_24).to(s.device)
    if s.dim() != 2 or s.shape[1] % perm.numel():
        raise ValueError(f"scales {list(s.shape)}: N must be a multiple of {perm.numel()}")
    out = torch.empty_like(s.reshape(-1, perm.numel()))
    out[:, perm] = s.reshape(-1, perm.numel())
    return out.reshape(s.shape)


def pack_marlin_zeros(zeros: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Zero points [G, N] -> zp int32 [G, N*bits/32] (vLLM marlin_zero_points: grouped order, interleaved)."""
    _check_bits(bits)
    z = permute_scales(zeros.to(torch.int64), grouped=True)
    return packing.pack_bits(_interleaved(z.reshape(-1), bits).view(z.shape), bits)


def unpack_marlin_zeros(zp: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """zp int32 [G, N*bits/32] -> zero points uint8 [G, N]."""
    _check_bits(bits)
    z = packing.unpack_bits(zp, bits).to(torch.int64)
    order = torch.tensor(_INTERLEAVE[bits], device=zp.device)
    inter = torch.empty_like(z.view(-1, len(order)))
    inter[:, order] = z.view(-1, len(order))
    return unpermute_scales(inter.view(z.shape), grouped=True).to(torch.uint8)


# -- Marlin 2:4 --------------------------------------------------------------------------------
# Positions (idx0, idx1) of the two values kept from a quad, by its non-zero mask (bit i: position
# i), as CUTLASS encodes them: the non-zeros in order, padded per its table when fewer than two.
_QUAD_POSITIONS = {0b0000: (2, 3), 0b0001: (0, 2), 0b0010: (1, 2), 0b0100: (2, 3), 0b1000: (2, 3)}
_QUAD_POSITIONS |= {(1 << a) | (1 << b): (a, b) for a in range(4) for b in range(a + 1, 4)}


@lru_cache(maxsize=None)
def _quad_tables() -> tuple[torch.Tensor, torch.Tensor]:
    idx0 = torch.full((16,), -1, dtype=torch.int64)
    idx1 = torch.full((16,), -1, dtype=torch.int64)
    for mask, (a, b) in _QUAD_POSITIONS.items():
        idx0[mask], idx1[mask] = a, b
    return idx0, idx1


@lru_cache(maxsize=16)  # each entry is O(N * rows): a handful of (N, chunk) pairs per model
def _meta_index(n: int, rows: int) -> torch.Tensor:
    """int64 [n, 2*rows]: flat position in B_meta [rows, 2n] of metadata element (output n, column c).

    Metadata column c (16 input rows) of output n moves to row c // 2; inside a 64-output block
    the outputs are reordered for the mma fragment (CUTLASS ColumnMajorInterleaved<2>) and each
    2x2 (output, column) block has its off-diagonal swapped.
    """
    r = torch.arange(n).view(n, 1)
    c = torch.arange(2 * rows).view(1, 2 * rows)
    o = r % 64
    dst = r - o + 2 * (o % 2) + (o % 8) // 4 + 32 * ((o % 4) // 2) + 4 * (o // 8)
    dst, c = torch.broadcast_tensors(dst, c)
    flip = (dst % 2) != (c % 2)  # the off-diagonal of each 2x2 block
    step = torch.where(dst % 2 == 0, 1, -1)
    dst = torch.where(flip, dst + step, dst)
    cw = torch.where(flip, c - step, c)
    return (c // 2) * (2 * n) + 2 * dst + cw % 2


def pack_marlin24_weight(codes: torch.Tensor, bits: int = 4,
                         chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """2:4-structured codes [K, N] -> (B_24 int32 [K/32, N*bits/2], B_meta int16 [K/32, 2N])."""
    _check_bits(bits)
    k, n = _check_strip_shape(codes, 2 * TILE, "codes")
    parts = [_pack24_rows(codes[k0:k0 + chunk], bits) for k0 in range(0, k, chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _pack24_rows(codes: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, n = codes.shape
    zero = 1 << (bits - 1)
    quads = codes.to(torch.int64).view(k // 4, 4, n)
    nonzero = quads != zero
    if int(nonzero.sum(dim=1).max()) > 2:
        raise ValueError("codes are not 2:4 sparse: some group of 4 input rows has more than 2 non-zero values")
    mask = (nonzero.to(torch.int64) << torch.arange(4, device=codes.device).view(1, 4, 1)).sum(dim=1)
    idx0, idx1 = (t.to(codes.device)[mask] for t in _quad_tables())  # [K/4, N]
    kept = torch.cat([quads.gather(1, idx0.unsqueeze(1)), quads.gather(1, idx1.unsqueeze(1))], dim=1)
    compressed = kept.view(k // 2, n)  # rows 2q, 2q+1: the values kept from quad q
    nibbles = (idx0 | (idx1 << 2)).view(k // 16, 4, n)
    meta = (nibbles << (4 * torch.arange(4, device=codes.device)).view(1, 4, 1)).sum(dim=1).t()  # [N, K/16]
    flat = torch.empty(meta.numel(), dtype=torch.int64, device=codes.device)
    flat[_meta_index(n, k // 32).to(codes.device).reshape(-1)] = meta.reshape(-1)
    b_meta = (flat - (flat >> 15) * (1 << 16)).to(torch.int16).view(k // 32, 2 * n)
    return _pack_strips(compressed, bits, sparse_24=True), b_meta


def unpack_marlin24_weight(b24: torch.Tensor, b_meta: torch.Tensor, bits: int = 4, chunk: int = 32) -> torch.Tensor:
    """(B_24, B_meta), or a window of whole 32x64 blocks of both -> codes uint8 [K, N] (pruned: zero)."""
    _check_bits(bits)
    if b24.dtype != torch.int32 or b24.dim() != 2:
        raise ValueError(f"B_24 must be 2-D int32, got {b24.dtype} {list(b24.shape)}")
    rows, n = b24.shape[0], b24.shape[1] * 2 // bits
    if b_meta.dtype != torch.int16 or list(b_meta.shape) != [rows, 2 * n]:
        raise ValueError(f"B_meta must be int16 [{rows}, {2 * n}] to match B_24 {list(b24.shape)}, "
                         f"got {b_meta.dtype} {list(b_meta.shape)}")
    out = torch.empty(rows * 2 * TILE, n, dtype=torch.uint8, device=b24.device)
    for r0 in range(0, rows, chunk):  # `chunk` rows of B_24 (32 input rows each) at a time
        r1 = min(rows, r0 + chunk)
        out[r0 * 2 * TILE:r1 * 2 * TILE] = _unpack24_rows(b24[r0:r1], b_meta[r0:r1], bits)
    return out


def _unpack24_rows(b24: torch.Tensor, b_meta: torch.Tensor, bits: int) -> torch.Tensor:
    compressed = _unpack_strips(b24, bits, sparse_24=True)  # [K/2, N]
    half_k, n = compressed.shape
    index = _meta_index(n, b24.shape[0]).to(b_meta.device)
    meta = (b_meta.to(torch.int32) & 0xFFFF).reshape(-1)[index]  # [N, K/16]
    nibbles = (meta.t().unsqueeze(1) >> (4 * torch.arange(4, dtype=torch.int32, device=meta.device)).view(1, 4, 1))
    nibbles = (nibbles & 0xF).reshape(half_k // 2, n).to(torch.int64)  # one per quad
    idx0, idx1 = nibbles & 3, nibbles >> 2
    if bool((idx0 >= idx1).any()):
        raise ValueError("B_meta holds invalid 2:4 metadata (a quad whose two positions are not increasing)")
    kept = compressed.view(half_k // 2, 2, n)
    quads = torch.full((half_k // 2, 4, n), 1 << (bits - 1), dtype=torch.uint8, device=b24.device)
    quads.scatter_(1, idx0.unsqueeze(1), kept[:, :1])
    quads.scatter_(1, idx1.unsqueeze(1), kept[:, 1:])
    return quads.view(2 * half_k, n)


def is_24_sparse(weight: QuantizedWeight) -> bool:
    """Whether every aligned quad of input rows holds at most 2 codes other than the zero point."""
    k, n = weight.qweight.shape
    if k % 4 or weight.zeros is not None:
        return False
    nonzero = weight.qweight.view(k // 4, 4, n) != (1 << (weight.bits - 1))
    return bool((nonzero.sum(dim=1) <= 2).all())


# -- repacks through the canonical form ---------------------------------------------------------
@dataclass
class MarlinPacked:
    """A linear in the Marlin layout, as Marlin kernels (IST, vLLM gptq_marlin / awq_marlin) take it."""

    B: torch.Tensor  # int32 [K/16, N*bits/2]; rows sorted by group under act-order
    s: torch.Tensor  # float16 [G, N], Marlin column order
    bits: int
    group_size: int  # rows per group (K: one group)
    zp: torch.Tensor | None = None  # int32 [G, N*bits/32] zero points; None: symmetric
    g_idx: torch.Tensor | None = None  # int32 [K] act-order groups (rows of B are sorted by them)

    @property
    def shape(self) -> tuple[int, int]:
        return self.s.shape[1], self.B.shape[0] * TILE


def quantized_to_marlin(weight: QuantizedWeight) -> MarlinPacked:
    """Canonical -> Marlin. Act-order rows are sorted by group (vLLM's g_idx_sort_indices)."""
    _check_bits(weight.bits)
    k = weight.in_features
    g_idx = weight.g_idx.long()
    order = torch.argsort(g_idx, stable=True)
    sorted_groups = g_idx[order]
    natural = torch.arange(k, device=g_idx.device) // weight.group_size
    if not torch.equal(sorted_groups, natural):
        raise ValueError(f"Marlin runs groups of {weight.group_size} consecutive rows (after sorting by g_idx); "
                         "this weight's groups have other sizes")
    act_order = not torch.equal(order, torch.arange(k, device=order.device))
    codes = weight.qweight.index_select(0, order) if act_order else weight.qweight
    grouped = weight.scales.shape[0] > 1
    return MarlinPacked(
        B=pack_marlin_weight(codes, weight.bits),
        s=permute_scales(weight.scales.to(torch.float16), grouped),
        bits=weight.bits,
        group_size=weight.group_size,
        zp=None if weight.zeros is None else pack_marlin_zeros(weight.zeros.round().to(torch.int64), weight.bits),
        g_idx=weight.g_idx.to(torch.int32).clone() if act_order else None,
    )


def marlin_to_quantized(packed: MarlinPacked) -> QuantizedWeight:
    """Marlin -> canonical (act-order rows back in checkpoint order)."""
    codes = unpack_marlin_weight(packed.B, packed.bits)
    k = codes.shape[0]
    scales = unpermute_scales(packed.s, packed.s.shape[0] > 1).float()
    zeros = None if packed.zp is None else unpack_marlin_zeros(packed.zp, packed.bits).float()
    g_idx = torch.arange(k, dtype=torch.int32, device=codes.device) // packed.group_size
    if packed.g_idx is not None:
        order = torch.argsort(packed.g_idx.long(), stable=True)
        unsorted = torch.empty_like(codes)
        unsorted[order] = codes
        codes, g_idx = unsorted, packed.g_idx.to(torch.int32)
    return QuantizedWeight(qweight=codes, scales=scales, zeros=zeros, g_idx=g_idx, bits=packed.bits,
                           group_size=packed.group_size)


# -- CPU kernel: compute from the Marlin layout ---------------------------------------------------
class MarlinLayoutLinear(torch.nn.Module):
    # x: [..., K] -> [..., N]
    chunk_strips = 4  # 64 input rows dequantized per step: the scratch tile is [64, N] float32 (cache-sized)

    def __init__(self, b: torch.Tensor, s: torch.Tensor, bits: int, strip_groups: torch.Tensor,
                 perm: torch.Tensor | None, bias: torch.Tensor | None, act_dtype: torch.dtype):
        super().__init__()
        self.register_buffer("B", b)  # int32 [K/16, N*bits/2], the checkpoint layout
        self.register_buffer("s", s)  # float32 [G, N], Marlin column order
        self.register_buffer("strip_groups", strip_groups)  # int64 [K/16]: scale row of each 16-row strip
        self.register_buffer("perm", perm)  # int64 [K]: input column of each strip row (act-order), or None
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = b.shape[0] * TILE, s.shape[1]
        byte_index, shift = _byte_index(bits, False, self.out_features)
        self.register_buffer("byte_index", byte_index.to(b.device, copy=True))  # int64 [16N]: decodes a strip
        self.register_buffer("shift", shift.to(b.device, copy=True))  # uint8 [16N]
        self.grouped = s.shape[0] > 1
        self.bits = bits
        self.act_dtype = act_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if self.perm is not None:
            x = x.index_select(1, self.perm)
        x = x.float()
        scales = unpermute_scales(self.s, self.grouped)
        zero = float(1 << (self.bits - 1))
        y = torch.zeros(x.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        for r0 in range(0, self.B.shape[0], self.chunk_strips):
            r1 = min(self.B.shape[0], r0 + self.chunk_strips)
            codes = _strip_codes(self.B[r0:r1], self.bits, self.byte_index, self.shift)  # [strips*16, N]
            tile = codes.view(r1 - r0, TILE, self.out_features).float() - zero
            tile.mul_(scales.index_select(0, self.strip_groups[r0:r1]).unsqueeze(1))
            y.addmm_(x[:, r0 * TILE:r1 * TILE], tile.view(-1, self.out_features))
        y = y.to(self.act_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


class MarlinLayoutKernel(QuantKernel):
    """Keeps the Marlin layout in memory (4 or 8 bits per weight) and dequantizes 64-row tiles per call.

    The portable fallback for symmetric 4/8-bit weights when the native int4 op is unavailable
    or disabled; slower than it, far more compact than the reference kernel.
    """

    name = "marlin-layout"

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        if spec.weight_format != "int":
            return False, f"runs integer codes, not {spec.weight_format} weights"
        if spec.device_type != "cpu":
            return False, f"device {spec.device_type}"
        if spec.act_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            return False, f"activation dtype {spec.act_dtype} not in bfloat16/float16/float32"
        if spec.has_zeros:
            return False, "asymmetric weights (zero points): the Marlin layout's codes have an implicit zero"
        if spec.bits not in MARLIN_BITS:
            return False, f"needs 4- or 8-bit codes, got {spec.bits}-bit"
        if spec.in_features % TILE or spec.out_features % BLOCK_N:
            return False, (f"[K={spec.in_features}, N={spec.out_features}] does not tile into "
                           f"{TILE}x{BLOCK_N} blocks")
        rows = spec.rows_per_group_gcd()
        if rows % TILE:
            return False, f"group size {spec.group_size}: groups must be whole {TILE}-row strips (share {rows} rows)"
        return True, ""

    @classmethod
    def build(cls, weight: QuantizedWeight, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        ok, reason = cls.can_implement(weight.spec(act_dtype, "cpu"))
        if not ok:
            raise ValueError(f"{cls.name} cannot run this weight: {reason}")
        k = weight.in_features
        g_idx = weight.g_idx.long()
        order = torch.argsort(g_idx, stable=True)
        groups = g_idx[order].view(k // TILE, TILE)
        if not torch.equal(groups, groups[:, :1].expand_as(groups)):
            raise ValueError(f"{cls.name}: groups do not tile into {TILE}-row strips after sorting by g_idx")
        identity = torch.equal(order, torch.arange(k, device=order.device))
        codes = weight.qweight if identity else weight.qweight.index_select(0, order)
        scales = permute_scales(weight.scales.float(), weight.scales.shape[0] > 1)
        strip_groups = groups[:, 0].contiguous()
        return MarlinLayoutLinear(pack_marlin_weight(codes, weight.bits), scales, weight.bits, strip_groups,
                                  None if identity else order, None if bias is None else bias.to(act_dtype), act_dtype)


# -- CUDA: 2:4 structure on the sparse tensor cores -----------------------------------------------
class SparseSemiStructuredLinear(torch.nn.Module):
    # x: [..., K] -> [..., N]
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = weight  # SparseSemiStructuredTensor [N, K]
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight, self.bias)


class Sparse24Kernel(QuantKernel):
    """Dequantizes a 2:4 weight once and runs it as torch's semi-structured sparse tensor (sm80+)."""

    name = "sparse-2:4"

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        if spec.weight_format != SPARSE_24_FORMAT:
            return False, f"needs weights known to be 2:4 sparse ({SPARSE_24_FORMAT}), got {spec.weight_format}"
        if spec.device_type != "cuda" or not torch.cuda.is_available():
            return False, "needs a CUDA device"
        major, minor = torch.cuda.get_device_capability()
        if major < 8:
            return False, f"needs compute capability 8.0 or newer (sparse tensor cores), device is {major}.{minor}"
        if spec.act_dtype not in (torch.float16, torch.bfloat16):
            return False, f"activation dtype {spec.act_dtype} not in float16/bfloat16"
        if spec.out_features % 32 or spec.in_features % 64:
            return False, f"[N={spec.out_features}, K={spec.in_features}] not multiples of [32, 64]"
        return True, ""

    @classmethod
    def build(cls, weight: Sparse24Weight, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        if not is_24_sparse(weight.plain):
            raise ValueError(f"{cls.name}: the weight is not 2:4 sparse along its input rows")
        dense = dequantize(weight.plain, act_dtype)  # [N, K], exact zeros where pruned
        if torch.backends.cusparselt.is_available():
            sparse = torch.sparse.SparseSemiStructuredTensorCUSPARSELT.from_dense(dense)
        else:
            sparse = torch.sparse.SparseSemiStructuredTensorCUTLASS.from_dense(dense)
        return SparseSemiStructuredLinear(sparse, None if bias is None else bias.to(act_dtype))


@dataclass
class Sparse24Weight:
    """A canonical weight whose codes are known to be 2:4 sparse along K (checked by `sparse_24_weight`).

    LinearSpec has no field for sparsity, so the structure travels as weight_format
    SPARSE_24_FORMAT: kernels that only know "int" refuse it, and when none takes it,
    kernels/select.py builds `plain`, the same weight, on the integer kernels.
    """

    plain: QuantizedWeight
    structure: ClassVar[str] = "2:4 structure"

    @property
    def shape(self) -> tuple[int, int]:
        return self.plain.shape

    def spec(self, act_dtype: torch.dtype, device_type: str) -> LinearSpec:
        return replace(self.plain.spec(act_dtype, device_type), weight_format=SPARSE_24_FORMAT)

    def describe_layer(self, spec: LinearSpec, kernel: type[QuantKernel]) -> str:
        return f"{spec.bits}-bit 2:4 g{spec.group_size}"


def sparse_24_weight(weight: QuantizedWeight) -> Sparse24Weight | QuantizedWeight:
    """The weight with its 2:4 structure made known where its codes have it, else the weight itself."""
    return Sparse24Weight(weight) if is_24_sparse(weight) else weight


__all__ = [
    "MARLIN_BITS", "MarlinLayoutKernel", "MarlinPacked", "SPARSE_24_FORMAT", "Sparse24Kernel", "Sparse24Weight",
    "is_24_sparse", "sparse_24_weight", "marlin_to_quantized", "pack_marlin24_weight", "pack_marlin_weight",
    "pack_marlin_zeros", "permute_scales", "quantized_to_marlin", "scale_perm", "unpack_marlin24_weight",
    "unpack_marlin_weight", "unpack_marlin_zeros", "unpermute_scales", "weight_perm",
]
