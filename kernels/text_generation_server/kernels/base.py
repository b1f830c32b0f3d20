"""What every quantized-linear kernel agrees on.

Loaders turn a checkpoint's packed layout into one canonical, layout-free form
(`QuantizedWeight`: unsigned integer codes, group scales, optional zero points
and each input row's group). Kernels read only the frozen `LinearSpec` to decide
whether they can run a layer, and transform the canonical weight once, at load,
into whatever layout they compute with. The reference kernel dequantizes; it is
the ground truth every other kernel is tested against.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from text_generation_server.kernels.phase import by_phase, prompt_linear


@dataclass(frozen=True)
class LinearSpec:
    """A quantized linear as kernels see it (this rank's partition)."""

    in_features: int  # K of this partition
    out_features: int  # N of this partition
    bits: int
    group_size: int  # rows per group; equal to in_features for per-channel
    has_zeros: bool  # asymmetric (explicit zero points) or symmetric (implied 2^(bits-1))
    act_order: bool  # g_idx is not k // group_size
    act_dtype: torch.dtype
    device_type: str  # "cpu" or "cuda"
    full_in_features: int | None = None
    full_out_features: int | None = None
    # Group-wise kernels run a fixed group size; after sorting rows by group, a kernel group
    # size s is exact when it divides every group's row count. None: assume `group_size` rows
    # per group (the last group shorter when group_size does not divide in_features).
    group_rows_gcd: int | None = None
    # Row count of every group in use, in group order (None: not known, e.g. a spec written by
    # hand): lets a kernel that needs whole fixed-size groups plan padding for the others.
    group_rows: tuple[int, ...] | None = None
    # "int": integer codes with group scales (a `QuantizedWeight`); other formats (fp8, ...)
    # bring their own weight type, and a kernel must refuse formats it does not know.
    weight_format: str = "int"

    def rows_per_group_gcd(self) -> int:
        """The largest row count that tiles every group once rows are sorted by group."""
        if self.group_rows_gcd is not None:
            return self.group_rows_gcd
        tail = self.in_features % self.group_size if self.group_size > 0 else 0
        return math.gcd(self.group_size, tail) if tail else self.group_size


@dataclass
class QuantizedWeight:
    """Canonical quantized weight: W[k, n] = scales[g, n] * (qweight[k, n] - zeros[g, n]), g = g_idx[k].

    qweight: uint8 [K, N] codes in [0, 2^bits); scales: float [G, N]; zeros: float [G, N]
    (integer-valued, None when symmetric: 2^(bits-1)); g_idx: int32 [K].
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        if self.bits not in (2, 3, 4, 5, 6, 8):
            raise ValueError(f"unsupported bits {self.bits}")
        if self.group_size <= 0:
            raise ValueError(f"group_size must be positive (in_features for per-channel), got {self.group_size}")
        if self.qweight.dim() != 2:
            raise ValueError(f"qweight must be 2-D [K, N], got shape {list(self.qweight.shape)}")
        k, n = self.qweight.shape
        if self.scales.dim() != 2 or self.scales.shape[1] != n:
            raise ValueError(f"scales must be [groups, {n}], got {list(self.scales.shape)}")
        if self.zeros is not None and self.zeros.shape != self.scales.shape:
            raise ValueError(f"zeros must match scales {list(self.scales.shape)}, got {list(self.zeros.shape)}")
        if self.g_idx.shape != (k,):
            raise ValueError(f"g_idx must be [{k}], got {list(self.g_idx.shape)}")
        if k and (int(self.g_idx.min()) < 0 or int(self.g_idx.max()) >= self.scales.shape[0]):
            raise ValueError(f"g_idx values must be in [0, {self.scales.shape[0]})")
        if self.qweight.numel() and (int(self.qweight.min()) < 0 or int(self.qweight.max()) >= 2**self.bits):
            raise ValueError(f"qweight codes must be in [0, {2**self.bits}) for {self.bits}-bit, "
                             f"got [{int(self.qweight.min())}, {int(self.qweight.max())}]")

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        """Logical (out_features, in_features), like a dense weight."""
        return self.out_features, self.in_features

    @property
    def act_order(self) -> bool:
        k = self.in_features
        natural = torch.arange(k, dtype=torch.int32, device=self.g_idx.device) // self.group_size
        return not torch.equal(self.g_idx.to(torch.int32) - self.g_idx.min().to(torch.int32), natural)

    def group_rows_gcd(self) -> int:
        """GCD of the row counts of the groups in use: a kernel group size must divide it."""
        counts = self.group_rows()
        return math.gcd(*counts) if counts else 0

    def group_rows(self) -> tuple[int, ...]:
        """Row count of every group in use (non-empty), in group order."""
        counts = torch.bincount(self.g_idx.long(), minlength=self.scales.shape[0])
        return tuple(counts[counts > 0].tolist())

    def zero_points(self) -> torch.Tensor:
        if self.zeros is not None:
            return self.zeros
        return torch.full_like(self.scales, float(2 ** (self.bits - 1)))

    def spec(self, act_dtype: torch.dtype, device_type: str) -> LinearSpec:
        return LinearSpec(
            in_features=self.in_features,
            out_features=self.out_features,
            bits=self.bits,
            group_size=self.group_size,
            has_zeros=self.zeros is not None,
            act_order=self.act_order,
            act_dtype=act_dtype,
            device_type=device_type,
            group_rows_gcd=self.group_rows_gcd(),
            group_rows=self.group_rows(),
        )

    def describe_layer(self, spec: LinearSpec, kernel: type[QuantKernel]) -> str:
        """The layer as the startup log names it beside its kernel."""
        return (f"{spec.bits}-bit g{spec.group_size} {'asym' if spec.has_zeros else 'sym'}"
                f"{' act-order' if spec.act_order else ''}")


def dequantize(w: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ground truth: dense [N, K] weight (the nn.Linear convention)."""
    g = w.g_idx.long()
    scales = w.scales.float()[g]  # [K, N]
    zeros = w.zero_points().float()[g]
    dense = (w.qweight.float() - zeros) * scales
    return dense.t().contiguous().to(dtype)


class QuantKernel(ABC):
    """A way to run a quantized linear. Subclasses are stateless; `build` returns the module."""

    name: str = "kernel"
    # Kernels of one family are ranked against each other for a layer (kernels/table.py), and their
    # refusals are what the startup log reports: "quantized" reads the canonical forms (integer codes,
    # their 2:4 form, fp8), "bnb-4bit" bitsandbytes' own 4-bit layout, "dense" unquantized weights.
    family: ClassVar[str] = "quantized"
    # True for kernels that dequantize the weight once into a dense copy in the activation dtype
    # (so the layer takes dense memory and runs at dense speed): on CUDA such a kernel is only
    # used when the operator allows it (select.check_dense_fallback). They are `reference`, the
    # bitsandbytes 4-bit `reference` and `fp8-dense`. sparse-2:4 also dequantizes, but into the
    # 2:4 compressed form (half the values) that the sparse tensor cores run: a deliberate
    # choice for a 2:4 checkpoint, not a fallback, so it is not flagged.
    dense_copy: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        """(True, "") when this kernel runs `spec` exactly; else (False, the reason)."""

    @classmethod
    @abstractmethod
    def build(cls, weight: QuantizedWeight, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        """Transforms the weight once (repack) and returns a module whose forward is one call."""


class ReferenceLinear(torch.nn.Module):
    # x: [tokens, K] -> [tokens, N]
    kernel_name = "reference"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """The dense product, on the prompt path in a prefill (kernels/phase.py)."""
        k = x.shape[-1]
        flat = x.reshape(-1, k)
        y = by_phase(flat, lambda t: prompt_linear(t, self.weight, self.bias),
                     lambda t: torch.nn.functional.linear(t, self.weight, self.bias))
        return y.reshape(*x.shape[:-1], y.shape[-1])


class ReferenceKernel(QuantKernel):
    """Dequantizes once at load and runs a dense matmul: always correct, never compact."""

    name = "reference"
    dense_copy = True

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        if spec.weight_format != "int":
            return False, f"dequantizes integer codes, not {spec.weight_format} weights"
        return True, ""

    @classmethod
    def build(cls, weight: QuantizedWeight, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        return ReferenceLinear(dequantize(weight, act_dtype), None if bias is None else bias.to(act_dtype))


class NoKernelError(ValueError):
    pass


class DenseFallbackError(NoKernelError):
    """A quantized layer on CUDA would run on a kernel that keeps a dense dequantized copy."""
