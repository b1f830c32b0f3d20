"""What warmup's kernel timing chooses on this GPU: triton-gemm or tinygemm per decode batch size.

Builds Llama-3.2-1B's four linear shapes (two layers of each) as 4-bit g128 layers with bfloat16
activations through build_linear (triton-gemm: the table's first), then does what warmup does
(kernels/tuning.py): `tune_kernels` at the CUDA graphs' batch sizes, once per shape, with CUDA
events over graph replays and the L2 cache flushed. Prints:
- per shape and batch size, both kernels' times and the choice, as the kernel cache recorded them;
- per batch size, one pass over every layer (a decode step's linears) with triton-gemm alone and
  with the chosen kernels, timed the same way, and the memory the rival's copies took;
- a second start from the cache: a fresh model, the preferences read again, and how many
  timings that took (0: the cache answered).

    python benchmarks/kernel_choice.py                            # 1B shapes, batches 1..32
    python benchmarks/kernel_choice.py --shapes 4096x4096 --batches 1,16
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time

import torch

from bench_common import command_line, md_table, ratio  # benchmarks/ is on sys.path here
from text_generation_server.kernels import select
from text_generation_server.kernels.base import QuantizedWeight
from text_generation_server.kernels.dispatch import held_bytes
from text_generation_server.kernels.select import build_linear, shape_key
from text_generation_server.kernels.tuning import cuda_timer, tune_kernels

SHAPES_1B = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)]  # qkv, o, gate+up, down (K in x N out)
BATCHES = [1, 2, 4, 8, 16, 32]  # serve's default --cuda-graphs up to 32 (it goes on to 64 and 128)


class Holder(torch.nn.Module):
    """A layer's place in a model, as the TP layers hold theirs (`.linear`): tuning replaces it there."""

    def __init__(self, linear: torch.nn.Module):
        super().__init__()
        self.linear = linear


def random_weight(k: int, n: int, bits: int, group_size: int, seed: int) -> QuantizedWeight:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randint(0, 2**bits, (k, n), dtype=torch.uint8, generator=gen, device="cuda")
    scales = torch.rand(-(-k // group_size), n, generator=gen, device="cuda") * 0.01 + 0.001
    g_idx = torch.arange(k, dtype=torch.int32, device="cuda") // group_size
    return QuantizedWeight(q, scales, None, g_idx, bits, group_size)


def build(shapes: list[tuple[int, int]], layers: int, bits: int, group_size: int) -> torch.nn.ModuleList:
    return torch.nn.ModuleList(
        Holder(build_linear(random_weight(k, n, bits, group_size, seed=31 * i + k + n), None, torch.bfloat16, "cuda",
                            f"layers.{i}.{k}x{n}"))
        for i in range(layers) for k, n in shapes)


def step_time(model: torch.nn.ModuleList, batch: int) -> float:
    """Seconds for one pass of `batch` rows through every layer, as a decode graph runs it."""
    inputs = {h.linear.linear_spec.in_features: torch.randn(batch, h.linear.linear_spec.in_features, device="cuda",
                                                          dtype=torch.bfloat16) for h in model}
    return cuda_timer(lambda: [h.linear(inputs[h.linear.linear_spec.in_features]) for h in model])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES_1B), help="KxN list (in x out)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="the CUDA graphs' batch sizes")
    ap.add_argument("--layers", type=int, default=2, help="layers of each shape (timed once per shape)")
    ap.add_argument("--bits", type=int, default=4, choices=(2, 3, 4))
    ap.add_argument("--group-size", type=int, default=128)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernel_choice.py needs a CUDA GPU: on CPU no two kernels are paired (the logic is "
              "tested in tests/test_kernel_tuning.py)", file=sys.stderr)
        return 2
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    os.environ[select.CACHE_ENV] = tempfile.mkdtemp(prefix="tgs-kernel-cache-")
    select._PREFERENCES.clear()
    started = time.time()
    with torch.inference_mode():
        model = build(shapes, args.layers, args.bits, args.group_size)
        before = sum(held_bytes(h) for h in model)
        alone = {b: step_time(model, b) for b in batches}
        chosen = tune_kernels(model, batches)
        after = sum(held_bytes(h) for h in model)
        mixed = {b: step_time(model, b) for b in batches}
        prefs = select.preferences("cuda")
        recorded = json.loads(prefs.path.read_text())["choices"] if prefs.path and prefs.path.exists() else {}
        # A second start: a fresh model and the preferences read again from the file.
        select._PREFERENCES.clear()
        timed: list[int] = []
        again = build(shapes, args.layers, args.bits, args.group_size)
        second = tune_kernels(again, batches, timer=lambda fn: timed.append(1) or cuda_timer(fn))

    print()
    print(f"Command: `{command_line(script='benchmarks/kernel_choice.py')}`")
    print(f"Device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; {datetime.date.today().isoformat()}; "
          f"{args.bits}-bit g{args.group_size} sym, bfloat16; {args.layers} layers per shape; run took "
          f"{time.time() - started:.0f} s.")
    print()
    rows = []
    for k, n in shapes:
        spec = model[shapes.index((k, n))].linear.linear_spec
        key = shape_key(spec)
        for b in batches:
            entry = recorded.get(key, {}).get(f"kernel rows<={b}", {})
            ms = entry.get("ms", {})
            rows.append([f"{k} x {n}", str(b), *(f"{ms[name] * 1e3:.1f}" if name in ms else "n/a"
                                                 for name in ("triton-gemm", "tinygemm")),
                         chosen.get(key, {}).get(b, "triton-gemm (not paired)")])
    print("Per shape, microseconds per call (graph replays, L2 flushed), as the kernel cache recorded them:")
    print()
    print("\n".join(md_table(["K x N", "batch", "triton-gemm", "tinygemm", "chosen"], rows, "lrrrl")))
    print()
    print(f"One pass over all {len(model)} layers, microseconds; copies of the rival: "
          f"{(after - before) / 2**20:+.1f} MiB on {before / 2**20:.1f} MiB of weights:")
    print()
    print("\n".join(md_table(["batch", "triton-gemm alone", "chosen kernels", "speed-up"],
                             [[str(b), f"{alone[b] * 1e6:.1f}", f"{mixed[b] * 1e6:.1f}", ratio(alone[b], mixed[b])]
                              for b in batches], "rrrr")))
    print()
    same = second == chosen
    print(f"Second start from the cache: {len(timed)} timings, choices {'the same' if same else 'DIFFERENT'}.")
    return 0 if same and not timed else 1


if __name__ == "__main__":
    sys.exit(main())
