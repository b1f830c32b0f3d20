"""Triton kernels for a decode step's small operations on CUDA: RMSNorm (with the residual add
before it), rotary embedding (with the K/V cache write after it), and SiLU-and-multiply, one
launch each.

Why: on an H200 the 1B shape's decode step launched 445 kernels inside its CUDA graph, and ~430
of them were these small operations at 1.5-2.5 us each: about 0.7 ms of a 1.75 ms step, against
0.8 ms for all the weight matrices (`benchmarks/gpu_step_profile.py`, BENCHMARKS "Decode step
profile"). torch spends four launches on a Llama RMSNorm (cast up, normalise, cast down, scale),
three on each rotary (roll, multiply, addcmul) and two on SiLU-and-multiply.

Each kernel rounds where the torch code it replaces rounds, so a fused step matches the unfused
one to the last bit except for the order of the float32 sum of squares:
- rms_norm: y = x.float() * rsqrt(mean(x^2) + eps), cast to x's dtype, times the weight in x's
  dtype (Llama's `weight * norm(x.float()).to(dtype)`); with a residual, x = round(h + r) first,
  and that sum is returned as well (the next residual).
- rotary: round(round(x * cos) + partner(x) * sin), partner being rotate_half's (the sign is in
  sin), as `torch.addcmul(x * cos, x.roll(d/2), sin)` does.
- silu_mul: round(round(silu(g)) * u), as `F.silu(g) * u` does.
- rotary_store: `rotary` of q and of k, then the rotated k and v copied into the paged cache at
  each token's slot (what `KVCache.store` does with two `index_copy_`): four launches become one.

They run only where `usable` says so: CUDA tensors of a 16-bit dtype, Triton installed,
`TGS_DISABLE_FUSED_OPS` unset, and a check on first use on that device (each kernel against the
torch arithmetic on a small input, outside any graph capture) passed; a kernel that fails to
compile or disagrees turns them off for the process with a warning, and the torch ops run.
Tests run them on the CPU under TRITON_INTERPRET=1. Built on the interpreter-safe builtins only
(tl.full, tl.reduce with the sum combiner), as kernels/lora_triton.py explains.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from loguru import logger

from text_generation_server.kernels.triton_support import LazyKernels, interpreting, tl, triton

_DTYPES = (torch.float16, torch.bfloat16)
MAX_ROW = 65536  # one program normalises a whole row: wider rows keep torch's kernels
DISABLE_ENV = "TGS_DISABLE_FUSED_OPS"


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _warps(block: int) -> int:
    return 1 if interpreting() else max(1, min(16, block // 256))


def _define() -> SimpleNamespace:
    @triton.jit
    def rms_norm(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, N, stride_x, stride_res, stride_out, stride_sum, eps,
                 HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # row * stride past 2**31 on long prefills
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_RES:
            r = tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * stride_sum + offs, x, mask=mask)
        xf = x.to(tl.float32)
        mean = tl.reduce(xf * xf, 0, tl.standard._sum_combine) / N
        normed = (xf / tl.sqrt(mean + eps)).to(out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * stride_out + offs, out, mask=mask)

    @triton.jit
    def rotary(x_ptr, cos_ptr, sin_ptr, out_ptr, H, D, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        half = D // 2
        partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
        mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
        base = x_ptr + t * stride_xt + offs_h[:, None] * stride_xh
        x = tl.load(base + offs_d[None, :], mask=mask, other=0.0)
        p = tl.load(base + partner[None, :], mask=mask, other=0.0)
        c = tl.load(cos_ptr + t * stride_ct + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_ct + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        a = (x.to(tl.float32) * c[None, :]).to(out_ptr.dtype.element_ty)
        out = (a.to(tl.float32) + p.to(tl.float32) * s[None, :]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :], out, mask=mask)

    @triton.jit
    def silu_mul(gu_ptr, out_ptr, I, stride_gu, stride_out, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < I
        g = tl.load(gu_ptr + t * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + t * stride_gu + I + offs, mask=mask, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * stride_out + offs, (act.to(tl.float32) * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def rotary_store(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, kc_ptr, vc_ptr, slot_ptr, H, KVH, D,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_qot,
                     stride_qoh, stride_kot, stride_koh, stride_cs, stride_ch,
                     BLOCK_H: tl.constexpr, BLOCK_KVH: tl.constexpr, BLOCK_D: tl.constexpr):
        # One token: q and k rotated as `rotary` rounds, k and v written to the cache at its slot.
        t = tl.program_id(0).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        half = D // 2
        partner = tl.where(offs_d < half, offs_d + half, offs_d - half)
        c = tl.load(cos_ptr + t * stride_ct + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_ct + offs_d, mask=offs_d < D, other=0.0).to(tl.float32)
        offs_h = tl.arange(0, BLOCK_H)
        mask = (offs_h[:, None] < H) & (offs_d[None, :] < D)
        base = q_ptr + t * stride_qt + offs_h[:, None] * stride_qh
        x = tl.load(base + offs_d[None, :], mask=mask, other=0.0)
        p = tl.load(base + partner[None, :], mask=mask, other=0.0)
        a = (x.to(tl.float32) * c[None, :]).to(qo_ptr.dtype.element_ty)
        out = (a.to(tl.float32) + p.to(tl.float32) * s[None, :]).to(qo_ptr.dtype.element_ty)
        tl.store(qo_ptr + t * stride_qot + offs_h[:, None] * stride_qoh + offs_d[None, :], out, mask=mask)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_KVH)
        kmask = (offs_k[:, None] < KVH) & (offs_d[None, :] < D)
        kbase = k_ptr + t * stride_kt + offs_k[:, None] * stride_kh
        x = tl.load(kbase + offs_d[None, :], mask=kmask, other=0.0)
        p = tl.load(kbase + partner[None, :], mask=kmask, other=0.0)
        a = (x.to(tl.float32) * c[None, :]).to(ko_ptr.dtype.element_ty)
        kr = (a.to(tl.float32) + p.to(tl.float32) * s[None, :]).to(ko_ptr.dtype.element_ty)
        tl.store(ko_ptr + t * stride_kot + offs_k[:, None] * stride_koh + offs_d[None, :], kr, mask=kmask)
        cache_at = slot * stride_cs + offs_k[:, None] * stride_ch + offs_d[None, :]
        tl.store(kc_ptr + cache_at, kr, mask=kmask)
        v = tl.load(v_ptr + t * stride_vt + offs_k[:, None] * stride_vh + offs_d[None, :], mask=kmask, other=0.0)
        tl.store(vc_ptr + cache_at, v, mask=kmask)

    return SimpleNamespace(rms_norm=rms_norm, rotary=rotary, silu_mul=silu_mul, rotary_store=rotary_store)


_kernels = LazyKernels(_define)


# -- the launches ---------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight * norm(x [+ residual]), the sum or None) for x [T, N] with unit stride in N."""
    n = x.shape[-1]
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else None
    res = residual if residual is not None else x
    block = _pow2(n)
    _kernels().rms_norm[(x.shape[0],)](x, res, weight, out, summed if summed is not None else out, n, x.stride(0),
                                       res.stride(0), out.stride(0), (summed if summed is not None else out).stride(0),
                                       float(eps), HAS_RES=residual is not None, BLOCK=block, num_warps=_warps(block))
    return out, summed


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (any token and head strides, unit stride in D) rotated by cos/sin [T, 1, D]."""
    tokens, heads, d = x.shape
    out = torch.empty(tokens, heads, d, dtype=x.dtype, device=x.device)
    block = _pow2(heads) * _pow2(d)
    _kernels().rotary[(tokens,)](x, cos, sin, out, heads, d, x.stride(0), x.stride(1), cos.stride(0), out.stride(0),
                                 out.stride(1), BLOCK_H=_pow2(heads), BLOCK_D=_pow2(d), num_warps=_warps(block))
    return out


def rotary_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rotated q, rotated k) for q [T, H, D] and k, v [T, KVH, D] (any token and head strides, unit
    stride in D), with the rotated k and v written into the caches [blocks, block_size, KVH, D]
    (contiguous, k's dtype) at `slots` [T]: what `rotary` twice and two `index_copy_` do, in one
    launch instead of four."""
    tokens, heads, d = q.shape
    kv_heads = k.shape[1]
    q_out = torch.empty(tokens, heads, d, dtype=q.dtype, device=q.device)
    k_out = torch.empty(tokens, kv_heads, d, dtype=k.dtype, device=k.device)
    block = (_pow2(heads) + _pow2(kv_heads)) * _pow2(d)
    _kernels().rotary_store[(tokens,)](
        q, k, v, cos, sin, q_out, k_out, key_cache, value_cache, slots, heads, kv_heads, d, q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), q_out.stride(0), q_out.stride(1),
        k_out.stride(0), k_out.stride(1), key_cache.stride(1), key_cache.stride(2),
        BLOCK_H=_pow2(heads), BLOCK_KVH=_pow2(kv_heads), BLOCK_D=_pow2(d), num_warps=_warps(block))
    return q_out, k_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] holding gate then up, unit stride in the last dim."""
    tokens, width = gate_up.shape
    inner = width // 2
    out = torch.empty(tokens, inner, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, _pow2(inner))
    _kernels().silu_mul[(tokens, triton.cdiv(inner, block))](gate_up, out, inner, gate_up.stride(0), out.stride(0),
                                                             BLOCK=block, num_warps=_warps(block))
    return out


# -- the torch arithmetic they replace (the first-use check compares against it) ---------------------
def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    summed = x + residual if residual is not None else None
    h = summed if summed is not None else x
    return weight * F.rms_norm(h.float(), (h.shape[-1],), None, eps).to(h.dtype), summed


def rotary_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


# -- when they run ----------------------------------------------------------------------------------
_checked: dict[str, bool] = {}  # device -> the first-use check's verdict


def self_check(device: torch.device) -> tuple[bool, str]:
    """Runs each kernel once on `device` against the torch arithmetic: (passed, what failed)."""
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.float16)

    try:
        x, r, w = rand(3, 320), rand(3, 320), rand(320)
        for residual in (None, r):
            got, got_sum = rms_norm(x, w, 1e-6, residual)
            want, want_sum = rms_norm_torch(x, w, 1e-6, residual)
            if not torch.allclose(got.float(), want.float(), rtol=2e-3, atol=2e-3):
                return False, "rms_norm disagrees with torch's"
            if residual is not None and not torch.equal(got_sum, want_sum):
                return False, "the residual add disagrees with torch's"
        qkv = rand(3, 7 * 48)
        q = qkv[:, :5 * 48].view(3, 5, 48)  # a strided view, as the qkv split gives
        cos, sin = rand(3, 1, 48), rand(3, 1, 48)
        if not torch.allclose(rotary(q, cos, sin).float(), rotary_torch(q, cos, sin).float(), rtol=2e-3, atol=2e-3):
            return False, "rotary disagrees with torch's"
        gu = rand(3, 2 * 200)
        if not torch.allclose(silu_mul(gu).float(), silu_mul_torch(gu).float(), rtol=2e-3, atol=2e-3):
            return False, "silu_mul disagrees with torch's"
    except Exception as exc:  # noqa: BLE001: a compiler or launch failure of any kind turns them off
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


def self_check_store(device: torch.device) -> tuple[bool, str]:
    """`rotary_store` once on `device` against torch's rotary and `index_copy_`: (passed, what
    failed). Apart from `self_check`, so a failure here keeps the other kernels on."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    try:
        qkv = torch.randn(3, 7 * 48, generator=gen).to(device=device, dtype=torch.float16)
        q, k, v = qkv[:, :5 * 48].view(3, 5, 48), qkv[:, 5 * 48:6 * 48].view(3, 1, 48), qkv[:, 6 * 48:].view(3, 1, 48)
        cos, sin = (torch.randn(3, 1, 48, generator=gen).to(device=device, dtype=torch.float16) for _ in range(2))
        caches = [torch.zeros(4, 2, 1, 48, dtype=k.dtype, device=device) for _ in range(2)]
        slots = torch.tensor([5, 0, 3], device=device)
        got_q, got_k = rotary_store(q, k, v, cos, sin, *caches, slots)
        if not (torch.allclose(got_q.float(), rotary_torch(q, cos, sin).float(), rtol=2e-3, atol=2e-3)
                and torch.allclose(got_k.float(), rotary_torch(k, cos, sin).float(), rtol=2e-3, atol=2e-3)
                and torch.equal(caches[0].view(8, 1, 48)[slots], got_k)
                and torch.equal(caches[1].view(8, 1, 48)[slots], v)):
            return False, "rotary_store disagrees with torch's rotary and index_copy_"
    except Exception as exc:  # noqa: BLE001: any failure keeps torch's rotary and cache write
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


# Tests set this to run the layers' fused paths on CPU tensors under TRITON_INTERPRET=1; serving never does.
INTERPRETED_ON_CPU = False


def usable(x: torch.Tensor) -> bool:
    """Whether the fused kernels run for tensors like `x` (see the module docstring). Cheap when
    they do not (a CPU tensor): the layers ask on every call."""
    if not x.is_cuda:
        return INTERPRETED_ON_CPU and x.dtype in _DTYPES and interpreting()
    if x.dtype not in _DTYPES or triton is None:
        return False
    key = str(x.device)
    verdict = _checked.get(key)
    if verdict is None:
        if os.environ.get(DISABLE_ENV, "") not in ("", "0"):
            verdict = False
            logger.info(f"fused decode kernels off ({DISABLE_ENV} is set): torch's ops run")
        elif torch.cuda.is_current_stream_capturing():
            return False  # never checked inside a capture; warmup's eager forwards come first
        else:
            verdict, why = self_check(x.device)
            if verdict:
                logger.info(f"fused decode kernels on {key}: RMSNorm (+ residual add), rotary, SiLU-and-multiply")
            else:
                logger.warning(f"fused decode kernels off on {key}: {why}; torch's ops run")
        _checked[key] = verdict
    return verdict


_store_checked: dict[str, bool] = {}  # device -> self_check_store's verdict


def usable_store(x: torch.Tensor) -> bool:
    """Whether `rotary_store` runs for tensors like `x`: where `usable` says the fused kernels do
    and its own first-use check passed (a failure warns once and keeps torch's rotary and
    `index_copy_`)."""
    if not usable(x):
        return False
    if not x.is_cuda:
        return True  # interpreted on the CPU for tests
    key = str(x.device)
    verdict = _store_checked.get(key)
    if verdict is None:
        verdict, why = self_check_store(x.device)
        if verdict:
            logger.info(f"fused decode kernels on {key}: the rotary of q and k with the K/V cache write")
        else:
            logger.warning(f"fused rotary + K/V cache write off on {key}: {why}; torch's rotary and index_copy_ run")
        _store_checked[key] = verdict
    return verdict
