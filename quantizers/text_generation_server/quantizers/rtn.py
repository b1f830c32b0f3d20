"""Round-to-nearest quantization, and the min/max grid GPTQ shares with it.

RTN is the baseline every GPTQ result is measured against, so both use one grid
function: any quality difference between them is then the solver's doing, not a
different choice of scales. The grid is GPTQ's: the range always includes zero
(so an all-positive group still represents 0 exactly), symmetric grids centre
the codes on 2^(bits-1), asymmetric ones pick an integer zero point.

Output is the canonical `QuantizedWeight` of kernels/base.py, so the same
packers and the reference `dequantize` apply to both methods.
"""

from __future__ import annotations

import torch

from text_generation_server.kernels.base import QuantizedWeight

SUPPORTED_BITS = (2, 3, 4, 8)
# Scales are stored as float16 in GPTQ checkpoints; the smallest positive subnormal is ~6e-8.
_MIN_SCALE = 1e-7


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {', '.join(map(str, SUPPORTED_BITS))}, got {bits}")


def check_group_size(group_size: int, in_features: int, what: str = "the weight") -> int:
    """The number of rows per group (in_features for per-channel); rejects sizes that do not tile K."""
    if group_size == -1:
        return in_features
    if group_size <= 0:
        raise ValueError(f"group size must be -1 (per-channel) or positive, got {group_size}")
    if in_features % group_size != 0:
        raise ValueError(
            f"group size {group_size} does not divide the {in_features} input features of {what}"
        )
    return group_size


def grid_params(
    x: torch.Tensor,
    bits: int,
    sym: bool,
    min_zero: int = 0,
    scale_dtype: torch.dtype | None = torch.float16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point per row of `x` so its min..max range (with 0) fits 2^bits codes.

    x: [..., G] -> scale [...], zero [...] (float, integer-valued).
    `min_zero` = 1 serves GPTQ v1 checkpoints, which store z - 1 and so cannot hold z = 0:
    such rows get z = 1 and a scale just wide enough to still cover their maximum.
    Scales are rounded to `scale_dtype` here, so the errors GPTQ propagates are those of
    the weights the checkpoint will actually hold.
    """
    check_bits(bits)
    maxq = 2**bits - 1
    x = x.float()
    xmin = x.amin(dim=-1).clamp(max=0)
    xmax = x.amax(dim=-1).clamp(min=0)
    if sym:
        amax = torch.maximum(-xmin, xmax)
        scale = 2 * amax / maxq
        zero = torch.full_like(scale, float(2 ** (bits - 1)))
    else:
        scale = (xmax - xmin) / maxq
        zero = torch.round(-xmin / scale.clamp(min=_MIN_SCALE))
        if min_zero > 0:
            low = zero < min_zero
            widened = torch.maximum(-xmin / min_zero, xmax / (maxq - min_zero))
            scale = torch.where(low, widened, scale)
            zero = torch.where(low, torch.full_like(zero, float(min_zero)), zero)
    # An all-zero row: any scale codes it exactly (as the zero point); 1 keeps it finite.
    scale = torch.where(scale > 0, scale.clamp(min=_MIN_SCALE), torch.ones_like(scale))
    if scale_dtype is not None:
        scale = scale.to(scale_dtype).float()
    return scale, zero


def quantize_codes(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes (float tensor) of `x` on the grid; scale/zero broadcast against x."""
    return torch.clamp(torch.round(x / scale) + zero, 0, 2**bits - 1)


def rtn_quantize(
    weight: torch.Tensor,
    bits: int,
    group_size: int,
    sym: bool,
    min_zero: int = 0,
    scale_dtype: torch.dtype | None = torch.float16,
) -> QuantizedWeight:
    """Rounds each group of a dense weight [N, K] to its own min/max grid.

    group_size -1 means one group per output row (per-channel).
    """
    check_bits(bits)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {list(weight.shape)}")
    n, k = weight.shape
    g = check_group_size(group_size, k)
    groups = k // g
    w = weight.float().reshape(n, groups, g)  # [N, G, g]
    scale, zero = grid_params(w, bits, sym, min_zero, scale_dtype)  # [N, G]
    codes = quantize_codes(w, scale.unsqueeze(-1), zero.unsqueeze(-1), bits)  # [N, G, g]
    g_idx = torch.arange(k, dtype=torch.int32, device=weight.device) // g
    return QuantizedWeight(
        qweight=codes.reshape(n, k).t().to(torch.uint8).contiguous(),
        scales=scale.t().contiguous(),
        zeros=None if sym else zero.t().contiguous(),
        g_idx=g_idx,
        bits=bits,
        group_size=g,
    )
