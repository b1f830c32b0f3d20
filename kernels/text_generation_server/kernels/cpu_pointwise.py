"""A bfloat16 decoder layer's small ops on the CPU in one native call each (issue #32).

At one decode row the RMSNorms, the rotary embedding and the MLP's silu * up were ~25 torch calls
a layer on vectors of a few thousand numbers: their dispatch and allocations, not their arithmetic,
cost ~2 ms of a single-stream Qwen2.5-1.5B step on the 2-core EPYC. The native ops
(cpu_native_pointwise_src.py) round where the torch code rounds; the layers (layers/norm.py,
rotary.py, mlp.py) call them for bfloat16 CPU tensors when the extension is built, and keep their
torch code otherwise. TGS_CPU_NATIVE_POINTWISE=0 keeps the torch code everywhere (read per call,
so a benchmark can switch it between steps).
"""

from __future__ import annotations

import os

import torch

from text_generation_server.kernels import cpu_native

ENV = "TGS_CPU_NATIVE_POINTWISE"


def module_for(x: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> cpu_native.Extension | None:
    """The extension when `x` is a CPU tensor of `dtype` and the switch is on, else None."""
    if x.device.type != "cpu" or x.dtype != dtype:
        return None
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    return cpu_native.native()


def norm_fits(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None,
              dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether `rms_norm` (`rms_norm_f32` for float32) takes x [rows, n] (and residual) against `weight` [n]."""
    return (x.dim() == 2 and x.stride(-1) == 1 and weight.dim() == 1 and weight.dtype == dtype
            and weight.is_contiguous() and weight.shape[0] == x.shape[1] and weight.device.type == "cpu"
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype
                                      and residual.stride(-1) == 1)))


def rms_norm(module: cpu_native.Extension, x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> list[torch.Tensor]:
    """[weight * bf16(rms-normalised x)] or, with a residual, [norm(x + residual), x + residual]."""
    return module.rms_norm_bf16(x, weight, eps, residual)


def rotary_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool,
                dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether `rotary` (`rotary_f32` for float32) takes x [tokens, heads, D] (rotate-half, every
    dimension rotated)."""
    return (not interleaved and x.dim() == 3 and x.shape[-1] % 2 == 0 and x.stride(-1) == 1
            and x.stride(1) == x.shape[-1] and cos.dtype == sin.dtype == dtype
            and cos.shape == sin.shape == (x.shape[0], 1, x.shape[-1]) and cos.stride(-1) == 1 and sin.stride(-1) == 1)


def rotary(module: cpu_native.Extension, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by cos and the signed sin (RotaryEmbedding.cos_sin's layout): a new tensor."""
    return module.rotary_bf16(x, cos, sin)


def silu_mul_fits(gate_up: torch.Tensor, local: int) -> bool:
    """Whether `silu_mul` takes gate_up [rows, 2 * local]."""
    return gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[-1] == 2 * local


def silu_mul(module: cpu_native.Extension, gate_up: torch.Tensor, local: int) -> torch.Tensor:
    """bf16(bf16(silu(gate)) * up) over gate_up's [gate | up] halves."""
    return module.silu_mul_bf16(gate_up, local)


# ---- float32 (serve's CPU default dtype): the forms cpu_native_pointwise_src.py describes ----------------


def module_for_f32(x: torch.Tensor) -> cpu_native.Extension | None:
    return module_for(x, torch.float32)


def norm_f32_fits(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    return norm_fits(x, weight, residual, torch.float32)


def rms_norm_f32(module: cpu_native.Extension, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> list[torch.Tensor]:
    """[x * rsqrt(mean(x^2) + eps) * weight] or, with a residual, [norm(x + residual), x + residual]."""
    return module.rms_norm_f32(x, weight, eps, residual)


def rotary_f32_fits(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> bool:
    return rotary_fits(x, cos, sin, interleaved, torch.float32)


def rotary_f32(module: cpu_native.Extension, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x rotated by cos and the signed sin, torch's addcmul(x * cos, partner, sin) bit for bit: a new tensor."""
    return module.rotary_f32(x, cos, sin)


def silu_mul_f32(module: cpu_native.Extension, gate_up: torch.Tensor, local: int) -> torch.Tensor:
    """silu(gate) * up over gate_up's [gate | up] float32 halves (torch's bits at AVX-512 and AVX2)."""
    return module.silu_mul_f32(gate_up, local)


def argmax(scores: torch.Tensor) -> torch.Tensor | None:
    """torch.argmax(scores, dim=-1) for float32 CPU scores [rows, vocab] with unit-stride rows, in one
    native call (the same index: first maximal, NaN first); None where it does not apply or the
    extension was not built by the time of the call (this never builds it: sampling may run before
    any layer did)."""
    if (scores.device.type != "cpu" or scores.dtype != torch.float32 or scores.dim() != 2 or scores.stride(-1) != 1
            or scores.shape[-1] == 0):
        return None
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    decided, module = cpu_native.loaded()
    if not decided or module is None:
        return None
    return module.argmax_f32(scores)
