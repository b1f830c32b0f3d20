"""GPTQ: quantize a linear layer column by column, pushing each column's error onto the rest.

Frantar et al. (2022) minimise ||X W^T - X Q^T||^2 over the calibration inputs X.
With H = 2 X^T X / n, quantizing column k of W leaves an error that the not yet
quantized columns can absorb: subtract err * Hinv[k, k:] / Hinv[k, k] from them
(the Optimal Brain Surgeon update). Working through the upper Cholesky factor of
H^-1 gives those rows directly, and doing it in blocks of columns turns most of
the work into one matmul per block.

Options, all of which change only *which* grid each column uses or *when*:
- group_size: every `group_size` consecutive columns (in processing order) get a
  fresh min/max grid, computed from the weights as updated so far (-1: one grid per
  row, computed up front).
- act_order: process columns by descending diag(H), the most sensitive first, so
  their error is spread over the most remaining columns. Groups then follow the
  permutation, so g_idx is not monotonic.
- static_groups: with act_order, compute every group's grid up front on the
  unpermuted weight, so g_idx stays k // group_size (kernels that cannot gather
  scales per row can still run it).

Rows are independent given H, so a fused weight (q, k and v share their input)
quantizes in one call and its rows split back into the checkpoint's tensors.
The result is the canonical `QuantizedWeight` (kernels/base.py); `gptq_tensors`
packs it into the qweight/qzeros/scales/g_idx a GPTQ checkpoint stores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from loguru import logger

from text_generation_server.kernels import packing
from text_generation_server.kernels.base import QuantizedWeight
from text_generation_server.quantizers.rtn import check_bits, check_group_size, grid_params, quantize_codes


class HessianAccumulator:
    """H = 2 X^T X / n over every input row a linear sees, accumulated batch by batch.

    Kept as a running mean so the magnitude of H does not grow with the number of
    calibration tokens (float32 stays accurate over many batches). The rescale and the
    product are one addmm (no scaled copy of the batch). H is symmetric, so for wide
    inputs only the blocks on and above the diagonal are computed (62% of the
    multiply-adds at 4 blocks); the lower blocks are mirrored when `hessian` is read.
    """

    def __init__(self, in_features: int, device: torch.device | None = None, blocks: int | None = None):
        self.in_features = in_features
        self._hessian = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.rows = 0
        if blocks is None:
            blocks = hessian_blocks(in_features)
        step = -(-in_features // max(1, blocks))
        edges = list(range(0, in_features, step)) + [in_features]
        self._spans = [slice(a, b) for a, b in zip(edges, edges[1:])]
        self._mirrored = True

    def add(self, x: torch.Tensor) -> None:
        # x: [..., K]
        x = x.reshape(-1, x.shape[-1])
        if x.dtype != torch.float32:
            x = x.float()
        if x.shape[1] != self.in_features:
            raise ValueError(f"inputs have {x.shape[1]} features, the accumulator expects {self.in_features}")
        batch = x.shape[0]
        if batch == 0:
            return
        total = self.rows + batch
        beta, alpha = self.rows / total, 2.0 / total
        for i, rows in enumerate(self._spans):
            xt = x[:, rows].t()
            for cols in self._spans[i:]:
                self._hessian[rows, cols].addmm_(xt, x[:, cols], beta=beta, alpha=alpha)
        self.rows = total
        self._mirrored = len(self._spans) == 1

    @property
    def hessian(self) -> torch.Tensor:
        """The full [K, K] matrix (lower blocks copied from the upper ones on first read)."""
        if not self._mirrored:
            for i, rows in enumerate(self._spans):
                for cols in self._spans[i + 1:]:
                    self._hessian[cols, rows] = self._hessian[rows, cols].t()
            self._mirrored = True
        return self._hessian


def hessian_blocks(in_features: int) -> int:
    """Diagonal blocks for HessianAccumulator: one for narrow inputs (a single GEMM is faster
    there), 4 to 8 for wide ones, each at least 1024 wide so every GEMM stays efficient."""
    if in_features < 512:
        return 1
    return min(8, max(4, in_features // 1024))


@dataclass
class GPTQResult:
    weight: QuantizedWeight
    dequantized: torch.Tensor  # [N, K] float32, what the checkpoint now computes
    damp: float  # the dampening actually added to diag(H)


def _inverse_cholesky(hessian: torch.Tensor, percdamp: float) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of (H + damp I)^-1, raising damp until H is positive definite.

    With J the reversal permutation and J (H + damp I) J = L L^T, the factor is J L^-1 J
    (upper triangular, positive diagonal, and its U^T U is the inverse): one Cholesky and one
    triangular inverse, against a Cholesky, a full inverse and a second Cholesky (2.5x the
    arithmetic; 11008 inputs: 8 s against 13-40 s on 2 cores).
    """
    diag_mean = float(torch.mean(torch.diag(hessian)))
    damp = percdamp * diag_mean
    eye = torch.eye(hessian.shape[0], dtype=hessian.dtype, device=hessian.device)
    for attempt in range(6):
        damped = hessian + damp * eye
        chol, info = torch.linalg.cholesky_ex(damped.flip(0, 1))
        if int(info) == 0:
            upper = _lower_triangular_inverse(chol).flip(0, 1)
            if bool(torch.isfinite(upper).all()) and bool((torch.diagonal(upper) > 0).all()):
                return upper, damp
        new_damp = max(damp * 10, diag_mean * 1e-2, 1e-6)
        logger.warning("GPTQ: H + {:.3g} I is not positive definite; retrying with damp {:.3g}", damp, new_damp)
        damp = new_damp
    raise ValueError(
        f"GPTQ: the Hessian is not positive definite even with damp {damp:.3g} (mean diag {diag_mean:.3g}); "
        "the calibration data may be degenerate (too few or repeated tokens)"
    )


def _lower_triangular_inverse(lower: torch.Tensor, leaf: int = 512) -> torch.Tensor:
    """L^-1 by halves: [[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]], so most of the work
    is two matmuls per level (torch has no triangular inverse; a triangular solve against the
    identity does 3x the arithmetic)."""
    n = lower.shape[0]
    if n <= leaf:
        return torch.linalg.solve_triangular(lower, torch.eye(n, dtype=lower.dtype, device=lower.device), upper=False)
    half = n // 2
    top = _lower_triangular_inverse(lower[:half, :half], leaf)
    bottom = _lower_triangular_inverse(lower[half:, half:], leaf)
    out = torch.zeros_like(lower)
    out[:half, :half] = top
    out[half:, half:] = bottom
    out[half:, :half] = -(bottom @ (lower[half:, :half] @ top))
    return out


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool,
    act_order: bool = False,
    static_groups: bool = False,
    percdamp: float = 0.01,
    block_size: int = 128,
    min_zero: int = 0,
    scale_dtype: torch.dtype | None = torch.float16,
) -> GPTQResult:
    """Quantizes a dense weight [N, K] given the Hessian [K, K] of its inputs.

    `min_zero` = 1 keeps zero points storable in GPTQ v1 checkpoints (see rtn.grid_params).
    """
    check_bits(bits)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {list(weight.shape)}")
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(f"Hessian must be [{k}, {k}] for a weight with {k} input features, "
                         f"got {list(hessian.shape)}")
    if not 0 <= percdamp:
        raise ValueError(f"percdamp must be >= 0, got {percdamp}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    g = check_group_size(group_size, k)
    per_channel = g == k
    groups = k // g

    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    # Inputs that are always zero carry no information: quantize their weights to exactly 0.
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    device = w.device
    scales = torch.empty(groups, n, dtype=torch.float32, device=device)
    zeros = torch.empty(groups, n, dtype=torch.float32, device=device)
    # The grids computed before any column moves: per-channel, and static groups.
    if per_channel:
        s, z = grid_params(w, bits, sym, min_zero, scale_dtype)
        scales[0], zeros[0] = s, z
    elif static_groups:
        s, z = grid_params(w.reshape(n, groups, g), bits, sym, min_zero, scale_dtype)  # [N, G]
        scales.copy_(s.t())
        zeros.copy_(z.t())

    if act_order:
        perm = torch.argsort(torch.diag(h), descending=True, stable=True)
        w = w[:, perm]
        h = h[perm][:, perm]
    else:
        perm = torch.arange(k, device=device)

    hinv, damp = _inverse_cholesky(h, percdamp)
    del h

    # Group of each processed column (position i holds original column perm[i]).
    if per_channel:
        col_group = torch.zeros(k, dtype=torch.long, device=device)
    elif static_groups:
        col_group = perm // g
    else:
        col_group = torch.arange(k, device=device) // g
    dynamic_groups = not per_channel and not static_groups

    groups_of = col_group.tolist()
    codes = torch.empty(n, k, dtype=torch.float32, device=device)
    deq = torch.empty(n, k, dtype=torch.float32, device=device)
    # Two levels of lazy updates: a column's error reaches the rest of its sub-block of `sub`
    # columns at once (rank 1, in place), the rest of its block once per sub-block (a matmul) and
    # later blocks once per block (a matmul). The arithmetic is GPTQ's; only when each update
    # lands changes. `sub` divides the group size, so a dynamic group always starts a sub-block
    # and sees every update of the columns before it.
    sub = math.gcd(16, block_size, g) if dynamic_groups else min(16, block_size)
    for start in range(0, k, block_size):
        stop = min(start + block_size, k)
        block = w[:, start:stop].clone()  # [N, B]
        errors = torch.empty_like(block)
        hblock = hinv[start:stop, start:stop]
        width = stop - start
        for sub_start in range(0, width, sub):
            sub_stop = min(sub_start + sub, width)
            for i in range(sub_start, sub_stop):
                col = start + i
                if dynamic_groups and col % g == 0:
                    # The group's columns as they stand now: this block's updated ones, then later
                    # blocks' with the updates this block has not yet applied to them.
                    later = w[:, stop:col + g]
                    if later.shape[1] and i:
                        later = later - errors[:, :i] @ hinv[start:col, stop:col + g]
                    span = torch.cat([block[:, i:], later], dim=1)[:, :g]
                    scales[col // g], zeros[col // g] = grid_params(span, bits, sym, min_zero, scale_dtype)
                grp = groups_of[col]
                s, z = scales[grp], zeros[grp]
                column = block[:, i]
                q = quantize_codes(column, s, z, bits)
                dq = s * (q - z)
                codes[:, col] = q
                deq[:, col] = dq
                err = (column - dq) / hblock[i, i]
                errors[:, i] = err
                block[:, i + 1:sub_stop].addr_(err, hblock[i, i + 1:sub_stop], alpha=-1)
            if sub_stop < width:
                block[:, sub_stop:].addmm_(errors[:, sub_start:sub_stop], hblock[sub_start:sub_stop, sub_stop:],
                                           alpha=-1)
        w[:, stop:] -= errors @ hinv[start:stop, stop:]

    inverse = torch.argsort(perm)
    codes = codes[:, inverse]
    deq = deq[:, inverse]
    g_idx = col_group[inverse].to(torch.int32)
    result = QuantizedWeight(
        qweight=codes.t().to(torch.uint8).contiguous(),
        scales=scales,
        zeros=None if sym else zeros,
        g_idx=g_idx,
        bits=bits,
        group_size=g,
    )
    return GPTQResult(weight=result, dequantized=deq, damp=damp)


def output_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """Relative output MSE ||X (approx - W)^T||^2 / ||X W^T||^2, read off H = 2 X^T X / n."""
    delta = (approx.float() - weight.float())
    num = torch.sum((delta @ hessian) * delta)
    den = torch.sum((weight.float() @ hessian) * weight.float())
    return float(num / den) if float(den) > 0 else float(num)


# -- from the canonical result to GPTQ checkpoint tensors ---------------------------------------
def packing_multiple(bits: int) -> int:
    """Codes per whole run of int32 words (8 at 4-bit, 32 at 3-bit): qweight rows and qzeros columns."""
    return 32 // math.gcd(32, bits)


def split_columns(weight: QuantizedWeight, start: int, count: int) -> QuantizedWeight:
    """Output features start..start+count of a fused quantized weight (codes are [K, N])."""
    cols = slice(start, start + count)
    return QuantizedWeight(qweight=weight.qweight[:, cols].contiguous(), scales=weight.scales[:, cols].contiguous(),
                           zeros=None if weight.zeros is None else weight.zeros[:, cols].contiguous(),
                           g_idx=weight.g_idx, bits=weight.bits, group_size=weight.group_size)


def gptq_tensors(prefix: str, weight: QuantizedWeight, checkpoint_format: str) -> dict[str, torch.Tensor]:
    """The four GPTQ tensors of one linear; v1 ("gptq") stores zero points minus one."""
    offset = 1 if checkpoint_format == "gptq" else 0
    zeros = weight.zero_points().round().to(torch.int64) - offset
    if int(zeros.min()) < 0:
        raise ValueError(f"'{prefix}': a zero point of 0 cannot be stored in checkpoint format "
                         f"'{checkpoint_format}' (use gptq_v2, or quantize with min_zero=1)")
    return {
        f"{prefix}.qweight": packing.pack_gptq_qweight(weight.qweight.cpu(), weight.bits),
        f"{prefix}.qzeros": packing.pack_gptq_qzeros(zeros.cpu(), weight.bits),
        f"{prefix}.scales": weight.scales.to(torch.float16).cpu(),
        f"{prefix}.g_idx": weight.g_idx.to(torch.int32).cpu().clone(),  # fused parts share one g_idx
    }
