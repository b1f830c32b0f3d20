"""The dense linear that unquantized weights run on."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DenseLinear(torch.nn.Module):
    # x: [tokens, in_features] -> [tokens, out_features]
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias, requires_grad=False)

    @property
    def kernel_name(self) -> str:
        return "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
