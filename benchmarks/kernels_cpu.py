"""CPU quantized-linear kernels against dense matmul on Llama-7B layer shapes.

Prints a markdown table: the kernel `build_linear` chooses for 4-bit g128 (symmetric,
asymmetric, act-order) and 8-bit per-channel weights, each timed against dense F.linear in
bf16 and fp32, all in one run so the ratios share the machine's state.

By default every timed call reads a different copy of the weights, cycling through enough
copies to exceed --working-set-mib (default 640, above this machine's reported 480 MiB L3):
that is the decode regime, where a model's weights stream from DRAM once per token. --hot
reuses one copy (cache-resident weights, the best case for dense bf16).

    python benchmarks/kernels_cpu.py                  # full run, a few minutes
    python benchmarks/kernels_cpu.py --quick          # 4096x4096 at batch 1 and 16
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from text_generation_server.kernels.base import QuantizedWeight, build_linear

SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (4096, 14336)]  # (in K, out N)
BATCHES = [1, 4, 16, 64]
VARIANTS = [
    # label, bits, group size (None: per-channel), symmetric, act-order
    ("int4 g128 sym", 4, 128, True, False),
    ("int4 g128 asym", 4, 128, False, False),
    ("int4 g128 act-order", 4, 128, False, True),
    ("int8 per-channel sym", 8, None, True, False),
]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def random_weight(k: int, n: int, bits: int, group_size: int | None, sym: bool, act_order: bool) -> QuantizedWeight:
    gs = group_size or k
    groups = math.ceil(k / gs)
    gen = torch.Generator().manual_seed(k * 31 + n)
    q = torch.randint(0, 2**bits, (k, n), dtype=torch.uint8, generator=gen)
    scales = torch.rand(groups, n, generator=gen) * 0.01 + 0.001
    zeros = None if sym else torch.randint(0, 2**bits, (groups, n), generator=gen).float()
    g_idx = torch.arange(k, dtype=torch.int32) // gs
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return QuantizedWeight(q, scales, zeros, g_idx, bits, gs)


def module_bytes(m: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))


class Dense(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def with_copies(module: torch.nn.Module, working_set: int) -> list[torch.nn.Module]:
    """The module and enough deep copies that cycling through them reads working_set bytes."""
    count = max(1, math.ceil(working_set / module_bytes(module)))
    return [module] + [copy.deepcopy(module) for _ in range(count - 1)]


def time_interleaved(copies: dict[str, list[torch.nn.Module]], inputs: dict[str, torch.Tensor], budget_s: float,
                     max_rounds: int) -> dict[str, tuple[float, float]]:
    """(median, min) seconds per call for each label. Rounds call every label once, each on its
    next copy, so a change in machine load hits all labels alike; at least 3 rounds."""
    times: dict[str, list[float]] = {label: [] for label in copies}
    with torch.inference_mode():
        for label, mods in copies.items():
            for m in mods[:2]:
                m(inputs[label])  # warm up code paths and the allocator
        start = time.perf_counter()
        rounds = 0
        while rounds < max_rounds and (rounds < 3 or time.perf_counter() - start < budget_s):
            for label, mods in copies.items():
                m, x = mods[rounds % len(mods)], inputs[label]
                t0 = time.perf_counter()
                m(x)
                times[label].append(time.perf_counter() - t0)
            rounds += 1
    return {label: (statistics.median(t), min(t)) for label, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="KxN list (in x out)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--budget", type=float, default=3.0, help="seconds of timing per shape and batch (doubled at batch 1)")
    ap.add_argument("--reps", type=int, default=25, help="at most this many rounds (one call per kernel each)")
    ap.add_argument("--working-set-mib", type=int, default=640)
    ap.add_argument("--hot", action="store_true", help="reuse one copy of the weights (cache-resident)")
    ap.add_argument("--quick", action="store_true", help="4096x4096, batch 1 and 16")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.batches = "4096x4096", "1,16"
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    working_set = 0 if args.hot else args.working_set_mib << 20

    started = time.time()
    rows = []
    kernels: dict[str, str] = {}
    for k, n in shapes:
        copies: dict[str, list[torch.nn.Module]] = {}
        dense = torch.randn(n, k, generator=torch.Generator().manual_seed(k + n)) * 0.02
        copies["fp32"] = with_copies(Dense(dense), working_set)
        copies["bf16"] = with_copies(Dense(dense.to(torch.bfloat16)), working_set)
        del dense
        for label, bits, gs, sym, act in VARIANTS:
            module = build_linear(random_weight(k, n, bits, gs, sym, act), None, torch.bfloat16, "cpu",
                                  layer=f"bench {k}x{n}")
            kernels[label] = module.kernel_name
            copies[label] = with_copies(module, working_set)
        for m in batches:
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            inputs = {label: x if label == "fp32" else x.to(torch.bfloat16) for label in copies}
            res = time_interleaved(copies, inputs, args.budget * (2 if m == 1 else 1), args.reps)
            ms = {label: 1e3 * r[0] for label, r in res.items()}
            best = {label: 1e3 * r[1] for label, r in res.items()}
            rows.append((k, n, m, ms, best))
            print(f"{k}x{n} batch {m}: " + ", ".join(f"{lbl} {t:.2f} ms" for lbl, t in ms.items()), flush=True)
        del copies

    labels = [v[0] for v in VARIANTS]
    print()
    print(f"Command: `{' '.join(['python benchmarks/kernels_cpu.py'] + sys.argv[1:])}`")
    print(f"Machine: {cpu_model()}, {torch.get_num_threads()} threads ({torch.get_num_threads()} of "
          f"{os.cpu_count()} cores); torch {torch.__version__}; "
          f"{datetime.date.today().isoformat()}; weights {'cache-resident (--hot)' if args.hot else f'cycled over {args.working_set_mib} MiB (DRAM-streaming)'}; "
          f"median of up to {args.reps} interleaved rounds; run took {time.time() - started:.0f} s.")
    print("Kernels chosen (bf16 activations): " + "; ".join(f"{lbl} -> {kernels[lbl]}" for lbl in labels))
    print()
    for stat, idx in (("median", 3), ("minimum", 4)):
        print(f"{stat.capitalize()} times in ms; speed-up = dense time / kernel time (higher is better).")
        print()
        head = ["K x N", "batch", "fp32", "bf16"] + [f"{lbl} (vs bf16 / vs fp32)" for lbl in labels]
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for row in rows:
            k, n, m, t = row[0], row[1], row[2], row[idx]
            cells = [f"{k} x {n}", str(m), f"{t['fp32']:.2f}", f"{t['bf16']:.2f}"]
            for lbl in labels:
                cells.append(f"{t[lbl]:.2f} ({t['bf16'] / t[lbl]:.2f}x / {t['fp32'] / t[lbl]:.2f}x)")
            print("| " + " | ".join(cells) + " |")
        print()

if __name__ == "__main__":
    main()
