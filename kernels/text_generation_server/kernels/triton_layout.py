"""The layout triton-gemm computes from, and the canonical weight back from it.

`repack` turns a canonical `QuantizedWeight` into a `GemmWeight` (kernels/triton_gemm.py says what
the kernels read: rows sorted by group, K and N padded, codes packed tile-interleaved in int32
words, one scale row per GS stored rows). `canonical_weight` is its inverse up to group labels:
the same codes, scales and zero points per input row, so another kernel can be built from a
triton-gemm layer without the checkpoint (warmup times such a kernel against it, kernels/select.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from text_generation_server.kernels.base import QuantizedWeight

CHUNK = 128  # K rows per packed chunk: the K tile of every path and K's padding unit (the kernels spell it 128)
N_ALIGN = 128  # N pads to this, so every BN in use divides it and weight loads need no mask

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# -- repack ------------------------------------------------------------------------------------

@dataclass
class GemmWeight:
    """A `QuantizedWeight` in the layout the Triton kernels read (see the module docstring)."""

    qweight: torch.Tensor  # int32 [Kp / PACK, Np], tile-interleaved
    scales: torch.Tensor  # [ceil(Kp / group_rows), Np], activation dtype
    zeros: torch.Tensor | None  # like scales; None: every zero point is sym_zero
    perm: torch.Tensor | None  # int32 [Kp]: input column of each stored row, -1 for padding; None: identity
    bits: int  # stored code width, 4 or 8
    group_rows: int  # stored rows per scale row
    sym_zero: int
    in_features: int
    out_features: int

    @property
    def padded_in(self) -> int:
        return self.qweight.shape[0] * 32 // self.bits

    @property
    def padded_out(self) -> int:
        return self.qweight.shape[1]


def _layout_cost(counts: list[int], group_rows: int, pad_groups: bool, k: int, bits: int, scale_bytes: int) -> int:
    """Stored bytes per output column: codes plus one scale (and zero) row per group_rows rows."""
    rows = sum(_cdiv(c, group_rows) * group_rows for c in counts) if pad_groups else k
    kp = _cdiv(rows, CHUNK) * CHUNK
    return kp * bits // 8 + _cdiv(kp, group_rows) * scale_bytes


def repack(weight: QuantizedWeight, act_dtype: torch.dtype) -> GemmWeight:
    """Sorts rows by group, pads K/N/groups, packs codes tile-interleaved, expands scales per GS rows."""
    k, n = weight.in_features, weight.out_features
    device = weight.qweight.device
    bits = 4 if weight.bits <= 4 else 8
    g = weight.g_idx.long()
    order = torch.argsort(g, stable=True)
    sorted_g = g[order]
    counts_t = torch.bincount(g, minlength=weight.scales.shape[0])
    used = counts_t[counts_t > 0]
    counts = used.tolist()
    # Scale rows per GS stored rows: GS must tile every group. The counts' gcd always does
    # (no padding); if it is small, padding each group to a multiple of 32..128 can be cheaper.
    scale_bytes = act_dtype.itemsize * (1 if weight.zeros is None else 2)
    candidates = [(math.gcd(*counts), False)] + [(s, True) for s in (128, 64, 32)]
    group_rows, pad_groups = min(candidates, key=lambda c: _layout_cost(counts, c[0], c[1], k, bits, scale_bytes))
    if pad_groups:
        padded = (used + group_rows - 1) // group_rows * group_rows
        gid = torch.repeat_interleave(torch.arange(len(counts), device=device), used)
        starts = torch.cumsum(used, 0) - used
        dest = (torch.cumsum(padded, 0) - padded)[gid] + torch.arange(k, device=device) - starts[gid]
        rows = int(padded.sum())
    else:
        dest = torch.arange(k, device=device)
        rows = k
    kp = _cdiv(max(rows, 1), CHUNK) * CHUNK
    np_ = _cdiv(max(n, 1), N_ALIGN) * N_ALIGN
    identity = not pad_groups and torch.equal(order, torch.arange(k, device=device))
    perm = None
    if not identity:
        perm = torch.full((kp,), -1, dtype=torch.int32, device=device)
        perm[dest] = order.to(torch.int32)

    codes = torch.zeros(kp, np_, dtype=torch.uint8, device=device)
    codes[dest, :n] = weight.qweight.index_select(0, order)
    # Which checkpoint group each block of group_rows stored rows takes its scale from.
    block_group = torch.full((_cdiv(kp, group_rows),), -1, dtype=torch.long, device=device)
    block_group[dest // group_rows] = sorted_g
    if not torch.equal(block_group[dest // group_rows], sorted_g):
        raise ValueError(f"triton-gemm: groups do not tile into {group_rows}-row blocks after sorting by g_idx")
    valid = (block_group >= 0).unsqueeze(1)
    src = block_group.clamp(min=0)

    def per_block(t: torch.Tensor) -> torch.Tensor:
        out = torch.where(valid, t.float().index_select(0, src), torch.zeros((), device=device))
        return torch.nn.functional.pad(out, (0, np_ - n)).to(act_dtype).contiguous()

    return GemmWeight(
        qweight=_pack_chunks(codes, bits),
        scales=per_block(weight.scales),
        zeros=None if weight.zeros is None else per_block(weight.zeros),
        perm=perm,
        bits=bits,
        group_rows=group_rows,
        sym_zero=2 ** (weight.bits - 1),
        in_features=k,
        out_features=n,
    )


def _pack_chunks(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [Kp, Np] -> int32 [Kp / PACK, Np]: word (c*R + r) field i holds row c*CHUNK + i*R + r."""
    kp, np_ = codes.shape
    pack, r = 32 // bits, CHUNK * bits // 32
    fields = codes.view(kp // CHUNK, pack, r, np_)
    words = torch.zeros(kp // CHUNK, r, np_, dtype=torch.int64, device=codes.device)
    for i in range(pack):
        words |= fields[:, i].to(torch.int64) << (bits * i)
    words = words - ((words >> 31) & 1) * (1 << 32)  # same 32 bits, as a signed int32
    return words.to(torch.int32).view(kp // pack, np_)


def unpack_chunks(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of the packing: int32 [Kp / PACK, Np] -> uint8 [Kp, Np] (tests, debugging)."""
    pack, r = 32 // bits, CHUNK * bits // 32
    words = qweight.to(torch.int64).view(-1, r, qweight.shape[1])
    fields = [(words >> (bits * i)) & ((1 << bits) - 1) for i in range(pack)]
    return torch.stack(fields, dim=1).reshape(-1, qweight.shape[1]).to(torch.uint8)


def canonical_weight(gw: GemmWeight) -> QuantizedWeight:
    """The canonical weight `gw` computes: every input row's codes, with its stored block of
    `group_rows` rows as its group (checkpoint groups split into blocks keep their scale in each).
    Exact: the kernels read the same codes, scales and zero points (scales already in the activation
    dtype), so a kernel built from it computes what one built from the checkpoint's weight does, up
    to that dtype's rounding of the scales."""
    k, n = gw.in_features, gw.out_features
    codes = unpack_chunks(gw.qweight, gw.bits)  # [Kp, Np], stored row order
    if gw.perm is None:
        stored = torch.arange(k, device=codes.device)  # input row i is stored row i
    else:
        rows = torch.nonzero(gw.perm >= 0).squeeze(1)
        stored = torch.empty(k, dtype=torch.long, device=codes.device)
        stored[gw.perm[rows].long()] = rows
    return QuantizedWeight(
        qweight=codes.index_select(0, stored)[:, :n].contiguous(),
        scales=gw.scales[:, :n].float(),
        zeros=None if gw.zeros is None else gw.zeros[:, :n].float(),
        g_idx=(stored // gw.group_rows).to(torch.int32),
        bits=gw.sym_zero.bit_length(),  # sym_zero = 2^(bits - 1) of the checkpoint's code width
        group_size=gw.group_rows,
    )
