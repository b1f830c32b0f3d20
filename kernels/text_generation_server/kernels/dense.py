"""The dense linear that unquantized weights run on."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_forward(native, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, except a decode-sized input against bfloat16 weights on the CPU: the native
    matrix-vector product streams the weights faster than torch's GEMM there (kernels/cpu_native.py)."""
    if native is not None:
        from text_generation_server.kernels import cpu_native

        y = cpu_native.bf16_linear(native, x, weight, bias)
        if y is not None:
            return y
    return F.linear(x, weight, bias)


def native_for(weight: torch.Tensor):
    """The native CPU extension when `weight` is bfloat16 on the CPU (built at load), else None."""
    from text_generation_server.kernels import cpu_native

    return cpu_native.for_bf16_weight(weight)


class DenseLinear(torch.nn.Module):
    # x: [tokens, in_features] -> [tokens, out_features]
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)
        self.native = native_for(weight)

    @property
    def kernel_name(self) -> str:
        return "dense"

    def _apply(self, fn, recurse: bool = True):
        # .to() may change the weight's device or dtype: the native path follows it.
        super()._apply(fn, recurse)
        self.native = native_for(self.weight)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_forward(self.native, x, self.weight, self.bias)
