"""GGML block formats decoded into the canonical quantized form the kernels read.

Every format kept quantized stores a row of K weights as K / block blocks; each block decodes
to integer codes and, per group of 16 or 32 weights, one scale and one offset:

    w = scale * q + offset          (offset = 0 for the symmetric formats)

The canonical form (`kernels.base.QuantizedWeight`) is w = scale * (q - zero), so the offset
becomes the zero point zero = -offset / scale. The symmetric formats keep their implied zero
(2^(bits-1): Q4_0's 8, Q5_0's 16, Q3_K's 4, Q6_K's 32; Q8_0's signed codes are shifted by 128)
and decode exactly; the formats with minimums (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) round once in
-offset / scale (a float32 ulp of the weight). A group whose scale is 0 but whose offset is not
(a constant group) keeps its value with codes 0, scale = offset, zero = -1.

The block layouts are ggml's (ggml-quants.c, dequantize_row_*); tests check each decoder
against the gguf package's own numpy dequantizer, which transformers uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK_K = 256  # the K-quants' super-block


@dataclass(frozen=True)
class BlockFormat:
    """One ggml type kept quantized: block geometry and the canonical form it decodes to."""

    name: str
    type_id: int  # GGMLQuantizationType value
    block: int  # weights per block
    block_bytes: int
    bits: int
    group: int  # weights per scale
    symmetric: bool


FORMATS: dict[int, BlockFormat] = {f.type_id: f for f in (
    BlockFormat("Q4_0", 2, 32, 18, 4, 32, True),
    BlockFormat("Q4_1", 3, 32, 20, 4, 32, False),
    BlockFormat("Q5_0", 6, 32, 22, 5, 32, True),
    BlockFormat("Q5_1", 7, 32, 24, 5, 32, False),
    BlockFormat("Q8_0", 8, 32, 34, 8, 32, True),
    BlockFormat("Q2_K", 10, QK_K, 84, 2, 16, False),
    BlockFormat("Q3_K", 11, QK_K, 110, 3, 16, True),
    BlockFormat("Q4_K", 12, QK_K, 144, 4, 32, False),
    BlockFormat("Q5_K", 13, QK_K, 176, 5, 32, False),
    BlockFormat("Q6_K", 14, QK_K, 210, 6, 16, True),
)}
DENSE_TYPES = {0: ("F32", torch.float32), 1: ("F16", torch.float16), 30: ("BF16", torch.bfloat16)}


@dataclass
class Decoded:
    """Rows of one tensor in canonical pieces: codes [R, K] uint8, scales and offsets [R, K/group] float32."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None

    def dequantize(self, fmt: BlockFormat) -> torch.Tensor:
        """w = scale * q + offset (symmetric: scale * (q - 2^(bits-1))), [R, K] float32."""
        r, k = self.codes.shape
        q = self.codes.float().view(r, k // fmt.group, fmt.group)
        if self.offsets is None:
            w = (q - float(2 ** (fmt.bits - 1))) * self.scales[..., None]
        else:
            w = q * self.scales[..., None] + self.offsets[..., None]
        return w.view(r, k)

    def canonical_zeros(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(codes, scales, zeros) with zero = -offset / scale; constant groups as the module docstring says."""
        if self.offsets is None:
            return self.codes, self.scales, None
        scales, offsets, codes = self.scales, self.offsets, self.codes
        safe = torch.where(scales == 0, torch.ones_like(scales), scales)
        zeros = torch.where(scales == 0, torch.zeros_like(scales), -offsets / safe)
        constant = (scales == 0) & (offsets != 0)
        if bool(constant.any()):
            r, k = codes.shape
            g = scales.shape[1]
            codes = codes.view(r, g, k // g).masked_fill(constant[..., None], 0).view(r, k)
            scales = torch.where(constant, offsets, scales)
            zeros = torch.where(constant, torch.full_like(zeros, -1.0), zeros)
        return codes, scales, zeros


def _half(raw: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 stored at byte `at` of every block, as float32 [R, nb]."""
    return raw[..., at:at + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32] codes: the low nibbles are elements 0-15, the high ones 16-31."""
    return torch.cat([qs & 0xF, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 4-byte little-endian word: bit j is element j's fifth bit, as [..., 32] 0/1."""
    shifts = torch.arange(8, dtype=torch.uint8)
    bits = (qh[..., :, None] >> shifts) & 1  # [..., 4 bytes, 8]
    return bits.reshape(*qh.shape[:-1], 32)


def _k_scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit minimums (ggml's get_scale_min_k4)."""
    q = packed.to(torch.int32)
    lo_sc, lo_m = q[..., 0:4] & 63, q[..., 4:8] & 63
    hi_sc = (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)
    hi_m = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1).float(), torch.cat([lo_m, hi_m], -1).float()


def _legacy(fmt: BlockFormat, raw: torch.Tensor) -> Decoded:
    d = _half(raw, 0)
    if fmt.name == "Q8_0":
        codes = (raw[..., 2:34].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return Decoded(codes, d, None)
    at = 2 if fmt.symmetric else 4
    m = None if fmt.symmetric else _half(raw, 2)
    if fmt.bits == 5:
        high = _high_bits(raw[..., at:at + 4])
        codes = _nibbles(raw[..., at + 4:at + 20]) | (high << 4)
    else:
        codes = _nibbles(raw[..., at:at + 16])
    return Decoded(codes, d, m)


def _q2_k(raw: torch.Tensor) -> Decoded:
    sc = raw[..., 0:16]
    qs = raw[..., 16:80]
    d, dmin = _half(raw, 80), _half(raw, 82)
    # element 128h + 32j + 16s + l: (qs[32h + 16s + l] >> 2j) & 3
    q = qs.reshape(*qs.shape[:-1], 2, 1, 2, 16)
    shifts = (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1, 1)
    codes = ((q >> shifts) & 3).reshape(*qs.shape[:-1], QK_K)
    scales = d[..., None] * (sc & 0xF).float()
    offsets = -dmin[..., None] * (sc >> 4).float()
    return Decoded(codes, scales, offsets)


def _q3_k(raw: torch.Tensor) -> Decoded:
    hmask, qs, packed = raw[..., 0:32], raw[..., 32:96], raw[..., 96:108]
    d = _half(raw, 108)
    # element 128h + 32j + 16s + l: low bits (qs[32h + 16s + l] >> 2j) & 3, high bit hmask[16s + l] bit 4h + j
    q = qs.reshape(*qs.shape[:-1], 2, 1, 2, 16)
    shifts = (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1, 1)
    low = ((q >> shifts) & 3).reshape(*qs.shape[:-1], QK_K)
    hm = hmask.reshape(*hmask.shape[:-1], 1, 1, 2, 16)
    hshift = (torch.arange(2, dtype=torch.uint8).view(2, 1, 1, 1) * 4 + torch.arange(4, dtype=torch.uint8).view(1, 4, 1, 1))
    high = ((hm >> hshift) & 1).reshape(*hmask.shape[:-1], QK_K)
    codes = low | (high << 2)
    i = torch.arange(16)
    low_sc = (packed[..., i % 8] >> (4 * (i // 8)).to(torch.uint8)) & 0xF
    high_sc = (packed[..., 8 + i % 4] >> (2 * (i // 4)).to(torch.uint8)) & 3
    sc = (low_sc | (high_sc << 4)).float() - 32.0
    return Decoded(codes, d[..., None] * sc, None)


def _q45_k(bits: int, raw: torch.Tensor) -> Decoded:
    d, dmin = _half(raw, 0), _half(raw, 2)
    sc, mn = _k_scale_min(raw[..., 4:16])
    at = 16
    if bits == 5:
        qh = raw[..., 16:48]
        at = 48
    qs = raw[..., at:at + 128].reshape(*raw.shape[:-1], 4, 1, 32)  # element 64c + 32s + l: qs[32c + l] >> 4s
    codes = (qs >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)) & 0xF
    codes = codes.reshape(*raw.shape[:-1], QK_K)
    if bits == 5:  # fifth bit of element 64c + 32s + l: qh[l] bit 2c + s
        high = (qh[..., None, :] >> torch.arange(8, dtype=torch.uint8).view(8, 1)) & 1
        codes = codes | (high.reshape(*raw.shape[:-1], QK_K) << 4)
    return Decoded(codes, d[..., None] * sc, -dmin[..., None] * mn)


def _q6_k(raw: torch.Tensor) -> Decoded:
    ql, qh = raw[..., 0:128], raw[..., 128:192]
    sc = raw[..., 192:208].contiguous().view(torch.int8).float()
    d = _half(raw, 208)
    # element 128h + 32t + l: low nibble ql[64h + 32(t % 2) + l] >> 4(t // 2), high bits (qh[32h + l] >> 2t) & 3
    lo = ql.reshape(*ql.shape[:-1], 2, 1, 2, 32)
    lo = (lo >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1, 1)) & 0xF  # [.., 2h, 2(t//2), 2(t%2), 32]
    hi = qh.reshape(*qh.shape[:-1], 2, 1, 32)
    hi = (hi >> (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)) & 3  # [.., 2h, 4t, 32]
    codes = lo.reshape(*ql.shape[:-1], QK_K) | (hi.reshape(*qh.shape[:-1], QK_K) << 4)
    return Decoded(codes, d[..., None] * sc, None)


def decode(fmt: BlockFormat, raw: torch.Tensor) -> Decoded:
    """raw uint8 [R, K / block * block_bytes] -> the rows' canonical pieces."""
    r = raw.shape[0]
    blocks = raw.reshape(r, -1, fmt.block_bytes)
    if fmt.block == 32:
        out = _legacy(fmt, blocks)
    elif fmt.name == "Q2_K":
        out = _q2_k(blocks)
    elif fmt.name == "Q3_K":
        out = _q3_k(blocks)
    elif fmt.name in ("Q4_K", "Q5_K"):
        out = _q45_k(fmt.bits, blocks)
    else:
        out = _q6_k(blocks)
    codes = out.codes.reshape(r, -1)
    scales = out.scales.reshape(r, -1)
    offsets = None if out.offsets is None else out.offsets.reshape(r, -1)
    return Decoded(codes.contiguous(), scales.contiguous(), offsets)
