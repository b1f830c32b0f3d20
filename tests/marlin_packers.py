"""Test-side Marlin and Marlin 2:4 packers, transcribed step by step from the published description.

Independent of the server's kernels/marlin.py (which computes one gather index per tile
strip): these follow the steps as IST-DASLab Marlin's Layer.pack, Sparse-Marlin and vLLM's
marlin_utils_test(_24).py describe them, loop by loop in numpy:
1. cut codes [K, N] into 16x16 tiles, lay each tile row out tile after tile;
2. permute every 1024 values with the warp-fragment permutation (then the interleave);
3. pack 32/bits codes per int32, least significant first;
4. permute scale columns in blocks (64 grouped, 32 per-channel; 2:4: its own 64 / identity);
2:4 first compresses each quad of K to its two kept values and 4-bit position codes, then
scatters the position codes into CUTLASS's reordered metadata layout.
"""

from __future__ import annotations

import numpy as np
import torch
from quant_packers import Quantized


def fragment_perm(bits: int, sparse_24: bool = False) -> np.ndarray:
    """The 1024-entry weight permutation (IST _get_perms; Sparse-Marlin / vLLM get_weight_perm_24)."""
    perm = []
    for thread in range(32):
        column = thread // 4
        rows = [2 * (thread % 4), 2 * (thread % 4) + 1, 2 * (thread % 4 + 4), 2 * (thread % 4 + 4) + 1]
        first = []
        for half in (0, 1):
            for row in rows:
                if sparse_24:
                    first.append(16 * row + (column // 2) * 256 + 8 * (column % 2) + 4 * half)
                else:
                    first.append(16 * row + column + 8 * half)
        for repeat in range(4):
            step = repeat if sparse_24 else 256 * repeat
            perm.extend(p + step for p in first)
    interleave = [0, 2, 4, 6, 1, 3, 5, 7] if bits == 4 else [0, 2, 1, 3]
    perm = np.array(perm).reshape(-1, len(interleave))[:, interleave]
    return perm.reshape(-1)


def scale_perms(sparse_24: bool = False) -> tuple[list[int], list[int]]:
    """(grouped, single) column orders of s."""
    if sparse_24:
        grouped = [8 * i + j for i in range(8) for j in (0, 4, 1, 5, 2, 6, 3, 7)]
        return grouped, list(range(64))
    grouped = [i + 8 * j for i in range(8) for j in range(8)]
    single = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    return grouped, single


def tile_and_pack(codes: np.ndarray, bits: int, sparse_24: bool = False) -> torch.Tensor:
    """Steps 1-3 on unsigned codes [rows, N] -> int32 [rows/16, 16N*bits/32]."""
    rows, n = codes.shape
    w = codes.astype(np.int64).reshape(rows // 16, 16, n // 16, 16).transpose(0, 2, 1, 3).reshape(rows // 16, 16 * n)
    w = w.reshape(-1, 1024)[:, fragment_perm(bits, sparse_24)].reshape(rows // 16, 16 * n)
    per = 32 // bits
    out = np.zeros((w.shape[0], w.shape[1] // per), dtype=np.uint64)
    w = w.astype(np.uint64)
    for i in range(per):
        out |= w[:, i::per] << np.uint64(bits * i)
    return torch.from_numpy(out.astype(np.uint32).view(np.int32).copy())


def permute_scales(scales: torch.Tensor, grouped: bool, sparse_24: bool = False) -> torch.Tensor:
    perm = scale_perms(sparse_24)[0 if grouped else 1]
    s = scales.numpy().reshape(-1, len(perm))[:, perm]
    return torch.from_numpy(np.ascontiguousarray(s.reshape(scales.shape)))


def marlin_tensors(prefix: str, q: Quantized) -> dict[str, torch.Tensor]:
    """What a Marlin checkpoint stores for one symmetric 4-bit linear."""
    assert q.sym and q.bits == 4
    grouped = q.scales.shape[0] > 1
    return {f"{prefix}.B": tile_and_pack(q.codes.numpy(), 4),
            f"{prefix}.s": permute_scales(q.scales.half(), grouped)}


def marlin_zero_points(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """vLLM marlin_zero_points: grouped scale order, then the interleave, packed along N."""
    grouped, _ = scale_perms()
    z = zeros.numpy().astype(np.int64).reshape(-1, 64)[:, grouped]
    interleave = [0, 2, 4, 6, 1, 3, 5, 7] if bits == 4 else [0, 2, 1, 3]
    z = z.reshape(-1, len(interleave))[:, interleave].reshape(zeros.shape).astype(np.uint64)
    per = 32 // bits
    out = np.zeros((z.shape[0], z.shape[1] // per), dtype=np.uint64)
    for i in range(per):
        out |= z[:, i::per] << np.uint64(bits * i)
    return torch.from_numpy(out.astype(np.uint32).view(np.int32).copy())


# -- 2:4 ------------------------------------------------------------------------------------------
def compress_24(codes: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes [K, N] (2:4 along K) -> (kept codes [K/2, N], B_meta int16 [K/32, 2N]).

    As vLLM compress_quantized_24_weight: remove the zero point, transpose to [N, K], encode
    each quad's non-zero mask with CUTLASS's boolean expressions, reorder the metadata.
    """
    zero = 1 << (bits - 1)
    dense = (codes.astype(np.int64) - zero).T  # [N, K]
    m, k = dense.shape
    quads = dense.reshape(m, k // 4, 4)
    m0, m1, m2, m3 = (quads[..., i] != 0 for i in range(4))
    expr0, expr1, expr2 = m0 & m1, ~m0 & m1, ~m0 & ~m1
    idx0 = expr1.astype(np.int64) | (expr2.astype(np.int64) << 1)
    idx1 = (expr0 | expr2 | m3).astype(np.int64) | ((expr1 | ~m1).astype(np.int64) << 1)
    kept0 = np.take_along_axis(quads, idx0[..., None], axis=2)[..., 0]
    kept1 = np.take_along_axis(quads, idx1[..., None], axis=2)[..., 0]
    sparse = np.stack([kept0, kept1], axis=-1).reshape(m, k // 2)
    nibbles = (idx0 | (idx1 << 2)).reshape(m, k // 16, 4)
    meta = np.zeros((m, k // 16), dtype=np.int64)
    for j in range(4):
        meta |= nibbles[:, :, j] << (4 * j)
    # Reordering (Sparse-Marlin _calculate_meta_reordering_scatter_offsets, int16 metadata).
    ncols = k // 16
    reordered = np.zeros(m * ncols, dtype=np.int64)
    for row in range(m):
        dst = (row // 64 * 64 + (row % 2) * 2 + (row % 8) // 4 + ((row % 32) % 4) // 2 * 32
               + ((row % 64) // 8) * 4)
        for col in range(ncols):
            r, c = dst, col
            if r % 2 == 0 and c % 2 == 1:
                r, c = r + 1, c - 1
            elif r % 2 == 1 and c % 2 == 0:
                r, c = r - 1, c + 1
            reordered[(c // 2) * m * 2 + r * 2 + c % 2] = meta[row, col]
    b_meta = reordered.astype(np.uint16).view(np.int16).reshape(ncols // 2, m * 2)  # resize_, no data moved
    return (sparse.T + zero), b_meta


def marlin24_tensors(prefix: str, q: Quantized) -> dict[str, torch.Tensor]:
    """What a Marlin 2:4 checkpoint stores for one symmetric linear whose codes are 2:4 along K."""
    assert q.sym
    kept, b_meta = compress_24(q.codes.numpy(), q.bits)
    grouped = q.scales.shape[0] > 1
    return {f"{prefix}.B_24": tile_and_pack(np.ascontiguousarray(kept), q.bits, sparse_24=True),
            f"{prefix}.B_meta": torch.from_numpy(b_meta.copy()),
            f"{prefix}.s": permute_scales(q.scales.half(), grouped, sparse_24=True)}


def prune_24(weight: torch.Tensor) -> torch.Tensor:
    """[N, K]: keeps the 2 largest magnitudes of every 4 consecutive inputs (mask_creator's rule)."""
    n, k = weight.shape
    quads = weight.reshape(n, k // 4, 4)
    drop = quads.abs().argsort(dim=2)[..., :2]
    return quads.scatter(2, drop, 0.0).reshape(n, k)
