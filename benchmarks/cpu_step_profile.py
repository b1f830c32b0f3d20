"""Where one single-stream CPU decode step goes: wall time per part of the model, in-process.

Issue #32 asks for CPU decode at memory speed; at one row the weights are read once a step, so a
step should take (bytes of weights) / (memory bandwidth) plus whatever the rest costs. This loads a
checkpoint the way `serve` does (`get_model`, the same `--quantize-lm-head`, warmup with its CPU
kernel measurement, 2 threads), prefills one prompt and decodes, timing every part of each step
with wall clocks around the modules' calls (CPU ops run synchronously, so a call's wall time is its
cost; exclusive times, each part without the parts inside it):

- the linears by kind (q/k/v, o_proj, gate_up, down) and the head, each with the bytes of weights
  it reads per step and the GB/s that makes;
- the norms (with the residual add fused into the post-attention one), rotary (cos/sin once per
  step and its application to q and k), the KV cache store, the attention over the paged cache,
  the MLP's activation, the layers' own residual adds and reshapes, the embedding;
- the step's host work: sampling and bookkeeping in `generate_token` outside the forward.

Then a second pass under torch's profiler counts the aten ops one step runs and where their time
goes (the profiler slows small ops, so its times are only a ranking). Memory bandwidth is
measured as `vs_llamacpp.py` measures it (torch sum over a 1 GiB buffer, all cores, best of 5),
and the linear times are compared against bytes / bandwidth.

    flock /tmp/tgs-bench.lock python benchmarks/cpu_step_profile.py ~/.cache/tgs-bench/models/qwen2.5-coder-1.5b/tgs-int4-rtn-g128 \
        --quantize-lm-head int8
    flock /tmp/tgs-bench.lock python benchmarks/cpu_step_profile.py ~/.cache/tgs-bench/models/qwen2.5-coder-1.5b/hf
    flock /tmp/tgs-bench.lock python benchmarks/cpu_step_profile.py ~/.cache/tgs-bench/models/qwen2.5-coder-1.5b/hf --quantize eetq
    flock /tmp/tgs-bench.lock python benchmarks/cpu_step_profile.py --dtype float32   # the embedded model

--compare ENV=VALUE[,...] runs the same steps a second time with environment switches set inside
the process (e.g. TGS_CPU_NATIVE_ATTENTION=0,TGS_CPU_NATIVE_POINTWISE=0: the torch forms of the
decode attention and of the small ops; TGS_CPU_DECODE_STEP=0: the layers one module at a time instead
of layers/cpu_decode_step.py's plan), interleaved with the first in rounds, and prints both.

The clock's own cost (two perf_counter reads and a frame a wrapped call, ~300 calls a step on a
28-layer model) is inside the step it reports: `--no-clock` reports only the steps' wall time,
un-instrumented, for the same rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from bench_common import command_line, environment, load_line, machine_line, md_table, now_iso, openmp_as_serve

openmp_as_serve()  # the ranks' OpenMP waits, set before torch loads libgomp

import torch  # noqa: E402
from loguru import logger  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


class Clock:
    """Exclusive wall time per category: a stack of open calls, each call's time less its children's."""

    def __init__(self) -> None:
        self.exclusive: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.stack: list[list[float]] = []  # [start, time in children]
        self.on = False

    def wrap(self, category: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            frame = [time.perf_counter(), 0.0]
            self.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stack.pop()
                spent = time.perf_counter() - frame[0]
                self.exclusive[category] += spent - frame[1]
                self.calls[category] += 1
                if self.stack:
                    self.stack[-1][1] += spent
        return timed

    def by_instance(self, categories: dict[int, str], method: Callable) -> Callable:
        """A class-level `method` timed under its instance's category (`categories`: id -> name); other
        instances run untimed."""
        def timed(module, *args, **kwargs):
            category = categories.get(id(module))
            if category is None or not self.on:
                return method(module, *args, **kwargs)
            return self.wrap(category, method)(module, *args, **kwargs)
        return timed

    def reset(self) -> None:
        self.exclusive.clear()
        self.calls.clear()


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of the tensors a one-row call reads: every parameter and buffer, less a packed int4
    layer's bfloat16 scales-and-zeros when its float32 scales and offsets are what the kernel reads."""
    seen: set[int] = set()
    total = 0
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t is None or t.data_ptr() in seen:
            continue
        owner = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
        if name.endswith("scales_and_zeros") and getattr(owner, "scales_f32", None) is not None:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def instrument(lm, clock: Clock) -> tuple[dict[str, int], Callable[[], None]]:
    """Wraps the model's parts with `clock`; returns the weight bytes per linear category and a
    function that puts back the class-level methods it wrapped (the model's own stay wrapped)."""
    from text_generation_server.layers import rotary as rotary_mod
    from text_generation_server.layers.attention import KVCache, TorchAttention
    from text_generation_server.layers.context import ForwardContext

    net = lm.model
    nbytes: dict[str, int] = defaultdict(int)
    # The layers' linears are timed at their classes' forward (category by instance), not by a forward set on
    # each instance: the decode plan calls a linear's resolved one-row call only where nothing is set on the
    # instance (layers/cpu_decode_step.py), and its resolved calls are timed as it hands them out below.
    linears: dict[int, str] = {}

    def wrap_forward(module: torch.nn.Module, category: str) -> None:
        module.forward = clock.wrap(category, module.forward)

    wrap_forward(net, "model (glue)")
    wrap_forward(net.embeddings, "embedding")
    wrap_forward(net.norm, "final norm")
    if hasattr(net.norm, "add_forward"):  # the chained layers' last residual add runs inside it
        net.norm.add_forward = clock.wrap("final norm", net.norm.add_forward)
    wrap_forward(net.head, "head")
    nbytes["head"] += weight_bytes(net.head)
    for layer in net.layers:
        wrap_forward(layer, "layer residual adds")
        if hasattr(layer, "forward_chained"):  # the CPU's chained layers (residual add in the next norm)
            layer.forward_chained = clock.wrap("layer residual adds", layer.forward_chained)
        attn, mlp = layer.self_attn, layer.mlp
        wrap_forward(attn, "attention glue (split, views)")
        for name in ("qkv", "kv", "o_proj"):
            sub = getattr(attn, name, None)
            if sub is not None:
                linears[id(sub)] = f"linear {name}"
                nbytes[f"linear {name}"] += weight_bytes(sub)
        wrap_forward(mlp, "mlp activation (silu * up)")
        for name in ("gate_up", "down", "fc_in", "fc_out"):
            sub = getattr(mlp, name, None)
            if sub is not None:
                linears[id(sub)] = f"linear {name}"
                nbytes[f"linear {name}"] += weight_bytes(sub)
        for norm_name in ("input_norm", "mlp_norm", "post_attn_norm", "post_mlp_norm"):
            norm = getattr(layer, norm_name)
            if norm is None:
                continue
            wrap_forward(norm, "norms")
            if hasattr(norm, "add_forward"):
                norm.add_forward = clock.wrap("norms", norm.add_forward)
    # Class-level: rotary (cos/sin once a step, then q and k), the cache store, the attention.
    from text_generation_server.layers.cpu_decode_step import CpuDecodeStep

    wrapped = [(ForwardContext, "cos_sin", "rotary"), (rotary_mod.RotaryEmbedding, "apply", "rotary"),
               (KVCache, "store", "kv cache store"), (TorchAttention, "decode", "attention (paged decode)"),
               (CpuDecodeStep, "run", "layer glue (the decode plan's Python)")]
    originals = [(cls, name, cls.__dict__[name]) for cls, name, _ in wrapped]
    for cls, name, category in wrapped:
        setattr(cls, name, clock.wrap(category, getattr(cls, name)))
    for cls in {type(part) for layer in net.layers for part in layer.modules() if id(part) in linears}:
        originals.append((cls, "forward", cls.__dict__["forward"]))
        cls.forward = clock.by_instance(linears, cls.__dict__["forward"])
    plan_calls = CpuDecodeStep.__dict__["_linear_calls"]
    originals.append((CpuDecodeStep, "_linear_calls", plan_calls))

    def timed_calls(plan, rows, dtype):
        calls = plan_calls(plan, rows, dtype)
        if not clock.on:
            return calls
        names = [linears.get(id(getattr(layer, group)[name]), "linear") for layer in plan.layers
                 for group, name in (("attn_modules", "qkv"), ("attn_modules", "o_proj"), ("mlp_modules", "gate_up"),
                                     ("mlp_modules", "down"))]
        return [call if isinstance(call, torch.nn.Module) else clock.wrap(name, call)
                for name, call in zip(names, calls)]

    CpuDecodeStep._linear_calls = timed_calls
    # The CPU decode step's fused native calls (layers/self_attention.py, `_cpu_decode`).
    from text_generation_server.kernels import cpu_native

    ext = cpu_native.native()
    fused = [("decode_attention_bf16", "attention (fused: rotary, kv cache store, paged decode)"),
             ("rotary_store_f32", "rotary + kv cache store (fused)"),
             # the same calls when the layers run as one plan (layers/cpu_decode_step.py) instead of modules
             ("rms_norm_bf16", "norms"), ("rms_norm_f32", "norms"),
             ("silu_mul_bf16", "mlp activation (silu * up)"), ("silu_mul_f32", "mlp activation (silu * up)")]
    ext_originals = [(name, getattr(ext, name)) for name, _ in fused if ext is not None and hasattr(ext, name)]
    for name, category in fused:
        if ext is not None and hasattr(ext, name):
            setattr(ext, name, clock.wrap(category, getattr(ext, name)))
    lm.generate_token = clock.wrap("step host (sampling, bookkeeping)", lm.generate_token)

    def restore() -> None:
        for cls, name, original in originals:
            setattr(cls, name, original)
        for name, original in ext_originals:
            setattr(ext, name, original)

    return dict(nbytes), restore


def load(args: argparse.Namespace):
    from helpers import ids_request, random_ids

    from text_generation_server.models.loader import get_model

    lm = get_model(args.model, dtype=args.dtype, quantize=args.quantize, quantize_lm_head=args.quantize_lm_head)
    limit = args.prompt + args.steps + 8
    lm.warmup([ids_request(0, random_ids(args.prompt, 1, 1000), 2)], limit, limit, limit, 0.5,
              max_batch_total_tokens=4 * limit, max_batch_size=1)
    return lm


def decode_steps(lm, args: argparse.Namespace, seed: int, clock: Clock | None = None) -> list[float]:
    """Prefills one prompt, then decodes args.steps tokens with `clock` on (the prefill untimed);
    each step's wall time (seconds)."""
    from helpers import ids_request, random_ids

    batch = lm.make_batch(seed, [ids_request(seed, random_ids(args.prompt, seed, 1000), args.steps + 2)])
    _, batch, _ = lm.generate_token(batch)
    times = []
    if clock is not None:
        clock.on = True
    try:
        while batch is not None and len(times) < args.steps:
            t0 = time.perf_counter()
            _, batch, _ = lm.generate_token(batch)
            times.append(time.perf_counter() - t0)
    finally:
        if clock is not None:
            clock.on = False
    if batch is not None:
        lm.release(batch)
    return times


def profile_ops(lm, args: argparse.Namespace) -> list[tuple[str, int, float]]:
    """(aten op, calls per step, self CPU ms per step) under torch's profiler, most time first."""
    from torch.profiler import ProfilerActivity, profile

    from helpers import ids_request, random_ids

    steps = 4
    batch = lm.make_batch(99, [ids_request(99, random_ids(args.prompt, 99, 1000), steps + 3)])
    _, batch, _ = lm.generate_token(batch)
    _, batch, _ = lm.generate_token(batch)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as prof:
        for _ in range(steps):
            _, batch, _ = lm.generate_token(batch)
    if batch is not None:
        lm.release(batch)
    rows = [(e.key, e.count // steps, e.self_cpu_time_total / 1000 / steps) for e in prof.key_averages()]
    return sorted(rows, key=lambda r: -r[2])


def main(argv: list[str] | None = None) -> int:
    from text_generation_server.about import EMBEDDED_MODEL_ID

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=EMBEDDED_MODEL_ID,
                        help=f"checkpoint folder or GGUF file (default: {EMBEDDED_MODEL_ID}, the embedded model)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantize", default=None,
                        help="as serve's flag (e.g. eetq: int8 per channel, quantized on load)")
    parser.add_argument("--quantize-lm-head", default="auto", help="as serve's flag (auto: its default)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (serve's rule gives 2 on 2 cores)")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens before the decode steps")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compare", default="",
                        help="ENV=VALUE[,ENV=VALUE...]: a second setting, measured interleaved with the first")
    parser.add_argument("--no-ops", action="store_true", help="skip the torch profiler pass")
    parser.add_argument("--no-clock", action="store_true",
                        help="no wrappers around the parts: the steps' wall time only (what the clock costs)")
    parser.add_argument("--bandwidth-mib", type=int, default=1024,
                        help="buffer of the bandwidth measurement (vs_llamacpp.py's: 1024 MiB)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start_load = os.getloadavg()[0]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vs_llamacpp import measure_bandwidth

    bw = measure_bandwidth(args.bandwidth_mib)
    lm = load(args)
    clock = Clock()
    nbytes, restore = ({}, lambda: None) if args.no_clock else instrument(lm, clock)
    settings: list[tuple[str, dict[str, str]]] = [("as is", {})]
    if args.compare:
        pairs = [item.partition("=") for item in args.compare.split(",")]
        if any(not key or not sep for key, sep, _ in pairs):
            parser.error(f"--compare takes ENV=VALUE[,ENV=VALUE...], got {args.compare!r}")
        settings.append((args.compare, {key: value for key, _, value in pairs}))
    per: dict[str, list[dict[str, float]]] = {name: [] for name, _ in settings}
    steps_ms: dict[str, list[float]] = {name: [] for name, _ in settings}
    decode_steps(lm, args, 7)  # a first pass: the kernels' first calls, the allocator's first pages
    for r in range(args.rounds):
        for name, env in (settings if r % 2 == 0 else settings[::-1]):
            with environment(env):
                clock.reset()
                times = decode_steps(lm, args, 10 + r, None if args.no_clock else clock)
            n = len(times)
            per[name].append({k: v * 1000 / n for k, v in clock.exclusive.items()})
            steps_ms[name].append(sum(times) / n * 1000)
    restore()
    ops = [] if args.no_ops else profile_ops(lm, args)
    end_load = os.getloadavg()[0]

    print(f"\n- command: `{command_line()}`")
    print(f"- {machine_line()}; threads {args.threads}; {load_line(end_load, start_load)}")
    print(f"- date: {now_iso()}; memory bandwidth (torch sum over {args.bandwidth_mib} MiB, all cores, best of 5): "
          f"read {bw.read_gbs:.1f} GB/s")
    print(f"- {args.prompt}-token prompt, {args.steps} decode steps x {args.rounds} rounds; ms per step are the "
          "median over rounds of each round's mean; exclusive wall time of each part")
    for name, _ in settings:
        cats = sorted({k for d in per[name] for k in d})
        med = {k: statistics.median(d.get(k, 0.0) for d in per[name]) for k in cats}
        step = statistics.median(steps_ms[name])
        accounted = sum(med.values())
        if args.no_clock:
            print(f"\n**{name}**: step {step:.2f} ms ({1000 / step:.1f} tok/s; no clock around the parts; rounds "
                  f"{', '.join(f'{v:.2f}' for v in steps_ms[name])})")
            continue
        print(f"\n**{name}**: step {step:.2f} ms ({1000 / step:.1f} tok/s; sum of the parts {accounted:.2f} ms)\n")
        rows = []
        for k in sorted(cats, key=lambda c: -med[c]):
            b = nbytes.get(k)
            gbs = f"{b / (med[k] / 1000) / 1e9:.1f}" if b and med[k] > 0 else ""
            floor = f"{b / (bw.read_gbs * 1e9) * 1000:.2f}" if b else ""
            rows.append([k, f"{med[k]:.2f}", f"{100 * med[k] / step:.0f}%", f"{b / 2**20:.0f}" if b else "", gbs,
                         floor])
        lin = [k for k in cats if k.startswith("linear") or k == "head"]
        lin_ms = sum(med[k] for k in lin)
        lin_b = sum(nbytes.get(k, 0) for k in lin)
        rows.append(["all linears + head", f"{lin_ms:.2f}", f"{100 * lin_ms / step:.0f}%", f"{lin_b / 2**20:.0f}",
                     f"{lin_b / (lin_ms / 1000) / 1e9:.1f}", f"{lin_b / (bw.read_gbs * 1e9) * 1000:.2f}"])
        print("\n".join(md_table(["part", "ms/step", "share", "MiB read", "GB/s", "ms at bandwidth"], rows,
                                 "lrrrrr")))
    if ops:
        total = sum(r[2] for r in ops)
        calls = sum(r[1] for r in ops)
        print(f"\n**torch profiler, one step** ({calls} op calls a step, {total:.1f} ms self CPU under the "
              "profiler; the top 20)\n")
        print("\n".join(md_table(["op", "calls/step", "self ms/step"],
                                 [[k, c, f"{t:.2f}"] for k, c, t in ops[:20]], "lrr")))
    logger.info("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
