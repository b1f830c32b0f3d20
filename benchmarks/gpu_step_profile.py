"""Where one decode step's device time goes: the engine in-process on the GPU, kernel by kernel.

Why: through `serve`, the 1B shape's decode step read 1.77 ms of device time (CUDA events around
the forward) on an H200 whose weight-read floor is ~0.6 ms (BENCHMARKS "GPU decode", issue #31),
and 0.41 ms more of host gap. The serve benchmark cannot say which kernels fill the 1.77 ms; this
script can: it loads the same random checkpoint in this process (no router, no gRPC) and

1. steps a batch with CUDA graphs, timing each `generate_token` on the host (wall) and the
   forward on the device (the engine's own DeviceClock), so host gap = wall - device; on CUDA
   twice, with launch ahead (the next step enqueued before a step's host work: the served way)
   and without, one after the other;
2. profiles a few of those graph steps and a few eager steps (a second load without graphs)
   with torch.profiler, and prints the kernels by device time per step, how many launch per
   step, and the device's busy time against the step's wall time (idle = waiting on the host).

    python benchmarks/gpu_step_profile.py --work-dir /tmp/tgs-gpu-decode-quick/fp16 --out $OUT
    python benchmarks/gpu_step_profile.py --device cpu --dtype float32 --hidden 128 --layers 2 \\
        --heads 4 --kv-heads 2 --intermediate 256 --vocab 1024 --steps 6   # a CPU dry run

The checkpoint is built (gpu_decode.py's seeded builder) when --work-dir holds none.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

from gpu_bench_logic import ModelShape  # noqa: E402


def requests_for(batch: int, prompt_tokens: int, new_tokens: int, vocab: int) -> list:
    from text_generation_server.engine.types import GenerationRequest

    rng = random.Random(batch)
    return [GenerationRequest(id=i, inputs="", input_ids=[rng.randrange(10, vocab - 10) for _ in range(prompt_tokens)],
                              max_new_tokens=new_tokens, ignore_eos_token=True) for i in range(batch)]


def load(path: Path, args: argparse.Namespace, graphs: list[int]):
    import torch

    from text_generation_server.models.loader import get_model

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device(args.device)
    lm = get_model(str(path), dtype=args.dtype, device=device, cuda_graphs=graphs,
                   max_batch_size=max(args.batches))
    total = args.prompt_tokens + args.steps + args.warm_steps + 8
    if graphs:
        warm = requests_for(1, args.prompt_tokens, args.steps, args.vocab)
        lm.warmup(warm, total, max(args.prompt_tokens * max(args.batches), total), total, 0.9,
                  max_batch_total_tokens=total * max(args.batches) * 2, max_batch_size=max(args.batches))
    else:
        lm.allocate_kv_cache(1 + max(args.batches) * lm.blocks_for(total) * 2)
    return lm


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def timed_steps(lm, batch_size: int, args: argparse.Namespace) -> dict:
    """Median host wall per decode step and device time per forward, graph or eager as loaded."""
    # + 2: the prefill makes the first token, and the last step must not end the batch
    batch = lm.make_batch(0, requests_for(batch_size, args.prompt_tokens, args.steps + args.warm_steps + 2, args.vocab))
    _, batch, _ = lm.generate_token(batch)  # prefill
    for _ in range(args.warm_steps):
        _, batch, _ = lm.generate_token(batch)
    sync(args.device)
    walls, devices = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter_ns()
        _, batch, timings = lm.generate_token(batch)
        walls.append(time.perf_counter_ns() - t0)
        devices.append(lm.last_device_ns)  # not lm.clock: a step launched ahead holds it, unfinished
        if batch is None:
            break
    if batch is not None:
        lm.filter(batch, [])
    wall, dev = statistics.median(walls) / 1e3, statistics.median(devices) / 1e3
    return {"batch": batch_size, "steps": len(walls), "wall_us": wall, "device_us": dev, "gap_us": wall - dev}


def profiled_steps(lm, batch_size: int, args: argparse.Namespace, steps: int) -> dict:
    """Kernels of `steps` decode steps: per-step device time by kernel, launches, busy share."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    batch = lm.make_batch(0, requests_for(batch_size, args.prompt_tokens, steps + args.warm_steps + 2, args.vocab))
    _, batch, _ = lm.generate_token(batch)
    for _ in range(args.warm_steps):
        _, batch, _ = lm.generate_token(batch)
    sync(args.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter_ns()
        for _ in range(steps):
            _, batch, _ = lm.generate_token(batch)
        sync(args.device)
        wall_us = (time.perf_counter_ns() - t0) / 1e3 / steps
    if batch is not None:
        lm.filter(batch, [])
    kernels: dict[str, list[float]] = {}
    spans: list[tuple[float, float]] = []
    for ev in prof.events():
        on_device = args.device == "cuda" and ev.device_type == torch.autograd.DeviceType.CUDA
        if args.device == "cuda" and not on_device:
            continue
        if args.device != "cuda" and not ev.name.startswith("aten::"):
            continue
        dur = ev.device_time if on_device else ev.cpu_time
        kernels.setdefault(ev.name, []).append(dur)
        start = ev.time_range.start
        spans.append((start, start + dur))
    spans.sort()
    busy, end = 0.0, float("-inf")
    for s, e in spans:  # the union of kernel intervals: overlapping kernels count once
        if e > end:
            busy += e - max(s, end)
            end = e
    rows = sorted(((sum(v) / steps, len(v) / steps, name) for name, v in kernels.items()), reverse=True)
    return {"batch": batch_size, "steps": steps, "wall_us_per_step": wall_us,
            "busy_us_per_step": busy / steps, "launches_per_step": sum(r[1] for r in rows),
            "kernel_us_per_step": sum(r[0] for r in rows),
            "top": [{"name": n[:110], "us_per_step": round(t, 2), "per_step": round(c, 2)} for t, c, n in rows[:25]]}


def table(title: str, p: dict) -> str:
    lines = [f"### {title}: batch {p['batch']}, {p['steps']} steps",
             f"wall {p['wall_us_per_step']:.0f} us a step; device busy {p['busy_us_per_step']:.0f} us "
             f"({p['busy_us_per_step'] / p['wall_us_per_step']:.0%}); kernel time {p['kernel_us_per_step']:.0f} us "
             f"in {p['launches_per_step']:.0f} launches a step", "",
             "| kernel | us per step | launches per step |", "|---|---:|---:|"]
    lines += [f"| `{r['name']}` | {r['us_per_step']:.1f} | {r['per_step']:.1f} |" for r in p["top"]]
    return "\n".join(lines) + "\n"


def save(out: Path, stem: str, result: dict, text: list[str]) -> None:
    """Written after every section, so a run stopped at its time limit still leaves what it measured."""
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{stem}.md").write_text("\n".join(text) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/tgs-gpu-step-profile/fp16"),
                    help="the checkpoint folder (built here when missing)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/tgs-gpu-step-profile/out")))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warm-steps", type=int, default=5)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--name", default="gpu_step_profile", help="the output files' stem")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager (no graphs) load and profile")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    if not (args.work_dir / "config.json").exists():
        from gpu_decode import build_checkpoint

        shape = ModelShape(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                           intermediate=args.intermediate, vocab=args.vocab)
        build_checkpoint(args.work_dir, shape, seed=0, device=args.device)
    result: dict = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                    "model": str(args.work_dir), "dtype": args.dtype, "graphs": [], "eager": []}
    text = [f"## Decode step profile: {result['device']}, {args.work_dir}, {args.dtype}\n"]
    graphs = sorted({1, 2, 4, 8} | set(args.batches)) if args.device == "cuda" else []
    lm = load(args.work_dir, args, graphs)
    text += ["| mode | batch | wall us | device us | host gap us |", "|---|---:|---:|---:|---:|"]
    # With graphs on CUDA, each batch twice in a row: as served (a step's successor launched before its
    # host work, engine/causal_lm.py) and with launch ahead off, so the table shows what it hides.
    modes = [(True, "graphs"), (False, "graphs, no launch ahead")] if lm.launch_ahead else [
        (False, "graphs" if graphs else "eager")]
    for b in args.batches:
        for ahead, mode in modes:
            lm.launch_ahead = ahead
            r = timed_steps(lm, b, args)
            r["launch_ahead"] = ahead
            result["graphs"].append(r)
            text.append(f"| {mode} | {b} | {r['wall_us']:.0f} | {r['device_us']:.0f} | {r['gap_us']:.0f} |")
            print(text[-1], flush=True)
            save(args.out, args.name, result, text)
    lm.launch_ahead = modes[0][0]
    text.append("")
    for b in args.batches:
        p = profiled_steps(lm, b, args, args.profile_steps)
        result[f"profile_graphs_{b}"] = p
        text.append(table("graphs" if graphs else "eager", p))
        print(text[-1], flush=True)
        save(args.out, args.name, result, text)
    del lm
    if args.device == "cuda":
        torch.cuda.empty_cache()
    if graphs and not args.no_eager:
        lm = load(args.work_dir, args, [])
        for b in args.batches:
            r = timed_steps(lm, b, args)
            result["eager"].append(r)
            print(f"| eager | {b} | {r['wall_us']:.0f} | {r['device_us']:.0f} | {r['gap_us']:.0f} |", flush=True)
            p = profiled_steps(lm, b, args, args.profile_steps)
            result[f"profile_eager_{b}"] = p
            text.append(table("eager", p))
            print(text[-1], flush=True)
            save(args.out, args.name, result, text)
    save(args.out, args.name, result, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
