"""Triton attention over the paged KV cache: decode (with flash-decoding splits) and varlen prefill.

The cache of a layer is [num_blocks, block_size, kv_heads, head_dim] for keys and values;
position p of sequence b lives in block block_tables[b, p // block_size] at offset
p % block_size. Both kernels read K/V straight from there (no gather copy): each key tile of
BLOCK_N positions looks up its block ids in the table (one int32 load per position, served
from L1 since consecutive positions share blocks), so any block_size works, smaller or larger
than the tile. Loads run along head_dim, the cache's unit-stride dimension, with the head
dimension a compile-time constant: 128-bit vector loads.

decode (`paged_decode`): grid (batch, kv_heads, splits). One program serves all H/KVH query
heads of a KV head, padded to 16 rows for tl.dot, so every K/V tile is read once per KV head.
A program loops only up to its own sequence's length. With splits > 1 (flash-decoding) each
program covers an equal share of the visible positions and writes fp32 partials (running max,
sum of exponentials, unnormalized output) to a workspace; a second kernel, grid (batch, heads),
combines them. Split boundaries are computed in the kernel from seq_lens, so the grid depends
only on shapes and the launch can be captured in a CUDA graph (no host sync, no allocation
when the caller passes a workspace from `decode_workspace`).

prefill (`paged_prefill`): grid (query tiles, kv_heads, batch) over the flattened new tokens
of every sequence. A query tile packs BLOCK_M rows of (token, query head of this KV head)
pairs, token-major, so the heads of a group share every K/V tile and short rows (decode rows
mixed into a prefill step) waste fewer rows. Each tile walks keys from the start of its window
(0 without one) to its last token's position, causal and window masks applied per element.
Tiles of later queries (more keys) are scheduled first. Programs past a sequence's q_len exit.

Softmax runs in base 2 with log2(e) folded into the scale; accumulation is fp32. Masked scores
are -inf and a row's running max is treated as 0 while it is still -inf, so fully masked tiles
(and padding rows with seq_len 0, which read nothing) contribute exactly zero, never NaN.

Logit soft-capping (Gemma 2; `softcap=` on both launchers): as in transformers' eager attention,
each score becomes softcap * tanh(q.k * scale / softcap) after the scale and before the causal
and window masks and the softmax, then goes to base 2 like the others. A constexpr (SOFTCAP)
selects it, so without a cap the kernels compile exactly as they would without the feature;
the cap itself is a runtime float, so one compiled kernel serves every cap. triton.language has
no tanh (libdevice's is per backend), so it is built from builtins: for |x| >= 1/4,
tanh(x) = 1 - 2 / (2^(2x log2(e)) + 1), which saturates to +-1 (exp2 going to 0 or inf), never
NaN; near 0 that form cancels (an absolute error of ~2^-24, times softcap: with Gemma 2's cap of
50 about 20x fp32's usual error), so for |x| < 1/4 an odd Taylor polynomial to x^9 takes over.
Either way tanh is within 2e-7 of the exact value. An fp8 cache (`kv_scales=`; constexpr FP8) is
loaded as bytes and widened in registers (kernels/kv_fp8.py); the KV head's key scale multiplies
qk_scale (soft-capping sees true scores), its value scale the output.

Like kernels/triton_gemm.py, the module imports without Triton, and the @triton.jit functions
are defined on first use for the current TRITON_INTERPRET setting, so tests run them on CPU
tensors in Triton's interpreter. The kernels call only Triton builtins for the same reason.
bfloat16 tl.dot is wrong in the interpreter (Triton 3.x), so there bf16 tiles are widened to
fp32 first; float32 inputs use IEEE fp32 dots everywhere (not TF32), since an fp32 KV cache is
a correctness setting.
"""

from __future__ import annotations

import math
import numbers
from types import SimpleNamespace

import torch

from text_generation_server.kernels import kv_fp8
from text_generation_server.kernels import paged_attention_args as args
from text_generation_server.kernels.triton_support import LazyKernels, interpreting, tl, triton

MIN_COMPUTE_CAPABILITY = (8, 0)
MAX_HEAD_DIM = 256
MAX_SPLITS = 64
MIN_SPLIT_TOKENS = 256  # a split reads at least this many positions: partials stay a small share of K/V bytes
PROGRAMS_PER_SM = 2  # decode splits aim at this many programs per SM (memory-bound: latency hiding)
DEFAULT_SMS = 132  # H100 SXM: decode_splits' default, so the answer never depends on the machine
MAX_GRID_Z = 65535  # prefill's grid puts sequences on z, whose CUDA limit this is
NO_WINDOW = 1 << 30  # passed as the window when there is none (masks become no-ops)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# K/V tile bytes per stage (one of K or V). Two 16 KiB tiles double-buffered are 64 KiB of shared
# memory: within every sm80+ part (99 KiB on sm86/sm89), and two decode programs fit an SM.
_TILE_BYTES = 16 * 1024


# -- environment -------------------------------------------------------------------------------

def paged_attention_available(device: torch.device) -> tuple[bool, str]:
    """(True, "") when the kernels can run on `device`, else (False, the reason in words).

    CUDA needs compute capability 8.0+ (Triton's own floor); CPU tensors run only in Triton's
    interpreter (TRITON_INTERPRET=1), which is for tests, not serving.
    """
    device = torch.device(device)
    if triton is None:
        return False, "triton is not installed"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "no CUDA device"
        if torch.version.hip is not None:
            return False, "ROCm devices are not validated for these kernels"
        cap = tuple(torch.cuda.get_device_capability(device))
        if cap < MIN_COMPUTE_CAPABILITY:
            return False, f"needs compute capability 8.0+, got {cap[0]}.{cap[1]}"
        return True, ""
    if device.type == "cpu":
        if interpreting():
            return True, ""
        return False, "CPU tensors run only under TRITON_INTERPRET=1 (Triton's interpreter)"
    return False, f"device type {device.type} is not supported (CUDA, or CPU under TRITON_INTERPRET=1)"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# -- plans -------------------------------------------------------------------------------------

def decode_splits(max_seq_len: int, block_size: int, batch: int, kv_heads: int,
                  num_sms: int | None = None) -> int:
    """Sequence splits for a decode step: enough (batch x kv_heads x splits) programs to give
    every SM PROGRAMS_PER_SM, but each split reading at least MIN_SPLIT_TOKENS positions (and a
    whole block), at most MAX_SPLITS.

    num_sms None means DEFAULT_SMS (an H100), never the current device, so the answer is a pure
    function of the arguments; pass the device's multi_processor_count on other GPUs. A CUDA
    graph bucket should pass the longest context it serves as max_seq_len.
    """
    if max_seq_len < 0 or block_size < 1 or batch < 0 or kv_heads < 1:
        raise ValueError(f"decode_splits: invalid max_seq_len={max_seq_len}, block_size={block_size}, "
                         f"batch={batch}, kv_heads={kv_heads}")
    sms = DEFAULT_SMS if num_sms is None else num_sms
    if sms < 1:
        raise ValueError(f"decode_splits: num_sms must be positive, got {num_sms}")
    programs = max(1, batch * kv_heads)
    target = PROGRAMS_PER_SM * sms
    if programs >= target:
        return 1
    want = _cdiv(target, programs)
    by_length = max_seq_len // max(MIN_SPLIT_TOKENS, block_size)
    return max(1, min(want, by_length, MAX_SPLITS))


def _decode_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for decode.

    The K tile (BLOCK_N x padded head_dim) is sized to _TILE_BYTES: 64 keys at fp16/bf16 and
    head_dim 128. Four warps cover a 16-row x BLOCK_N dot; two stages overlap the next tile's
    loads with this one's math. The interpreter uses 16-key tiles so small tests cross tiles
    and blocks both ways.
    """
    if interpreting():
        return 16, 4, 1
    dp = max(16, _pow2(head_dim))
    block_n = max(16, min(64, _TILE_BYTES // (dp * dtype.itemsize)))
    return block_n, 4, 2


def _prefill_config(max_rows: int, head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for prefill; max_rows = max_q_len x group.

    On GPU the FlashAttention-2 shape, 128 x 64 tiles, at fp16/bf16 up to head_dim 128; head_dim
    256 and fp32 (wider rows) halve both, so K/V stages stay within _TILE_BYTES and the kernel
    within the 99 KiB of shared memory of sm86/sm89 parts. BLOCK_M shrinks to the rows there
    are (batches of short rows). Eight warps once the Q tile and its fp32 accumulator reach
    32 KiB: with four, ptxas spills registers at those sizes (cuobjdump, sm86). Two stages
    overlap the next K/V tile's loads with this one's dots. The interpreter uses 16 x 16 tiles
    (see _decode_config).
    """
    if interpreting():
        return 16, 16, 4, 1
    dp = max(16, _pow2(head_dim))
    wide = dtype == torch.float32
    block_m, block_n = (128, 64) if dp <= 128 else (64, 32)
    if wide:
        block_m, block_n = block_m // 2, block_n // 2
    block_m = max(16, min(block_m, _pow2(max_rows)))
    warps = 8 if block_m * dp * (dtype.itemsize + 4) >= 32 * 1024 else 4
    return block_m, block_n, warps, 2


# -- Triton kernels ----------------------------------------------------------------------------

def _define_kernels() -> SimpleNamespace:
    # tl.max and tl.sum are themselves @triton.jit functions (see the module docstring); the
    # kernels call tl.reduce with the combiners those two use, which the interpreter runs as
    # numpy reductions and the compiler exactly as tl.max / tl.sum.
    for combiner in ("_elementwise_max", "_sum_combine"):
        if not hasattr(tl.standard, combiner):
            raise RuntimeError(f"triton {triton.__version__} has no triton.language.standard.{combiner}")

    @triton.jit
    def decode(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, ks_ptr, vs_ptr,
               qk_scale, softcap, window, num_splits, max_blocks,
               stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
               stride_bt, stride_ob, stride_oh,
               GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
               BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr, SOFTCAP: tl.constexpr,
               FP8: tl.constexpr):
        # Program (b, kvh, split): query heads kvh*GROUP .. +GROUP of sequence b against this
        # split's share of the positions [lo, hi) it can see.
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        v_scale = 1.0
        if FP8 != 0:  # the KV head's scales, times 256 for e4m3fn's widened bytes (kernels/kv_fp8.py)
            qk_scale = qk_scale * tl.load(ks_ptr + kvh) * (256.0 if FP8 == 1 else 1.0)
            v_scale = tl.load(vs_ptr + kvh) * (256.0 if FP8 == 1 else 1.0)
        offs_g = tl.arange(0, GP)
        offs_d = tl.arange(0, DP)
        offs_n = tl.arange(0, BLOCK_N)
        g_ok = offs_g < GROUP
        d_ok = offs_d < D
        heads = kvh * GROUP + offs_g
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [GP, DP]
        if DOT_F32:
            q = q.to(tl.float32)
        seq_len = tl.load(lens_ptr + b)
        hi = tl.minimum(seq_len, max_blocks * BS)  # never past the table, whatever seq_lens says
        lo = tl.maximum(seq_len - window, 0)
        start0 = (lo // BLOCK_N) * BLOCK_N  # tiles aligned to BLOCK_N positions
        per = ((hi - start0 + num_splits - 1) // num_splits + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        start = start0 + split * per
        end = tl.minimum(start + per, hi)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.full([GP], 0.0, tl.float32)
        acc = tl.full([GP, DP], 0.0, tl.float32)
        k_head = k_ptr + kvh * stride_kh
        v_head = v_ptr + kvh * stride_vh
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + offs_n
            n_ok = (pos < end) & (pos >= lo)
            blk = tl.load(bt_ptr + b * stride_bt + pos // BS, mask=n_ok, other=0).to(tl.int64)
            off = pos % BS
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_head + blk[:, None] * stride_kb + off[:, None] * stride_kt + offs_d[None, :],
                        mask=kv_mask, other=0)  # [BLOCK_N, DP]
            if FP8 != 0:  # bytes -> float16 (e4m3fn: value / 256, kernels/kv_fp8.py) -> q's dtype
                k = (((k & 0x80).to(tl.uint16) << 8) | ((k & 0x7F).to(tl.uint16) << (6 + FP8)))
                k = k.to(tl.float16, bitcast=True).to(q_ptr.dtype.element_ty)
            if DOT_F32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            if SOFTCAP:
                # softcap * tanh(x) in base 2, x = raw * scale / softcap (module docstring): an odd
                # polynomial for |x| < 1/4, else 1 - 2 / (e^2x + 1)
                x = s * (qk_scale / (softcap * 1.4426950408889634))
                x2 = x * x
                poly = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
                    -0.05396825396825397 + x2 * 0.021869488536155203))))
                big = 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)
                s = tl.where(x2 < 0.0625, poly, big) * (softcap * 1.4426950408889634)
            else:
                s = s * qk_scale
            s = tl.where(n_ok[None, :], s, float("-inf"))  # [GP, BLOCK_N]
            m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            v = tl.load(v_head + blk[:, None] * stride_vb + off[:, None] * stride_vt + offs_d[None, :],
                        mask=kv_mask, other=0)
            if FP8 != 0:  # bytes -> float16 (e4m3fn: value / 256, kernels/kv_fp8.py) -> q's dtype
                v = (((v & 0x80).to(tl.uint16) << 8) | ((v & 0x7F).to(tl.uint16) << (6 + FP8)))
                v = v.to(tl.float16, bitcast=True).to(q_ptr.dtype.element_ty)
            if DOT_F32:
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        acc = acc * v_scale  # an fp8 cache's value scale (1.0 otherwise), partials too: the combine is linear
        if SPLIT:
            row = (b * (GROUP * tl.num_programs(1)) + heads) * num_splits + split  # [GP]
            tl.store(m_ptr + row, m_i, mask=g_ok)
            tl.store(l_ptr + row, l_i, mask=g_ok)
            tl.store(acc_ptr + row[:, None] * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
        else:
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # seq_len 0: acc is 0, so zeros
            tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])

    @triton.jit
    def combine(m_ptr, l_ptr, acc_ptr, out_ptr, num_splits, stride_ob, stride_oh,
                D: tl.constexpr, DP: tl.constexpr, SP: tl.constexpr):
        # Program (b, h): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, M = max_s m_s.
        b = tl.program_id(0)
        h = tl.program_id(1)
        row0 = (b * tl.num_programs(1) + h) * num_splits
        offs_s = tl.arange(0, SP)
        offs_d = tl.arange(0, DP)
        s_ok = offs_s < num_splits
        d_ok = offs_d < D
        m = tl.load(m_ptr + row0 + offs_s, mask=s_ok, other=float("-inf"))
        l = tl.load(l_ptr + row0 + offs_s, mask=s_ok, other=0.0)
        m_max = tl.reduce(m, 0, tl.standard._elementwise_max)
        m_use = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: seq_len 0
        total = tl.reduce(tl.exp2(m - m_use) * l, 0, tl.standard._sum_combine)
        acc = tl.full([DP], 0.0, tl.float32)
        for s in range(0, num_splits):
            w = tl.exp2(tl.load(m_ptr + row0 + s) - m_use)  # empty split: 2^-inf = 0
            acc += w * tl.load(acc_ptr + (row0 + s) * D + offs_d, mask=d_ok, other=0.0)
        o = acc / tl.where(total == 0.0, 1.0, total)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_ok)

    @triton.jit
    def prefill(q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, lens_ptr, out_ptr, ks_ptr, vs_ptr,
                qk_scale, softcap, window, max_blocks,
                stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                stride_bt, stride_ot, stride_oh,
                GROUP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, DOT_F32: tl.constexpr,
                SOFTCAP: tl.constexpr, FP8: tl.constexpr):
        # Program (tile, kvh, b): rows tile*BLOCK_M .. +BLOCK_M of sequence b's (token, head) pairs
        # (row r = token r // GROUP, query head kvh*GROUP + r % GROUP); tiles in reverse order so
        # the longest (last queries, most keys) start first.
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        kvh = tl.program_id(1)
        b = tl.program_id(2)
        q_start = tl.load(cu_ptr + b)
        q_len = tl.load(cu_ptr + b + 1) - q_start
        row_lo = tile * BLOCK_M
        if row_lo >= q_len * GROUP:
            return
        v_scale = 1.0
        if FP8 != 0:  # the KV head's scales, times 256 for e4m3fn's widened bytes (kernels/kv_fp8.py)
            qk_scale = qk_scale * tl.load(ks_ptr + kvh) * (256.0 if FP8 == 1 else 1.0)
            v_scale = tl.load(vs_ptr + kvh) * (256.0 if FP8 == 1 else 1.0)
        rows = row_lo + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, DP)
        offs_n = tl.arange(0, BLOCK_N)
        d_ok = offs_d < D
        tok = rows // GROUP
        r_ok = tok < q_len
        heads = kvh * GROUP + rows % GROUP
        q = tl.load(q_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                    + offs_d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, DP]
        if DOT_F32:
            q = q.to(tl.float32)
        seq_len = tl.load(lens_ptr + b)
        cache_len = seq_len - q_len
        qpos = cache_len + tok  # [BLOCK_M] each row's position
        tok_last = tl.minimum((row_lo + BLOCK_M - 1) // GROUP, q_len - 1)
        hi = tl.minimum(cache_len + tok_last + 1, max_blocks * BS)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(cache_len + row_lo // GROUP - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, DP], 0.0, tl.float32)
        k_head = k_ptr + kvh * stride_kh
        v_head = v_ptr + kvh * stride_vh
        for n0 in range(lo, hi, BLOCK_N):
            pos = n0 + offs_n
            n_ok = pos < hi
            blk = tl.load(bt_ptr + b * stride_bt + pos // BS, mask=n_ok, other=0).to(tl.int64)
            off = pos % BS
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_head + blk[:, None] * stride_kb + off[:, None] * stride_kt + offs_d[None, :],
                        mask=kv_mask, other=0)  # [BLOCK_N, DP]
            if FP8 != 0:  # bytes -> float16 (e4m3fn: value / 256, kernels/kv_fp8.py) -> q's dtype
                k = (((k & 0x80).to(tl.uint16) << 8) | ((k & 0x7F).to(tl.uint16) << (6 + FP8)))
                k = k.to(tl.float16, bitcast=True).to(q_ptr.dtype.element_ty)
            if DOT_F32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            visible = n_ok[None, :] & (pos[None, :] <= qpos[:, None])
            if HAS_WINDOW:
                visible = visible & (qpos[:, None] - pos[None, :] < window)
            if SOFTCAP:
                # softcap * tanh(x) in base 2, x = raw * scale / softcap (module docstring): an odd
                # polynomial for |x| < 1/4, else 1 - 2 / (e^2x + 1)
                x = s * (qk_scale / (softcap * 1.4426950408889634))
                x2 = x * x
                poly = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (
                    -0.05396825396825397 + x2 * 0.021869488536155203))))
                big = 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)
                s = tl.where(x2 < 0.0625, poly, big) * (softcap * 1.4426950408889634)
            else:
                s = s * qk_scale
            s = tl.where(visible, s, float("-inf"))  # [BLOCK_M, BLOCK_N]
            m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            v = tl.load(v_head + blk[:, None] * stride_vb + off[:, None] * stride_vt + offs_d[None, :],
                        mask=kv_mask, other=0)
            if FP8 != 0:  # bytes -> float16 (e4m3fn: value / 256, kernels/kv_fp8.py) -> q's dtype
                v = (((v & 0x80).to(tl.uint16) << 8) | ((v & 0x7F).to(tl.uint16) << (6 + FP8)))
                v = v.to(tl.float16, bitcast=True).to(q_ptr.dtype.element_ty)
            if DOT_F32:
                pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        o = acc * v_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # v_scale: an fp8 cache's (else 1.0)
        tl.store(out_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh
                 + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])

    return SimpleNamespace(decode=decode, combine=combine, prefill=prefill)


_kernels = LazyKernels(_define_kernels)


# -- launchers ---------------------------------------------------------------------------------

def _check_common(name: str, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: torch.Tensor, window: int | None,
                  extra: dict[str, torch.Tensor], softcap: float | None = None,
                  kv_scales: kv_fp8.KVScales | None = None) -> None:
    """Shapes, dtypes, strides and devices every launch needs; raises ValueError naming the problem."""
    if q.dim() != 3:
        raise ValueError(f"{name}: q must be 3-D, got shape {list(q.shape)}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"{name}: q dtype {q.dtype} not in float16/bfloat16/float32")
    if key_cache.dim() != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(f"{name}: key_cache and value_cache must both be [num_blocks, block_size, kv_heads, "
                         f"head_dim], got {list(key_cache.shape)} and {list(value_cache.shape)}")
    if value_cache.dtype != key_cache.dtype or (key_cache.dtype != q.dtype and not kv_fp8.is_fp8(key_cache.dtype)):
        raise ValueError(f"{name}: cache dtypes {key_cache.dtype}/{value_cache.dtype} must match q's {q.dtype} or be fp8")
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = key_cache.shape[2]
    kv_fp8.check_kernel_scales(name, key_cache.dtype, kv_scales, kv_heads, q.device)
    if key_cache.shape[3] != dim:
        raise ValueError(f"{name}: q head_dim {dim} does not match the cache's {key_cache.shape[3]}")
    if not 1 <= dim <= MAX_HEAD_DIM:
        raise ValueError(f"{name}: head_dim {dim} not in 1..{MAX_HEAD_DIM}")
    if heads % kv_heads != 0:
        raise ValueError(f"{name}: {heads} query heads are not a multiple of {kv_heads} KV heads")
    for t_name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: {t_name} needs unit stride along head_dim, got strides {t.stride()}")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or block_tables.stride(1) != 1:
        raise ValueError(f"{name}: block_tables must be int32 [batch, max_blocks] with unit column stride, got "
                         f"{block_tables.dtype} {list(block_tables.shape)} strides {block_tables.stride()}")
    batch = block_tables.shape[0]
    if seq_lens.shape != (batch,) or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        raise ValueError(f"{name}: seq_lens must be contiguous int32 [{batch}], got {seq_lens.dtype} "
                         f"{list(seq_lens.shape)}")
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{name}: window must be None or a positive int, got {window!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"{name}: softcap must be None or a positive finite number, got {softcap!r}")
    tensors = {"q": q, "key_cache": key_cache, "value_cache": value_cache, "block_tables": block_tables,
               "seq_lens": seq_lens, **extra}
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        raise ValueError(f"{name}: tensors on different devices: "
                         + ", ".join(f"{n} {t.device}" for n, t in tensors.items()))
    ok, why = paged_attention_available(q.device)
    if not ok:
        raise ValueError(f"{name} cannot run on {q.device}: {why}")


def _dot_f32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


def decode_workspace(batch: int, heads: int, head_dim: int, num_splits: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 split partials for `paged_decode`: running max [B, H, S], sum [B, H, S], output [B, H, S, D].

    Allocate once (for the largest batch and split count in use) before capturing CUDA graphs:
    paged_decode accepts any contiguous float32 tensors at least this large.
    """
    shape = (batch, heads, num_splits)
    return (torch.empty(shape, dtype=torch.float32, device=device),
            torch.empty(shape, dtype=torch.float32, device=device),
            torch.empty(*shape, head_dim, dtype=torch.float32, device=device))


def paged_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int | None = None, *, num_splits: int = 1,
                 out: torch.Tensor | None = None,
                 workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                 softcap: float | None = None, kv_scales: kv_fp8.KVScales | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its paged K/V (the new token's already stored).

    q [B, H, D]; caches [num_blocks, block_size, KVH, D]; block_tables int32 [B, max_blocks];
    seq_lens int32 [B], positions in cache including the new token (0: padding row, zeros out).
    window: the query sees the last `window` positions. softcap: scores (after `scale`) become
    softcap * tanh(scores / softcap) before the softmax (Gemma 2). An fp8 cache needs its `kv_scales`
    (module docstring). Returns out [B, H, D] in q's dtype.
    No host sync and a grid of (B, KVH, num_splits): capturable in a CUDA graph with a workspace.
    """
    name = "paged_decode"
    _check_common(name, q, key_cache, value_cache, block_tables, seq_lens, window, {}, softcap, kv_scales)
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = key_cache.shape
    if seq_lens.shape[0] != batch:
        raise ValueError(f"{name}: q has {batch} rows but block_tables/seq_lens have {seq_lens.shape[0]}")
    if not isinstance(num_splits, int) or not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"{name}: num_splits must be an int in 1..{MAX_SPLITS}, got {num_splits!r}")
    out = args.check_out(name, out, q)
    if q.device.type == "cpu":
        args.check_lengths_cpu(name, seq_lens, block_tables.shape[1] * block_size)
    if batch == 0:
        return out
    split = num_splits > 1
    if split:
        if workspace is None:
            workspace = decode_workspace(batch, heads, dim, num_splits, q.device)
        m_ws, l_ws, acc_ws = args.check_workspace(name, workspace, batch * heads * num_splits, dim, q.device)
    else:
        m_ws = l_ws = acc_ws = out  # unused (SPLIT is a compile-time False)
    group = heads // kv_heads
    dp = max(16, _pow2(dim))
    block_n, warps, stages = _decode_config(dim, q.dtype)
    kernels = _kernels()
    k_arg, v_arg, ks, vs, fp8 = kv_fp8.kernel_cache_args(key_cache, value_cache, kv_scales, seq_lens)
    kernels.decode[(batch, kv_heads, num_splits)](
        q, k_arg, v_arg, block_tables, seq_lens, out, m_ws, l_ws, acc_ws, ks, vs,
        float(scale) * 1.4426950408889634, 1.0 if softcap is None else float(softcap),
        NO_WINDOW if window is None else window, num_splits, block_tables.shape[1],
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GP=max(16, _pow2(group)), D=dim, DP=dp, BS=block_size, BLOCK_N=block_n, SPLIT=split,
        DOT_F32=_dot_f32(q.dtype), SOFTCAP=softcap is not None, FP8=fp8, num_warps=warps, num_stages=stages,
    )
    if split:
        kernels.combine[(batch, heads)](
            m_ws, l_ws, acc_ws, out, num_splits, out.stride(0), out.stride(1),
            D=dim, DP=dp, SP=max(2, _pow2(num_splits)), num_warps=1 if dp <= 64 else 2,
        )
    return out


def paged_prefill(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, window: int | None = None, *,
                  max_q_len: int, out: torch.Tensor | None = None, softcap: float | None = None,
                  kv_scales: kv_fp8.KVScales | None = None) -> torch.Tensor:
    """Causal attention of the new tokens of B sequences (flattened) over their paged K/V.

    q [T, H, D]; cu_seqlens_q int32 [B+1] (sequence b's new tokens are q[cu[b]:cu[b+1]], its
    last positions); seq_lens int32 [B] = positions in cache after this step, so the cached
    prefix is seq_lens[b] - q_len_b. max_q_len bounds every q_len (it sizes the grid; rows past
    it would not be computed). softcap and kv_scales as in `paged_decode`. Returns out [T, H, D] in q's dtype.
    """
    name = "paged_prefill"
    _check_common(name, q, key_cache, value_cache, block_tables, seq_lens, window, {"cu_seqlens_q": cu_seqlens_q},
                  softcap, kv_scales)
    batch = block_tables.shape[0]
    tokens, heads, dim = q.shape
    _, block_size, kv_heads, _ = key_cache.shape
    if cu_seqlens_q.shape != (batch + 1,) or cu_seqlens_q.dtype != torch.int32 or not cu_seqlens_q.is_contiguous():
        raise ValueError(f"{name}: cu_seqlens_q must be contiguous int32 [{batch + 1}], got {cu_seqlens_q.dtype} "
                         f"{list(cu_seqlens_q.shape)}")
    if not isinstance(max_q_len, int) or max_q_len < 0:
        raise ValueError(f"{name}: max_q_len must be a non-negative int, got {max_q_len!r}")
    if batch > MAX_GRID_Z:
        raise ValueError(f"{name}: {batch} sequences in one launch, at most {MAX_GRID_Z} (CUDA's grid z limit)")
    out = args.check_out(name, out, q)
    if q.device.type == "cpu":
        args.check_lengths_cpu(name, seq_lens, block_tables.shape[1] * block_size)
        cu = cu_seqlens_q.tolist()
        q_lens = [cu[i + 1] - cu[i] for i in range(batch)]
        if cu[0] != 0 or cu[-1] != tokens or min(q_lens, default=0) < 0 or max(q_lens, default=0) > max_q_len:
            raise ValueError(f"{name}: cu_seqlens_q {cu} must rise from 0 to {tokens} by steps of at most "
                             f"max_q_len={max_q_len}")
        if any(q_len > s for q_len, s in zip(q_lens, seq_lens.tolist())):
            raise ValueError(f"{name}: a sequence has more new tokens than positions in cache: q_lens {q_lens}, "
                             f"seq_lens {seq_lens.tolist()}")
    if tokens == 0 or batch == 0 or max_q_len == 0:
        return out
    group = heads // kv_heads
    block_m, block_n, warps, stages = _prefill_config(max_q_len * group, dim, q.dtype)
    grid = (_cdiv(max_q_len * group, block_m), kv_heads, batch)
    k_arg, v_arg, ks, vs, fp8 = kv_fp8.kernel_cache_args(key_cache, value_cache, kv_scales, seq_lens)
    _kernels().prefill[grid](
        q, k_arg, v_arg, block_tables, cu_seqlens_q, seq_lens, out, ks, vs,
        float(scale) * 1.4426950408889634, 1.0 if softcap is None else float(softcap),
        NO_WINDOW if window is None else window, block_tables.shape[1],
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, D=dim, DP=max(16, _pow2(dim)), BS=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_WINDOW=window is not None, DOT_F32=_dot_f32(q.dtype), SOFTCAP=softcap is not None, FP8=fp8,
        num_warps=warps, num_stages=stages,
    )
    return out
