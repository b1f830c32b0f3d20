"""Triton kernels for the LoRA term on CUDA: each row reads its adapter slot from a per-row index
(Punica's BGMV: one program per row and output block), so a decode step mixing adapters costs two
launches per linear and a CUDA graph replays it for any mix (the index is a fixed buffer).

    shrink: h[t, :] = A[slot[t]] @ x[t]          A bank [slots, W, K] -> h [rows, W] float32
    expand: out[t, :] += h[t] @ Bt[slot[t]]      B bank transposed [slots, W, N]
A row with slot -1 (the base model) gets h = 0 and out unchanged. Defined lazily per interpreter
setting (kernels/triton_support.py), so tests check them on the CPU under TRITON_INTERPRET=1 against
`lora_rows_torch` (kernels/lora.py). They call only Triton builtins (tl.full, tl.reduce with the
combiner tl.sum uses): tl.zeros and tl.sum are themselves @triton.jit functions, which the
interpreter cannot call when it was switched on after Triton's import (kernels/paged_attention.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from text_generation_server.kernels.lora import check_banks
from text_generation_server.kernels.triton_support import LazyKernels, interpreting, tl, triton

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def lora_triton_available(device: torch.device) -> tuple[bool, str]:
    """(True, "") when the kernels run on `device`; else the reason."""
    if triton is None:
        return False, "triton is not installed"
    device = torch.device(device)
    if device.type == "cuda":
        return (True, "") if torch.cuda.is_available() else (False, "no CUDA device")
    if device.type == "cpu" and interpreting():
        return True, ""
    return False, f"{device.type} tensors run only on CUDA or under TRITON_INTERPRET=1"


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _define() -> SimpleNamespace:
    @triton.jit
    def shrink(x_ptr, a_ptr, slot_ptr, h_ptr, K, W, stride_x, stride_as, stride_aw, stride_h,
               BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
        row = tl.program_id(0)
        slot = tl.load(slot_ptr + row)
        offs_w = tl.arange(0, BLOCK_W)
        acc = tl.full((BLOCK_W,), 0.0, tl.float32)
        if slot >= 0:
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                xk = tl.load(x_ptr + row * stride_x + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
                a = tl.load(a_ptr + slot * stride_as + offs_w[:, None] * stride_aw + offs_k[None, :],
                            mask=(offs_w[:, None] < W) & (offs_k[None, :] < K), other=0.0).to(tl.float32)
                acc += tl.reduce(a * xk[None, :], 1, tl.standard._sum_combine)
        tl.store(h_ptr + row * stride_h + offs_w, acc, mask=offs_w < W)

    @triton.jit
    def expand(h_ptr, b_ptr, slot_ptr, out_ptr, N, W, stride_h, stride_bs, stride_bw, stride_out,
               BLOCK_W: tl.constexpr, BLOCK_N: tl.constexpr):
        row = tl.program_id(0)
        block = tl.program_id(1)
        slot = tl.load(slot_ptr + row)
        if slot >= 0:
            offs_w = tl.arange(0, BLOCK_W)
            offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
            h = tl.load(h_ptr + row * stride_h + offs_w, mask=offs_w < W, other=0.0)
            b = tl.load(b_ptr + slot * stride_bs + offs_w[None, :] * stride_bw + offs_n[:, None],
                        mask=(offs_n[:, None] < N) & (offs_w[None, :] < W), other=0.0).to(tl.float32)
            add = tl.reduce(b * h[None, :], 1, tl.standard._sum_combine)
            ptrs = out_ptr + row * stride_out + offs_n
            cur = tl.load(ptrs, mask=offs_n < N, other=0.0).to(tl.float32)
            tl.store(ptrs, (cur + add).to(out_ptr.dtype.element_ty), mask=offs_n < N)

    return SimpleNamespace(shrink=shrink, expand=expand)


_kernels = LazyKernels(_define)


def lora_rows_triton(x: torch.Tensor, out: torch.Tensor, a_bank: torch.Tensor, b_bank: torch.Tensor,
                     row_slots: torch.Tensor, h: torch.Tensor | None = None) -> torch.Tensor:
    """out += the LoRA term of each row's slot, in place (see the module docstring); `h`: a float32
    [rows, W] scratch to reuse (a graph's fixed buffer), else allocated."""
    # x: [rows, K], out: [rows, N], row_slots: [rows] int32
    check_banks("lora_rows_triton", x, out, a_bank, b_bank)
    rows, k = x.shape
    w, n = b_bank.shape[1], b_bank.shape[2]
    for name, t in (("x", x), ("out", out), ("a_bank", a_bank), ("b_bank", b_bank)):
        if t.dtype not in _DTYPES or t.stride(-1) != 1 or t.device != x.device:
            raise ValueError(f"lora_rows_triton: {name} must be float16/bfloat16/float32 on {x.device} with unit "
                             f"last stride, got {t.dtype} on {t.device} strides {t.stride()}")
    if row_slots.shape != (rows,) or row_slots.dtype != torch.int32 or row_slots.device != x.device:
        raise ValueError(f"lora_rows_triton: row_slots must be int32 [{rows}] on {x.device}, got {row_slots.dtype} "
                         f"{list(row_slots.shape)} on {row_slots.device}")
    if h is None:
        h = torch.empty(rows, w, dtype=torch.float32, device=x.device)
    elif h.dtype != torch.float32 or h.shape[0] < rows or h.shape[1] != w or h.stride(-1) != 1:
        raise ValueError(f"lora_rows_triton: h must be float32 [>= {rows}, {w}], got {h.dtype} {list(h.shape)}")
    if rows == 0:
        return out
    kern = _kernels()
    block_w = max(16, _pow2(w))
    block_k = max(16, min(128, 4096 // block_w))
    kern.shrink[(rows,)](x, a_bank, row_slots, h, k, w, x.stride(0), a_bank.stride(0), a_bank.stride(1),
                         h.stride(0), BLOCK_W=block_w, BLOCK_K=block_k)
    block_n = max(16, min(128, 8192 // block_w))
    kern.expand[(rows, triton.cdiv(n, block_n))](h, b_bank, row_slots, out, n, w, h.stride(0), b_bank.stride(0),
                                                 b_bank.stride(1), out.stride(0), BLOCK_W=block_w, BLOCK_N=block_n)
    return out
