"""Expert-weight bytes the fused MoE kernel reads per decode step, against the active experts' size.

The point of kernels/fused_moe.py is that a step reads only the experts its tokens picked. Three
tables:

1. From the alignment, on real layer shapes: every non-padding block of sorted rows reads its
   expert's whole weight (all column tiles together) once per launch, so the kernel reads
   sum_e ceil(rows_e / block_m) x expert bytes; the active experts hold sum over picked e of
   expert bytes, all experts E x that. read/active is 1.00x while each expert gets at most
   block_m rows (decode); above that, repeat reads of an expert's tiles by its several blocks
   are an upper bound on DRAM traffic (L2 serves some). Routing: k distinct experts per token,
   uniform at random, averaged over --draws draws.
2. Counted in Triton's interpreter (CPU) on a scaled-down layer: every load the kernel issues is
   recorded, and the distinct bytes it touched in each expert's weights (codes, scales, zero
   points, act-order permutation) are compared with the picked experts' stored bytes; the bytes
   touched in experts nobody picked must be 0.
3. On CUDA only: median time of fused_moe (bf16 dense, int4 g128 act-order-free, fp8
   per-channel) against moe_reference (bf16, a loop over the active experts), L2 flushed
   before each call, and the bandwidth the fused op reaches on the bytes of table 1.

    python benchmarks/moe_triton_bytes.py              # tables 1-2 (3 too on a GPU)
    python benchmarks/moe_triton_bytes.py --no-count   # skip the interpreter count
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from dataclasses import dataclass

import torch
from bench_common import (  # benchmarks/ is on sys.path here
    command_line,
    machine_line,
    md_table,
    now_iso,
    ratio,
)

SHAPES = {  # name: (experts, top-k, hidden, intermediate per expert)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "gpt-oss-20b": (32, 4, 2880, 2880),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
BATCHES = [1, 4, 16, 64]
FORMATS = ("bf16", "int4-g128", "fp8-channel")
MIB = 2**20


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expert_bytes(fmt: str, hidden: int, inter: int) -> int:
    """Stored bytes of one expert's w13 and w2 in the layout the kernel reads."""
    if fmt == "bf16":
        return 3 * hidden * inter * 2
    if fmt == "fp8-channel":
        return 3 * hidden * inter + (2 * inter + hidden) * 4
    # int4 g128, asymmetric: codes at 4 bits, K and each part's N padded to 128 (triton_gemm),
    # fp16 scales and zero points per 128 rows.
    def proj(k: int, n: int, parts: int) -> int:
        kp, cols = _cdiv(k, 128) * 128, parts * _cdiv(n, 128) * 128
        return kp * cols // 2 + 2 * (kp // 128) * cols * 2
    return proj(hidden, inter, 2) + proj(inter, hidden, 1)


def random_routing(tokens: int, topk: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """topk_ids [T, k]: k distinct experts per token, uniform at random."""
    return torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :topk].to(torch.int32)


@dataclass
class Accounting:
    active: float  # experts picked (mean over draws)
    blocks: float  # non-padding blocks launched
    padding: float  # share of launched rows that are padding


def account(fm, tokens: int, topk: int, experts: int, draws: int, seed: int = 0) -> Accounting:
    gen = torch.Generator().manual_seed(seed)
    active, blocks, padding = [], [], []
    for _ in range(draws):
        ids = random_routing(tokens, topk, experts, gen)
        bm = fm.block_m_for(tokens, topk, experts)
        _, block_experts, total = fm.moe_align(ids, experts, bm)
        active.append(len(torch.unique(ids)))
        blocks.append(int(total) // bm)
        padding.append(1 - tokens * topk / int(total))
        assert int((block_experts[: int(total) // bm] >= 0).sum()) == int(total) // bm
    return Accounting(statistics.mean(active), statistics.mean(blocks), statistics.mean(padding))


def table_alignment(fm, draws: int) -> list[str]:
    rows = []
    for name, (e, k, h, i) in SHAPES.items():
        for t in BATCHES:
            acc = account(fm, t, k, e, draws)
            for fmt in FORMATS:
                per = expert_bytes(fmt, h, i)
                read, active, every = acc.blocks * per, acc.active * per, e * per
                rows.append([name, fmt, t, f"{acc.active:.1f}", f"{acc.blocks:.1f}", f"{100 * acc.padding:.0f}%",
                             f"{read / MIB:.1f}", f"{active / MIB:.1f}", f"{every / MIB:.0f}",
                             ratio(read, active), ratio(read, every)])
    header = ["layer (E, k)", "weights", "batch", "active experts", "blocks", "padded rows", "read MiB",
              "active MiB", "all experts MiB", "read/active", "read/all"]
    return md_table(header, rows, "llrrrrrrrrr")


# -- counted in the interpreter ----------------------------------------------------------------

def _expert_tensors(w) -> list[torch.Tensor]:
    """The per-expert tensors ([E, ...]) of a dense tensor, MoeGemmWeight or MoeFp8Weight."""
    if isinstance(w, torch.Tensor):
        return [w]
    if hasattr(w, "qweight"):
        return [t for t in (w.qweight, w.scales, w.zeros, w.perm) if t is not None]
    return [w.weight, w.scale]


def count_touched(fm, x, w13, w2, weights, ids) -> tuple[dict[int, int], dict[int, int]]:
    """Runs fused_moe in the interpreter, recording every load; returns distinct bytes touched
    per expert and stored bytes per expert, over every per-expert tensor of w13 and w2."""
    import numpy as np
    from triton.runtime import interpreter

    tensors = _expert_tensors(w13) + _expert_tensors(w2)
    seen: list[np.ndarray] = []
    original = interpreter.InterpreterBuilder.create_masked_load

    def recording(self, ptrs, mask, other, cache_policy, is_volatile):
        addrs = ptrs.data[mask.data].astype(np.int64)
        size = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        seen.append((addrs[:, None] + np.arange(size)[None, :]).reshape(-1))
        return original(self, ptrs, mask, other, cache_policy, is_volatile)

    interpreter.InterpreterBuilder.create_masked_load = recording
    try:
        fm.fused_moe(x, w13, w2, weights, ids)
    finally:
        interpreter.InterpreterBuilder.create_masked_load = original
    touched_addrs = np.unique(np.concatenate(seen))
    experts = tensors[0].shape[0]
    touched = {e: 0 for e in range(experts)}
    stored = {e: 0 for e in range(experts)}
    for t in tensors:
        per = t[0].numel() * t.element_size()
        base = t.data_ptr()
        for e in range(experts):
            lo = base + e * t.stride(0) * t.element_size()
            stored[e] += per
            touched[e] += int(np.searchsorted(touched_addrs, lo + per) - np.searchsorted(touched_addrs, lo))
    return touched, stored


def table_counted(fm) -> list[str]:
    from text_generation_server.kernels.base import QuantizedWeight

    os.environ["TRITON_INTERPRET"] = "1"
    e, k, h, i = 16, 4, 256, 128
    gen = torch.Generator().manual_seed(0)
    dense13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).half()
    dense2 = (torch.randn(e, h, i, generator=gen) / i**0.5).half()

    def q(kk: int, n: int) -> QuantizedWeight:
        return QuantizedWeight(torch.randint(0, 16, (kk, n), generator=gen).to(torch.uint8),
                               torch.rand(kk // 128, n, generator=gen) / 16, torch.full((kk // 128, n), 8.0),
                               torch.arange(kk, dtype=torch.int32) // 128, 4, 128)

    fp8 = lambda t: t.to(torch.float8_e4m3fn)
    weights_by_fmt = {
        "fp16": (dense13, dense2),
        "int4-g128": (fm.MoeGemmWeight.from_quantized([(q(h, i), q(h, i)) for _ in range(e)], torch.float16),
                      fm.MoeGemmWeight.from_quantized([q(i, h) for _ in range(e)], torch.float16)),
        "fp8-channel": (fm.MoeFp8Weight.from_tensors(fp8(dense13.float() * 16), torch.full((e, 2 * i), 1 / 16)),
                        fm.MoeFp8Weight.from_tensors(fp8(dense2.float() * 16), torch.full((e, h), 1 / 16))),
    }
    rows = []
    for t in (1, 8):
        ids = random_routing(t, k, e, gen)
        weights = torch.rand(t, k, generator=gen)
        x = torch.randn(t, h, generator=gen).half()
        picked = set(ids.reshape(-1).tolist())
        for fmt, (w13, w2) in weights_by_fmt.items():
            touched, stored = count_touched(fm, x, w13, w2, weights, ids)
            active = sum(stored[x_] for x_ in picked)
            read = sum(touched[x_] for x_ in picked)
            idle = sum(touched[x_] for x_ in range(e) if x_ not in picked)
            rows.append([fmt, t, len(picked), f"{read / 1024:.1f}", f"{active / 1024:.1f}", ratio(read, active),
                         idle])
    header = ["weights", "batch", "active experts", "touched KiB", "active KiB", "touched/active",
              "bytes touched in unpicked experts"]
    lines = [f"Scaled-down layer E={e}, k={k}, H={h}, I={i}, float16 activations, interpreter:", ""]
    return lines + md_table(header, rows, "lrrrrrr")


# -- CUDA timing -------------------------------------------------------------------------------

def _timed(fn, flush: torch.Tensor, iters: int) -> float:
    """Median seconds of fn() over `iters` calls, L2 flushed before each (weights come from HBM)."""
    fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _cuda_forms(fm, e: int, h: int, i: int) -> dict[str, tuple]:
    """(w13, w2) of one random layer on the GPU in each format, bf16 activations."""
    from text_generation_server.kernels.base import QuantizedWeight

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device=dev, generator=gen) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device=dev, generator=gen) / i**0.5).bfloat16()

    def q(kk: int, n: int) -> QuantizedWeight:
        groups = _cdiv(kk, 128)
        return QuantizedWeight(torch.randint(0, 16, (kk, n), device=dev, generator=gen).to(torch.uint8),
                               torch.rand(groups, n, device=dev, generator=gen) / 16,
                               torch.full((groups, n), 8.0, device=dev),
                               torch.arange(kk, dtype=torch.int32, device=dev) // 128, 4, 128)

    def fp8(w: torch.Tensor, n: int) -> object:
        return fm.MoeFp8Weight.from_tensors(w.float().mul(16).to(torch.float8_e4m3fn),
                                            torch.full((e, n), 1 / 16, device=dev))

    return {
        "bf16": (w13, w2),
        "int4-g128": (fm.MoeGemmWeight.from_quantized([(q(h, i), q(h, i)) for _ in range(e)], torch.bfloat16),
                      fm.MoeGemmWeight.from_quantized([q(i, h) for _ in range(e)], torch.bfloat16)),
        "fp8-channel": (fp8(w13, 2 * i), fp8(w2, h)),
    }


def _cuda_rows(fm, name: str, shape: tuple[int, int, int, int], flush: torch.Tensor, iters: int) -> list[list]:
    e, k, h, i = shape
    forms = _cuda_forms(fm, e, h, i)
    w13, w2 = forms["bf16"]
    rows = []
    for t in BATCHES:
        ids = random_routing(t, k, e, torch.Generator().manual_seed(t)).cuda()
        weights = torch.rand(t, k, device="cuda")
        x = torch.randn(t, h, device="cuda").bfloat16()
        ref_s = _timed(lambda: fm.moe_reference(x, w13, w2, weights, ids), flush, iters)  # noqa: B023
        blocks = account(fm, t, k, e, draws=1, seed=t).blocks  # moe_align is deterministic: same ids on CPU
        for fmt, (a, b) in forms.items():
            s = _timed(lambda: fm.fused_moe(x, a, b, weights, ids), flush, iters)  # noqa: B023
            read = blocks * expert_bytes(fmt, h, i)
            rows.append([name, fmt, t, f"{ref_s * 1e6:.0f}", f"{s * 1e6:.0f}", ratio(ref_s, s),
                         f"{read / s / 1e9:.0f}"])
    return rows


def table_cuda(fm, iters: int) -> list[str]:
    flush = torch.empty(256 * MIB, dtype=torch.uint8, device="cuda")
    rows = []
    for name, shape in SHAPES.items():
        rows += _cuda_rows(fm, name, shape, flush, iters)
        torch.cuda.empty_cache()
    header = ["layer", "weights", "batch", "reference bf16 us", "fused us", "speed-up", "fused GB/s (table 1 bytes)"]
    return md_table(header, rows, "llrrrrr")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=20, help="routing draws averaged per row of table 1")
    parser.add_argument("--no-count", action="store_true", help="skip the interpreter count (table 2)")
    parser.add_argument("--iters", type=int, default=30, help="timed calls per CUDA measurement")
    args = parser.parse_args(argv)
    from text_generation_server.kernels import fused_moe as fm

    reason = fm.machine_reason()
    print(f"# fused MoE: expert bytes read per step\n\n`{command_line(script='benchmarks/moe_triton_bytes.py')}`, "
          f"{now_iso()}\n\n{machine_line(torch.cuda.get_device_name() if not reason else 'no GPU use')}\n")
    print("## 1. From the alignment (real layer shapes, uniform random routing)\n")
    print("\n".join(table_alignment(fm, args.draws)))
    if not args.no_count:
        print("\n## 2. Counted in the interpreter\n")
        print("\n".join(table_counted(fm)))
    if reason:
        print(f"\n## 3. CUDA timing: skipped ({reason})")
    else:
        os.environ.pop("TRITON_INTERPRET", None)
        print("\n## 3. CUDA timing (L2 flushed before each call)\n")
        print("\n".join(table_cuda(fm, args.iters)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
