"""CPU kernel for integer codes of up to 8 bits with a scale (and zero point) per group of columns.

`cpu-int8` takes one scale per output channel, and the int4 op codes of at most 4 bits: GGUF's
Q8_0 (32-column groups), Q6_K (16) and the 5-bit formats (Q5_0, Q5_1, Q5_K: 32) fit neither, and
would otherwise fall to the reference kernel's dense copy (4 bytes a weight in float32). This
kernel keeps one int8 code a weight plus a float32 scale and offset per group, and in each
forward dequantizes blocks of output rows into one buffer (the int8 x float32 product written in
one pass), each followed by its product: in bfloat16 for bfloat16 activations (the weights rounded
to bfloat16 as the dense reference's copy is, and torch's bfloat16 GEMM: about twice its float32
one's speed on the 2-core EPYC), else in float32 (activations upcast, the output cast back):

    W[n, k] = s[n, g] * (q[n, k] - z[n, g]) = s[n, g] * q8[n, k] + c[n, g],
    q8 = q - 2^(bits-1) (fits int8 for any width up to 8), c = s * (2^(bits-1) - z), g = k // group.

The offset c is zero for symmetric weights and then skipped. A prompt's rows take the phase
rule's prompt path (kernels/phase.py: the product is `prompt_linear`, whose bits do not depend on
how a prompt is chunked); decoding rows take torch's plain linear.

`cpu-int8-group-native` (ranked first where the native extension has its AVX-512 code) keeps the
same buffers and the same prompt path, with the dequantization one native pass of the same two
roundings (so prompts get the torch kernel's bits), and runs decode batches of 1 to 8 rows through
a matrix-vector kernel that reads the codes and scales in place, once for all rows
(cpu_native_group_src.py: a row's bits do not depend on its batch neighbours).
"""

from __future__ import annotations

import torch

from text_generation_server.kernels import cpu_native
from text_generation_server.kernels.base import LinearSpec, QuantizedWeight, QuantKernel
from text_generation_server.kernels.phase import by_phase, prompt_linear

_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# ggml's groups: 32 (Q8_0, Q5_0, Q5_1, Q5_K's sub-blocks) and 16 (Q6_K's). Wider groups of 5- to
# 8-bit codes (GPTQ 8-bit g128) keep the dense reference, which outruns this kernel there.
GROUP_SIZES = (16, 32)
# Bytes of dequantized weight per block of output rows: enough rows that torch's float32 GEMM runs
# at its speed (a 128 x 8960 prompt against 1536 outputs took 4.5x as long in 16-row blocks, what a
# 1 MiB block gave, as in 256-row ones; 2-core EPYC, 2026-11-28), few enough to stay in L3.
BLOCK_BYTES = 8 << 20
# Decode rows up to which the native kernel reads the codes in place (its tiles keep one
# accumulator per row and output in registers); more rows dequantize blocks as the torch kernel.
NATIVE_GEMV_MAX_ROWS = 8


class GroupInt8Linear(torch.nn.Module):
    # x: [..., K] -> [..., N]
    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                 bias: torch.Tensor | None, act_dtype: torch.dtype):
        super().__init__()
        self.register_buffer("codes", codes)  # int8 [N, G, group]
        self.register_buffer("scales", scales)  # float32 [N, G, 1]
        self.register_buffer("offsets", offsets)  # float32 [N, G, 1] or None (symmetric)
        self.register_buffer("bias", bias)
        self.act_dtype = act_dtype
        self.compute_dtype = torch.bfloat16 if act_dtype == torch.bfloat16 else torch.float32
        self.out_features, groups, group = codes.shape
        self.in_features = groups * group
        self.block = max(16, BLOCK_BYTES // (self.in_features * 4) // 16 * 16)

    def dequantized(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [start, stop) of W in the compute dtype (into `out` [rows, G, group] when given)."""
        float_out = out if out is not None and out.dtype == torch.float32 else None
        w = torch.mul(self.codes[start:stop], self.scales[start:stop], out=float_out)  # int8 x float32 in one pass
        if self.offsets is not None:
            w.add_(self.offsets[start:stop])
        if w.dtype != self.compute_dtype:
            w = w.to(self.compute_dtype) if out is None else out.copy_(w)
        return w.view(stop - start, self.in_features)

    def _product(self, x: torch.Tensor, prompt: bool) -> torch.Tensor:
        # x: [M, K] -> [M, N], compute dtype; one block buffer reused: each block is dequantized in
        # one pass and multiplied while it is in cache.
        out = x.new_empty(x.shape[0], self.out_features)
        buffer = torch.empty(self.block, *self.codes.shape[1:], dtype=self.compute_dtype)
        for start in range(0, self.out_features, self.block):
            stop = min(self.out_features, start + self.block)
            w = self.dequantized(start, stop, buffer[:stop - start])
            out[:, start:stop] = prompt_linear(x, w, None) if prompt else torch.nn.functional.linear(x, w)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        flat = x.reshape(-1, self.in_features).to(self.compute_dtype)
        y = by_phase(flat, lambda t: self._product(t, True), lambda t: self._product(t, False)).to(self.act_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


class GroupInt8NativeLinear(GroupInt8Linear):
    """GroupInt8Linear with the native extension's dequantization and decode matrix-vector kernel."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
                 bias: torch.Tensor | None, act_dtype: torch.dtype):
        super().__init__(codes, scales, offsets, bias, act_dtype)
        self.native = cpu_native.native()
        if self.native is None:
            raise ValueError(f"cpu-int8-group-native: native kernels unavailable ({cpu_native.unavailable_reason()})")
        self._no_offsets = torch.empty(0)

    def _flat(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # codes [N, K], scales and offsets [N, G] (offsets empty when symmetric): views, no copies
        n = self.out_features
        offsets = self._no_offsets if self.offsets is None else self.offsets.view(n, -1)
        return self.codes.view(n, self.in_features), self.scales.view(n, -1), offsets

    def dequantized(self, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        codes, scales, offsets = self._flat()
        if out is None:
            out = torch.empty(stop - start, *self.codes.shape[1:], dtype=self.compute_dtype)
        self.native.group_int8_dequant(codes, scales, offsets, start, stop, out)
        return out.view(stop - start, self.in_features)

    def _product(self, x: torch.Tensor, prompt: bool) -> torch.Tensor:
        if prompt or not 0 < x.shape[0] <= NATIVE_GEMV_MAX_ROWS:
            return super()._product(x, prompt)
        codes, scales, offsets = self._flat()
        y = self.native.group_int8_gemv(x.float().contiguous(), codes, scales, offsets, cpu_native.PREFETCH_BYTES)
        return y.to(self.compute_dtype)


class CpuGroupInt8Kernel(QuantKernel):
    """Codes of up to 8 bits as int8 with per-group scales, dequantized an 8 MiB block at a time."""

    name = "cpu-int8-group"
    layer: type[GroupInt8Linear] = GroupInt8Linear

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        if spec.weight_format != "int":
            return False, f"runs integer codes, not {spec.weight_format} weights"
        if spec.device_type != "cpu":
            return False, f"device {spec.device_type}"
        if spec.act_dtype not in _ACT_DTYPES:
            return False, f"activation dtype {spec.act_dtype} not in bfloat16/float16/float32"
        if spec.bits < 5:
            return False, f"{spec.bits}-bit codes are the int4 kernels' (this one takes 5 to 8 bits)"
        if spec.group_size not in GROUP_SIZES:
            return False, f"group size {spec.group_size} not in {GROUP_SIZES} (ggml's block groups)"
        if spec.act_order:
            return False, "act-order groups (g_idx not k // group_size)"
        if spec.in_features % spec.group_size:
            return False, f"in_features {spec.in_features} not a multiple of the group size {spec.group_size}"
        return True, ""

    @classmethod
    def build(cls, weight: QuantizedWeight, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        spec = weight.spec(act_dtype, "cpu")
        ok, reason = cls.can_implement(spec)
        if not ok:
            raise ValueError(f"{cls.name} cannot run this weight: {reason}")
        k, n = weight.qweight.shape
        group = weight.group_size
        groups = k // group
        mid = 2 ** (weight.bits - 1)
        codes = (weight.qweight.t().to(torch.int16) - mid).to(torch.int8).reshape(n, groups, group).contiguous()
        first = weight.g_idx.long()[::group]  # the checkpoint group of each kernel group
        scales = weight.scales.float().index_select(0, first).t().contiguous()  # [N, G]
        zeros = weight.zero_points().float().index_select(0, first).t()
        offsets = scales * (mid - zeros)
        return cls.layer(codes, scales.unsqueeze(-1), None if bool((offsets == 0).all())
                         else offsets.unsqueeze(-1).contiguous(),
                         None if bias is None else bias.to(act_dtype), act_dtype)


class CpuGroupInt8NativeKernel(CpuGroupInt8Kernel):
    """cpu-int8-group's layers with the native dequantization and decode kernel (AVX-512 builds)."""

    name = "cpu-int8-group-native"
    layer = GroupInt8NativeLinear

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        ok, reason = super().can_implement(spec)
        if not ok:
            return ok, reason
        module = cpu_native.native()
        if module is None:
            return False, f"native kernels unavailable ({cpu_native.unavailable_reason()})"
        if not module.group_int8_native_isa():
            return False, "native kernels built without AVX-512 (their scalar loops lose to cpu-int8-group)"
        return True, ""
