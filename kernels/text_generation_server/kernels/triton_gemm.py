"""triton-gemm: a fused Triton dequantize+GEMM for integer-quantized linears on CUDA.

triton-gemm runs every canonical `QuantizedWeight` (2 to 8 bits, any group size, symmetric or
not, act-order), repacked once at build:

- Rows are sorted by group (act-order). One scale row then serves GS stored rows, GS the gcd of
  the group row counts; where that gcd is small (a shard cut mid-group, odd K), each group is
  padded to a multiple of 32..128 rows instead if that stores fewer bytes. The stored row ->
  input column map (`perm`, -1 for padding) is applied while loading the input, so act-order
  costs no extra pass and no buffer.
- Codes are stored 4-bit (2 to 4 bits) or 8-bit (5 to 8 bits) in int32 words packed along K,
  tile-interleaved: in each 128-row chunk, bit field i of word row r holds row i*R + r
  (R = 128 * bits / 32). One word load unpacks into 32 / bits row blocks of R rows with a shift
  and a mask, each fed to its own tl.dot; no word is loaded twice.
- Scales and zero points [ceil(Kp/GS), Np] in the activation dtype (zero points are integers,
  exact in fp16 and bf16 up to 256).
- K pads to a multiple of 128 and N to a multiple of 128 with zero weights (never refused).

Three paths. Decode batches (and calls outside a model's forward) take one by token count M:
- split-K (M <= 16, too few output tiles to fill the GPU): the K chunks are split across
  programs; each writes fp32 partials to a shared workspace and bumps a per-tile counter; the
  last to arrive sums the partials in fixed order (deterministic), writes the output and resets
  the counter (Marlin's approach, one launch, no memset).
- fused (M <= LARGE_BATCH_TOKENS): the same kernel, one program per output tile.
- dequant (M > LARGE_BATCH_TOKENS, Exllama's approach): dequantize into one shared scratch
  buffer [K, N] (rows scattered back to input order, so the input needs no permutation) and
  call the dense GEMM.
A prefill forward takes the dequant path whatever its M (kernels/phase.py): the three paths sum
in different orders, so a 5-row cached remainder on split-K and the 40-row chunk before it on
the fused kernel would round the same prompt differently. Dequant is the path the dense layers
take (torch's GEMM on the dequantized weight) and the fastest for long prompts; a short prompt
pays one dequantization of the weight (~4.5 bytes moved per weight instead of ~0.5).
The workspaces live in kernels/scratch.py, sized once at warmup, shared by all layers; the
layout, and the canonical weight back from it, in kernels/triton_layout.py.

The module imports without Triton; the kernels then refuse every layer with the reason. The
@triton.jit functions are defined on first use, so TRITON_INTERPRET=1 set by a test before
that (or at any time: one set per interpreter mode) runs them on CPU tensors. For the same
reason the kernels call only Triton builtins: tl.zeros and tl.cdiv are themselves @triton.jit
functions, decorated when triton is imported, and the interpreter cannot call those.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch
from loguru import logger

from text_generation_server.kernels.base import LinearSpec, QuantizedWeight, QuantKernel
from text_generation_server.kernels.phase import by_phase, pad_prompt_rows
from text_generation_server.kernels.scratch import SCRATCH, ScratchSpace, typed_view
from text_generation_server.kernels.triton_layout import (
    CHUNK,
    GemmWeight,
    _cdiv,
    canonical_weight,
    repack,
)
from text_generation_server.kernels.triton_support import LazyKernels, interpreting, tl, triton

# Above this many tokens, dequantize-then-cuBLAS beats the fused kernel. Per 4-bit weight the
# dequant path moves ~4.5 bytes (read 0.5 packed, write 2, read back 2) before a cuBLAS GEMM at
# F flop/s; the fused kernel, compute-bound at these sizes, runs at a fraction e of F. Break-even:
# 2M/F * (1/e - 1) = 4.5/B, i.e. M = 4.5 F / (2 B (1/e - 1)) for B bytes/s. With e ~ 0.5 and
# cuBLAS at ~700 TF/s that is ~470 tokens on an H100 (3.35 TB/s) and ~280 on an A100 (~250 TF/s,
# 2 TB/s). 256 errs towards cuBLAS, whose efficiency is known; benchmarks/kernels_cuda.py times
# both paths at every batch so this can be set from measurements.
LARGE_BATCH_TOKENS = 256
SPLIT_K_MAX_TOKENS = 16  # one 16-row M tile: beyond it, M tiles provide the parallelism
MAX_SPLIT_K = 16
SPLIT_TRAFFIC_SHARE = 0.25  # partial sums may add at most this share of the weight's bytes
PROGRAMS_PER_SM = 2  # split-K aims at this many programs per SM (memory-bound: hide latency)
MIN_COMPUTE_CAPABILITY = (8, 0)  # Triton's README: NVIDIA GPUs of compute capability 8.0+
_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DEFAULT_SMS = 132  # H100 SXM; only used off-GPU (interpreter tests), where it only shapes plans
_DEFAULT_SMEM = 99 * 1024  # the smallest opt-in shared memory of sm80+ parts (sm86/sm89)


# -- environment -------------------------------------------------------------------------------

def triton_missing() -> str:
    return "triton is not installed" if triton is None else ""


def _cuda_capability() -> tuple[int, int] | None:
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())


def layer_reason(spec: LinearSpec) -> str:
    """Why a layer is not one for a CUDA integer kernel ("" when it is); tinygemm shares it."""
    if spec.weight_format != "int":
        return f"runs integer codes, not {spec.weight_format} weights"
    if spec.device_type != "cuda":
        return f"device {spec.device_type}"
    return ""


def machine_reason() -> str:
    """Why this machine's GPU cannot run triton-gemm ("" when it can).

    tinygemm shares it: torch's int4 matmul (aten/src/ATen/native/cuda/int4mm.cu) runs sm80+
    bfloat16 tensor-core tiles, and is not validated on ROCm here either.
    """
    cap = _cuda_capability()
    if cap is None:
        return "no CUDA device"
    if torch.version.hip is not None:
        return "ROCm devices are not validated for this kernel"
    if cap < MIN_COMPUTE_CAPABILITY:
        return f"needs compute capability 8.0+, got {cap[0]}.{cap[1]}"
    return ""


def _device_limits(device: torch.device) -> tuple[int, int]:
    """(SM count, shared memory per block) of the device the weights live on."""
    if device.type != "cuda":
        return _DEFAULT_SMS, _DEFAULT_SMEM
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, int(getattr(props, "shared_memory_per_block_optin", _DEFAULT_SMEM))



# -- plans -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    path: str  # "split-k", "fused" or "dequant"
    block_m: int = 16
    block_n: int = 64
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def _tiles(m: int, elt: int = 2) -> tuple[int, int, int]:
    """(BM, BN, warps) by token count: a 16-row tile for decode, wider tiles as M grows.

    float32 activations stop at 64 rows: compiled for sm86, the 128x128 float32 8-bit tile
    needs 100 KiB of shared memory, over that GPU's 99 KiB.
    """
    if m > 64 and elt > 2:
        return 64, 128, 4
    if m <= 16:
        return 16, 64, 4
    if m <= 32:
        return 32, 64, 4
    if m <= 64:
        return 64, 64, 4
    if m <= 128:
        return 64, 128, 4
    return 128, 128, 8


def split_k_for(m: int, tiles: int, chunks: int, weight_bytes_per_col: int, sms: int) -> int:
    """Splits of K for a batch of `m` tokens over `tiles` output tiles (1: no split).

    Enough programs to give every SM PROGRAMS_PER_SM, but the fp32 partials (written and read
    back, 8 bytes per token per column per split) stay under SPLIT_TRAFFIC_SHARE of the weight.
    """
    if m > SPLIT_K_MAX_TOKENS or tiles >= PROGRAMS_PER_SM * sms:
        return 1
    want = _cdiv(PROGRAMS_PER_SM * sms, tiles)
    traffic = int(weight_bytes_per_col * SPLIT_TRAFFIC_SHARE) // (8 * m)
    s = max(1, min(want, traffic, MAX_SPLIT_K, chunks))
    return _cdiv(chunks, _cdiv(chunks, s))  # no empty split


# Shared memory the compiled kernel needs beyond its pipelined loads (epilogue layout conversion).
SMEM_FIXED = 16 * 1024


def stage_bytes(bm: int, bn: int, bits: int, elt: int, row_scales: bool = False, zeros: bool = False) -> int:
    """Shared memory one pipeline stage of the fused kernel holds: the input tile, the packed
    weight tile and, when a scale group does not cover a whole field block (GS % R != 0), a scale
    (and zero) row per K row, loaded as [R, BN] tiles in the activation dtype."""
    per = bm * CHUNK * elt + CHUNK * bn * bits // 8
    if row_scales:
        per += CHUNK * bn * elt * (2 if zeros else 1)
    return per


def _stages(bm: int, bn: int, bits: int, elt: int, smem: int, row_scales: bool = False, zeros: bool = False) -> int:
    """Pipeline stages that fit `smem`. Triton's software pipeline keeps num_stages - 1 copies of
    each loop-carried load in shared memory, plus SMEM_FIXED: on an H100 (torch 2.11, Triton 3.6)
    the float32 8-bit 64x128 tile with per-row scales asked for exactly 3 x 112 KiB + 16 KiB at
    num_stages 4 (360448 bytes, over the 227 KiB limit)."""
    per = stage_bytes(bm, bn, bits, elt, row_scales, zeros)
    return max(2, min(4, 1 + (smem - SMEM_FIXED) // per))


def fit_tiles(bm: int, bn: int, bits: int, elt: int, smem: int, row_scales: bool = False,
              zeros: bool = False) -> tuple[int, int, int]:
    """(BM, BN, stages): the tiles narrowed (BN, then BM, down to 16) until two stages fit `smem`;
    the float32 64x128 tile with per-row scales needs 128 KiB at two stages, over an sm86's 99 KiB."""
    while SMEM_FIXED + stage_bytes(bm, bn, bits, elt, row_scales, zeros) > smem:
        if bn > 16:
            bn //= 2
        elif bm > 16:
            bm //= 2
        else:
            break
    return bm, bn, _stages(bm, bn, bits, elt, smem, row_scales, zeros)


# The plan of every prefill forward, whatever its row count (module docstring).
PROMPT_PLAN = Plan("dequant")


def smaller_plan(plan: Plan) -> Plan | None:
    """The plan to try when the compiled kernel asks for more shared memory than the GPU has: one
    stage fewer (tiles stay, so the split-K scratch sized at warmup still fits); None at one stage."""
    if plan.num_stages > 1:
        return replace(plan, num_stages=plan.num_stages - 1)
    return None


# -- Triton kernels ----------------------------------------------------------------------------

def _define_kernels() -> SimpleNamespace:
    @triton.jit
    def fused_gemm(x_ptr, perm_ptr, qw_ptr, s_ptr, z_ptr, bias_ptr, out_ptr, ws_ptr, lock_ptr,
                   M, N, K, stride_xm, stride_om, stride_q, stride_s, chunks, chunks_per_split, split_k,
                   BITS: tl.constexpr, GS: tl.constexpr, SYM_ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
                   GATHER: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr):
        # out[M, N] = x[M, K] @ W[K, N]; program (tile, split) covers chunks [c_lo, c_hi) of K.
        PACK: tl.constexpr = 32 // BITS
        R: tl.constexpr = 128 * BITS // 32
        MASK: tl.constexpr = (1 << BITS) - 1
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        tiles_n = (N + BN - 1) // BN
        offs_m = (pid // tiles_n) * BM + tl.arange(0, BM)
        offs_n = (pid % tiles_n) * BN + tl.arange(0, BN)
        offs_r = tl.arange(0, R)
        m_ok = offs_m < M
        acc = tl.full((BM, BN), 0.0, tl.float32)
        c_lo = pid_k * chunks_per_split
        c_hi = tl.minimum(c_lo + chunks_per_split, chunks)
        for c in range(c_lo, c_hi):
            words = tl.load(qw_ptr + (c * R + offs_r)[:, None] * stride_q + offs_n[None, :])
            for i in tl.static_range(PACK):
                rows = c * 128 + i * R + offs_r
                if GATHER:
                    cols = tl.load(perm_ptr + rows)
                    a = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :],
                                mask=m_ok[:, None] & (cols >= 0)[None, :], other=0.0)
                else:
                    a = tl.load(x_ptr + offs_m[:, None] * stride_xm + rows[None, :],
                                mask=m_ok[:, None] & (rows < K)[None, :], other=0.0)
                q = ((words >> (i * BITS)) & MASK).to(tl.float32)
                if GS % R == 0:  # the whole field block shares one scale row
                    g = (c * 128 + i * R) // GS
                    s = tl.load(s_ptr + g * stride_s + offs_n).to(tl.float32)[None, :]
                    if HAS_ZEROS:
                        z = tl.load(z_ptr + g * stride_s + offs_n).to(tl.float32)[None, :]
                    else:
                        z = SYM_ZERO
                else:
                    g = rows // GS
                    s = tl.load(s_ptr + g[:, None] * stride_s + offs_n[None, :]).to(tl.float32)
                    if HAS_ZEROS:
                        z = tl.load(z_ptr + g[:, None] * stride_s + offs_n[None, :]).to(tl.float32)
                    else:
                        z = SYM_ZERO
                w = (q - z) * s
                if DOT_F32:
                    acc += tl.dot(a.to(tl.float32), w, input_precision="ieee")
                else:
                    acc += tl.dot(a, w.to(a.dtype))
        if SPLIT:
            # Marlin-style fix-up: publish the partial, count arrivals; the last one reduces.
            tile = tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :]
            tiles = tl.num_programs(0)
            tl.store(ws_ptr + (pid_k * tiles + pid) * (BM * BN) + tile, acc, mask=m_ok[:, None])
            tl.debug_barrier()  # every thread's partial is written before the release below
            arrived = tl.atomic_add(lock_ptr + pid, 1, sem="acq_rel", scope="gpu")
            last = arrived == split_k - 1
            if last:
                acc = tl.full((BM, BN), 0.0, tl.float32)
                for s_i in range(0, split_k):  # fixed order: the sum does not depend on who is last
                    acc += tl.load(ws_ptr + (s_i * tiles + pid) * (BM * BN) + tile, mask=m_ok[:, None],
                                   other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(lock_ptr + pid, 0, sem="relaxed", scope="gpu")  # ready for the next call
        else:
            last = True
        if last:
            n_ok = offs_n < N
            if HAS_BIAS:
                acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def dequantize(qw_ptr, s_ptr, z_ptr, perm_ptr, out_ptr, K, N, stride_q, stride_s, stride_o,
                   BITS: tl.constexpr, GS: tl.constexpr, SYM_ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr,
                   GATHER: tl.constexpr, BN: tl.constexpr):
        # out[K, N] (input row order) = dequantized chunk pid_c, columns tile pid_n.
        PACK: tl.constexpr = 32 // BITS
        R: tl.constexpr = 128 * BITS // 32
        MASK: tl.constexpr = (1 << BITS) - 1
        c = tl.program_id(0)
        offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
        offs_r = tl.arange(0, R)
        n_ok = offs_n < N
        words = tl.load(qw_ptr + (c * R + offs_r)[:, None] * stride_q + offs_n[None, :])
        for i in tl.static_range(PACK):
            rows = c * 128 + i * R + offs_r
            g = rows // GS
            s = tl.load(s_ptr + g[:, None] * stride_s + offs_n[None, :]).to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(z_ptr + g[:, None] * stride_s + offs_n[None, :]).to(tl.float32)
            else:
                z = SYM_ZERO
            w = (((words >> (i * BITS)) & MASK).to(tl.float32) - z) * s
            if GATHER:
                dest = tl.load(perm_ptr + rows)
                ok = dest >= 0
            else:
                dest = rows
                ok = rows < K
            tl.store(out_ptr + dest[:, None] * stride_o + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
                     mask=ok[:, None] & n_ok[None, :])

    return SimpleNamespace(fused_gemm=fused_gemm, dequantize=dequantize)


_kernels = LazyKernels(_define_kernels)


def _check_launch(x: torch.Tensor, gw: GemmWeight, out: torch.Tensor) -> None:
    if x.dim() != 2 or x.shape[1] != gw.in_features or x.stride(1) != 1:
        raise ValueError(f"input must be [M, {gw.in_features}] with unit column stride, got {list(x.shape)} "
                         f"strides {x.stride()}")
    if out.shape != (x.shape[0], gw.out_features) or out.stride(1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"output must be [{x.shape[0]}, {gw.out_features}] {x.dtype} with unit column stride")
    if x.dtype != gw.scales.dtype or x.device != gw.qweight.device or out.device != x.device:
        raise ValueError(f"input {x.dtype} on {x.device} does not match weights {gw.scales.dtype} on "
                         f"{gw.qweight.device}")


def fused_gemm(x: torch.Tensor, gw: GemmWeight, bias: torch.Tensor | None, out: torch.Tensor, plan: Plan,
               workspace: torch.Tensor | None = None, locks: torch.Tensor | None = None) -> torch.Tensor:
    """out[M, N] = x[M, K] @ W + bias with the fused kernel; split-K needs the workspace and zeroed locks."""
    _check_launch(x, gw, out)
    m = x.shape[0]
    tiles = _cdiv(m, plan.block_m) * _cdiv(gw.out_features, plan.block_n)
    chunks = gw.padded_in // CHUNK
    per = _cdiv(chunks, plan.split_k)
    split = plan.split_k > 1
    if split:
        if _cdiv(chunks, per) != plan.split_k:
            raise ValueError(f"split_k {plan.split_k} leaves empty splits over {chunks} chunks")
        need_ws = plan.split_k * tiles * plan.block_m * plan.block_n
        if workspace is None or locks is None or workspace.numel() < need_ws or locks.numel() < tiles:
            raise ValueError(f"split-K needs a float32 workspace of {need_ws} and {tiles} int32 locks")
        if workspace.dtype != torch.float32 or locks.dtype != torch.int32:
            raise ValueError("split-K workspace must be float32 and locks int32")
    dummy = gw.scales
    _kernels().fused_gemm[(tiles, plan.split_k)](
        x, dummy if gw.perm is None else gw.perm, gw.qweight, gw.scales, dummy if gw.zeros is None else gw.zeros,
        dummy if bias is None else bias, out, workspace if split else dummy, locks if split else dummy,
        m, gw.out_features, gw.in_features, x.stride(0), out.stride(0), gw.qweight.stride(0), gw.scales.stride(0),
        chunks, per, plan.split_k,
        BITS=gw.bits, GS=gw.group_rows, SYM_ZERO=gw.sym_zero, HAS_ZEROS=gw.zeros is not None,
        GATHER=gw.perm is not None, HAS_BIAS=bias is not None, SPLIT=split,
        DOT_F32=x.dtype == torch.float32 or (x.dtype == torch.bfloat16 and interpreting()),
        BM=plan.block_m, BN=plan.block_n, num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    return out


def dequantize_into(gw: GemmWeight, out: torch.Tensor) -> torch.Tensor:
    """out[K, N] = the dense weight in input row order (the large-batch path's first half)."""
    if out.shape != (gw.in_features, gw.out_features) or not out.is_contiguous() or out.dtype != gw.scales.dtype:
        raise ValueError(f"dequantize target must be contiguous [{gw.in_features}, {gw.out_features}] "
                         f"{gw.scales.dtype}, got {list(out.shape)} {out.dtype}")
    bn = 128
    dummy = gw.scales
    _kernels().dequantize[(gw.padded_in // CHUNK, _cdiv(gw.out_features, bn))](
        gw.qweight, gw.scales, dummy if gw.zeros is None else gw.zeros, dummy if gw.perm is None else gw.perm, out,
        gw.in_features, gw.out_features, gw.qweight.stride(0), gw.scales.stride(0), out.stride(0),
        BITS=gw.bits, GS=gw.group_rows, SYM_ZERO=gw.sym_zero, HAS_ZEROS=gw.zeros is not None,
        GATHER=gw.perm is not None, BN=bn, num_warps=4,
    )
    return out


# -- module ------------------------------------------------------------------------------------

class TritonGemmLinear(torch.nn.Module):
    # x: [..., K] -> [..., N]
    kernel_name = "triton-gemm"

    def __init__(self, gw: GemmWeight, bias: torch.Tensor | None, act_dtype: torch.dtype,
                 scratch: ScratchSpace | None = None):
        super().__init__()
        self.gw = gw
        for name in ("qweight", "scales", "zeros", "perm"):  # buffers, so .to()/state_dict see them
            self.register_buffer(name, getattr(gw, name))
        self.register_buffer("bias", bias)
        self.act_dtype = act_dtype
        self.in_features = gw.in_features
        self.out_features = gw.out_features
        self.scratch_device = gw.qweight.device
        self.sms, self.smem = _device_limits(self.scratch_device)
        self.scratch = SCRATCH if scratch is None else scratch
        self.scratch.register(self)
        self._plans: dict[int, Plan] = {}

    def _apply(self, fn, recurse: bool = True):
        # .to()/.cuda() replace the buffers; the launchers read gw, so it must follow them.
        super()._apply(fn, recurse)
        self.gw = replace(self.gw, qweight=self.qweight, scales=self.scales, zeros=self.zeros, perm=self.perm)
        self.scratch_device = self.qweight.device
        self.sms, self.smem = _device_limits(self.scratch_device)
        self._plans.clear()
        return self

    def plan(self, m: int) -> Plan:
        """The path and tiles for `m` tokens (cached: a handful of distinct plans per layer)."""
        plan = self._plans.get(m)
        if plan is None:
            if m > LARGE_BATCH_TOKENS:
                plan = Plan("dequant")
            else:
                gw = self.gw
                bm, bn, warps = _tiles(m, self.act_dtype.itemsize)
                row_scales = gw.group_rows % (CHUNK * gw.bits // 32) != 0
                bm, bn, stages = fit_tiles(bm, bn, gw.bits, self.act_dtype.itemsize, self.smem, row_scales,
                                           gw.zeros is not None)
                tiles = _cdiv(m, bm) * _cdiv(gw.out_features, bn)
                split = split_k_for(m, tiles, gw.padded_in // CHUNK, gw.padded_in * gw.bits // 8, self.sms)
                plan = Plan("split-k" if split > 1 else "fused", bm, bn, split, warps, stages)
            self._plans[m] = plan
        return plan

    def _split_bytes(self, m: int, plan: Plan) -> tuple[int, int]:
        tiles = _cdiv(m, plan.block_m) * _cdiv(self.out_features, plan.block_n)
        return plan.split_k * tiles * plan.block_m * plan.block_n * 4, tiles * 4

    def scratch_needs(self, max_tokens: int, max_input_tokens: int) -> dict[str, int]:
        """Split-K partials and locks for decode-sized batches; the dense weight for prompts, which
        take the dequant path whatever their size (module docstring)."""
        needs = {"splitk_partials": 0, "splitk_locks": 0}
        for m in range(1, min(max_tokens, SPLIT_K_MAX_TOKENS) + 1):
            plan = self.plan(m)
            if plan.split_k > 1:
                ws, locks = self._split_bytes(m, plan)
                needs["splitk_partials"] = max(needs["splitk_partials"], ws)
                needs["splitk_locks"] = max(needs["splitk_locks"], locks)
        needs["dequant"] = self.in_features * self.out_features * self.act_dtype.itemsize
        return needs

    def prepare_scratch(self, max_tokens: int, max_input_tokens: int) -> int:
        """Sizes the shared scratch (first call does it for all layers) and, on CUDA, compiles this
        layer's kernel variants now rather than on the first request. Returns bytes allocated."""
        allocated = self.scratch.prepare(max_tokens, max_input_tokens)
        if self.scratch_device.type == "cuda":
            sizes = {min(b, max_tokens) for b in (1, 16, 32, 64, 128, LARGE_BATCH_TOKENS)}
            with torch.no_grad():
                for m in sorted(sizes):
                    self.run(torch.zeros(m, self.in_features, dtype=self.act_dtype, device=self.scratch_device))
                self.run(torch.zeros(1, self.in_features, dtype=self.act_dtype, device=self.scratch_device),
                         PROMPT_PLAN)
        return allocated

    def canonical_weight(self) -> QuantizedWeight:
        """The canonical weight this layer computes (kernels/triton_layout.py), for building another
        kernel from it (warmup's kernel timing, kernels/select.py)."""
        return canonical_weight(self.gw)

    def run(self, x: torch.Tensor, plan: Plan | None = None) -> torch.Tensor:
        """x [M, K] -> [M, N] by `plan` (default: the plan for M). Tests and benchmarks force paths here."""
        if x.dtype != self.act_dtype:
            raise ValueError(f"{self.kernel_name}: input dtype {x.dtype}, built for {self.act_dtype}")
        if x.stride(-1) != 1:
            x = x.contiguous()
        m = x.shape[0]
        if m == 0:
            return x.new_empty(0, self.out_features)
        plan = self.plan(m) if plan is None else plan
        dev = self.scratch_device
        if plan.path == "dequant":
            nbytes = self.in_features * self.out_features * self.act_dtype.itemsize
            w = typed_view(self.scratch.get("dequant", dev, nbytes), self.act_dtype,
                           (self.in_features, self.out_features))
            dequantize_into(self.gw, w)
            xp = pad_prompt_rows(x)  # CPU (the interpreter) only: torch's GEMM rounds its smallest inputs apart
            return (torch.mm(xp, w) if self.bias is None else torch.addmm(self.bias, xp, w))[:m]
        out = torch.empty(m, self.out_features, dtype=self.act_dtype, device=dev)
        ws = locks = None
        if plan.split_k > 1:
            ws_bytes, lock_bytes = self._split_bytes(m, plan)
            ws = typed_view(self.scratch.get("splitk_partials", dev, ws_bytes), torch.float32, (ws_bytes // 4,))
            locks = typed_view(self.scratch.get("splitk_locks", dev, lock_bytes), torch.int32, (lock_bytes // 4,))
        try:
            return fused_gemm(x, self.gw, self.bias, out, plan, ws, locks)
        except Exception as exc:
            if type(exc).__name__ != "OutOfResources":
                raise
            # The shared-memory model (_stages) was short for this GPU: the launch failed before
            # any work was queued, so a smaller plan can run in its place, and is kept for this M.
            smaller = smaller_plan(plan)
            if smaller is None:
                raise
            logger.warning("{}: {}x{} plan {} needs more GPU resources than there are ({}); using {}",
                           self.kernel_name, self.in_features, self.out_features, plan, exc, smaller)
            if self._plans.get(m) == plan:
                self._plans[m] = smaller
            return self.run(x, smaller)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        # A prompt's rows: one path whatever their count; decoding rows their plan by row count.
        y = by_phase(x.reshape(-1, self.in_features), lambda t: self.run(t, PROMPT_PLAN), lambda t: self.run(t, None))
        return y.reshape(*lead, self.out_features)


class TritonGemmKernel(QuantKernel):
    """Fused dequantize+GEMM in Triton (split-K for decode), dequantize+cuBLAS for large batches."""

    name = "triton-gemm"

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        # Every bit width (2..8), group size, zero point and order runs (see repack): only the
        # activation dtype can disqualify a layer.
        reason = layer_reason(spec) or triton_missing() or machine_reason() or cls._dtype_reason(spec.act_dtype)
        return (not reason), reason

    @staticmethod
    def _dtype_reason(act_dtype: torch.dtype) -> str:
        if act_dtype not in _ACT_DTYPES:
            return f"activation dtype {act_dtype} not in float16/bfloat16/float32"
        return ""

    @classmethod
    def build(cls, weight: QuantizedWeight, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        # The machine checks are can_implement's; build checks only what the layout needs, so the
        # interpreter can run it on CPU tensors.
        reason = triton_missing() or cls._dtype_reason(act_dtype)
        if reason:
            raise ValueError(f"{cls.name} cannot run this weight: {reason}")
        gw = repack(weight, act_dtype)
        return TritonGemmLinear(gw, None if bias is None else bias.to(act_dtype).contiguous(), act_dtype)
