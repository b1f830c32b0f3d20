"""bitsandbytes 4-bit (NF4/FP4) kernels, on bitsandbytes' own layout (the weight types and the
loader are quantizers/bitsandbytes.py).

The layout: `packed` uint8 [ceil(rows*cols/2)], two codes per byte, first in the high nibble,
over the row-major flattened [rows, cols]; `absmax` float32, one scale per `blocksize` flattened
elements; W = table[code] * absmax[block]. Row-parallel ranks store whole blocks around their
columns and zero-pad the input by `pad` (columns before, after).

Kernels, in order (kernels/table.py; a layer logs which runs; TGS_DISABLE_KERNELS switches them
off like the others):
- "bnb-cpu-4bit": bitsandbytes' fused CPU 4-bit matmul on its packed CPU layout (needs AVX512-BF16,
  N % 32 == 0, K % blocksize == 0). Fastest on CPU (about 2x a dense fp32 matmul at batch 1) and
  compact; it computes in bfloat16 (bf16 activations and scales), like the project's int4/int8 CPU
  kernels.
- "reference": dequantizes once (exact, dense memory). On CPU it ranks before bnb-matmul-4bit, as
  the reference ranks before marlin-layout: a dense matmul outruns a dequantize per call.
- "bnb-matmul-4bit": bnb.matmul_4bit, compact; the fused kernel on CUDA (first choice there), a
  dequantize per call on CPU (slow: TGS_DISABLE_KERNELS=bnb-cpu-4bit,reference trades speed for
  memory). On CPU only with K % blocksize == 0: bitsandbytes 0.50.2's CPU dequantize returns wrong
  values for some shapes whose blocks straddle rows (e.g. [4, 96] in blocks of 64).
"""

from __future__ import annotations

from functools import cache
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

from text_generation_server.kernels.base import LinearSpec, QuantKernel, ReferenceLinear

# The two 4-bit code tables, as float32 (bitsandbytes get_4bit_type). NF4: quantiles of N(0, 1)
# scaled to [-1, 1]; FP4: sign + 2-bit exponent + 1-bit mantissa, normalised by 6 (code 1 is 1/192).
CODES = {
    "nf4": torch.tensor([
        -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
        0.7229568362236023, 1.0], dtype=torch.float32),
    "fp4": torch.tensor([0.0, 1 / 192, 2 / 3, 1.0, 1 / 3, 0.5, 1 / 6, 0.25,
                         -0.0, -1 / 192, -2 / 3, -1.0, -1 / 3, -0.5, -1 / 6, -0.25], dtype=torch.float32),
}


class MissingDependencyError(ValueError):
    """An optional package this quantization needs is not installed."""


def bnb_functional():
    """bitsandbytes.functional, or an error saying how to install it."""
    try:
        import bitsandbytes.functional as bnb_f
    except (ImportError, OSError) as exc:
        raise MissingDependencyError(
            f"bitsandbytes 4-bit quantization needs the bitsandbytes package ({exc}): "
            'pip install "text-generation-server[bnb]"'
        ) from exc
    return bnb_f


@cache
def _cpu_fused_4bit() -> str:
    """Why bitsandbytes' fused CPU 4-bit kernel cannot run here ("" when it can)."""
    try:
        bnb_f = bnb_functional()
    except MissingDependencyError:
        return "bitsandbytes is not installed"
    if not hasattr(bnb_f, "_convert_weight_packed_for_cpu") or not hasattr(bnb_f, "has_avx512bf16"):
        return "this bitsandbytes has no packed CPU 4-bit layout"
    # bitsandbytes registers its CPU gemv_4bit kernel (for that layout) only on AVX512-BF16 CPUs.
    if not bnb_f.has_avx512bf16():
        return "the CPU lacks AVX512-BF16"
    return ""


def dequantize_flat(packed: torch.Tensor, absmax: torch.Tensor, count: int, quant_type: str,
                    blocksize: int) -> torch.Tensor:
    """float32 [count]: table[code] * absmax[i // blocksize] of the first `count` packed codes."""
    codes = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:count].long()
    scale = absmax.float().repeat_interleave(blocksize)[:count]
    return CODES[quant_type].to(packed.device)[codes] * scale


class Bnb4bitLayout(Protocol):
    """What the 4-bit kernels read of a weight (quantizers.bitsandbytes.Bnb4bitWeight)."""

    packed: torch.Tensor  # uint8 [ceil(rows*cols/2)]
    absmax: torch.Tensor  # float32 [ceil(rows*cols/blocksize)]
    rows: int
    cols: int
    quant_type: str
    blocksize: int
    pad: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of this rank's partition (padding excluded)."""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense [N, K] of this rank's partition."""


class _Bnb4bitKernel(QuantKernel):
    """What the 4-bit kernels share: their family, and refusing every other weight format first."""

    family: ClassVar[str] = "bnb-4bit"

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        if spec.weight_format not in ("bnb-nf4", "bnb-fp4"):
            return False, f"runs bitsandbytes 4-bit weights, not {spec.weight_format} weights"
        reason = cls.layer_reason(spec)
        return (False, reason) if reason else (True, "")

    @classmethod
    def layer_reason(cls, spec: LinearSpec) -> str:
        """Why this kernel cannot run a 4-bit layer ("" when it can)."""
        return ""


class Bnb4bitLinear(torch.nn.Module):
    # x: [..., K] -> [..., N]; the input is zero-padded to the stored columns first
    def __init__(self, weight: Bnb4bitLayout, bias: torch.Tensor | None, act_dtype: torch.dtype, fused_cpu: bool):
        super().__init__()
        bnb_f = bnb_functional()
        import bitsandbytes

        self._gemv_4bit = bnb_f.gemv_4bit
        self._matmul_4bit = bitsandbytes.matmul_4bit
        self.fused_cpu = fused_cpu
        self.pad = weight.pad
        self.out_features, self.in_features = weight.shape
        self.act_dtype = act_dtype
        code = CODES[weight.quant_type].to(weight.packed.device)
        state = bnb_f.QuantState(absmax=weight.absmax.float().clone(), shape=torch.Size([weight.rows, weight.cols]),
                                 code=code, blocksize=weight.blocksize, quant_type=weight.quant_type,
                                 dtype=act_dtype)
        packed = weight.packed.reshape(-1, 1)
        if fused_cpu:  # bitsandbytes' blocked CPU layout; absmax becomes bf16 [K/blocksize, N]
            packed, state = bnb_f._convert_weight_packed_for_cpu(packed.clone(), state)
        self.register_buffer("packed", packed)
        self.register_buffer("bias", None if bias is None else bias.to(act_dtype))
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        if self.pad != (0, 0):
            x = F.pad(x, self.pad)
        if self.fused_cpu:
            y = self._gemv_4bit(x.contiguous(), self.packed, state=self.state).to(self.act_dtype)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = self._matmul_4bit(x.to(self.act_dtype), self.packed.t(), quant_state=self.state, bias=self.bias)
        return y.reshape(*lead, self.out_features)


class BnbCpu4bitKernel(_Bnb4bitKernel):
    """bitsandbytes' fused CPU 4-bit matmul (AVX512-BF16): compact, bf16 compute."""

    name = "bnb-cpu-4bit"

    @classmethod
    def layer_reason(cls, spec: LinearSpec) -> str:
        if spec.device_type != "cpu":
            return f"device {spec.device_type}"
        if spec.act_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            return f"activation dtype {spec.act_dtype} not in bfloat16/float16/float32"
        if spec.out_features % 32:
            return f"out_features {spec.out_features} not a multiple of 32"
        if spec.in_features % spec.group_size:
            return f"in_features {spec.in_features} not a multiple of the blocksize {spec.group_size}"
        return _cpu_fused_4bit()

    @classmethod
    def build(cls, weight: Bnb4bitLayout, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        return Bnb4bitLinear(weight, bias, act_dtype, fused_cpu=True)


class BnbMatmul4bitKernel(_Bnb4bitKernel):
    """bnb.matmul_4bit: the fused kernel on CUDA, dequantize-per-call on CPU; compact either way."""

    name = "bnb-matmul-4bit"

    @classmethod
    def layer_reason(cls, spec: LinearSpec) -> str:
        if spec.device_type == "cpu" and spec.in_features % spec.group_size:
            return (f"in_features {spec.in_features} not a multiple of the blocksize {spec.group_size} "
                    "(bitsandbytes' CPU dequantize is wrong for some shapes whose blocks straddle rows)")
        try:
            bnb_functional()
        except MissingDependencyError:
            return "bitsandbytes is not installed"
        return ""

    @classmethod
    def build(cls, weight: Bnb4bitLayout, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        return Bnb4bitLinear(weight, bias, act_dtype, fused_cpu=False)


class Bnb4bitReferenceKernel(_Bnb4bitKernel):
    """Dequantizes once and runs a dense matmul: always exact, never compact."""

    name = "reference"
    dense_copy = True

    @classmethod
    def build(cls, weight: Bnb4bitLayout, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        return ReferenceLinear(weight.dequantize(act_dtype), None if bias is None else bias.to(act_dtype))
