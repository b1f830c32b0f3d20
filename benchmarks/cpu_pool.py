"""The native kernels' thread split: the pool (tgs::parallel_for) against at::parallel_for, in one process.

Issue #32: with another process on the second core, every two-thread native kernel under
at::parallel_for (OpenMP: a static split and a fork/join barrier) waited for a thread the scheduler
had not run, 0.2-1.9 GB/s instead of ~20. The extension can switch its split at run time
(cpu_native.set_parallel_mode), so both are measured on the same layers, interleaved (each round:
every layer under one split, then under the other, the order alternating), quiet and `--contended` (a busy
Python loop pinned with taskset to the last core, nice 0, for the whole setting):

- layers: one decode row through the layers' own forward (build_linear / DenseLinear, as a model
  runs them) on Qwen2.5-1.5B's shapes (qkv with bias, o_proj, gate_up, down), for int4 with int8
  activations (cpu-int4pack-q8, serve's default), int4 exact (the native kernel), int8 per-channel
  (the matrix-vector kernel) and bfloat16 (the native gemv); weights cold (copies cycled so at least
  --working-set-mib of other weights are read between two reads of one copy); GB/s of the module's
  weight bytes, median over rounds, at each --threads;
- `--model DIR`: whole decode steps of a checkpoint loaded as serve loads it (cpu_step_profile.py's
  loading and decode loop), median ms a step, the splits alternating round by round.

Extra labels in --splits: pool-spinN (idle workers spin N us before sleeping; the default is 50),
omp (at::parallel_for).

    flock /tmp/tgs-bench.lock python benchmarks/cpu_pool.py --contended both
    flock /tmp/tgs-bench.lock python benchmarks/cpu_pool.py --layers none \
        --model ~/.cache/tgs-bench/models/qwen2.5-coder-1.5b/tgs-int4-rtn-g128 --contended both
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench_common import command_line, load_line, machine_line, md_table, now_iso  # benchmarks/ is on sys.path here
from kernels_cpu import contended, random_weight

# (name, K, N, bias) of one Qwen2.5-1.5B layer's linears
SHAPES = [("qkv", 1536, 2048, True), ("o_proj", 1536, 1536, False), ("gate_up", 1536, 17920, False),
          ("down", 8960, 1536, False)]
FORMATS = ("int4-q8", "int4", "int8", "bf16")
SETTLE_S = 0.05  # idle time between two splits' blocks of calls


def set_split(module, split: str) -> None:
    """`split`: "pool", "pool-spinN" or "omp"."""
    from text_generation_server.kernels import cpu_native

    if split == "omp":
        cpu_native.set_parallel_mode(module, False)
    elif split == "pool":
        cpu_native.set_parallel_mode(module, True, 50)
    elif split.startswith("pool-spin"):
        cpu_native.set_parallel_mode(module, True, int(split.removeprefix("pool-spin")))
    else:
        raise SystemExit(f"--splits: unknown split {split!r} (pool, pool-spinN, omp)")


def build_layer(fmt: str, k: int, n: int, bias: bool) -> torch.nn.Module:
    from text_generation_server.kernels import cpu_act_int8
    from text_generation_server.kernels.dense import DenseLinear
    from text_generation_server.kernels.select import build_linear

    b = torch.randn(n, generator=torch.Generator().manual_seed(n)).bfloat16() if bias else None
    if fmt == "bf16":
        w = (torch.randn(n, k, generator=torch.Generator().manual_seed(k + n)) * 0.02).bfloat16()
        return DenseLinear(w, b)
    os.environ[cpu_act_int8.ENV] = "on" if fmt == "int4-q8" else "off"
    try:
        w = random_weight(k, n, 8 if fmt == "int8" else 4, None if fmt == "int8" else 128, True, False)
        module = build_linear(w, b, torch.bfloat16, "cpu", layer=f"bench {k}x{n}")
    finally:
        os.environ.pop(cpu_act_int8.ENV, None)
    want = {"int4-q8": "cpu-int4pack-q8", "int4": "cpu-int4pack", "int8": "cpu-int8"}[fmt]
    if module.kernel_name != want:
        raise SystemExit(f"{fmt}: built {module.kernel_name}, not {want} (native kernels missing?)")
    return module


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes a one-row call reads: the tensors the native path uses (int4: codes, float32 scales and
    offsets, not torch's packed scales_and_zeros)."""
    skip = {"scales_and_zeros", "scales"} if hasattr(module, "packed") else {"scales"}
    return sum(t.numel() * t.element_size() for name, t in [*module.named_buffers(), *module.named_parameters()]
               if name.split(".")[-1] not in skip and t is not None)


def time_layers(formats: list[str], splits: list[str], threads: list[int], loads: list[bool], rounds: int,
                working_set: int, torch_op: Callable[[], object] | None = None) -> list[list[str]]:
    """The layer table; `torch_op`: called untimed before each layer (a torch op with an OpenMP
    region, whose idle threads then spin, GOMP_SPINCOUNT, while the layer runs)."""
    from text_generation_server.kernels import cpu_native
    from text_generation_server.kernels.phase import forward_phase

    native = cpu_native.native()
    layers: dict[str, list[torch.nn.Module]] = {}
    nbytes: dict[str, int] = {}
    inner: dict[str, int] = {}
    for fmt in formats:
        for name, k, n, bias in SHAPES:
            m = build_layer(fmt, k, n, bias)
            layers[f"{fmt} {name}"] = [m]
            nbytes[f"{fmt} {name}"] = weight_bytes(m)
            inner[f"{fmt} {name}"] = k
    per_round = sum(nbytes.values())
    count = max(2, math.ceil(working_set / per_round))
    for label, mods in layers.items():
        mods.extend(copy.deepcopy(mods[0]) for _ in range(count - 1))
    print(f"{len(layers)} layers, {per_round / 2**20:.0f} MiB a round, {count} copies each", flush=True)
    rows = []
    x = {k: torch.randn(1, k, generator=torch.Generator().manual_seed(k)).bfloat16() for _, k, _, _ in SHAPES}
    for busy in loads:
        for t in threads:
            torch.set_num_threads(t)
            with contended(busy) as how, torch.inference_mode(), forward_phase(prefill=False):
                start = os.getloadavg()[0]
                times: dict[tuple[str, str], list[float]] = {(label, s): [] for label in layers for s in splits}
                for label, mods in layers.items():  # first calls: code paths, allocator, pool threads
                    for s in splits:
                        set_split(native, s)
                        mods[0](x[inner[label]])
                for r in range(rounds):
                    # Each split runs every layer in a row, as a model's step does (a split's idle
                    # workers then meet the next call of their own split, not the other's).
                    for s in (splits if r % 2 == 0 else splits[::-1]):
                        set_split(native, s)
                        # libgomp's threads spin for milliseconds after the omp split's last region
                        # (OMP_WAIT_POLICY unset): let that end, so no split starts beside the other's
                        time.sleep(SETTLE_S)
                        for label, mods in layers.items():
                            m = mods[r % len(mods)]
                            if torch_op is not None:
                                torch_op()
                            t0 = time.perf_counter()
                            m(x[inner[label]])
                            times[(label, s)].append(time.perf_counter() - t0)
                end = os.getloadavg()[0]
            set_split(native, "pool")
            for label in layers:
                med = {s: statistics.median(times[(label, s)]) for s in splits}
                gbs = {s: nbytes[label] / med[s] / 1e9 for s in splits}
                base = splits[-1]
                rows.append([how, str(t), label, f"{nbytes[label] / 2**20:.1f}",
                             *[f"{gbs[s]:.1f}" for s in splits],
                             *[f"{med[base] / med[s]:.2f}x" for s in splits[:-1]], f"{start:.2f} -> {end:.2f}"])
            print(f"{how}, {t} threads done", flush=True)
    head = ["load", "threads", "layer", "MiB", *[f"{s} GB/s" for s in splits],
            *[f"{s} / {splits[-1]}" for s in splits[:-1]], "1-min load"]
    print("\n".join(md_table(head, rows, "lllr" + "r" * (2 * len(splits) - 1) + "r")))
    return rows


def time_steps(model: str, splits: list[str], threads: int, loads: list[bool], rounds: int, steps: int,
               quantize_lm_head: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu_step_profile import decode_steps, load

    from text_generation_server.kernels import cpu_native

    torch.set_num_threads(threads)
    args = argparse.Namespace(model=model, dtype="bfloat16", quantize_lm_head=quantize_lm_head, prompt=128,
                              steps=steps)
    lm = load(args)
    native = cpu_native.native()
    decode_steps(lm, args, 7)
    rows = []
    for busy in loads:
        with contended(busy) as how:
            start = os.getloadavg()[0]
            per: dict[str, list[float]] = {s: [] for s in splits}
            for r in range(rounds):
                for s in (splits if r % 2 == 0 else splits[::-1]):
                    set_split(native, s)
                    per[s].append(statistics.median(decode_steps(lm, args, 10 + r)) * 1000)
            end = os.getloadavg()[0]
        set_split(native, "pool")
        med = {s: statistics.median(v) for s, v in per.items()}
        base = splits[-1]
        ratios = [f"{per[base][i] / per[s][i]:.2f}" for s in splits[:-1] for i in range(rounds)]
        rows.append([how, *[f"{med[s]:.2f}" for s in splits], *[f"{med[base] / med[s]:.2f}x" for s in splits[:-1]],
                     ", ".join(ratios), f"{start:.2f} -> {end:.2f}"])
        print(f"steps, {how} done", flush=True)
    head = ["load", *[f"{s} ms/step" for s in splits], *[f"{s} / {splits[-1]}" for s in splits[:-1]],
            "rounds' ratios", "1-min load"]
    print(f"\nDecode steps of {model} ({threads} threads, 128-token prompt, {steps} steps a round, {rounds} rounds; "
          "median over rounds of each round's median step)\n")
    print("\n".join(md_table(head, rows, "l" + "r" * (len(head) - 1))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default=",".join(FORMATS), help=f"formats of the layer table ({', '.join(FORMATS)}) "
                    "or 'none'")
    ap.add_argument("--splits", default="pool,omp", help="the splits compared, the baseline last (pool, pool-spinN, omp)")
    ap.add_argument("--threads", default="1,2", help="torch threads of the layer table")
    ap.add_argument("--contended", choices=("off", "on", "both"), default="off",
                    help="a busy loop pinned to the last core: off, on, or both (quiet first)")
    ap.add_argument("--rounds", type=int, default=30, help="layer rounds (each: every layer once under each split)")
    ap.add_argument("--working-set-mib", type=int, default=640)
    ap.add_argument("--torch-op", action="store_true",
                    help="before each layer call a torch op that forks OpenMP (a sum over 4 MiB of float32), as "
                         "a step's torch ops do: its threads' spin-wait then meets the layer")
    ap.add_argument("--model", default="", help="checkpoint folder: also time whole decode steps")
    ap.add_argument("--step-threads", type=int, default=2)
    ap.add_argument("--step-rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--quantize-lm-head", default="auto")
    args = ap.parse_args(argv)
    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    loads = {"off": [False], "on": [True], "both": [False, True]}[args.contended]
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    start = os.getloadavg()[0]
    print(f"- command: `{command_line(script='benchmarks/cpu_pool.py')}`")
    print(f"- {machine_line()}; date {now_iso()}")
    if args.layers != "none":
        formats = [f.strip() for f in args.layers.split(",") if f.strip()]
        unknown = [f for f in formats if f not in FORMATS]
        if unknown:
            ap.error(f"--layers: unknown {unknown}; choose from {FORMATS}")
        big = torch.randn(1 << 20)
        print(f"- OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}, "
              f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')}; torch op between layers: {args.torch_op}")
        time_layers(formats, splits, [int(t) for t in args.threads.split(",")], loads, args.rounds,
                    args.working_set_mib << 20, (lambda: big.sum()) if args.torch_op else None)
    if args.model:
        time_steps(os.path.expanduser(args.model), splits, args.step_threads, loads, args.step_rounds, args.steps,
                   args.quantize_lm_head)
    print(f"- {load_line(os.getloadavg()[0], start)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
