"""FP8 (e4m3) linears: one canonical weight form, and the kernels that run it.

Loaders bring every fp8 layout (per-tensor, per-channel [N, 1], 128x128 blocks; fused
parts; rank slices that cut a block) into one form, `Fp8Weight`:

    W[n, k] = float(weight[n, k]) * scale[row_block[n], col_block[k]]

A per-tensor weight has a 1x1 scale grid, a per-channel one an [N, 1] grid (so do
fused per-tensor parts: one row of the grid per part), a block-scaled one a
[ceil(N/bn), ceil(K/bk)] grid with row_block = n // bn, col_block = k // bk, renumbered
when a rank keeps only part of it. The weight stays float8_e4m3fn in memory (one byte
per value); `dequantize_fp8` is the ground truth every kernel is tested against.

Activations. A checkpoint declares how its authors computed each linear's input: weight-only
("none": x as it is), or rounded to e4m3 first, x_q = e4m3(clamp(x / s, -448, 448)), with
s = input_scale (static: calibrated, stored per linear), amax|x| / 448 per token
("dynamic-token"; fbgemm caps the amax at activation_scale_ub), per call ("dynamic-tensor") or
per token and group of input columns ("dynamic-group", compressed-tensors' 1x128 groups, aligned
to the checkpoint's columns when a rank holds a slice of them; a rank's dynamic scales see only
its own columns). Every kernel computes that declared model, so CPU, GPU and the checkpoint's
authors (compressed-tensors' fake quantization, which transformers runs on CPU) agree token for
token: `Fp8InputQuantizer` is the one piece of code that quantizes inputs, for the tensor cores
and for the emulating kernels alike.

Kernels (ranked in this order in kernels/table.py, chosen by kernels/select.py like the int ones):
- fp8-scaled-mm (CUDA, compute capability >= 8.9): torch._scaled_mm on e4m3 inputs quantized
  per call as declared. Weights with one scale column (per-tensor, per-channel) and inputs
  with one scale per token or per tensor only: block scales and per-group input scales go to
  fp8-dequant. A weight-only checkpoint runs here with dynamic per-token inputs (the tensor
  cores need fp8 on both sides); that is the one place a kernel departs from the declaration.
- fp8-dense (CPU, first there): dequantized once at load into the activation dtype; dense
  speed, dense memory (CPUs have no fp8 arithmetic). Declared fp8 inputs are emulated: x is
  rounded to e4m3 and scaled back in float32 (`Fp8InputQuantizer.fake_quantize`), then the
  dense matmul runs; exact in float32, and in bfloat16/float16 only the already-rounded values
  are cast to the activation dtype for the matmul.
- fp8-dequant (CPU and CUDA, always): dequantizes the weight per forward, a few rows at a
  time, and runs a dense matmul: in the activation dtype for weight-only checkpoints (exactly
  x @ W^T), in float32 where inputs are quantized, as _scaled_mm accumulates:
  (x_q * s) @ (w_q * w_scale)^T, cast to the activation dtype. On CPU the e4m3 -> float32
  conversion goes through a 256-entry table (bit-identical to torch's conversion, ~5x faster
  than `.float()`).

torch 2.13 also has a CPU torch._scaled_mm for fp8; it is not used: it measured slower than
fp8-dequant (2048x2048, batch 1, one thread: 28 ms against 5-7 ms; a dense matmul is 0.7 ms,
the naive `w.float() * scale` dequant 24 ms), and the emulation computes the same values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from text_generation_server.kernels.base import LinearSpec, QuantKernel, ReferenceLinear

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite e4m3fn value
ACTIVATIONS = ("none", "static", "dynamic-token", "dynamic-tensor", "dynamic-group")
_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# fp8-dequant materialises at most this many bytes of float32 weight at a time: on CPU a
# cache-sized chunk (measured fastest), on CUDA enough to keep the matmuls large.
DEQUANT_CHUNK_BYTES = 4 << 20
DEQUANT_CHUNK_BYTES_CUDA = 256 << 20


@dataclass
class Fp8Weight:
    """Canonical fp8 linear of one rank: W[n, k] = float(weight[n, k]) * scale[row_block[n], col_block[k]].

    activation: how the checkpoint declares the inputs are quantized (module docstring):
    "none" (weight-only), "static" (input_scale, a float32 scalar from the checkpoint),
    "dynamic-token", "dynamic-tensor" or "dynamic-group" (scales computed per call).
    activation_scale_ub caps the dynamic per-token maximum (fbgemm_fp8). dynamic-group scales
    cover activation_group_size input columns each, counted from the checkpoint's column 0:
    this rank's column 0 is the checkpoint's column activation_group_offset.
    """

    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # float32 [R, C]
    row_block: torch.Tensor  # int32 [N], values in [0, R)
    col_block: torch.Tensor  # int32 [K], values in [0, C)
    activation: str = "none"
    input_scale: torch.Tensor | None = None
    activation_scale_ub: float | None = None
    activation_group_size: int | None = None
    activation_group_offset: int = 0

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
        if self.activation == "dynamic-group" and not (self.activation_group_size or 0) > 0:
            raise ValueError(f"dynamic-group activations need a positive activation_group_size, "
                             f"got {self.activation_group_size}")
        if self.activation_group_offset < 0:
            raise ValueError(f"activation_group_offset must be >= 0, got {self.activation_group_offset}")

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

    def activation_groups_split(self) -> bool:
        """Whether per-group input scales cut this rank's columns into more than one group
        (otherwise one group holds them all, and its scale is simply the token's)."""
        if self.activation != "dynamic-group":
            return False
        return self.activation_group_offset % self.activation_group_size + self.shape[1] > self.activation_group_size

    def describe_activations(self) -> str:
        """What the checkpoint declares for this linear's inputs, for the kernel log."""
        if self.activation == "none":
            return "activations not quantized (weight-only fp8)"
        if self.activation == "static":
            return f"fp8 static per-tensor activations (input_scale {float(self.input_scale):.4g})"
        if self.activation == "dynamic-tensor":
            return "fp8 per-tensor dynamic activations"
        if self.activation == "dynamic-group":
            return f"fp8 per-token dynamic activations in groups of {self.activation_group_size} columns"
        ub = "" if self.activation_scale_ub is None else f", amax capped at {self.activation_scale_ub:g}"
        return f"fp8 per-token dynamic activations{ub}"

    def spec(self, act_dtype: torch.dtype, device_type: str) -> LinearSpec:
        """group_size is the input columns per scale along K: K for per-tensor or per-channel weights
        with per-token or per-tensor inputs; less for block weight scales or per-group input scales."""
        lengths = [stop - start for start, stop, _ in self.column_runs()] or [0]
        n, k = self.shape
        group = k if self.scale.shape[1] == 1 else max(max(lengths), 1)
        if self.activation_groups_split():
            group = min(group, self.activation_group_size)
        return LinearSpec(in_features=k, out_features=n, bits=8, group_size=group,
                          has_zeros=False, act_order=False, act_dtype=act_dtype, device_type=device_type,
                          group_rows_gcd=math.gcd(*lengths) if k else None, weight_format="fp8")

    def describe_layer(self, spec: LinearSpec, kernel: type[QuantKernel]) -> str:
        """What the layer computes on `kernel`, as the startup log and the module's `computes` say it."""
        return f"fp8 e4m3 weights ({self.scale_kind()} scales), {kernel.describe(self, spec.device_type)}"

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


# -- input quantization ----------------------------------------------------------------------
class Fp8InputQuantizer(torch.nn.Module):
    """Rounds a linear's inputs to e4m3 the way its checkpoint declares: the one implementation
    behind fp8-scaled-mm's tensor-core inputs and the CPU kernels' emulation.

    The arithmetic is compressed-tensors' (the quantization the checkpoint's authors ran, and
    what transformers computes on CPU): s = amax|x| / 448 over the token, the call or the group,
    or the static input_scale; x_q = e4m3(clamp(x / s, -448, 448)) (torch's cast rounds to
    nearest even); x ~ x_q * s. Always in float32, whatever the activation dtype, as _scaled_mm
    takes its scales. An all-zero token gets s = 1 (its codes are 0 under any scale; the
    reference uses eps, which gives the same zeros).
    """

    # x: [M, K] -> e4m3 codes [M, K] and float32 scales [M, 1] or [1, 1]
    def __init__(self, weight: Fp8Weight, activation: str | None = None):
        super().__init__()
        self.activation = activation or weight.activation
        self.scale_ub = weight.activation_scale_ub
        self.register_buffer("input_scale", None if weight.input_scale is None
                             else weight.input_scale.reshape(1, 1).float())
        # Per-group scales only where groups cut this rank's columns; one group is the token's scale.
        self.group_size = weight.activation_group_size if weight.activation_groups_split() else None
        self.lead = weight.activation_group_offset % self.group_size if self.group_size else 0
        if self.activation == "dynamic-group" and self.group_size is None:
            self.activation = "dynamic-token"
        if self.activation == "static" and self.input_scale is None:
            raise ValueError("static activations need the checkpoint's input_scale")

    @staticmethod
    def _scale_of(amax: torch.Tensor) -> torch.Tensor:
        return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))

    @staticmethod
    def _round(xf: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (xf / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (e4m3 codes [M, K], float32 scale [M, 1] or [1, 1]) with x ~ codes * scale."""
        if self.group_size is not None:
            raise ValueError("per-group input scales have no [M, 1] form: use fake_quantize")
        xf = x.float()
        if self.activation == "static":
            scale = self.input_scale
        elif self.activation == "dynamic-tensor":
            scale = self._scale_of(xf.abs().amax().reshape(1, 1))
        elif self.activation in ("dynamic-token", "dynamic-group"):
            amax = xf.abs().amax(dim=1, keepdim=True)
            scale = self._scale_of(amax if self.scale_ub is None else amax.clamp(max=self.scale_ub))
        else:
            raise ValueError(f"activation {self.activation!r} quantizes nothing")
        return self._round(xf, scale), scale

    def fake_quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> float32 [M, K]: the values the declared quantization leaves (x itself for "none")."""
        if self.activation == "none":
            return x.float()
        if self.group_size is None:
            q, scale = self.quantize(x)
            return fp8_to_float32(q) * scale
        # Groups are the checkpoint's columns g*G..(g+1)*G: pad so this rank's slice lines up with them.
        m, k, g = x.shape[0], x.shape[1], self.group_size
        xf = F.pad(x.float(), (self.lead, -(-(self.lead + k) // g) * g - self.lead - k)).view(m, -1, g)
        scale = self._scale_of(xf.abs().amax(dim=2, keepdim=True))  # [M, groups, 1]
        return (fp8_to_float32(self._round(xf, scale)) * scale).view(m, -1)[:, self.lead:self.lead + k]


# -- fp8-dequant ------------------------------------------------------------------------------
class Fp8DequantLinear(torch.nn.Module):
    # x: [..., K] -> [..., N]
    def __init__(self, weight: Fp8Weight, bias: torch.Tensor | None, act_dtype: torch.dtype):
        super().__init__()
        n, k = weight.shape
        # Declared fp8 inputs: emulated, and the matmul runs in float32 like _scaled_mm's accumulator.
        self.quantizer = None if weight.activation == "none" else Fp8InputQuantizer(weight)
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

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows [start, stop) of W in `dtype` (default: the activation dtype), equal to dequantize_fp8's."""
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
        return w.to(dtype or self.act_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        n = self.out_features
        dtype = self.act_dtype
        if self.quantizer is not None:
            x, dtype = self.quantizer.fake_quantize(x), torch.float32
        # Bias in the matmul only where nothing is cast after it (weight-only, one chunk).
        fused_bias = self.bias if self.quantizer is None and self.chunk_rows >= n else None
        if self.chunk_rows >= n:
            y = F.linear(x, self.dequantize_rows(0, n, dtype), fused_bias)
        else:
            y = torch.cat([F.linear(x, self.dequantize_rows(s, min(s + self.chunk_rows, n), dtype))
                           for s in range(0, n, self.chunk_rows)], dim=1)
        y = y.to(self.act_dtype)
        if self.bias is not None and fused_bias is None:
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

    @classmethod
    def describe(cls, weight: Fp8Weight, device_type: str) -> str:
        """What this layer computes on this kernel, for the startup log."""
        acts = weight.describe_activations()
        return acts if weight.activation == "none" else f"{acts} (emulated on {device_type.upper()})"


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
        dense, bias = dequantize_fp8(weight, act_dtype), None if bias is None else bias.to(act_dtype)
        if weight.activation == "none":
            return ReferenceLinear(dense, bias)
        return Fp8EmulatedDenseLinear(dense, bias, Fp8InputQuantizer(weight))


class Fp8EmulatedDenseLinear(ReferenceLinear):
    """fp8-dense for declared fp8 inputs: each call rounds x to e4m3 and back, then the dense matmul."""

    # x: [..., K] -> [..., N]
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quantizer: Fp8InputQuantizer):
        super().__init__(weight, bias)
        self.quantizer = quantizer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = self.quantizer.fake_quantize(x.reshape(-1, x.shape[-1])).to(self.weight.dtype)
        return self.linear(xq.reshape(x.shape))


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
        if weight.activation_groups_split():
            raise ValueError("fp8-scaled-mm needs one input scale per token or per tensor, not per group")
        # Weight-only checkpoints too get e4m3 inputs here: the tensor cores take nothing else.
        self.quantizer = Fp8InputQuantizer(weight, "dynamic-token" if weight.activation == "none" else None)
        self.register_buffer("bias", None if bias is None else bias.to(act_dtype))
        self.per_tensor_weight = weight.scale.shape[0] == 1
        self.act_dtype = act_dtype
        self.in_features, self.out_features = k, n

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (e4m3 [M, Kp], float32 scale [M, 1] or [1, 1]) with x ~ q * scale."""
        q, scale = self.quantizer.quantize(x)
        if q.shape[1] != self.weight.shape[1]:
            q = F.pad(q.view(torch.uint8), (0, self.weight.shape[1] - q.shape[1])).view(FP8_DTYPE)
        return q, scale

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
            return False, (f"scales every {spec.group_size} input columns (block weight scales or per-group "
                           "input scales) need a blockwise scaled matmul; only per-tensor and per-channel "
                           "weight scales with per-token or per-tensor input scales run here")
        return True, ""

    @classmethod
    def build(cls, weight: Fp8Weight, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        return Fp8ScaledMMLinear(weight, bias, act_dtype)

    @classmethod
    def describe(cls, weight: Fp8Weight, device_type: str) -> str:
        if weight.activation == "none":
            return ("fp8 per-token dynamic activations (the checkpoint is weight-only; the fp8 tensor cores "
                    "take e4m3 inputs)")
        return f"{weight.describe_activations()} (on fp8 tensor cores)"
