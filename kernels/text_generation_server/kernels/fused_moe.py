"""fused-moe: a mixture-of-experts feed-forward in two Triton launches on CUDA.

    y[t] = sum_j topk_weights[t, j] * (w2[e] @ act(w13[e] @ x[t] + b13[e]) + b2[e]),  e = topk_ids[t, j]

Why grouped GEMMs: a decode step routes each token to k of E experts, so a dense pass over
all experts reads E/k times the bytes that matter, and a loop of per-expert GEMMs costs one
launch (and a host sync to learn which experts are in use) per expert. Here `moe_align` sorts
the (token, slot) pairs by expert with torch ops only (no host sync, so a CUDA graph can
capture it) and pads each expert's run to a multiple of block_m; then each program of the
kernel takes one block of rows, all of one expert, and multiplies them by that expert's
weight tile. An expert no token picked owns no block and its weights are never read, so
bytes read are the active experts' size (benchmarks/moe_triton_bytes.py counts them).

Launches:
1. gate_up (+ activation): each program computes the gate and the up tile of the same output
   columns side by side (rows n and I + n of w13) and applies the activation in registers,
   writing act(g) * u: [T*k, I]. Fusing it saves writing and re-reading [T*k, 2I] and a
   launch, which at decode is most of the cost beyond the weights.
2. down (+ bias, x routing weight): [T*k, I] -> [T*k, H], one row per (token, slot), each
   written by exactly one program; a torch sum over the k slots gives [T, H]. No atomics, so
   the result does not depend on scheduling.
Programs whose block lies past the padded row count (the grid is sized for the worst case,
so its shape depends only on T) return at once.

Weights, one of three forms per projection (w13 and w2 may differ):
- dense: w13 [E, 2I, H], w2 [E, H, I] in the activation dtype (rows 0..I of w13: gate);
- `MoeGemmWeight`: every expert's canonical `QuantizedWeight` repacked by triton_gemm.repack
  (2..8 bits, group scales, zero points, act-order through a per-expert row permutation)
  and stacked; gate and up are separate parts, so each keeps its own act-order permutation;
- `MoeFp8Weight`: e4m3 [E, N, K] with the scale grid of fp8.Fp8Weight (per-tensor,
  per-channel or block). Weights only: activations are not quantized. The kernel decodes
  e4m3 bytes with integer ops into exact fp16 values (Marlin's trick), so it runs on sm80
  as well as in the interpreter, neither of which converts fp8 natively.

Like triton_gemm, the @triton.jit functions are defined on first use per TRITON_INTERPRET
mode, so tests run them on CPU tensors in Triton's interpreter. `moe_reference` is the dense
ground truth and the documented fallback when `machine_reason()` is not "".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Union

import torch
from loguru import logger
from text_generation_server.kernels import triton_gemm as tg
from text_generation_server.kernels import triton_layout
from text_generation_server.kernels.base import QuantizedWeight
from text_generation_server.kernels.fp8 import FP8_DTYPE, Fp8Weight
from text_generation_server.kernels.scratch import SCRATCH, ScratchSpace, typed_view
from text_generation_server.kernels.triton_support import (
    LazyKernels,
    interpreting,
    tl,
    triton,
)

__all__ = [
    "ACTIVATIONS", "FusedMoe", "MoeFp8Weight", "MoeGemmWeight", "block_m_for", "fused_moe",
    "fused_moe_scratch_bytes", "machine_reason", "max_padded_rows", "moe_activation", "moe_align",
    "moe_reference",
]

ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "swiglu_oai")
BLOCK_MS = (16, 32, 64)  # tl.dot needs >= 16 rows; 64 keeps prefill tiles efficient
BLOCK_FILL = 2  # a block holds twice an average expert's rows (block_m_for)
BLOCK_N = 64  # divides triton_gemm's N padding (128), so packed weight loads need no mask
_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

MoeWeight = Union[torch.Tensor, "MoeGemmWeight", "MoeFp8Weight"]


def machine_reason() -> str:
    """Why this machine cannot run the fused MoE kernels ("" when it can): triton_gemm's floor
    (Triton installed, CUDA, compute capability 8.0+, not ROCm)."""
    return tg.triton_missing() or tg.machine_reason()


# -- alignment ---------------------------------------------------------------------------------

def block_m_for(tokens: int, topk: int, num_experts: int) -> int:
    """Rows per block: the smallest that holds BLOCK_FILL x an average expert's rows. Routing
    spreads rows unevenly; a block sized to the mean would leave many experts a second block
    that reads their weights again (Mixtral shape, batch 64: 1.45x the active bytes, against
    1.00x at twice the mean, benchmarks/moe_triton_bytes.py). Padding rows cost compute only,
    which decode has to spare."""
    for bm in BLOCK_MS:
        if tokens <= _max_tokens_for(bm, topk, num_experts):
            return bm
    return BLOCK_MS[-1]


def _max_tokens_for(block_m: int, topk: int, num_experts: int) -> int:
    """The most tokens block_m_for gives `block_m` (tokens * topk * BLOCK_FILL <= block_m * E)."""
    return block_m * num_experts // (BLOCK_FILL * topk)


def max_padded_rows(tokens: int, topk: int, num_experts: int, block_m: int) -> int:
    """Worst-case sorted rows: T*k, plus block_m - 1 padding for each expert that can be active
    (at most min(E, T*k)). A whole number of blocks, fixed by the shapes alone."""
    rows = tokens * topk
    cap = rows + min(num_experts, rows) * (block_m - 1)
    return cap // block_m * block_m  # the padded total is a multiple of block_m and <= cap


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int,
              out: tuple[torch.Tensor, torch.Tensor] | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids, expert_ids_per_block, num_tokens_post_padded) for topk_ids [T, k].

    sorted_token_ids int32 [max_padded_rows]: the flat (token * k + slot) indices grouped by
    expert (token order within an expert), each expert's run padded to a multiple of block_m
    with the sentinel T*k, unused tail also T*k. expert_ids_per_block int32 [max_padded_rows /
    block_m]: the expert of each block, -1 past the end. num_tokens_post_padded int32 [1]: rows
    in use. Torch ops only, no host sync: shapes depend on T, k, E and block_m only.
    `out`: (sorted ids, block experts) buffers to fill instead of allocating (scratch).
    """
    t, k = topk_ids.shape
    rows = t * k
    dev = topk_ids.device
    cap = max_padded_rows(t, k, num_experts, block_m)
    blocks = cap // block_m
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # flat indices grouped by expert, token order within
    sorted_e = flat[order]
    rank = torch.arange(rows, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    dest = (ends - padded)[sorted_e] + rank
    if out is None:
        sorted_ids = torch.empty(cap, dtype=torch.int32, device=dev)
        block_experts = torch.empty(blocks, dtype=torch.int32, device=dev)
    else:
        sorted_ids, block_experts = out[0][:cap], out[1][:blocks]
    sorted_ids.fill_(rows)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    total = ends[-1:]
    starts = torch.arange(blocks, device=dev) * block_m
    owner = torch.searchsorted(ends, starts, right=True)  # first expert whose run ends after the start
    block_experts.copy_(torch.where(starts < total, owner, -1))
    return sorted_ids, block_experts, total.to(torch.int32)


# -- weights -----------------------------------------------------------------------------------

def _split_columns(w: QuantizedWeight, parts: int) -> list[QuantizedWeight]:
    """A fused [K, parts * N] canonical weight as `parts` [K, N] weights (same g_idx)."""
    n = w.out_features // parts
    if n * parts != w.out_features:
        raise ValueError(f"cannot split {w.out_features} output columns into {parts} equal parts")
    cut = lambda t, i: None if t is None else t[:, i * n:(i + 1) * n]
    return [QuantizedWeight(cut(w.qweight, i), cut(w.scales, i), cut(w.zeros, i), w.g_idx, w.bits, w.group_size)
            for i in range(parts)]


@dataclass
class MoeGemmWeight:
    """Every expert's part(s) of one projection in triton_gemm's packed layout, stacked.

    Parts sit side by side along the packed columns, each padded to `part_cols` (a multiple
    of 128): w13 has two (gate, up), w2 one. Each part keeps its own row permutation, because
    GPTQ act-order quantizes gate and up separately and their g_idx differ.
    """

    qweight: torch.Tensor  # int32 [E, Kp / PACK, parts * part_cols], tile-interleaved
    scales: torch.Tensor  # [E, ceil(Kp / group_rows), parts * part_cols], activation dtype
    zeros: torch.Tensor | None  # like scales; None: every zero point is sym_zero
    perm: torch.Tensor | None  # int32 [E, parts, Kp]: input column of each stored row (-1 pad); None: identity
    bits: int
    group_rows: int
    sym_zero: int
    in_features: int  # K
    out_features: int  # N of one part
    parts: int

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    @property
    def padded_in(self) -> int:
        return self.qweight.shape[1] * 32 // self.bits

    @property
    def part_cols(self) -> int:
        return self.qweight.shape[2] // self.parts

    @classmethod
    def from_quantized(cls, experts: Sequence[QuantizedWeight | Sequence[QuantizedWeight]],
                       act_dtype: torch.dtype, split: int = 1) -> MoeGemmWeight:
        """Stacks per-expert canonical weights ([K, N] each). An entry is one weight (cut into
        `split` equal column parts: 2 for a fused gate_up) or a sequence of parts (gate, up).

        Every expert must repack to the same layout (bits, group rows, padding); checkpoints
        quantize experts alike, and the kernel reads one layout for all of them.
        """
        if not experts:
            raise ValueError("no experts")
        per_expert = [_split_columns(e, split) if isinstance(e, QuantizedWeight) else list(e) for e in experts]
        parts = len(per_expert[0])
        packed = [[tg.repack(p, act_dtype) for p in ps] for ps in per_expert]
        first = packed[0][0]
        key = lambda g: (g.bits, g.group_rows, g.padded_in, g.padded_out, g.in_features,
                         g.out_features, g.sym_zero, g.zeros is None)
        for e, gws in enumerate(packed):
            if len(gws) != parts:
                raise ValueError(f"expert {e} has {len(gws)} parts, expert 0 has {parts}")
            for p, g in enumerate(gws):
                if key(g) != key(first):
                    raise ValueError(
                        f"expert {e} part {p} repacks to (bits, group rows, padded K, padded N, K, N, zero, "
                        f"symmetric) {key(g)}, expert 0 part 0 to {key(first)}: the fused MoE kernel reads one "
                        "layout for every expert")
        kp = first.padded_in
        gather = any(g.perm is not None for gws in packed for g in gws)
        identity = torch.arange(kp, dtype=torch.int32, device=first.qweight.device)
        identity = torch.where(identity < first.in_features, identity, -1)
        cat = lambda name: torch.stack([torch.cat([getattr(g, name) for g in gws], 1) for gws in packed])
        return cls(
            qweight=cat("qweight").contiguous(),
            scales=cat("scales").contiguous(),
            zeros=None if first.zeros is None else cat("zeros").contiguous(),
            perm=torch.stack([torch.stack([identity if g.perm is None else g.perm for g in gws])
                              for gws in packed]).contiguous() if gather else None,
            bits=first.bits, group_rows=first.group_rows, sym_zero=first.sym_zero,
            in_features=first.in_features, out_features=first.out_features, parts=parts,
        )

    def dequantize(self) -> torch.Tensor:
        """Dense float32 [E, parts * N, K] (nn.Linear convention), from the packed layout."""
        e, kp, n = self.num_experts, self.padded_in, self.out_features
        block = torch.arange(kp, device=self.qweight.device) // self.group_rows
        out = torch.zeros(e, self.parts * n, self.in_features, dtype=torch.float32, device=self.qweight.device)
        for i in range(e):
            codes = triton_layout.unpack_chunks(self.qweight[i], self.bits).float()  # [Kp, parts * part_cols]
            z = self.sym_zero if self.zeros is None else self.zeros[i].float()[block]
            w = (codes - z) * self.scales[i].float()[block]
            for p in range(self.parts):
                wp = w[:, p * self.part_cols:p * self.part_cols + n]
                src = torch.arange(kp, device=w.device) if self.perm is None else self.perm[i, p].long()
                keep = (src >= 0) & (src < self.in_features)
                out[i, p * n:(p + 1) * n].index_copy_(1, src[keep], wp[keep].t())
        return out


@dataclass
class MoeFp8Weight:
    """Stacked e4m3 expert weights: W[e, n, k] = float(weight[e, n, k]) * scale[e, row_block[n], col_block[k]].

    One scale column (C == 1: per-tensor, per-channel, per-tensor parts) is applied once per
    output column after the K loop; a block grid (C > 1) scales each weight tile in the loop.
    """

    weight: torch.Tensor  # float8_e4m3fn [E, N, K]
    scale: torch.Tensor  # float32 [E, R, C]
    row_block: torch.Tensor  # int32 [N], values in [0, R)
    col_block: torch.Tensor  # int32 [K], values in [0, C)

    def __post_init__(self) -> None:
        if self.weight.dtype != FP8_DTYPE or self.weight.dim() != 3:
            raise ValueError(f"weight must be 3-D float8_e4m3fn, got {self.weight.dtype} {list(self.weight.shape)}")
        e, n, k = self.weight.shape
        if self.scale.dtype != torch.float32 or self.scale.dim() != 3 or self.scale.shape[0] != e:
            raise ValueError(f"scale must be float32 [{e}, R, C], got {self.scale.dtype} {list(self.scale.shape)}")
        if self.row_block.shape != (n,) or self.col_block.shape != (k,):
            raise ValueError(f"row_block must be [{n}] and col_block [{k}]")

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    @property
    def grid(self) -> bool:
        return self.scale.shape[2] > 1

    @classmethod
    def from_tensors(cls, weight: torch.Tensor, channel_scale: torch.Tensor | None = None,
                     tensor_scale: torch.Tensor | None = None) -> MoeFp8Weight:
        """weight e4m3 [E, N, K]; channel_scale [E, N] (or [E, N, 1]); tensor_scale [E] (or a scalar)."""
        e, n, k = weight.shape
        dev = weight.device
        scale = torch.ones(e, n, dtype=torch.float32, device=dev)
        if channel_scale is not None:
            scale = scale * channel_scale.float().reshape(e, n)
        if tensor_scale is not None:
            scale = scale * tensor_scale.float().reshape(-1, 1).expand(e, 1)
        return cls(weight.contiguous(), scale.reshape(e, n, 1).contiguous(),
                   torch.arange(n, dtype=torch.int32, device=dev), torch.zeros(k, dtype=torch.int32, device=dev))

    @classmethod
    def from_fp8_weights(cls, experts: Sequence[Fp8Weight | Sequence[Fp8Weight]]) -> MoeFp8Weight:
        """Stacks per-expert canonical `Fp8Weight`s; an entry may be parts (gate, up) stacked along N.

        Every expert must use the same scale layout (row_block, col_block, grid shape): the
        kernel reads one layout for all of them.
        """
        stacked = []
        for e, entry in enumerate(experts):
            parts = [entry] if isinstance(entry, Fp8Weight) else list(entry)
            if any(not torch.equal(p.col_block, parts[0].col_block) or p.scale.shape[1] != parts[0].scale.shape[1]
                   for p in parts):
                raise ValueError(f"expert {e}: parts must share their input-column scale blocks to stack along N")
            offsets = [0]
            for p in parts[:-1]:
                offsets.append(offsets[-1] + p.scale.shape[0])
            stacked.append((torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]),
                            torch.cat([p.row_block + o for p, o in zip(parts, offsets)]), parts[0].col_block))
        _, s0, rb0, cb0 = stacked[0]
        for e, (_, s, rb, cb) in enumerate(stacked):
            if s.shape != s0.shape or not torch.equal(rb, rb0) or not torch.equal(cb, cb0):
                raise ValueError(f"expert {e} has another fp8 scale layout than expert 0 (grid {list(s.shape)} vs "
                                 f"{list(s0.shape)}): the fused MoE kernel reads one layout for every expert")
        return cls(torch.stack([w for w, _, _, _ in stacked]).contiguous(),
                   torch.stack([s for _, s, _, _ in stacked]).contiguous(),
                   rb0.to(torch.int32).contiguous(), cb0.to(torch.int32).contiguous())

    def dequantize(self) -> torch.Tensor:
        """Dense float32 [E, N, K]: the ground truth for this form."""
        s = self.scale[:, self.row_block.long()][:, :, self.col_block.long()]
        return self.weight.float() * s


# -- reference ---------------------------------------------------------------------------------

def moe_activation(gate: torch.Tensor, up: torch.Tensor, activation: str, alpha: float = 1.702,
                   limit: float = 7.0) -> torch.Tensor:
    """act(gate) * up for each of ACTIVATIONS; swiglu_oai is gpt-oss's clamped GLU (transformers'
    GptOssExperts: gate clamped above at limit, up to [-limit, limit], (up + 1) * g * sigmoid(alpha g))."""
    if activation == "silu":
        return torch.nn.functional.silu(gate) * up
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(gate, approximate="tanh") * up
    if activation == "gelu":
        return torch.nn.functional.gelu(gate) * up
    if activation == "swiglu_oai":
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
        return (up + 1) * gate * torch.sigmoid(gate * alpha)
    raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")


def moe_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                  activation: str = "silu", alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """The dense ground truth in float32, looping over the experts in use (x.dtype out).

    x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk [T, k]. It syncs with the host (which experts
    are in use), so it is the tests' reference and a fallback, not a CUDA-graph path.
    """
    t, h = x.shape
    inter = w13.shape[1] // 2
    flat_e = topk_ids.reshape(-1).long()
    flat_t = torch.arange(t, device=x.device).repeat_interleave(topk_ids.shape[1])
    flat_w = topk_weights.reshape(-1).float()
    xf = x.float()
    y = torch.zeros(t, h, dtype=torch.float32, device=x.device)
    for e in torch.unique(flat_e).tolist():
        sel = torch.nonzero(flat_e == e).squeeze(1)
        tok = flat_t[sel]
        gu = xf[tok] @ w13[e].float().t()
        if b13 is not None:
            gu = gu + b13[e].float()
        o = moe_activation(gu[:, :inter], gu[:, inter:], activation, alpha, limit) @ w2[e].float().t()
        if b2 is not None:
            o = o + b2[e].float()
        y.index_add_(0, tok, o * flat_w[sel, None])
    return y.to(x.dtype)


# -- Triton kernels ----------------------------------------------------------------------------

def _define_kernels() -> SimpleNamespace:
    # One kernel without @jit helpers: the interpreter re-executes a kernel's source against the
    # module's globals, so helpers defined here would not resolve there, and module-level ones
    # would be fixed to the interpreter mode of import time. The gate and up accumulators share
    # one K loop, so each input tile is loaded once for both.
    @triton.jit
    def moe_gemm(a_ptr, ids_ptr, blk_e_ptr, total_ptr, route_ptr, w_ptr, s_ptr, z_ptr, p_ptr, rb_ptr, cb_ptr,
                 bias_ptr, out_ptr, num_rows, N, K, up_off, chunks, alpha, limit,
                 stride_am, stride_om, stride_we, stride_wn, stride_wk, stride_se, stride_sr, stride_pe, stride_pp,
                 stride_be,
                 A_DIV: tl.constexpr, GATED: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ROUTE: tl.constexpr, FMT: tl.constexpr, BITS: tl.constexpr, GS: tl.constexpr,
                 SYM_ZERO: tl.constexpr, HAS_ZEROS: tl.constexpr, GATHER: tl.constexpr, GRID: tl.constexpr,
                 DOT_F32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # Program (block, column tile): rows ids = sorted_ids[block], all of expert e; input row
        # id // A_DIV (x: the token; the intermediate: the row itself);
        # out[ids, tile] = [route *] [act](rows @ W_e^T [+ b_e]), gated: act(gate) * up.
        # FMT 0: dense [E, N, K]; 1: triton_gemm's packed integer layout; 2: e4m3 bytes [E, N, K].
        PACK: tl.constexpr = 32 // BITS
        R: tl.constexpr = 128 * BITS // 32
        MASK: tl.constexpr = (1 << BITS) - 1
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        if pid_m * BM >= tl.load(total_ptr):
            return  # pure padding past the rows in use
        e = tl.load(blk_e_ptr + pid_m).to(tl.int64)
        ids = tl.load(ids_ptr + pid_m * BM + tl.arange(0, BM))
        ok = ids < num_rows
        a_rows = a_ptr + (ids // A_DIV).to(tl.int64) * stride_am
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < N
        w_e = w_ptr + e * stride_we
        s_e = s_ptr + e * stride_se
        acc = tl.full((BM, BN), 0.0, tl.float32)
        up = tl.full((BM, BN), 0.0, tl.float32)
        if FMT == 1:
            # 128-row chunks; field i of word row r holds stored row i*R + r; stored row j reads
            # input column perm[part, j] (GATHER) or j, and scale row j // GS. Parts sit at
            # column offsets 0 and up_off; N pads to 128, so the weight loads need no mask.
            z_e = z_ptr + e * stride_se
            p_e = p_ptr + e * stride_pe
            offs_r = tl.arange(0, R)
            cols_u = offs_n + up_off
            for c in range(chunks):
                word_rows = w_e + (c * R + offs_r)[:, None] * stride_wn
                words = tl.load(word_rows + offs_n[None, :])
                if GATED:
                    words_u = tl.load(word_rows + cols_u[None, :])
                for i in tl.static_range(PACK):
                    rows = c * 128 + i * R + offs_r
                    if GATHER:
                        src = tl.load(p_e + rows)
                        a = tl.load(a_rows[:, None] + src[None, :], mask=ok[:, None] & (src >= 0)[None, :],
                                    other=0.0)
                    else:
                        a = tl.load(a_rows[:, None] + rows[None, :], mask=ok[:, None] & (rows < K)[None, :],
                                    other=0.0)
                    if DOT_F32:
                        a = a.to(tl.float32)
                    if GS % R == 0:  # one scale row for the whole field block
                        g_off = ((c * 128 + i * R) // GS) * stride_sr
                    else:
                        g_off = (rows // GS)[:, None] * stride_sr
                    q = ((words >> (i * BITS)) & MASK).to(tl.float32)
                    s = tl.load(s_e + g_off + offs_n[None, :]).to(tl.float32)
                    if HAS_ZEROS:
                        z = tl.load(z_e + g_off + offs_n[None, :]).to(tl.float32)
                    else:
                        z = SYM_ZERO
                    w = (q - z) * s
                    if DOT_F32:
                        acc += tl.dot(a, w, input_precision="ieee")
                    else:
                        acc += tl.dot(a, w.to(a.dtype))
                    if GATED:
                        if GATHER:  # gate and up were quantized apart: each has its own act-order
                            src = tl.load(p_e + stride_pp + rows)
                            a = tl.load(a_rows[:, None] + src[None, :], mask=ok[:, None] & (src >= 0)[None, :],
                                        other=0.0)
                            if DOT_F32:
                                a = a.to(tl.float32)
                        q = ((words_u >> (i * BITS)) & MASK).to(tl.float32)
                        s = tl.load(s_e + g_off + cols_u[None, :]).to(tl.float32)
                        if HAS_ZEROS:
                            z = tl.load(z_e + g_off + cols_u[None, :]).to(tl.float32)
                        else:
                            z = SYM_ZERO
                        w = (q - z) * s
                        if DOT_F32:
                            up += tl.dot(a, w, input_precision="ieee")
                        else:
                            up += tl.dot(a, w.to(a.dtype))
        else:
            # Dense or e4m3 rows [E, N, K]; the up rows start at up_off. An e4m3 byte s.eeee.mmm
            # read as fp16 bits s.0eeee.mmm0000000 is the same value times 2^-8, exactly
            # (subnormals included): integer ops only, so sm80 and the interpreter run it too.
            offs_k = tl.arange(0, BK)
            rb = tl.load(rb_ptr + offs_n, mask=n_ok, other=0)
            rb_u = rb
            if FMT == 2 and GATED:
                rb_u = tl.load(rb_ptr + up_off + offs_n, mask=n_ok, other=0)
            for k0 in range(0, K, BK):
                kk = k0 + offs_k
                k_ok = kk < K
                a = tl.load(a_rows[:, None] + kk[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
                if DOT_F32:
                    a = a.to(tl.float32)
                w_ptrs = w_e + offs_n[None, :] * stride_wn + kk[:, None] * stride_wk
                w_ok = k_ok[:, None] & n_ok[None, :]
                if FMT == 2:
                    b = tl.load(w_ptrs, mask=w_ok, other=0).to(tl.int32)
                    w = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
                    if GRID:
                        cb = tl.load(cb_ptr + kk, mask=k_ok, other=0)
                        s = tl.load(s_e + rb[None, :] * stride_sr + cb[:, None], mask=w_ok, other=0.0)
                        w = w.to(tl.float32) * (s * 256.0)
                else:
                    w = tl.load(w_ptrs, mask=w_ok, other=0.0)
                if DOT_F32:
                    acc += tl.dot(a, w.to(tl.float32), input_precision="ieee")
                else:
                    acc += tl.dot(a, w.to(a.dtype))
                if GATED:
                    if FMT == 2:
                        b = tl.load(w_ptrs + up_off * stride_wn, mask=w_ok, other=0).to(tl.int32)
                        w = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
                        if GRID:
                            s = tl.load(s_e + rb_u[None, :] * stride_sr + cb[:, None], mask=w_ok, other=0.0)
                            w = w.to(tl.float32) * (s * 256.0)
                    else:
                        w = tl.load(w_ptrs + up_off * stride_wn, mask=w_ok, other=0.0)
                    if DOT_F32:
                        up += tl.dot(a, w.to(tl.float32), input_precision="ieee")
                    else:
                        up += tl.dot(a, w.to(a.dtype))
            if FMT == 2 and not GRID:  # one scale per output row: it factors out of the K sum
                acc = acc * (tl.load(s_e + rb * stride_sr, mask=n_ok, other=0.0) * 256.0)[None, :]
                if GATED:
                    up = up * (tl.load(s_e + rb_u * stride_sr, mask=n_ok, other=0.0) * 256.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + e * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                up += tl.load(bias_ptr + e * stride_be + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:  # exp-based: tl.sigmoid is a @jit function, which the interpreter cannot call here
            if ACT == 0:  # silu
                acc = acc / (1.0 + tl.exp(-acc)) * up
            elif ACT == 1:  # gelu, tanh approximation: 0.5 g (1 + tanh(z)) = g sigmoid(2z)
                zt = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
                acc = acc / (1.0 + tl.exp(-2.0 * zt)) * up
            elif ACT == 2:  # gelu, erf
                acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476)) * up
            else:  # swiglu_oai
                g = tl.minimum(acc, limit)
                u = tl.minimum(tl.maximum(up, -limit), limit)
                acc = (u + 1.0) * g / (1.0 + tl.exp(-alpha * g))
        if ROUTE:  # the routing weight scales the whole expert output, bias included
            acc = acc * tl.load(route_ptr + ids, mask=ok, other=0.0)[:, None]
        tl.store(out_ptr + ids.to(tl.int64)[:, None] * stride_om + offs_n[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])

    return SimpleNamespace(moe_gemm=moe_gemm)


_kernels = LazyKernels(_define_kernels)


def _dims(w: MoeWeight) -> tuple[int, int, int]:
    """(experts, output rows over all parts, input features) of one projection."""
    if isinstance(w, MoeGemmWeight):
        return w.num_experts, w.parts * w.out_features, w.in_features
    if isinstance(w, MoeFp8Weight):
        return tuple(w.weight.shape)  # type: ignore[return-value]
    if isinstance(w, torch.Tensor) and w.dim() == 3:
        return tuple(w.shape)  # type: ignore[return-value]
    raise ValueError(f"expert weights must be a dense [E, N, K] tensor, MoeGemmWeight or MoeFp8Weight, got {type(w)}")


def _launch(a: torch.Tensor, a_div: int, align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], block_m: int,
            w: MoeWeight, bias: torch.Tensor | None, out: torch.Tensor, n: int, gated: bool,
            route: torch.Tensor | None, act: int, alpha: float, limit: float) -> None:
    """One grouped GEMM: out[rows, :n] for every (token, slot) row, from input rows a[row // a_div]."""
    sorted_ids, block_experts, total = align
    k = a.shape[1]
    dummy = out
    dot_f32 = a.dtype == torch.float32 or (a.dtype == torch.bfloat16 and interpreting())
    common = {"A_DIV": a_div, "GATED": gated, "ACT": act, "HAS_BIAS": bias is not None,
              "ROUTE": route is not None, "DOT_F32": dot_f32, "BM": block_m, "BN": BLOCK_N, "num_warps": 4}
    if isinstance(w, MoeGemmWeight):
        fmt, w_ptr, s_ptr = 1, w.qweight, w.scales
        z_ptr, p_ptr = (dummy if w.zeros is None else w.zeros), (dummy if w.perm is None else w.perm)
        up_off, chunks, bk = w.part_cols, w.padded_in // tg.CHUNK, 128
        strides = (w.qweight.stride(0), w.qweight.stride(1), 0, w.scales.stride(0), w.scales.stride(1),
                   0 if w.perm is None else w.perm.stride(0), 0 if w.perm is None else w.perm.stride(1))
        extra = {"BITS": w.bits, "GS": w.group_rows, "SYM_ZERO": w.sym_zero, "HAS_ZEROS": w.zeros is not None,
                 "GATHER": w.perm is not None, "GRID": False}
        rb = cb = dummy
    else:
        fp8 = isinstance(w, MoeFp8Weight)
        wt = w.weight.view(torch.uint8) if fp8 else w
        fmt, w_ptr, up_off, chunks = (2 if fp8 else 0), wt, n, 0
        bk = 64 if a.dtype.itemsize <= 2 else 32
        s_ptr = w.scale if fp8 else dummy
        rb, cb = (w.row_block, w.col_block) if fp8 else (dummy, dummy)
        strides = (wt.stride(0), wt.stride(1), wt.stride(2), s_ptr.stride(0) if fp8 else 0,
                   s_ptr.stride(1) if fp8 else 0, 0, 0)
        extra = {"BITS": 4, "GS": 128, "SYM_ZERO": 0, "HAS_ZEROS": False, "GATHER": False, "GRID": fp8 and w.grid}
        z_ptr = p_ptr = dummy
    grid = (block_experts.shape[0], tg._cdiv(n, BLOCK_N))
    _kernels().moe_gemm[grid](
        a, sorted_ids, block_experts, total, dummy if route is None else route, w_ptr, s_ptr, z_ptr, p_ptr, rb, cb,
        dummy if bias is None else bias, out, out.shape[0], n, k, up_off, chunks, alpha, limit,
        a.stride(0), out.stride(0), strides[0], strides[1], strides[2], strides[3], strides[4], strides[5],
        strides[6], 0 if bias is None else bias.stride(0), FMT=fmt, BK=bk, **common, **extra,
    )


def _check(x: torch.Tensor, w13: MoeWeight, w2: MoeWeight, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
           b13: torch.Tensor | None, b2: torch.Tensor | None, activation: str) -> tuple[int, int, int]:
    """Validates shapes, dtypes and devices; returns (E, H, I)."""
    if x.dim() != 2 or x.dtype not in _ACT_DTYPES:
        raise ValueError(f"x must be [T, H] float16/bfloat16/float32, got {x.dtype} {list(x.shape)}")
    t, h = x.shape
    e, two_i, h13 = _dims(w13)
    e2, h2, i2 = _dims(w2)
    inter = two_i // 2
    if h13 != h or e2 != e or h2 != h or i2 != inter or two_i != 2 * inter:
        raise ValueError(f"w13 must be [E, 2I, {h}] and w2 [E, {h}, I], got {[e, two_i, h13]} and {[e2, h2, i2]}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t or topk_ids.dtype.is_floating_point:
        raise ValueError(f"topk_ids must be integer [{t}, k], got {topk_ids.dtype} {list(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32 {list(topk_ids.shape)}, got {topk_weights.dtype} "
                         f"{list(topk_weights.shape)}")
    for name, b, shape in (("b13", b13, (e, two_i)), ("b2", b2, (e, h))):
        if b is not None and (tuple(b.shape) != shape or b.stride(1) != 1):
            raise ValueError(f"{name} must be {list(shape)} with unit column stride, got {list(b.shape)}")
    for name, w in (("w13", w13), ("w2", w2)):
        if isinstance(w, torch.Tensor) and (w.dtype != x.dtype or w.stride(2) != 1):
            raise ValueError(f"dense {name} must be {x.dtype} with unit stride along K, got {w.dtype} {w.stride()}")
        if isinstance(w, MoeGemmWeight) and (w.scales.dtype != x.dtype or w.parts != (2 if name == "w13" else 1)):
            raise ValueError(f"packed {name} must be built for {x.dtype} with {2 if name == 'w13' else 1} part(s), "
                             f"got {w.scales.dtype} with {w.parts}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    devices = {x.device, topk_ids.device, topk_weights.device} | {b.device for b in (b13, b2) if b is not None}
    devices |= {(w.weight if isinstance(w, MoeFp8Weight) else w.qweight if isinstance(w, MoeGemmWeight) else w).device
                for w in (w13, w2)}
    if len(devices) != 1:
        raise ValueError(f"every tensor must be on one device, got {sorted(map(str, devices))}")
    return e, h, inter


# -- scratch -----------------------------------------------------------------------------------

def fused_moe_scratch_bytes(max_tokens: int, topk: int, num_experts: int, block_m: int, hidden: int,
                            intermediate: int, dtype: torch.dtype) -> dict[str, int]:
    """Scratch of one fused_moe call over `max_tokens` tokens at `block_m`, per buffer name.

    No [T*k, 2I] buffer: the activation is fused into the gate_up launch (module docstring).
    """
    rows = max_tokens * topk
    cap = max_padded_rows(max_tokens, topk, num_experts, block_m)
    return {
        "moe_sorted_ids": cap * 4,  # int32
        "moe_block_experts": cap // block_m * 4,  # int32
        "moe_intermediate": rows * intermediate * dtype.itemsize,  # act(g) * u: [T*k, I]
        "moe_expert_out": rows * hidden * dtype.itemsize,  # routed expert outputs: [T*k, H]
    }


def _scratch_upto(max_tokens: int, topk: int, num_experts: int, hidden: int, intermediate: int,
                  dtype: torch.dtype) -> dict[str, int]:
    """Largest need over every token count <= max_tokens: block_m grows with T, so each block
    size is checked at the largest T that uses it (the block count need not grow with T)."""
    candidates = {max_tokens}
    for bm in BLOCK_MS:
        candidates.add(min(max_tokens, max(1, _max_tokens_for(bm, topk, num_experts))))
    needs: dict[str, int] = {}
    for t in candidates:
        for name, nbytes in fused_moe_scratch_bytes(t, topk, num_experts, block_m_for(t, topk, num_experts), hidden,
                                                    intermediate, dtype).items():
            needs[name] = max(needs.get(name, 0), nbytes)
    return needs


def _buffers(scratch: ScratchSpace | None, device: torch.device, t: int, topk: int, num_experts: int, block_m: int,
             hidden: int, inter: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """(sorted ids, block experts, intermediate, expert outputs): from the scratch space once
    warmup has sized it, else freshly allocated (tests, calls before warmup)."""
    cap = max_padded_rows(t, topk, num_experts, block_m)
    shapes = ((torch.int32, (cap,)), (torch.int32, (cap // block_m,)), (dtype, (t * topk, inter)),
              (dtype, (t * topk, hidden)))
    if scratch is None or not scratch.frozen:
        return tuple(torch.empty(shape, dtype=dt, device=device) for dt, shape in shapes)
    names = ("moe_sorted_ids", "moe_block_experts", "moe_intermediate", "moe_expert_out")
    return tuple(typed_view(scratch.get(name, device, math.prod(shape) * dt.itemsize), dt, shape)
                 for name, (dt, shape) in zip(names, shapes))


# -- the op ------------------------------------------------------------------------------------

def fused_moe(x: torch.Tensor, w13: MoeWeight, w2: MoeWeight, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, activation: str = "silu",
              alpha: float = 1.702, limit: float = 7.0, scratch: ScratchSpace | None = None,
              block_m: int | None = None) -> torch.Tensor:
    """y [T, H] = sum over slots of topk_weights * expert(x) (module docstring), in two launches.

    x [T, H]; w13 [E, 2I, H] / w2 [E, H, I] dense in x.dtype, MoeGemmWeight or MoeFp8Weight;
    topk_ids [T, k] in [0, E); topk_weights [T, k] float32, final (softmaxed, renormalised);
    b13 [E, 2I], b2 [E, H]. `scratch`: where the buffers come from once warmup froze it.
    """
    num_experts, hidden, inter = _check(x, w13, w2, topk_weights, topk_ids, b13, b2, activation)
    t, topk = topk_ids.shape
    if t == 0:
        return x.new_zeros(0, hidden)
    if x.stride(1) != 1:
        x = x.contiguous()
    block_m = block_m_for(t, topk, num_experts) if block_m is None else block_m
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    ids_buf, blk_buf, mid, expert_out = _buffers(scratch, x.device, t, topk, num_experts, block_m, hidden, inter,
                                                 x.dtype)
    align = moe_align(topk_ids, num_experts, block_m, out=(ids_buf, blk_buf))
    act = ACTIVATIONS.index(activation)
    _launch(x, topk, align, block_m, w13, b13, mid, inter, True, None, act, alpha, limit)
    _launch(mid, 1, align, block_m, w2, b2, expert_out, hidden, False, topk_weights.reshape(-1).contiguous(), act,
            alpha, limit)
    return expert_out.view(t, topk, hidden).sum(dim=1)


class FusedMoe(torch.nn.Module):
    """One MoE layer's use of fused_moe: registers its scratch with the planner so warmup counts
    it, and runs the op with buffers from there. Holds no weights (the layer owns them).

    The buffers are shared by every layer (the planner keeps the largest need per name): layers
    run one at a time, and each call's outputs leave the scratch before it returns.
    """

    kernel_name = "fused-moe"

    def __init__(self, num_experts: int, topk: int, hidden: int, intermediate: int, dtype: torch.dtype,
                 device: torch.device | str, activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                 scratch: ScratchSpace | None = None):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
        self.num_experts, self.topk, self.hidden, self.intermediate = num_experts, topk, hidden, intermediate
        self.dtype = dtype
        self.activation, self.alpha, self.limit = activation, alpha, limit
        self.scratch_device = torch.device(device)
        self.scratch = SCRATCH if scratch is None else scratch
        self.scratch.register(self)

    def scratch_needs(self, max_tokens: int, max_input_tokens: int) -> dict[str, int]:
        return _scratch_upto(max_tokens, self.topk, self.num_experts, self.hidden, self.intermediate, self.dtype)

    def prepare_scratch(self, max_tokens: int, max_input_tokens: int) -> int:
        """Sizes the shared scratch (the first call does it for every registered user)."""
        allocated = self.scratch.prepare(max_tokens, max_input_tokens)
        if allocated:
            logger.debug("fused-moe scratch for {} tokens x top-{}: {}", max_tokens, self.topk,
                         self.scratch_needs(max_tokens, max_input_tokens))
        return allocated

    def forward(self, x: torch.Tensor, w13: MoeWeight, w2: MoeWeight, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, b13: torch.Tensor | None = None,
                b2: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, H] -> [T, H]
        return fused_moe(x, w13, w2, topk_weights, topk_ids, b13, b2, self.activation, self.alpha, self.limit,
                         scratch=self.scratch)
