"""Feed-forward blocks: gated (SwiGLU, GeGLU) and plain (fc -> activation -> fc), tensor parallel.

Activations are transformers' (`hidden_act` / `hidden_activation` names), each in the same
arithmetic as its ACT2FN entry so float32 outputs agree; a name not listed here is refused
at load, naming the config key, never run approximately.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from text_generation_server.kernels import cpu_pointwise, fused_pointwise
from text_generation_server.layers.tensor_parallel import TensorParallelColumnLinear, TensorParallelRowLinear
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": _gelu_new,
    "gelu_fast": _gelu_fast,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "relu2": lambda x: F.relu(x).square(),
}


def activation(name: str, key: str = "hidden_act", source: str = "config.json") -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation transformers names `name`; unknown names are refused with the key."""
    try:
        return ACTIVATIONS[name]
    except (KeyError, TypeError):
        raise CheckpointError(f"{source}: {key} '{name}' is not supported "
                              f"(supported: {', '.join(sorted(ACTIVATIONS))})") from None


class GatedMLP(torch.nn.Module):
    """down(act(gate(x)) * up(x)); gate and up run as one column-parallel matmul.

    `gate_up`: the checkpoint names of gate and up (two tensors), or one fused tensor name
    (Phi-3's gate_up_proj) holding gate then up.
    """

    # x: [tokens, hidden] -> [tokens, hidden]
    def __init__(self, weights: Weights, prefix: str, hidden: int, intermediate: int, act: Callable,
                 gate_up: tuple[str, ...] = ("gate_proj", "up_proj"), down: str = "down_proj", bias: bool = False):
        super().__init__()
        world = weights.process_group.size
        if intermediate % world != 0:
            raise CheckpointError(f"config.json: intermediate_size ({intermediate}) must be divisible by the "
                                  f"{world} shards")
        self.local = intermediate // world
        self.act = act
        if len(gate_up) == 1:
            self.gate_up = TensorParallelColumnLinear.load_packed(weights, f"{prefix}.{gate_up[0]}", bias,
                                                                  [intermediate, intermediate], hidden)
        else:
            self.gate_up = TensorParallelColumnLinear.load_multi(weights, [f"{prefix}.{n}" for n in gate_up], bias,
                                                                 [intermediate, intermediate], hidden)
        self.down = TensorParallelRowLinear.load(weights, f"{prefix}.{down}", bias, hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        if (fused_pointwise.usable(gate_up) and self.act is F.silu and gate_up.dim() == 2 and gate_up.stride(-1) == 1
                and gate_up.shape[-1] == 2 * self.local):
            return self.down(fused_pointwise.silu_mul(gate_up))  # one launch on CUDA instead of two
        native = cpu_pointwise.module_for(gate_up) if self.act is F.silu else None
        if native is not None and cpu_pointwise.silu_mul_fits(gate_up, self.local):
            return self.down(cpu_pointwise.silu_mul(native, gate_up, self.local))  # one call on the CPU (bfloat16)
        native = cpu_pointwise.module_for_f32(gate_up) if self.act is F.silu else None
        if native is not None and cpu_pointwise.silu_mul_fits(gate_up, self.local):
            return self.down(cpu_pointwise.silu_mul_f32(native, gate_up, self.local))  # float32, the same bits
        gate, up = gate_up.split(self.local, dim=-1)
        return self.down(self.act(gate) * up)

    def linear_stages(self) -> list[list[str]]:
        """Module paths of the linears in the order `quantize` calibrates them."""
        return [["gate_up"], ["down"]]


class MLP(torch.nn.Module):
    """fc_out(act(fc_in(x))): GPT-2, GPT-NeoX, Falcon, Phi-2, StarCoder2."""

    # x: [tokens, hidden] -> [tokens, hidden]
    def __init__(self, weights: Weights, prefix: str, hidden: int, intermediate: int, act: Callable,
                 fc_in: str, fc_out: str, bias: bool = True):
        super().__init__()
        world = weights.process_group.size
        if intermediate % world != 0:
            raise CheckpointError(f"config.json: the MLP's {intermediate} intermediate features must be divisible by "
                                  f"the {world} shards")
        self.act = act
        self.fc_in = TensorParallelColumnLinear.load(weights, f"{prefix}.{fc_in}", bias, intermediate, hidden)
        self.fc_out = TensorParallelRowLinear.load(weights, f"{prefix}.{fc_out}", bias, hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(self.act(self.fc_in(x)))

    def linear_stages(self) -> list[list[str]]:
        return [["fc_in"], ["fc_out"]]
