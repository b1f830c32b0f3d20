"""CUDA quantized-linear kernels against dense fp16 matmul and tinygemm on Llama layer shapes.

For each shape (K in x N out) and batch, prints the median time of:
- fp16 dense: torch.matmul(x, W^T) in float16 (the baseline);
- triton-gemm: the plan the layer picks for that batch (split-K / fused), float16;
- dequant+mm: the large-batch path forced at that batch (dequantize into the shared scratch,
  then cuBLAS), to check LARGE_BATCH_TOKENS against measurements;
- tinygemm: torch._weight_int4pack_mm in bfloat16 (4-bit only);
and triton-gemm's speed-up over fp16 and over tinygemm, and the memory bandwidth it achieves
(weight, scales, input and output bytes over its time) as a share of the device's peak.

Every timed call starts with L2 flushed (a 256 MiB write, outside the timed region), so the
weights stream from HBM as they do in a decode step; --hot keeps them cache-resident.

    python benchmarks/kernels_cuda.py                       # 4 shapes x 8 batches, 4-bit g128
    python benchmarks/kernels_cuda.py --quick               # 4096x4096 at batch 1 and 16
    python benchmarks/kernels_cuda.py --bits 8 --asym --act-order
    python benchmarks/kernels_cuda.py --peak-gbs 3350       # a device not in PEAK_GBS
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import torch

from bench_common import command_line, md_table, ratio  # benchmarks/ is on sys.path here
from text_generation_server.kernels import triton_gemm as tg
from text_generation_server.kernels.base import QuantizedWeight
from text_generation_server.kernels.scratch import SCRATCH
from text_generation_server.kernels.tinygemm import TinyGemmKernel

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]  # (in K, out N)
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128]

# Peak HBM/GDDR bandwidth in GB/s from NVIDIA's product datasheets, matched against
# torch.cuda.get_device_name() lower-cased, first match wins (so "a100" precedes "a10",
# "l40" precedes "l4", "h100 nvl" precedes "h100").
PEAK_GBS = [
    ("b200", 8000),
    ("h200", 4800),
    ("h100 nvl", 3900),
    ("h100 pcie", 2000),
    ("h100", 3350),  # SXM5 80GB HBM3
    ("a100-sxm4-80gb", 2039),
    ("a100 80gb pcie", 1935),
    ("a100", 1555),  # 40GB, SXM4 and PCIe
    ("l40s", 864),
    ("l40", 864),
    ("l4", 300),
    ("a10g", 600),
    ("a10", 600),
    ("a40", 696),
    ("rtx 6000 ada", 960),
    ("rtx a6000", 768),
    ("rtx 4090", 1008),
    ("rtx 3090", 936),
]


def peak_gbs(name: str) -> tuple[float | None, str]:
    low = name.lower()
    for key, gbs in PEAK_GBS:
        if key in low:
            return float(gbs), f"table entry '{key}'"
    return None, "not in the table (pass --peak-gbs)"


def random_weight(k: int, n: int, bits: int, group_size: int, sym: bool, act_order: bool,
                  device: torch.device) -> QuantizedWeight:
    gen = torch.Generator(device=device).manual_seed(k * 31 + n)
    groups = -(-k // group_size)
    q = torch.randint(0, 2**bits, (k, n), dtype=torch.uint8, generator=gen, device=device)
    scales = torch.rand(groups, n, generator=gen, device=device) * 0.01 + 0.001
    zeros = None if sym else torch.randint(0, 2**bits, (groups, n), generator=gen, device=device).float()
    g_idx = torch.arange(k, dtype=torch.int32, device=device) // group_size
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen, device=device)]
    return QuantizedWeight(q, scales, zeros, g_idx, bits, group_size)


def module_bytes(m: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in m.buffers())


class Timer:
    """Median CUDA-event time of fn(); L2 flushed before every call unless hot."""

    def __init__(self, hot: bool, reps: int):
        self.reps = reps
        self.flush = None if hot else torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn) -> float:
        for _ in range(3):
            fn()  # compile, warm the allocator
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for start, end in zip(starts, ends):
            if self.flush is not None:
                self.flush.zero_()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3  # microseconds


def bench_shape(k: int, n: int, batches: list[int], args: argparse.Namespace, timer: Timer,
                tiny_skipped: set[str]) -> list[tuple]:
    """Rows (k, n, m, plan, fp16 us, triton us, dequant+mm us, tinygemm us or None, triton GB/s) for one shape."""
    device = torch.device("cuda")
    w = random_weight(k, n, args.bits, args.group_size or k, not args.asym, args.act_order, device)
    ok, why = tg.TritonGemmKernel.can_implement(w.spec(torch.float16, "cuda"))
    if not ok:
        raise SystemExit(f"triton-gemm cannot run {k}x{n}: {why}")
    triton_mod = tg.TritonGemmKernel.build(w, None, torch.float16)
    ok, tiny_why = TinyGemmKernel.can_implement(w.spec(torch.bfloat16, "cuda"))
    tiny_mod = TinyGemmKernel.build(w, None, torch.bfloat16) if ok else None
    if not ok:
        tiny_skipped.add(f"{k}x{n}: {tiny_why}")
    del w
    dense = (torch.randn(n, k, device=device) * 0.02).half().t()  # x @ W^T with W [N, K], as F.linear
    # Room for every forced path: split-K partials, and the dequant buffer even below the threshold.
    SCRATCH.prepare(max_tokens=max(max(batches), tg.LARGE_BATCH_TOKENS + 1), max_input_tokens=max(batches))
    weight_bytes = module_bytes(triton_mod)
    rows = []
    for m in batches:
        x = torch.randn(m, k, device=device).half()
        xb = x.bfloat16()
        plan = triton_mod.plan(m)
        t_dense = timer(lambda: torch.matmul(x, dense))
        t_triton = timer(lambda: triton_mod.run(x, plan))
        t_dequant = timer(lambda: triton_mod.run(x, tg.Plan("dequant")))
        t_tiny = timer(lambda: tiny_mod(xb)) if tiny_mod is not None else None
        gbs = (weight_bytes + 2 * m * (k + n)) / (t_triton * 1e-6) / 1e9
        rows.append((k, n, m, plan, t_dense, t_triton, t_dequant, t_tiny, gbs))
        print(f"{k}x{n} batch {m}: fp16 {t_dense:.1f} us, triton-gemm {t_triton:.1f} us ({plan.path}"
              f"{f' x{plan.split_k}' if plan.split_k > 1 else ''}), dequant+mm {t_dequant:.1f} us, tinygemm "
              f"{'n/a' if t_tiny is None else f'{t_tiny:.1f} us'}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="KxN list (in x out)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--bits", type=int, default=4, choices=(2, 3, 4, 5, 6, 8))
    ap.add_argument("--group-size", type=int, default=128, help="rows per group; 0 for per-channel")
    ap.add_argument("--asym", action="store_true", help="explicit zero points")
    ap.add_argument("--act-order", action="store_true", help="shuffled g_idx (desc_act)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--hot", action="store_true", help="do not flush L2 between calls")
    ap.add_argument("--peak-gbs", type=float, default=None, help="device peak memory bandwidth in GB/s")
    ap.add_argument("--quick", action="store_true", help="4096x4096, batch 1 and 16")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernels_cuda.py needs a CUDA GPU, and torch.cuda.is_available() is False on this "
              "machine. For the CPU kernels run benchmarks/kernels_cpu.py.", file=sys.stderr)
        return 2
    if tg.triton is None:
        print("benchmarks/kernels_cuda.py needs Triton (pip install 'text-generation-server[triton]').",
              file=sys.stderr)
        return 2
    if args.quick:
        args.shapes, args.batches = "4096x4096", "1,16"
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    name = torch.cuda.get_device_name(0)
    peak, peak_source = (args.peak_gbs, "--peak-gbs") if args.peak_gbs else peak_gbs(name)
    timer = Timer(args.hot, args.reps)
    started = time.time()
    rows = []
    tiny_skipped: set[str] = set()
    with torch.inference_mode():
        for k, n in shapes:
            rows += bench_shape(k, n, batches, args, timer, tiny_skipped)
            SCRATCH.reset()
            torch.cuda.empty_cache()

    print()
    print(f"Command: `{command_line(script='benchmarks/kernels_cuda.py')}`")
    print(f"Device: {name} (peak {'unknown' if peak is None else f'{peak:.0f} GB/s'}, {peak_source}); "
          f"torch {torch.__version__}; triton {tg.triton.__version__}; {datetime.date.today().isoformat()}; "
          f"{args.bits}-bit g{args.group_size or 'K'} {'asym' if args.asym else 'sym'}"
          f"{' act-order' if args.act_order else ''}; L2 {'hot' if args.hot else 'flushed before each call'}; "
          f"median of {args.reps} calls; run took {time.time() - started:.0f} s.")
    for reason in sorted(tiny_skipped):
        print(f"tinygemm not run: {reason}")
    print()
    print("Times in microseconds; speed-up = other time / triton-gemm time (higher is better).")
    print()
    head = ["K x N", "batch", "plan", "fp16 matmul", "triton-gemm", "vs fp16", "dequant+mm", "tinygemm (bf16)",
            "vs tinygemm", "GB/s", "% of peak"]
    cells = [[f"{k} x {n}", str(m), plan.path + (f" x{plan.split_k}" if plan.split_k > 1 else ""),
              f"{t_dense:.1f}", f"{t_triton:.1f}", ratio(t_dense, t_triton), f"{t_dequant:.1f}",
              "n/a" if t_tiny is None else f"{t_tiny:.1f}", ratio(t_tiny, t_triton),
              f"{gbs:.0f}", "n/a" if peak is None else f"{100 * gbs / peak:.0f}%"]
             for k, n, m, plan, t_dense, t_triton, t_dequant, t_tiny, gbs in rows]
    print("\n".join(md_table(head, cells)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
