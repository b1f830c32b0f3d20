"""Triton decode for multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache.

The cache of a layer is [num_blocks, block_size, 1, W]: one latent per token, W = R + P numbers
(R = kv_lora_rank, the compressed K/V; P = qk_rope_head_dim, the shared rotary key), shared by
every head. Absorbed decode (layers/mla.py) has already turned each head's query into latent
space, so attention is multi-query with head dimension W for the keys and R for the values,
which are the first R numbers of the same latents:

    scores[h, t] = q[h, :R] . c[t] + q[h, R:] . pe[t]      (c = latent[:R], pe = latent[R:])
    out[h]       = softmax_t(scores * scale) @ c            -> [H, R]

Grid (batch, ceil(H / HEADS)): one program per sequence and group of HEADS query heads (padded
to 16 rows for tl.dot), so each latent tile, read once from the table's blocks, serves the whole
group. The latent and rotary parts are separate tiles (R and P need not be powers of two, and
576 = 512 + 64 would pad to 1024). Each program loops over its own sequence's positions with an
online softmax in base 2 (log2(e) folded into the scale), fp32 accumulation; rows with seq_len 0
(CUDA-graph padding) read nothing and write zeros. No split along the sequence: a batch of
few long sequences leaves SMs idle (a flash-decoding split like paged_attention's is the next
step), but the grid depends only on shapes and there is no host sync, so a launch can be
captured in a CUDA graph.

As in paged_attention.py, kernels are defined on first use for the current TRITON_INTERPRET
setting, float32 uses IEEE dots, and bfloat16 tiles are widened to fp32 under the interpreter
(whose bf16 tl.dot is wrong in Triton 3.x).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from text_generation_server.kernels.kv_fp8 import FP8_FORMATS, KVScales, as_bytes, is_fp8
from text_generation_server.kernels.paged_attention import paged_attention_available
from text_generation_server.kernels.triton_support import LazyKernels, interpreting, tl, triton

MAX_LATENT_DIM = 1024  # R + P; DeepSeek-V2/V3 use 512 + 64
HEADS = 16  # query heads per program (tl.dot's minimum rows)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def mla_decode_available(device: torch.device) -> tuple[bool, str]:
    """Where the kernel runs: as the paged-attention kernels (CUDA sm80+, or CPU under the interpreter)."""
    return paged_attention_available(device)


def _config(rp: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, warps, stages): latent tiles of BLOCK_N x RP; 32 positions x 512 at bf16 is 32 KiB
    (double-buffered, 64 KiB of shared memory); the interpreter takes 16 (tl.dot's minimum)."""
    if interpreting():
        return 16, 4, 1
    block_n = 32 if rp * dtype.itemsize <= 1024 else 16
    return block_n, 8 if rp >= 256 else 4, 2


def mla_decode(q: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, value_dim: int, *, out: torch.Tensor | None = None,
               kv_scales: KVScales | None = None) -> torch.Tensor:
    """Absorbed MLA decode of one new token per sequence (its latent already stored).

    q [B, H, W] (latent-space query, then the rotary part); latent_cache [blocks, block_size, 1, W];
    block_tables int32 [B, max_blocks]; seq_lens int32 [B], positions including the new token (0:
    a padding row, zeros out); value_dim R: values are the latents' first R numbers. An fp8 cache
    needs `kv_scales` ([1] each; keys and values are the same latents, so the key scale serves both):
    its bytes are widened in the kernel, the scale folded into the scores and the output.
    Returns out [B, H, R] in q's dtype.
    """
    name = "mla_decode"
    if q.dim() != 3 or latent_cache.dim() != 4 or latent_cache.shape[2] != 1:
        raise ValueError(f"{name}: q must be [B, H, W] and latent_cache [blocks, block_size, 1, W], got "
                         f"{list(q.shape)} and {list(latent_cache.shape)}")
    batch, heads, width = q.shape
    if latent_cache.shape[3] != width:
        raise ValueError(f"{name}: q width {width} does not match the cache's {latent_cache.shape[3]}")
    if not 0 < value_dim < width or width > MAX_LATENT_DIM:
        raise ValueError(f"{name}: need 0 < value_dim ({value_dim}) < width ({width}) <= {MAX_LATENT_DIM}")
    if q.dtype not in _DTYPES or (latent_cache.dtype != q.dtype and not is_fp8(latent_cache.dtype)):
        raise ValueError(f"{name}: q and cache must share a dtype of float16/bfloat16/float32 (or the cache be fp8), "
                         f"got {q.dtype} and {latent_cache.dtype}")
    if is_fp8(latent_cache.dtype) != (kv_scales is not None) or (
            kv_scales is not None and (kv_scales.dtype != latent_cache.dtype or kv_scales.key.shape != (1,)
                                       or kv_scales.key.device != q.device)):
        raise ValueError(f"{name}: an fp8 cache, and only one, takes kv_scales of its dtype with one [1] scale on "
                         f"{q.device}; got a {latent_cache.dtype} cache and {kv_scales}")
    if q.stride(-1) != 1 or latent_cache.stride(-1) != 1:
        raise ValueError(f"{name}: q and latent_cache need unit stride along the width, got {q.stride()} and "
                         f"{latent_cache.stride()}")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32 or block_tables.stride(1) != 1 \
            or block_tables.shape[0] != batch:
        raise ValueError(f"{name}: block_tables must be int32 [{batch}, max_blocks] with unit column stride, got "
                         f"{block_tables.dtype} {list(block_tables.shape)}")
    if seq_lens.shape != (batch,) or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        raise ValueError(f"{name}: seq_lens must be contiguous int32 [{batch}], got {seq_lens.dtype} "
                         f"{list(seq_lens.shape)}")
    devices = {t.device for t in (q, latent_cache, block_tables, seq_lens)}
    if len(devices) != 1:
        raise ValueError(f"{name}: tensors on different devices: {sorted(map(str, devices))}")
    ok, why = mla_decode_available(q.device)
    if not ok:
        raise ValueError(f"{name} cannot run on {q.device}: {why}")
    block_size = latent_cache.shape[1]
    if q.device.type == "cpu" and seq_lens.numel():
        capacity = block_tables.shape[1] * block_size
        if int(seq_lens.min()) < 0 or int(seq_lens.max()) > capacity:
            raise ValueError(f"{name}: seq_lens must lie in 0..{capacity}, got {seq_lens.tolist()}")
    if out is None:
        out = torch.empty(batch, heads, value_dim, dtype=q.dtype, device=q.device)
    elif out.shape != (batch, heads, value_dim) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"{name}: out must be {q.dtype} [{batch}, {heads}, {value_dim}] with unit last stride")
    if batch == 0:
        return out
    rope = width - value_dim
    rp, pp = max(16, _pow2(value_dim)), max(16, _pow2(rope))
    block_n, warps, stages = _config(rp, q.dtype)
    cache, scales, fp8 = latent_cache, seq_lens, 0  # seq_lens: an unused pointer without fp8
    if kv_scales is not None:
        cache, scales, fp8 = as_bytes(latent_cache), kv_scales.key, FP8_FORMATS[kv_scales.dtype]
    _kernels().decode[(batch, -(-heads // HEADS))](
        q, cache, block_tables, seq_lens, out, scales,
        float(scale) * 1.4426950408889634, heads, block_tables.shape[1],
        q.stride(0), q.stride(1), latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        HB=HEADS, R=value_dim, RP=rp, P=rope, PP=pp, BS=block_size, BLOCK_N=block_n,
        DOT_F32=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and interpreting()), FP8=fp8,
        num_warps=warps, num_stages=stages,
    )
    return out


def _define_kernels() -> SimpleNamespace:
    for combiner in ("_elementwise_max", "_sum_combine"):
        if not hasattr(tl.standard, combiner):
            raise RuntimeError(f"triton {triton.__version__} has no triton.language.standard.{combiner}")

    @triton.jit
    def decode(q_ptr, c_ptr, bt_ptr, lens_ptr, out_ptr, s_ptr, qk_scale, heads_total, max_blocks,
               stride_qb, stride_qh, stride_cb, stride_ct, stride_bt, stride_ob, stride_oh,
               HB: tl.constexpr, R: tl.constexpr, RP: tl.constexpr, P: tl.constexpr, PP: tl.constexpr,
               BS: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr):
        # Program (b, g): query heads g*HB .. +HB of sequence b against all its positions.
        b = tl.program_id(0)
        g = tl.program_id(1)
        v_scale = 1.0
        if FP8 != 0:  # the layer's one scale (keys and values alike), x256 for e4m3fn bytes (kernels/kv_fp8.py)
            qk_scale = qk_scale * tl.load(s_ptr + 0) * (256.0 if FP8 == 1 else 1.0)
            v_scale = tl.load(s_ptr + 0) * (256.0 if FP8 == 1 else 1.0)
        heads = g * HB + tl.arange(0, HB)
        h_ok = heads < heads_total
        offs_r = tl.arange(0, RP)
        offs_p = tl.arange(0, PP)
        offs_n = tl.arange(0, BLOCK_N)
        r_ok = offs_r < R
        p_ok = offs_p < P
        q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
        q_c = tl.load(q_row + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)  # [HB, RP]
        q_p = tl.load(q_row + R + offs_p[None, :], mask=h_ok[:, None] & p_ok[None, :], other=0.0)  # [HB, PP]
        if DOT_F32:
            q_c = q_c.to(tl.float32)
            q_p = q_p.to(tl.float32)
        seq_len = tl.load(lens_ptr + b)
        hi = tl.minimum(seq_len, max_blocks * BS)  # never past the table, whatever seq_lens says
        m_i = tl.full([HB], float("-inf"), tl.float32)
        l_i = tl.full([HB], 0.0, tl.float32)
        acc = tl.full([HB, RP], 0.0, tl.float32)
        for n0 in range(0, hi, BLOCK_N):
            pos = n0 + offs_n
            n_ok = pos < hi
            blk = tl.load(bt_ptr + b * stride_bt + pos // BS, mask=n_ok, other=0).to(tl.int64)
            row = c_ptr + blk[:, None] * stride_cb + (pos % BS)[:, None] * stride_ct
            c = tl.load(row + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :], other=0)  # [BLOCK_N, RP]
            pe = tl.load(row + R + offs_p[None, :], mask=n_ok[:, None] & p_ok[None, :], other=0)  # [BLOCK_N, PP]
            if FP8 != 0:  # bytes -> float16 (e4m3fn: value / 256, kernels/kv_fp8.py) -> q's dtype
                c = (((c & 0x80).to(tl.uint16) << 8) | ((c & 0x7F).to(tl.uint16) << (6 + FP8)))
                c = c.to(tl.float16, bitcast=True).to(q_ptr.dtype.element_ty)
            if FP8 != 0:
                pe = (((pe & 0x80).to(tl.uint16) << 8) | ((pe & 0x7F).to(tl.uint16) << (6 + FP8)))
                pe = pe.to(tl.float16, bitcast=True).to(q_ptr.dtype.element_ty)
            if DOT_F32:
                c32 = c.to(tl.float32)
                s = tl.dot(q_c, tl.trans(c32), input_precision="ieee") \
                    + tl.dot(q_p, tl.trans(pe.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q_c, tl.trans(c)) + tl.dot(q_p, tl.trans(pe))
            s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))  # [HB, BLOCK_N]
            m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            if DOT_F32:  # p rounded to the cache's dtype first, as the compiled bf16 dot rounds it
                pv = tl.dot(p.to(c.dtype).to(tl.float32), c32, input_precision="ieee")
            else:
                pv = tl.dot(p.to(c.dtype), c)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # seq_len 0: acc is 0, so zeros
        if FP8 != 0:
            o = o * v_scale
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_r[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & r_ok[None, :])

    return SimpleNamespace(decode=decode)


_kernels = LazyKernels(_define_kernels)
