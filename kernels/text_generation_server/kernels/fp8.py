"""FP8 (e4m3) linears: one canonical weight form, and the kernels that run it.

Loaders bring every fp8 layout (per-tensor, per-channel [N, 1], 128x128 blocks; fused
parts; rank slices that cut a block) into one form, `Fp8Weight`:

    W[n, k] = float(weight[n, k]) * scale[row_block[n], col_block[k]]

A per-tensor weight has a 1x1 scale grid, a per-channel one an [N, 1] grid (so do
fused per-tensor parts: one row of the grid per part), a block-scaled one a
[ceil(N/bn), ceil(K/bk)] grid with row_block = n // bn, col_block = k // bk, renumbered
when a rank keeps only part of it. The weight stays float8_e4m3fn in memory (one byte
per value); `dequantize_fp8` is the ground truth every kernel is tested against.

Kernels (registered in this order, chosen through base.choose_kernel like the int ones):
- fp8-scaled-mm (CUDA, compute capability >= 8.9): torch._scaled_mm. Activations are
  quantized to e4m3 on every call: with the checkpoint's static input_scale, or with
  scales computed at run time (per token, or per tensor when the checkpoint says so;
  fbgemm's activation_scale_ub caps the per-token maximum). Weights with one scale
  column (per-tensor, per-channel) only: block scales go to fp8-dequant.
- fp8-dense (CPU, first there): dequantized once at load into the activation dtype; dense
  speed, dense memory (CPUs have no fp8 arithmetic).
- fp8-dequant (CPU and CUDA, always): dequantizes the weight per forward, a few rows at a
  time, into the activation dtype and runs a dense matmul. Activations are NOT quantized
  on this path, whatever the checkpoint's activation scheme: it computes x @ W^T with the
  checkpoint's exact weights. On CPU the e4m3 -> float32 conversion goes through a
  256-entry table (bit-identical to torch's conversion, ~5x faster than `.float()`).

torch 2.13 also has a CPU torch._scaled_mm for fp8; it is not used: it needs fp8
activations (so it is not exact against the dequantized weights) and measured slower
than fp8-dequant (2048x2048, batch 1, one thread: 28 ms against 5-7 ms; a dense matmul
is 0.7 ms, the naive `w.float() * scale` dequant 24 ms).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from loguru import logger

from text_generation_server.kernels.base import (
    LinearSpec,
    QuantKernel,
    ReferenceLinear,
    check_dense_fallback,
    choose_kernel,
    register,
)

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite e4m3fn value
ACTIVATIONS = ("static", "dynamic-token", "dynamic-tensor")
_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Dynamic activation scales never go below this (an all-zero row would divide by zero).
_MIN_ACT_SCALE = 1e-12
# fp8-dequant materialises at most this many bytes of float32 weight at a time: on CPU a
# cache-sized chunk (measured fastest), on CUDA enough to keep the matmuls large.
DEQUANT_CHUNK_BYTES = 4 << 20
DEQUANT_CHUNK_BYTES_CUDA = 256 << 20


@dataclass
class Fp8Weight:
    """Canonical fp8 linear of one rank: W[n, k] = float(weight[n, k]) * scale[row_block[n], col_block[k]].

    activation: how fp8-scaled-mm quantizes inputs: "static" (input_scale, a float32
    scalar from the checkpoint), "dynamic-token" or "dynamic-tensor" (scales computed per
    call). activation_scale_ub caps the dynamic per-token maximum (fbgemm_fp8).
    """

    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [R, C]
    row_block: torch.Tensor  # int32 [N], values in [0, R)
    col_block: torch.Tensor  # int32 [K], values in [0, C)
    activation: str = "dynamic-token"
    input_scale: torch.Tensor | None = None
    activation_scale_ub: float | None = None

    def __post_init__(self) -> None:
        if self.weight.dtype != FP8_DTYPE or self.weight.dim() != 2:
            raise ValueError(f"weight must be 2-D float8_e4m3fn, got {self.weight.dtype} {list(self.weight.shape)}")
        n, k = self.weight.shape
        if self.scale.dtype != torch.float32 or self.scale.dim() != 2:
            raise ValueError(f"scale must be a 2-D float32 grid, got {self.scale.dtype} {list(self.scale.shape)}")
        for name, idx, size, bound in (("row_block", self.row_block, n, self.scale.shape[0]),
                                       ("col_block", self.col_block, k, self.scale.shape[1])):
            if idx.shape != (size,):
                raise ValueError(f"{name} must be [{size}], got {list(idx.shape)}")
            if size and (int(idx.min()) < 0 or int(idx.max()) >= bound):
                raise ValueError(f"{name} values must be in [0, {bound})")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        if self.activation == "static":
            if self.input_scale is None or self.input_scale.numel() != 1:
                raise ValueError("static activations need a single input_scale")
            if not float(self.input_scale) > 0:
                raise ValueError(f"input_scale must be positive, got {float(self.input_scale)}")
        if self.activation_scale_ub is not None and not self.activation_scale_ub > 0:
            raise ValueError(f"activation_scale_ub must be positive, got {self.activation_scale_ub}")

    @property
    def shape(self) -> tuple[int, int]:
        """Logical (out_features, in_features), like a dense weight."""
        return tuple(self.weight.shape)  # type: ignore[return-value]

    def column_runs(self) -> list[tuple[int, int, int]]:
        """(start, stop, scale column) for each run of input columns sharing a scale column."""
        cols = self.col_block.tolist()
        runs, start = [], 0
        for k in range(1, len(cols) + 1):
            if k == len(cols) or cols[k] != cols[start]:
                runs.append((start, k, cols[start]))
                start = k
        return runs

    def scale_kind(self) -> str:
        if self.scale.shape[1] > 1:
            return "block"
        return "per-tensor" if self.scale.shape[0] == 1 else "per-channel"

    def spec(self, act_dtype: torch.dtype, device_type: str) -> LinearSpec:
        """group_size is the input columns per scale column (K unless block-scaled)."""
        lengths = [stop - start for start, stop, _ in self.column_runs()] or [0]
        n, k = self.shape
        return LinearSpec(in_features=k, out_features=n, bits=8,
                          group_size=k if self.scale.shape[1] == 1 else max(max(lengths), 1),
                          has_zeros=False, act_order=False, act_dtype=act_dtype, device_type=device_type,
                          group_rows_gcd=math.gcd(*lengths) if k else None, weight_format="fp8")

    def nbytes(self) -> int:
        """Resident bytes of the weight and its scales (what a rank keeps for this linear)."""
        extra = [self.scale, self.row_block, self.col_block]
        extra += [] if self.input_scale is None else [self.input_scale]
        return self.weight.numel() * self.weight.element_size() + sum(t.numel() * t.element_size() for t in extra)


def dequantize_fp8(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ground truth: dense [N, K] weight, computed in float32 then cast."""
    scales = w.scale[w.row_block.long()][:, w.col_block.long()]  # [N, K]
    return (w.weight.float() * scales).to(dtype)


# e4m3fn code -> float32 value, for all 256 byte patterns (0x7F and 0xFF are NaN).
_E4M3_TABLE = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()


def fp8_to_float32(w: torch.Tensor) -> torch.Tensor:
    """Bit-identical to w.float(); on CPU a table lookup, because the CPU cast is ~5x slower."""
    if w.device.type != "cpu":
        return w.float()
    codes = w.view(torch.uint8).reshape(-1).to(torch.int32)
    return _E4M3_TABLE.index_select(0, codes).view(w.shape)


# -- fp8-dequant ------------------------------------------------------------------------------
class Fp8DequantLinear(torch.nn.Module):
    # x: [..., K] -> [..., N]
    def __init__(self, weight: Fp8Weight, bias: torch.Tensor | None, act_dtype: torch.dtype):
        super().__init__()
        n, k = weight.shape
        self.register_buffer("weight", weight.weight)  # float8_e4m3fn [N, K]
        self.register_buffer("scale", weight.scale)  # float32 [R, C]
        # Each output row's scale row; None when that is implied (one scale row, or one per row).
        implied = weight.scale.shape[0] == 1 or (weight.scale.shape[0] == n and torch.equal(
            weight.row_block, torch.arange(n, dtype=weight.row_block.dtype, device=weight.row_block.device)))
        self.register_buffer("row_block", None if implied else weight.row_block.to(torch.int32))  # [N]
        self.register_buffer("bias", None if bias is None else bias.to(act_dtype))
        self.runs = weight.column_runs()
        # Block scales: on CPU one in-place multiply per run of columns; on CUDA one gather of
        # each row's scales across K instead of K/128 small kernel launches.
        on_cuda = weight.weight.device.type == "cuda"
        self.register_buffer("col_block", weight.col_block.to(torch.int32) if on_cuda and len(self.runs) > 1
                             else None)  # [K]
        self.act_dtype = act_dtype
        self.in_features, self.out_features = k, n
        self.chunk_rows = max(1, (DEQUANT_CHUNK_BYTES_CUDA if on_cuda else DEQUANT_CHUNK_BYTES) // (4 * max(k, 1)))

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of W in the activation dtype, equal to dequantize_fp8's."""
        w = fp8_to_float32(self.weight[start:stop])
        if self.row_block is not None:
            scales = self.scale.index_select(0, self.row_block[start:stop])
        else:
            scales = self.scale if self.scale.shape[0] == 1 else self.scale[start:stop]
        if len(self.runs) == 1:
            w.mul_(scales)
        elif self.col_block is not None:
            w.mul_(scales.index_select(1, self.col_block))
        else:
            for a, b, c in self.runs:
                w[:, a:b].mul_(scales[:, c:c + 1])
        return w.to(self.act_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        n = self.out_features
        if self.chunk_rows >= n:
            y = F.linear(x, self.dequantize_rows(0, n), self.bias)
        else:
            y = torch.cat([F.linear(x, self.dequantize_rows(s, min(s + self.chunk_rows, n)))
                           for s in range(0, n, self.chunk_rows)], dim=1)
            if self.bias is not None:
                y = y + self.bias
        return y.reshape(*lead, n)


class Fp8DequantKernel(QuantKernel):
    """Dequantize per forward (a few rows at a time) and matmul: exact, fp8-resident, never fast."""

    name = "fp8-dequant"
    device: ClassVar[str] = "cpu"  # one registration per device list, each refusing the other devices

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        if spec.device_type != cls.device:
            return False, f"device {spec.device_type}"
        if spec.weight_format != "fp8":
            return False, f"runs fp8 weights, not {spec.weight_format}"
        if spec.act_dtype not in _ACT_DTYPES:
            return False, f"activation dtype {spec.act_dtype} not in bfloat16/float16/float32"
        return True, ""

    @classmethod
    def build(cls, weight: Fp8Weight, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        return Fp8DequantLinear(weight, bias, act_dtype)


class Fp8DequantCudaKernel(Fp8DequantKernel):
    device: ClassVar[str] = "cuda"


class Fp8DenseKernel(Fp8DequantKernel):
    """Dequantize once at load into the activation dtype and run torch's dense matmul.

    The CPU default, by the same rule as the integer `reference`: speed first. CPUs have no
    fp8 arithmetic, and fp8-dequant's per-forward conversion runs at 0.08x bf16 dense at
    batch 1 on 7B-sized layers (BENCHMARKS.md); this path runs at dense speed, exactly the
    same weights, with activation-dtype memory. TGS_DISABLE_KERNELS=fp8-dense keeps the
    weights in fp8 (half of bf16) on fp8-dequant instead.
    """

    name = "fp8-dense"
    dense_copy = True

    @classmethod
    def build(cls, weight: Fp8Weight, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        return ReferenceLinear(dequantize_fp8(weight, act_dtype), None if bias is None else bias.to(act_dtype))


# -- fp8-scaled-mm ----------------------------------------------------------------------------
def _round16(n: int) -> int:
    return -(-n // 16) * 16


class Fp8ScaledMMLinear(torch.nn.Module):
    """torch._scaled_mm with fp8 activations quantized per call.

    _scaled_mm wants a row-major A [M, K] and a column-major B [K, N] (our [N, K] weight,
    transposed as a view), K and N multiples of 16: both are zero-padded once at build
    (weight) or per call (activation columns), and the output is sliced back. Scales:
    both per-tensor -> "tensorwise" scalar scales, output in the activation dtype;
    otherwise "rowwise" scale_a [M, 1] and scale_b [1, N], which torch runs with bf16
    output only, cast back afterwards.
    """

    # x: [..., K] -> [..., N]
    def __init__(self, weight: Fp8Weight, bias: torch.Tensor | None, act_dtype: torch.dtype):
        super().__init__()
        n, k = weight.shape
        if weight.scale.shape[1] != 1:
            raise ValueError("fp8-scaled-mm needs one scale column (per-tensor or per-channel weight scales)")
        np_, kp = _round16(n), _round16(k)
        # Zero bytes are e4m3 zeros; padding the uint8 view needs no fp8 kernels.
        padded = weight.weight
        if (np_, kp) != (n, k):
            padded = F.pad(padded.view(torch.uint8), (0, kp - k, 0, np_ - n)).view(FP8_DTYPE)
        self.register_buffer("weight", padded.contiguous())  # float8_e4m3fn [Np, Kp]
        col_scale = torch.ones(1, np_, dtype=torch.float32, device=padded.device)
        col_scale[0, :n] = weight.scale[weight.row_block.long(), 0]
        self.register_buffer("scale_b", col_scale)  # float32 [1, Np]
        self.register_buffer("input_scale", None if weight.input_scale is None
                             else weight.input_scale.reshape(1, 1).float().to(padded.device))
        self.register_buffer("bias", None if bias is None else bias.to(act_dtype))
        self.activation = weight.activation
        self.activation_scale_ub = weight.activation_scale_ub
        self.per_tensor_weight = weight.scale.shape[0] == 1
        self.act_dtype = act_dtype
        self.in_features, self.out_features = k, n

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (e4m3 [M, Kp], float32 scale [M, 1] or [1, 1]) with x ~ q * scale."""
        xf = x.float()
        if self.activation == "static":
            scale = self.input_scale
        elif self.activation == "dynamic-tensor":
            scale = (xf.abs().amax().reshape(1, 1) / E4M3_MAX).clamp(min=_MIN_ACT_SCALE)
        else:
            amax = xf.abs().amax(dim=1, keepdim=True)
            if self.activation_scale_ub is not None:
                amax = amax.clamp(max=self.activation_scale_ub)
            scale = (amax / E4M3_MAX).clamp(min=_MIN_ACT_SCALE)
        q = (xf / scale).clamp(-E4M3_MAX, E4M3_MAX)
        if q.shape[1] != self.weight.shape[1]:
            q = F.pad(q, (0, self.weight.shape[1] - q.shape[1]))
        return q.to(FP8_DTYPE), scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        q, scale_a = self.quantize_input(x)
        if scale_a.shape[0] == 1 and self.per_tensor_weight:
            y = torch._scaled_mm(q, self.weight.t(), scale_a=scale_a.reshape(()), scale_b=self.scale_b[0, 0],
                                 out_dtype=self.act_dtype)
        else:
            scale_a = scale_a.expand(q.shape[0], 1).contiguous()
            y = torch._scaled_mm(q, self.weight.t(), scale_a=scale_a, scale_b=self.scale_b,
                                 out_dtype=torch.bfloat16)
        y = y[:, :self.out_features].to(self.act_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


class Fp8ScaledMMKernel(QuantKernel):
    """torch._scaled_mm on fp8 tensor cores: weights and activations in e4m3."""

    name = "fp8-scaled-mm"

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        if spec.weight_format != "fp8":
            return False, f"runs fp8 weights, not {spec.weight_format}"
        if spec.device_type != "cuda":
            return False, f"device {spec.device_type}"
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        capability = torch.cuda.get_device_capability()
        if capability < (8, 9):
            return False, f"compute capability {capability[0]}.{capability[1]} < 8.9 (no fp8 tensor cores)"
        if spec.act_dtype not in _ACT_DTYPES:
            return False, f"activation dtype {spec.act_dtype} not in bfloat16/float16/float32"
        if spec.group_size != spec.in_features:
            return False, (f"block scales ({spec.group_size} input columns per scale) need a blockwise "
                           "scaled matmul; only per-tensor and per-channel scales run here")
        return True, ""

    @classmethod
    def build(cls, weight: Fp8Weight, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        return Fp8ScaledMMLinear(weight, bias, act_dtype)


register("cuda", Fp8ScaledMMKernel)
register("cuda", Fp8DequantCudaKernel)
register("cpu", Fp8DenseKernel)
register("cpu", Fp8DequantKernel)

_LOGGED: set[tuple] = set()


def build_fp8_linear(weight: Fp8Weight, bias: torch.Tensor | None, act_dtype: torch.dtype, device_type: str,
                     layer: str = "") -> torch.nn.Module:
    """Chooses the kernel for this fp8 weight (same registry as the int kernels), logs it once per kind of layer."""
    spec = weight.spec(act_dtype, device_type)
    kernel, rejected = choose_kernel(spec)
    check_dense_fallback(spec, kernel, rejected, layer)
    key = (layer, weight.scale_kind(), weight.activation, spec.group_size, kernel.name)
    if key not in _LOGGED:
        _LOGGED.add(key)
        why = "; ".join(f"{n}: {r}" for n, r in rejected) or "first choice"
        logger.info("{}fp8 e4m3 {} scales, {} activations: kernel {} ({})", f"{layer}: " if layer else "",
                    weight.scale_kind(), weight.activation, kernel.name, why)
    module = kernel.build(weight, bias, act_dtype)
    module.kernel_name = kernel.name
    return module
