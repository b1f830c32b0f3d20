"""Normalisation layers, in each family's exact arithmetic.

The families differ in where they leave float32: Llama normalises in float32 and casts
back before scaling by the weight; Gemma scales by (1 + weight) in float32 and casts after;
Cohere centres like LayerNorm without a bias; GPT-style models use torch's LayerNorm with a
bias. One class per arithmetic, chosen by the family, so a bfloat16 model rounds where
transformers rounds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from text_generation_server.kernels import cpu_pointwise, fused_pointwise
from text_generation_server.quantizers.sources import CheckpointError

from text_generation_server.quantizers.weights import Weights


def load_vector(weights: Weights, name: str, size: int | list[int]) -> torch.Tensor:
    """A norm's weight or bias, its shape checked (names the tensor and file when wrong)."""
    expected = [size] if isinstance(size, int) else list(size)
    tensor = weights.get_tensor(name)
    if list(tensor.shape) != expected:
        raise CheckpointError(f"tensor '{name}' has shape {list(tensor.shape)}, expected {expected} "
                              f"(in {weights.files_of(name)})")
    return tensor


class RMSNorm(torch.nn.Module):
    """x / rms(x) scaled by the weight. Llama casts the normalised value to the input dtype and
    then multiplies (the default); Gemma (`offset=1`: scale by 1 + w) and OLMo 2
    (`float_scale=True`) multiply in float32 and cast the product."""

    def __init__(self, weight: torch.Tensor, eps: float, offset: float = 0.0, float_scale: bool = False):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.offset = offset
        # The float32 scale (1 + w for Gemma), computed once.
        self._scale32 = (weight.float() + offset) if (offset or float_scale) else None

    @classmethod
    def load(cls, weights: Weights, prefix: str, size: int | list[int], eps: float, offset: float = 0.0,
             float_scale: bool = False) -> "RMSNorm":
        return cls(load_vector(weights, f"{prefix}.weight", size), eps, offset, float_scale)

    def _fusable(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
        """Llama's arithmetic on a 16-bit [T, N] row-major input: one Triton launch on CUDA
        (kernels/fused_pointwise.py) instead of torch's four."""
        return (fused_pointwise.usable(x) and self._scale32 is None and x.dim() == 2 and x.dtype == self.weight.dtype
                and x.stride(-1) == 1 and x.shape[-1] <= fused_pointwise.MAX_ROW and self.weight.dim() == 1
                and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                          and residual.stride(-1) == 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._scale32 is not None:
            if self._scale32.device != x.device:
                self._scale32 = self._scale32.to(x.device)
            return (F.rms_norm(x.float(), self.weight.shape, None, self.eps) * self._scale32).to(x.dtype)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            native = cpu_pointwise.module_for_f32(x)
            if native is not None and cpu_pointwise.norm_f32_fits(x, self.weight):
                return cpu_pointwise.rms_norm_f32(native, x, self.weight, self.eps)[0]  # one call for ~8 ops
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        if self._fusable(x):
            return fused_pointwise.rms_norm(x, self.weight, self.eps)[0]
        native = cpu_pointwise.module_for(x)
        if native is not None and cpu_pointwise.norm_fits(x, self.weight):
            return cpu_pointwise.rms_norm(native, x, self.weight, self.eps)[0]  # one call, the same roundings
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add and the next norm in one launch
        where the fused kernels run (CUDA; bfloat16 on the CPU: kernels/cpu_pointwise.py), else the
        same arithmetic in two steps."""
        if self._fusable(x, residual):
            normed, summed = fused_pointwise.rms_norm(x, self.weight, self.eps, residual)
            return normed, summed
        native = cpu_pointwise.module_for(x) if self._scale32 is None else None
        if native is not None and cpu_pointwise.norm_fits(x, self.weight, residual):
            normed, summed = cpu_pointwise.rms_norm(native, x, self.weight, self.eps, residual)
            return normed, summed
        native = cpu_pointwise.module_for_f32(x) if self._scale32 is None else None
        if native is not None and cpu_pointwise.norm_f32_fits(x, self.weight, residual):
            normed, summed = cpu_pointwise.rms_norm_f32(native, x, self.weight, self.eps, residual)
            return normed, summed
        summed = x + residual
        return self(summed), summed


class LayerNorm(torch.nn.Module):
    """torch's LayerNorm over the last dimension(s) of the weight's shape; `bias` may be None
    (Cohere, OLMo-style), then the arithmetic is float32 and cast at the end as Cohere does."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.eps = eps

    @classmethod
    def load(cls, weights: Weights, prefix: str, size: int | list[int], eps: float, bias: bool = True) -> "LayerNorm":
        w = load_vector(weights, f"{prefix}.weight", size)
        b = load_vector(weights, f"{prefix}.bias", size) if bias else None
        return cls(w, b, eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            out = F.layer_norm(x.float(), self.weight.shape, None, None, self.eps)
            return (self.weight.float() * out).to(x.dtype)
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class ShardedRMSNorm(torch.nn.Module):
    """RMSNorm over a whole projection whose features are split across tensor-parallel ranks
    (OLMo 2's q/k norm): each rank holds its slice of the weight, and the mean square is summed
    over ranks before normalising, so every rank divides by the full projection's rms."""

    def __init__(self, weight: torch.Tensor, eps: float, full_size: int, process_group):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.eps = eps
        self.full_size = full_size
        self.process_group = process_group

    @classmethod
    def load(cls, weights: Weights, prefix: str, size: int, eps: float) -> "ShardedRMSNorm":
        name = f"{prefix}.weight"
        shape = weights.get_shape(name)
        if shape != [size]:
            raise CheckpointError(f"tensor '{name}' has shape {shape}, expected {[size]} (in {weights.files_of(name)})")
        return cls(weights.get_sharded(name, dim=0), eps, size, weights.process_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [tokens, local features]
        x32 = x.float()
        square_sum = x32.pow(2).sum(-1, keepdim=True)
        if self.process_group.size > 1:
            square_sum = self.process_group.all_reduce(square_sum)
        normed = x32 * torch.rsqrt(square_sum / self.full_size + self.eps)
        return (self.weight.float() * normed).to(x.dtype)
