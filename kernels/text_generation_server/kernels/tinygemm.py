"""tinygemm: torch's int4 matmul (`torch._weight_int4pack_mm`, gpt-fast's kernel) for CUDA linears.

It runs 4-bit (and narrower) codes with bfloat16 activations in groups of 32, 64, 128 or 256
rows, from its own tensor-core layout, built once from the canonical `QuantizedWeight`
(`tinygemm_layout`, then `_convert_weight_to_int4pack`). Act-order weights are sorted by group
at build; each forward then permutes the input into a shared scratch buffer.

It ranks right after triton-gemm (kernels/table.py): triton-gemm runs every
layer tinygemm can, so tinygemm serves when triton-gemm is missing (no Triton) or disabled
(TGS_DISABLE_KERNELS). The layer and machine checks are triton-gemm's, shared.
"""

from __future__ import annotations

import torch
from loguru import logger

from text_generation_server.kernels.base import LinearSpec, QuantizedWeight, QuantKernel
from text_generation_server.kernels.cpu import int4_group_size
from text_generation_server.kernels.scratch import SCRATCH, ScratchSpace, typed_view
from text_generation_server.kernels.triton_gemm import layer_reason, machine_reason


def _tinygemm_reason(spec: LinearSpec) -> str:
    if spec.act_dtype != torch.bfloat16:
        return f"needs bfloat16 activations, got {spec.act_dtype}"
    if spec.bits > 4:
        return f"needs at most 4-bit codes, got {spec.bits}-bit"
    if int4_group_size(spec) is None:
        if spec.in_features % 32:
            return f"in_features {spec.in_features} not a multiple of 32 (padding K would copy every input)"
        return f"groups of {spec.rows_per_group_gcd()} rows do not tile into 32, 64, 128 or 256"
    return ""


def _torch_reason() -> str:
    if not (hasattr(torch.ops.aten, "_weight_int4pack_mm") and hasattr(torch.ops.aten, "_convert_weight_to_int4pack")):
        return "this torch has no _weight_int4pack_mm"
    if tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) < (2, 5):
        return "needs torch 2.5+ (uint8 input to _convert_weight_to_int4pack)"
    return ""


def tinygemm_layout(weight: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]:
    """(codes uint8 [Np, K/2], scales_and_zeros bf16 [K/g, Np, 2], g, perm) for torch's tinygemm.

    The op dequantizes w = (q - 8) * scale + zero with the even-k code in a byte's high nibble
    (aten/src/ATen/native/cuda/int4mm.cu), so zero = (8 - z) * scale. N pads to a multiple of 8.
    """
    spec = weight.spec(torch.bfloat16, "cuda")
    gs = int4_group_size(spec)
    if gs is None or weight.bits > 4:
        raise ValueError(f"tinygemm cannot run this weight: {_tinygemm_reason(spec)}")
    k, n = weight.in_features, weight.out_features
    g_idx = weight.g_idx.long()
    perm = torch.argsort(g_idx, stable=True)
    sub = g_idx[perm].view(k // gs, gs)
    if not torch.equal(sub, sub[:, :1].expand_as(sub)):
        raise ValueError(f"tinygemm: groups do not tile into {gs}-row blocks after sorting by g_idx")
    src = sub[:, 0]
    identity = torch.equal(perm, torch.arange(k, device=perm.device))
    codes = (weight.qweight if identity else weight.qweight.index_select(0, perm)).t()  # [N, K]
    np_ = -(-n // 8) * 8
    codes = torch.nn.functional.pad(codes, (0, 0, 0, np_ - n))
    packed = (codes[:, 0::2] << 4) | codes[:, 1::2]
    scales = weight.scales.float().index_select(0, src)
    zeros = weight.zero_points().float().index_select(0, src)
    sz = torch.stack([scales, (8.0 - zeros) * scales], dim=-1)
    sz = torch.nn.functional.pad(sz, (0, 0, 0, np_ - n)).to(torch.bfloat16).contiguous()
    return packed.contiguous(), sz, gs, None if identity else perm


class TinyGemmLinear(torch.nn.Module):
    # x: [..., K] bf16 -> [..., N] bf16
    kernel_name = "tinygemm"

    def __init__(self, packed: torch.Tensor, sz: torch.Tensor, group_size: int, perm: torch.Tensor | None,
                 bias: torch.Tensor | None, in_features: int, out_features: int, scratch: ScratchSpace | None = None):
        super().__init__()
        self.register_buffer("packed", packed)  # int32, the op's tensor-core layout
        self.register_buffer("scales_and_zeros", sz)
        self.register_buffer("perm", perm)
        self.register_buffer("bias", bias)
        self.group_size = group_size
        self.in_features = in_features
        self.out_features = out_features
        self.scratch_device = packed.device
        self.scratch = SCRATCH if scratch is None else scratch
        self.scratch.register(self)

    def scratch_needs(self, max_tokens: int, max_input_tokens: int) -> dict[str, int]:
        """Act-order permutes the input: one bf16 [tokens, K] buffer for the largest forward."""
        return {"act_order_input": 0 if self.perm is None else max_tokens * self.in_features * 2}

    def prepare_scratch(self, max_tokens: int, max_input_tokens: int) -> int:
        return self.scratch.prepare(max_tokens, max_input_tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise ValueError(f"{self.kernel_name}: input dtype {x.dtype}, needs torch.bfloat16")
        lead = x.shape[:-1]
        x = x.reshape(-1, self.in_features)
        m = x.shape[0]
        if m == 0:
            return x.new_empty(*lead, self.out_features)
        if self.perm is not None:
            buf = self.scratch.get("act_order_input", self.scratch_device, m * self.in_features * 2)
            x = torch.index_select(x, 1, self.perm, out=typed_view(buf, torch.bfloat16, (m, self.in_features)))
        else:
            x = x.contiguous()
        y = torch._weight_int4pack_mm(x, self.packed, self.group_size, self.scales_and_zeros)
        y = y[:, :self.out_features]
        if self.bias is not None:
            y.add_(self.bias)
        return y.reshape(*lead, self.out_features)


class TinyGemmKernel(QuantKernel):
    """torch._weight_int4pack_mm (gpt-fast's tinygemm): bf16 activations, 4-bit, groups of 32..256."""

    name = "tinygemm"

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        reason = layer_reason(spec) or _torch_reason() or machine_reason() or _tinygemm_reason(spec)
        return (not reason), reason

    @classmethod
    def build(cls, weight: QuantizedWeight, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        if act_dtype != torch.bfloat16:
            raise ValueError(f"{cls.name} cannot run this weight: needs bfloat16 activations, got {act_dtype}")
        codes, sz, gs, perm = tinygemm_layout(weight)
        k = weight.in_features
        inner_k_tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
        packed = torch._convert_weight_to_int4pack(codes, inner_k_tiles)
        logger.debug("tinygemm: K={} N={} group {} inner_k_tiles {}", k, weight.out_features, gs, inner_k_tiles)
        return TinyGemmLinear(packed, sz, gs, perm, None if bias is None else bias.to(torch.bfloat16),
                              k, weight.out_features)
