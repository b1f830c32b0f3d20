"""Exact pack/unpack for the integer layouts quantized checkpoints store.

Every layout here is one primitive: a dense little-endian bitstream of b-bit codes
in int32 words (code i of a run at bit b*i, least significant first; a code may
straddle two words when b does not divide 32, as GPTQ 3-bit does: 32 codes in 3
words). The layouts differ only in which axis is packed and, for AWQ, in a fixed
column interleave inside each word. Codes are always unsigned (the zero point,
the signed offset of compressed-tensors and GPTQ v1's off-by-one are checkpoint
semantics that loaders apply; packing never changes a value).

Unpacked codes are uint8; packed words are int32 with the top bit carried as the
sign, exactly as the checkpoints store them.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "AWQ_ORDER",
    "pack_bits",
    "unpack_bits",
    "packed_len",
    "pack_gptq_qweight",
    "unpack_gptq_qweight",
    "pack_gptq_qzeros",
    "unpack_gptq_qzeros",
    "pack_awq",
    "unpack_awq",
    "pack_pack_quantized",
    "unpack_pack_quantized",
]

# AWQ GEMM: nibble i (bits 4i..4i+3) of word j holds column 8j + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_INVERSE = tuple(AWQ_ORDER.index(c) for c in range(8))

_MASK32 = (1 << 32) - 1


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in [1, 8], got {bits!r}")


def packed_len(length: int, bits: int) -> int:
    """int32 words holding `length` codes of `bits` bits, densely."""
    _check_bits(bits)
    return math.ceil(length * bits / 32)


def _chunk(bits: int) -> tuple[int, int]:
    # The bit pattern repeats every `values` codes, which fill exactly `words` words.
    g = math.gcd(32, bits)
    return 32 // g, bits // g


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    # words: int64 in [0, 2^32) -> the same 32 bits as int32 (explicit two's complement).
    return (words - ((words >> 31) & 1) * (1 << 32)).to(torch.int32)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packs the last dim of unsigned codes [..., L] into int32 words [..., ceil(L*bits/32)]."""
    _check_bits(bits)
    if codes.dtype.is_floating_point or codes.dtype == torch.bool or codes.is_complex():
        raise ValueError(f"codes must be an integer tensor, got {codes.dtype}")
    length = codes.shape[-1]
    n_words = packed_len(length, bits)
    if codes.numel() == 0:
        return torch.zeros(*codes.shape[:-1], n_words, dtype=torch.int32, device=codes.device)
    c = codes.to(torch.int64)
    lo, hi = int(c.min()), int(c.max())
    if lo < 0 or hi >= 1 << bits:
        raise ValueError(f"codes must be in [0, {1 << bits}) for {bits}-bit packing, got [{lo}, {hi}]")
    values, words = _chunk(bits)
    pad = (-length) % values
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    c = c.reshape(*c.shape[:-1], -1, values)  # [..., chunks, values]
    out = torch.zeros(*c.shape[:-1], words, dtype=torch.int64, device=c.device)
    for i in range(values):
        word, shift = divmod(bits * i, 32)
        v = c[..., i]
        out[..., word] |= (v << shift) & _MASK32
        if shift + bits > 32:  # the high bits spill into the next word
            out[..., word + 1] |= v >> (32 - shift)
    out = out.reshape(*out.shape[:-2], -1)[..., :n_words]
    return _to_int32(out)


def unpack_bits(packed: torch.Tensor, bits: int, length: int | None = None) -> torch.Tensor:
    """Inverse of pack_bits: int32 words [..., W] -> uint8 codes [..., length].

    `length` defaults to every whole code the words hold; it must need exactly W words.
    """
    _check_bits(bits)
    if packed.dtype != torch.int32:
        raise ValueError(f"packed words must be int32, got {packed.dtype}")
    n_words = packed.shape[-1]
    if length is None:
        length = n_words * 32 // bits
    if packed_len(length, bits) != n_words:
        raise ValueError(f"{length} codes of {bits} bits pack into {packed_len(length, bits)} int32 words, "
                         f"got {n_words}")
    values, words = _chunk(bits)
    chunks = math.ceil(length / values)
    w = packed.to(torch.int64) & _MASK32
    pad = chunks * words - n_words
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    w = w.reshape(*w.shape[:-1], chunks, words)
    mask = (1 << bits) - 1
    out = torch.empty(*w.shape[:-1], values, dtype=torch.int64, device=w.device)
    for i in range(values):
        word, shift = divmod(bits * i, 32)
        v = w[..., word] >> shift
        if shift + bits > 32:
            v = v | (w[..., word + 1] << (32 - shift))
        out[..., i] = v & mask
    out = out.reshape(*out.shape[:-2], -1)[..., :length]
    return out.to(torch.uint8)


def _check_2d(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {list(t.shape)}")


# GPTQ --------------------------------------------------------------------------------------


def pack_gptq_qweight(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [K, N] -> qweight int32 [ceil(K*bits/32), N], packed down the input rows."""
    _check_2d(codes, "codes")
    return pack_bits(codes.t(), bits).t().contiguous()


def unpack_gptq_qweight(qweight: torch.Tensor, bits: int, in_features: int | None = None) -> torch.Tensor:
    """qweight int32 [ceil(K*bits/32), N] -> codes uint8 [K, N]."""
    _check_2d(qweight, "qweight")
    return unpack_bits(qweight.t(), bits, in_features).t().contiguous()


def pack_gptq_qzeros(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """Zero-point codes [G, N] -> qzeros int32 [G, ceil(N*bits/32)], packed along the outputs.

    The codes are stored as given: a GPTQ v1 writer passes z - 1 (see unpack_gptq_qzeros).
    """
    _check_2d(zeros, "zeros")
    return pack_bits(zeros, bits)


def unpack_gptq_qzeros(qzeros: torch.Tensor, bits: int, out_features: int | None = None) -> torch.Tensor:
    """qzeros int32 [G, ceil(N*bits/32)] -> stored codes uint8 [G, N].

    These are the stored codes: checkpoint format "gptq" (v1) means z = stored + 1 (the
    original packer subtracted one before storing), "gptq_v2" means z = stored.
    """
    _check_2d(qzeros, "qzeros")
    return unpack_bits(qzeros, bits, out_features)


# AWQ (GEMM) --------------------------------------------------------------------------------


def pack_awq(codes: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """4-bit codes [R, N] -> int32 [R, N/8] with the GEMM interleave; qweight (R=K) and qzeros (R=G)."""
    _check_2d(codes, "codes")
    if bits != 4:
        raise ValueError(f"AWQ GEMM packs 4-bit codes only, got {bits}-bit")
    n = codes.shape[1]
    if n % 8:
        raise ValueError(f"AWQ GEMM needs the output dim to be a multiple of 8, got {n}")
    # Slot i of each 8-column block takes column AWQ_ORDER[i].
    order = torch.tensor(AWQ_ORDER, device=codes.device)
    inter = codes.reshape(codes.shape[0], n // 8, 8).index_select(2, order).reshape(codes.shape[0], n)
    return pack_bits(inter, 4)


def unpack_awq(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [R, N/8] with the GEMM interleave -> codes uint8 [R, N]."""
    _check_2d(packed, "packed")
    if bits != 4:
        raise ValueError(f"AWQ GEMM packs 4-bit codes only, got {bits}-bit")
    rows, words = packed.shape
    inter = unpack_bits(packed, 4, words * 8)
    inverse = torch.tensor(_AWQ_INVERSE, device=packed.device)
    return inter.reshape(rows, words, 8).index_select(2, inverse).reshape(rows, words * 8)


# compressed-tensors pack-quantized --------------------------------------------------------


def pack_pack_quantized(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [N, K] (signed value + 2^(bits-1)) -> weight_packed int32 [N, ceil(K*bits/32)].

    Packed along K, least significant first; for 2, 4 and 8 bits this is ceil(K / (32/bits))
    words. Other widths use the dense layout of current compressed-tensors releases.
    """
    _check_2d(codes, "codes")
    return pack_bits(codes, bits)


def unpack_pack_quantized(packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """weight_packed int32 [N, ceil(K*bits/32)] -> unsigned codes uint8 [N, K] (weight_shape gives K)."""
    _check_2d(packed, "weight_packed")
    return unpack_bits(packed, bits, in_features)
