"""Test-side EXL2 quantizer and packer, written from the published layout, loop by loop.

Independent of the server's unpacking (quantizers/exl2.py, kernels/packing.py): codes are
packed unit by unit the way exllamav2's `pack_columns` kernel writes them (a unit is the
run of rows that fills whole words: 16 rows in 1 word at 2 bits, 32 in 3 at 3 bits, 8 in 1
at 4, 32 in 5 at 5, 16 in 3 at 6, 4 in 1 at 8; value i of a unit goes to bit 32w + (b*i -
32w) of word w, shifted left or right and cut to 32 bits), scale codes the way
`pack_rows_4` writes them (qs - 1 in nibble i of word j for column 8j + i, computed on
uint16 so a padded column's 0 - 1 = 0xFFFF spills into the nibbles above it), and scales
in numpy float16 the way the kernel's dq_scale computes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

UNITS = {2: (16, 1), 3: (32, 3), 4: (8, 1), 5: (32, 5), 6: (16, 3), 8: (4, 1)}  # bits -> (rows, words)
MASK32 = 0xFFFFFFFF


@dataclass
class Exl2Layer:
    """One quantized linear. Stored row j holds original input row perm[j]."""

    codes: np.ndarray  # int64 [K, N], stored (permuted) row order, unsigned: q in [0, 2^b)
    plan: list[tuple[int, int]]  # (bits, rows) per group, in stored order
    qscale: np.ndarray  # int64 [G, N] in 1..16
    qscale_max: np.ndarray  # float16 [G]
    perm: np.ndarray  # int64 [K]

    def scales(self) -> np.ndarray:
        """float32 [G, N]: fp16(qs^2 * fp16(qscale_max / 256)), as dq_scale on the fp16 q_scale_max does."""
        base = (self.qscale_max.astype(np.float32) / np.float32(256)).astype(np.float16)
        square = (self.qscale * self.qscale).astype(np.float32)
        return (square * base.astype(np.float32)[:, None]).astype(np.float16).astype(np.float32)

    def stored_groups(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.plan)), [rows for _, rows in self.plan])

    def dense(self) -> torch.Tensor:
        """[N, K] float32, original row order: the ground truth the server must reproduce."""
        group = self.stored_groups()
        mid = np.array([2 ** (bits - 1) for bits, _ in self.plan])[group]
        stored = (self.codes - mid[:, None]).astype(np.float64) * self.scales()[group].astype(np.float64)
        out = np.empty_like(stored)
        out[self.perm] = stored
        return torch.from_numpy(out.T.astype(np.float32).copy())


def quantize_exl2(weight: torch.Tensor, plan: list[tuple[int, int]], perm: torch.Tensor | None = None) -> Exl2Layer:
    """Round-to-nearest against exllamav2's fp16 scales, its error search skipped: qs = ceil(16 sqrt(s / s_max))."""
    n, k = weight.shape
    assert sum(rows for _, rows in plan) == k, "the plan must cover every input row"
    perm = np.arange(k) if perm is None else perm.numpy().astype(np.int64)
    w = weight.double().numpy().T[perm]  # [K, N] stored order
    codes = np.zeros((k, n), dtype=np.int64)
    qscale = np.zeros((len(plan), n), dtype=np.int64)
    qscale_max = np.zeros(len(plan), dtype=np.float16)
    row = 0
    for g, (bits, rows) in enumerate(plan):
        x = w[row:row + rows]
        maxq = 2 ** bits - 1
        base = (np.abs(x).max(axis=0) + 1e-12) / (maxq / 2)
        qscale_max[g] = np.float16(base.max())
        qscale[g] = np.clip(np.ceil(np.sqrt(base / base.max()) * 16), 1, 16)  # never below base: no clipping
        layer = Exl2Layer(codes, plan, qscale, qscale_max, perm)
        scale = layer.scales()[g].astype(np.float64)
        codes[row:row + rows] = np.clip(np.round(x / scale) + 2 ** (bits - 1), 0, maxq)
        row += rows
    return Exl2Layer(codes, plan, qscale, qscale_max, perm)


def wshift(x: np.ndarray, j: int) -> np.ndarray:
    """exllamav2's wshift on a column of codes: x << j for j >= 0, x >> -j otherwise, 0 past 32 bits."""
    if j <= -32 or j >= 32:
        return np.zeros_like(x)
    return (x << j) & MASK32 if j >= 0 else x >> -j


def pack_columns(codes: np.ndarray, bits: int) -> np.ndarray:
    """[rows, N] codes of one group -> uint32 [ceil(rows * bits / 32), N], unit by unit."""
    rows, n = codes.shape
    unit_rows, unit_words = UNITS[bits]
    units = -(-rows // unit_rows)
    padded = np.zeros((units * unit_rows, n), dtype=np.int64)  # a short last unit reads zeros
    padded[:rows] = codes
    out = np.zeros((units * unit_words, n), dtype=np.int64)
    for u in range(units):
        for i in range(unit_rows):
            x = padded[u * unit_rows + i]  # one row, every column at once
            for w in range(unit_words):
                out[u * unit_words + w] |= wshift(x, bits * i - 32 * w)
    qrows = -(-rows * bits // 32)
    return out[:qrows].astype(np.uint32)


def pack_rows_4(qscale: np.ndarray) -> np.ndarray:
    """[G, N] scale codes (0 in padded columns) -> uint32 [G, N / 8]."""
    g, n = qscale.shape
    out = np.zeros((g, n // 8), dtype=np.int64)
    for j in range(n // 8):
        for i in range(8):
            x = (qscale[:, 8 * j + i].astype(np.int64) - 1) & 0xFFFF  # every group at once, as uint16
            out[:, j] |= (x << (4 * i)) & MASK32
    return out.astype(np.uint32)


def as_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(words).astype(np.uint32).view(np.int32).copy())


def exl2_tensors(prefix: str, layer: Exl2Layer, with_perm: bool = False,
                 bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The tensors exllamav2's converter saves for one linear (adaptivegptq.py pack())."""
    k, n = layer.codes.shape
    padding = -n % 32
    qscale = np.pad(layer.qscale, ((0, 0), (0, padding)))
    q_weight, q_groups, row, word = [], [], 0, 0
    for bits, rows in layer.plan:
        codes = np.pad(layer.codes[row:row + rows], ((0, 0), (0, padding)), constant_values=2 ** (bits - 1))
        packed = pack_columns(codes, bits)
        q_groups += [bits, word]
        q_weight.append(packed)
        row += rows
        word += packed.shape[0]
    out = {
        f"{prefix}.q_weight": as_int32(np.concatenate(q_weight)),
        f"{prefix}.q_invperm": torch.from_numpy(np.argsort(layer.perm)).to(torch.int32),
        f"{prefix}.q_scale": as_int32(pack_rows_4(qscale)),
        f"{prefix}.q_scale_max": torch.from_numpy(layer.qscale_max.copy()),
        f"{prefix}.q_groups": torch.tensor(q_groups, dtype=torch.int16),
    }
    if with_perm:
        out[f"{prefix}.q_perm"] = torch.from_numpy(layer.perm.copy()).to(torch.int32)
    if bias is not None:
        out[f"{prefix}.bias"] = bias.half()
    return out
