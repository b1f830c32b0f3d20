"""Test-side quantizer and packers: checkpoints written the way the published tools write them.

Independent of the server's own unpacking (kernels/packing.py): these follow the
layouts in specs/formats.md bit for bit, loop by loop, including GPTQ v1's
zero-point off-by-one, AWQ's nibble interleave and compressed-tensors' signed
codes with an offset. Loader tests compare what the server reads back against the
dense weights computed here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a word holds column 8j + AWQ_ORDER[i]


@dataclass
class Quantized:
    """Round-to-nearest result in unsigned form: W[n, k] = scales[g, n] * (codes[k, n] - zeros[g, n])."""

    codes: torch.Tensor  # int64 [K, N] in [0, 2^bits)
    scales: torch.Tensor  # float32 [G, N]
    zeros: torch.Tensor  # int64 [G, N]; 2^(bits-1) everywhere when symmetric
    g_idx: torch.Tensor  # int32 [K]
    bits: int
    group_size: int  # -1: one group
    sym: bool

    def dense(self) -> torch.Tensor:
        """[N, K] float32: the ground truth the server must reproduce."""
        g = self.g_idx.long()
        return ((self.codes - self.zeros[g]).double() * self.scales.double()[g]).t().float().contiguous()


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int, sym: bool,
                 perm: torch.Tensor | None = None, static_groups: bool = False) -> Quantized:
    """Round-to-nearest with GPTQ's min/max rule. `perm` makes act-order groups: with
    static groups g_idx stays k // g; otherwise group i holds rows perm[i*g:(i+1)*g]."""
    n, k = weight.shape
    w = weight.t().double()  # [K, N]
    maxq = 2 ** bits - 1
    size = k if group_size == -1 else group_size
    if perm is None or static_groups:
        g_idx = torch.arange(k) // size
    else:
        g_idx = torch.empty(k, dtype=torch.long)
        g_idx[perm] = torch.arange(k) // size
    groups = int(g_idx.max()) + 1
    scales = torch.empty(groups, n, dtype=torch.float64)
    zeros = torch.empty(groups, n, dtype=torch.long)
    for g in range(groups):
        rows = w[g_idx == g]
        lo, hi = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        if sym:
            amax = torch.maximum(lo.abs(), hi)
            scale = (2 * amax / maxq).clamp(min=1e-8)
            zero = torch.full((n,), 2 ** (bits - 1), dtype=torch.long)
        else:
            scale = ((hi - lo) / maxq).clamp(min=1e-8)
            zero = torch.round(-lo / scale).long().clamp(1, maxq)  # >= 1: GPTQ v1 cannot store 0
        # Scales are stored in float16: quantize against the stored value.
        scales[g] = scale.half().double()
        zeros[g] = zero
    codes = torch.round(w / scales[g_idx]).long() + zeros[g_idx]
    codes = codes.clamp(0, maxq)
    return Quantized(codes, scales.float(), zeros, g_idx.to(torch.int32), bits, group_size, sym)


# -- GPTQ ---------------------------------------------------------------------------
def pack_gptq_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[K, N] codes -> int32 [K*bits/32, N]: row k in word-row k // (32/bits), least significant first.

    3-bit: each block of 32 rows is one 96-bit little-endian stream over 3 words,
    value j at bit 3j (values 10 and 21 straddle words), as AutoGPTQ's pack loop writes it.
    """
    v = values.numpy().astype(np.uint64)
    k, n = v.shape
    if bits == 3:
        assert k % 32 == 0, "3-bit GPTQ packs 32 rows per 3 words"
        out = np.zeros((k // 32 * 3, n), dtype=np.uint64)
        for block in range(k // 32):
            for j in range(32):
                bit = 3 * j
                word, shift = block * 3 + bit // 32, bit % 32
                out[word] |= (v[block * 32 + j] << np.uint64(shift)) & np.uint64(0xFFFFFFFF)
                if shift + 3 > 32:  # the high bits spill into the next word
                    out[word + 1] |= v[block * 32 + j] >> np.uint64(32 - shift)
    else:
        per = 32 // bits
        assert k % per == 0
        out = np.zeros((k // per, n), dtype=np.uint64)
        for i in range(per):
            out |= v[i::per] << np.uint64(bits * i)
    return torch.from_numpy(out.astype(np.uint32).view(np.int32).copy())


def gptq_tensors(prefix: str, q: Quantized, fmt: str = "gptq", with_g_idx: bool = True,
                 bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The tensors AutoGPTQ (fmt "gptq", v1) or GPTQModel ("gptq_v2") saves for one linear."""
    zeros = q.zeros.clone()
    if fmt == "gptq":
        # v1 writers store zero - 1 (a symmetric 4-bit word reads 0x77777777).
        assert int(zeros.min()) >= 1, "GPTQ v1 cannot store a zero point of 0"
        zeros -= 1
    out = {
        f"{prefix}.qweight": pack_gptq_rows(q.codes, q.bits),
        f"{prefix}.qzeros": pack_gptq_rows(zeros.t().contiguous(), q.bits).t().contiguous(),
        f"{prefix}.scales": q.scales.half(),
    }
    if with_g_idx:
        out[f"{prefix}.g_idx"] = q.g_idx.clone()
    if bias is not None:
        out[f"{prefix}.bias"] = bias.half()
    return out


# -- AWQ ------------------------------------------------------------------------------
def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[R, N] 4-bit codes -> int32 [R, N/8], AutoAWQ GEMM's interleaved nibbles."""
    v = values.numpy().astype(np.uint64)
    r, n = v.shape
    assert n % 8 == 0
    out = np.zeros((r, n // 8), dtype=np.uint64)
    for col in range(n // 8):
        for i in range(8):
            out[:, col] |= v[:, col * 8 + AWQ_ORDER[i]] << np.uint64(4 * i)
    return torch.from_numpy(out.astype(np.uint32).view(np.int32).copy())


def awq_tensors(prefix: str, q: Quantized, bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    assert q.bits == 4 and not bool((q.g_idx != torch.arange(len(q.g_idx)) // q.group_size).any())
    out = {
        f"{prefix}.qweight": pack_awq(q.codes),
        f"{prefix}.qzeros": pack_awq(q.zeros),  # no off-by-one in AWQ
        f"{prefix}.scales": q.scales.half(),
    }
    if bias is not None:
        out[f"{prefix}.bias"] = bias.half()
    return out


# -- compressed-tensors -----------------------------------------------------------------
def pack_ct(signed: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """compressed-tensors pack_to_int32: int8 signed codes + 2^(bits-1), packed along `dim`, padded."""
    offset = 1 << (bits - 1)
    v = (signed.to(torch.int32) + offset).numpy().astype(np.uint64)
    if dim == 0:
        v = v.T
    rows, cols = v.shape
    per = 32 // bits
    words = -(-cols // per)
    v = np.pad(v, ((0, 0), (0, words * per - cols)))
    out = np.zeros((rows, words), dtype=np.uint64)
    for i in range(per):
        out |= v[:, i::per] << np.uint64(bits * i)
    if dim == 0:
        out = out.T
    return torch.from_numpy(np.ascontiguousarray(out).astype(np.uint32).view(np.int32).copy())


def ct_tensors(prefix: str, q: Quantized, with_g_idx: bool, bias: torch.Tensor | None = None
               ) -> dict[str, torch.Tensor]:
    """pack-quantized: weight_packed [N, ceil(K/(32/b))], weight_scale [N, G], packed zero points."""
    offset = 1 << (q.bits - 1)
    signed = (q.codes.t() - offset).to(torch.int8)  # [N, K]
    k = q.codes.shape[0]
    out = {
        f"{prefix}.weight_packed": pack_ct(signed, q.bits),
        f"{prefix}.weight_scale": q.scales.t().contiguous().half(),
        f"{prefix}.weight_shape": torch.tensor([q.codes.shape[1], k], dtype=torch.int32),
    }
    if not q.sym:
        out[f"{prefix}.weight_zero_point"] = pack_ct((q.zeros.t() - offset).to(torch.int8), q.bits, dim=0)
    if with_g_idx:
        out[f"{prefix}.weight_g_idx"] = q.g_idx.clone()
    if bias is not None:
        out[f"{prefix}.bias"] = bias.half()
    return out
