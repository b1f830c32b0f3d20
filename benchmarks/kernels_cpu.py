"""Every quantized CPU kernel path against dense matmul on Llama-7B layer shapes.

Prints one markdown table per layer shape: a row per quantized format with the kernel the
project's own selection picks for it (`module.kernel_name`), the module's resident bytes
against a dense bf16 weight, its output error against its own dequantized weight, and its
time at each batch as a ratio to dense F.linear in bf16 and in fp32. Every format runs in
the same interleaved rounds, so the ratios share the machine's state.

Formats (--formats picks a subset; fp32 and bf16 dense always run):
  int4-sym, int4-asym, int4-act   4-bit g128 codes through build_linear (cpu-int4pack)
  bf16-gemv                       a dense bfloat16 layer as models build it (kernels/dense.py: the
                                  native matrix-vector product at 1-2 rows)
  read                            torch's float32 sum over a bf16 copy of the weight's bytes on the same threads: a
                                  plain read of the bytes, the denominator of the bandwidth shares
                                  printed when it runs
  int8                            8-bit per-channel codes through build_linear (cpu-int8)
  int4-prompt                     int4-sym inside a prefill forward: the prompt path at every batch
                                  (the native kernel reading the packed codes, kernels/cpu.py)
  int4-dequant                    the same with the dequantized bf16 GEMM forced as the prompt path
                                  (what int4 prompts ran before the native kernel)
  int4-torch, int8-torch          int4-sym and int8 with the native CPU kernels detached
                                  (kernels/cpu_native.py): torch's weight-only ops at every batch
  marlin4, marlin8                symmetric 4/8-bit g128 with cpu-int4pack, cpu-int8 and
                                  reference switched off by TGS_DISABLE_KERNELS for that build
                                  only, which is how a deployment reaches marlin-layout (it
                                  ranks after the dense reference on CPU)
  fp8                             e4m3 weight, per-channel scales (the --quantize fp8 path):
                                  fp8-dense by default (dequantized once at load)
  fp8-resident                    the same with fp8-dense disabled: fp8-dequant keeps e4m3
  nf4                             bitsandbytes nf4, blocksize 64 (the on-load path):
                                  bnb-cpu-4bit on AVX512-BF16 CPUs, else the reference
  eetq                            --quantize eetq: int8 per-channel through ChannelInt8Weight
  exl2-lo, exl2-hi                EXL2 act-order weights with 32-row groups of mixed widths:
                                  2/3/4-bit (canonical 4-bit) and 4/5/6-bit (canonical 8-bit)

Weights are random: uniform codes for the integer formats (speed does not depend on the
values), N(0, 0.02) dense weights quantized the way the loaders do for fp8, nf4 and eetq.

By default the weights are cold: each label has enough copies that between two reads of one
copy the interleaved calls read at least --working-set-mib (default 640, above this machine's
reported 480 MiB L3) of other weights, counting the dense fp32 and bf16 copies alone, so every
timed call streams its weights from DRAM, as a decode step does. --hot reuses one copy
(cache-resident, dense bf16's best case). Kernels that dequantize every call (marlin-layout,
fp8-dequant) run tens of times slower than dense; after 3 rounds any format 10x slower than
bf16 leaves the rounds, so it does not starve the others of samples.

    python benchmarks/kernels_cpu.py                     # 4 shapes x batch 1, 4, 16, 64
    python benchmarks/kernels_cpu.py --quick             # 4096x4096 at batch 1 and 16
    python benchmarks/kernels_cpu.py --formats int4-sym,marlin4,nf4 --threads 1
    python benchmarks/kernels_cpu.py --qwen15b --formats bf16-gemv,read      # bf16's share of bandwidth
    python benchmarks/kernels_cpu.py --qwen15b --formats bf16-gemv,read --contended

--contended runs a busy Python loop pinned to the last core while timing (another process on a core).

On a machine shared with other jobs prefer --threads 1: with every core's thread in each call,
a call waits for the scheduler to run all of them, and on a loaded 2-core VM the medians of
every row collapse to the scheduler's time slice (about 8 ms), hiding the kernels' differences.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from bench_common import command_line, cpu_model, md_table, ratio  # benchmarks/ is on sys.path here
from text_generation_server.kernels.base import QuantizedWeight, dequantize
from text_generation_server.kernels.fp8 import Fp8Weight, dequantize_fp8
from text_generation_server.kernels.phase import forward_phase
from text_generation_server.kernels.select import DISABLE_ENV, build_linear
from text_generation_server.quantizers.eetq import ChannelInt8Weight, quantize_rows
from text_generation_server.quantizers.exl2 import Exl2Weight
from text_generation_server.quantizers.fp8 import Fp8LinearWeight, channel_scales, quantize_e4m3

SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (4096, 14336)]  # (in K, out N)
QWEN15B_SHAPES = [(1536, 2048), (1536, 1536), (1536, 17920), (8960, 1536)]  # qkv, o_proj, gate_up, down
BATCHES = [1, 4, 16, 64]
ACT = torch.bfloat16
DENSE = ("fp32", "bf16")
MIN_ROUNDS = 3  # every label is timed at least this often
SLOW_FACTOR = 10.0  # after MIN_ROUNDS, labels this many times slower than bf16 dense stop being timed


@contextlib.contextmanager
def kernels_disabled(names: list[str]) -> Iterator[None]:
    """TGS_DISABLE_KERNELS extended by `names` while building one module, then restored."""
    old = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = ",".join(filter(None, [old, *names]))
    try:
        yield
    finally:
        if old is None:
            del os.environ[DISABLE_ENV]
        else:
            os.environ[DISABLE_ENV] = old


BUSY = "while True: pass"


@contextlib.contextmanager
def contended(on: bool, core: int | None = None) -> Iterator[str]:
    """A busy Python loop pinned with taskset to one core (the last by default), nice 0, while the
    block runs: another process holding a core, as on a shared machine or beside serve's router."""
    if not on:
        yield "no busy loop"
        return
    core = (os.cpu_count() or 1) - 1 if core is None else core
    process = subprocess.Popen(["taskset", "-c", str(core), "nice", "-n", "0", sys.executable, "-c", BUSY])
    time.sleep(0.3)
    try:
        yield f"busy loop on core {core}"
    finally:
        process.kill()
        process.wait()


def layer(k: int, n: int) -> str:
    return f"bench {k}x{n}"


# -- weights, built the way each format's loader builds them ----------------------------------
def random_weight(k: int, n: int, bits: int, group_size: int | None, sym: bool, act_order: bool) -> QuantizedWeight:
    gs = group_size or k
    groups = math.ceil(k / gs)
    gen = torch.Generator().manual_seed(k * 31 + n + bits)
    q = torch.randint(0, 2**bits, (k, n), dtype=torch.uint8, generator=gen)
    scales = torch.rand(groups, n, generator=gen) * 0.01 + 0.001
    zeros = None if sym else torch.randint(0, 2**bits, (groups, n), generator=gen).float()
    g_idx = torch.arange(k, dtype=torch.int32) // gs
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    return QuantizedWeight(q, scales, zeros, g_idx, bits, gs)


def dense_weight(k: int, n: int) -> torch.Tensor:
    """float32 [N, K] ~ N(0, 0.02), like a Llama projection."""
    return torch.randn(n, k, generator=torch.Generator().manual_seed(k + n)) * 0.02


def int_format(bits: int, group_size: int | None, sym: bool, act_order: bool, disable: tuple[str, ...] = (),
               torch_ops_only: bool = False) -> Callable[[int, int], tuple[torch.nn.Module, torch.Tensor]]:
    """`torch_ops_only`: the same module with its native CPU kernels detached (kernels/cpu_native.py),
    i.e. torch's weight-only op at every batch: the baseline the native paths are measured against."""
    def build(k: int, n: int) -> tuple[torch.nn.Module, torch.Tensor]:
        w = random_weight(k, n, bits, group_size, sym, act_order)
        with kernels_disabled(list(disable)):
            module = build_linear(w, None, ACT, "cpu", layer=layer(k, n))
        if torch_ops_only:
            module.native = None
            module.kernel_name = f"{module.kernel_name} (torch op only)"
        return module, dequantize(w)
    return build


def fp8_format(disable: tuple[str, ...] = ()) -> Callable[[int, int], tuple[torch.nn.Module, torch.Tensor]]:
    def build(k: int, n: int) -> tuple[torch.nn.Module, torch.Tensor]:
        dense = dense_weight(k, n)
        scales = channel_scales(dense)  # [N, 1], as Fp8OnLoadLoader quantizes
        fp8 = Fp8Weight(weight=quantize_e4m3(dense, scales), scale=scales.contiguous(),
                        row_block=torch.arange(n, dtype=torch.int32), col_block=torch.zeros(k, dtype=torch.int32),
                        activation="dynamic-token")
        with kernels_disabled(list(disable)):
            module = Fp8LinearWeight(fp8, "bench", layer(k, n), ACT, "cpu").get_linear(None)
        return module, dequantize_fp8(fp8)
    return build


def nf4_format(k: int, n: int) -> tuple[torch.nn.Module, torch.Tensor]:
    from text_generation_server.quantizers.bitsandbytes import ON_LOAD_BLOCKSIZE, Bnb4bitWeight, bnb_functional

    dense = dense_weight(k, n)
    packed, state = bnb_functional().quantize_4bit(dense.contiguous(), blocksize=ON_LOAD_BLOCKSIZE,
                                                   quant_type="nf4", compress_statistics=False)
    w = Bnb4bitWeight(packed=packed.reshape(-1).contiguous(), absmax=state.absmax.float().contiguous(), rows=n,
                      cols=k, quant_type="nf4", blocksize=ON_LOAD_BLOCKSIZE, prefix="bench", layer=layer(k, n),
                      act_dtype=ACT, device_type="cpu")
    return w.get_linear(None), w.dequantize()


def eetq_format(k: int, n: int) -> tuple[torch.nn.Module, torch.Tensor]:
    dense = dense_weight(k, n)
    q, scales = quantize_rows(dense, dense.abs().amax(dim=1))
    w = ChannelInt8Weight(qweight=q, scales=scales, prefix="bench", layer=layer(k, n), act_dtype=ACT,
                          device_type="cpu")
    return w.get_linear(None), w.dequantize()


def exl2_format(widths: tuple[int, ...], rows: int = 32) -> Callable[[int, int], tuple[torch.nn.Module, torch.Tensor]]:
    """EXL2 weight with `rows`-row groups cycling through `widths`, rows in a random act-order."""
    def build(k: int, n: int) -> tuple[torch.nn.Module, torch.Tensor]:
        gen = torch.Generator().manual_seed(k * 7 + n + sum(widths))
        groups = -(-k // rows)
        group_widths = torch.tensor([widths[g % len(widths)] for g in range(groups)], dtype=torch.int32)
        g_stored = torch.arange(k, dtype=torch.int32) // rows  # group of each stored row
        half = (1 << (group_widths[g_stored.long()] - 1)).view(k, 1)  # 2^(b-1) per stored row
        codes = (torch.rand(k, n, generator=gen) * 2 * half).floor().sub(half).to(torch.int8)  # [-2^(b-1), 2^(b-1))
        order = torch.randperm(k, generator=gen)  # stored row j is original row order[j]
        g_idx = torch.empty_like(g_stored)
        g_idx[order] = g_stored
        original = torch.empty_like(codes)
        original[order] = codes
        scales = torch.rand(groups, n, generator=gen) * 0.002 + 0.0005
        w = Exl2Weight(codes=original, scales=scales, g_idx=g_idx, widths=group_widths, prefix="bench",
                       layer=layer(k, n), act_dtype=ACT, device_type="cpu")
        canonical = w.to_quantized()
        return w.get_linear(None), dequantize(canonical)
    return build


def bf16_gemv_format(k: int, n: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """The dense bfloat16 layer as a model builds it (kernels/dense.py): the native matrix-vector
    product at 1-2 rows, torch's GEMM above."""
    from text_generation_server.kernels.dense import DenseLinear

    dense = dense_weight(k, n)
    module = DenseLinear(dense.to(torch.bfloat16), None)
    module.kernel_name = "dense (native gemv)"
    return module, dense.to(torch.bfloat16).float()


class PlainRead(torch.nn.Module):
    """Reads a bfloat16 weight's bytes once a call (torch's sum, on the same threads): what the
    memory gives a kernel reading that many bytes, the denominator of a bandwidth share."""

    kernel_name = "torch sum (plain read)"

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bytes as float32 (each a bfloat16 pair: normal numbers of the weights' magnitude, so no
        # slow denormals): torch's float32 sum streams at memory speed, its bfloat16 sum does not
        # (1.4 GB/s on a 52 MiB weight here: the conversion, not the memory).
        return self.weight.view(torch.float32).sum()


def read_format(k: int, n: int) -> tuple[torch.nn.Module, torch.Tensor]:
    dense = dense_weight(k, n)
    return PlainRead(dense.to(torch.bfloat16)), dense


class Prefill(torch.nn.Module):
    """A layer called inside a prefill forward (kernels/phase.py): its prompt path at every batch,
    as prompts of that many rows (a chat turn after a cached prefix, a short prompt) run it."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.kernel_name = getattr(inner, "kernel_name", "?")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with forward_phase(prefill=True):
            return self.inner(x)


def prompt_path(build: Callable[[int, int], tuple[torch.nn.Module, torch.Tensor]], variant: str | None = None
                ) -> Callable[[int, int], tuple[torch.nn.Module, torch.Tensor]]:
    """`build`'s module on its prompt path; `variant`: that variant forced as the prompt path (the
    dequantized GEMM int4 prompts took before the native kernel: the baseline it is measured against)."""
    def wrapped(k: int, n: int) -> tuple[torch.nn.Module, torch.Tensor]:
        module, truth = build(k, n)
        if variant is not None:
            module.prompt_variant = lambda: variant
            module.kernel_name = f"{module.kernel_name} ({variant})"
        return Prefill(module), truth
    return wrapped


@dataclass(frozen=True)
class Format:
    key: str
    label: str
    build: Callable[[int, int], tuple[torch.nn.Module, torch.Tensor]]  # (K, N) -> (module, fp32 [N, K] truth)


FORMATS = [
    Format("int4-sym", "int4 g128 sym", int_format(4, 128, True, False)),
    Format("int4-asym", "int4 g128 asym", int_format(4, 128, False, False)),
    Format("int4-act", "int4 g128 act-order", int_format(4, 128, False, True)),
    Format("int4-torch", "int4 g128 sym, torch op only*", int_format(4, 128, True, False, torch_ops_only=True)),
    Format("int4-prompt", "int4 g128 sym, prompt path", prompt_path(int_format(4, 128, True, False))),
    Format("int4-dequant", "int4 g128 sym, prompt path dequantized*",
           prompt_path(int_format(4, 128, True, False), "dequant")),
    Format("bf16-gemv", "bf16 dense layer (native gemv)", bf16_gemv_format),
    Format("read", "plain read of a bf16 weight*", read_format),
    Format("int8", "int8 per-channel", int_format(8, None, True, False)),
    Format("int8-torch", "int8 per-channel, torch op only*", int_format(8, None, True, False, torch_ops_only=True)),
    Format("marlin4", "marlin 4-bit g128 sym*", int_format(4, 128, True, False, ("cpu-int4pack", "cpu-int8", "reference"))),
    Format("marlin8", "marlin 8-bit g128 sym*", int_format(8, 128, True, False, ("cpu-int4pack", "cpu-int8", "reference"))),
    Format("fp8", "fp8 e4m3 per-channel", fp8_format()),
    Format("fp8-resident", "fp8 e4m3 per-channel*", fp8_format(("fp8-dense",))),
    Format("nf4", "bnb nf4 b64", nf4_format),
    Format("eetq", "eetq int8 per-channel", eetq_format),
    Format("exl2-lo", "exl2 2/3/4-bit g32 act", exl2_format((2, 3, 4, 4))),
    Format("exl2-hi", "exl2 4/5/6-bit g32 act", exl2_format((4, 5, 6, 5))),
]


# -- measuring ---------------------------------------------------------------------------------
def resident_bytes(module: torch.nn.Module) -> int:
    """Bytes of every tensor the module keeps: parameters, buffers, and tensors held in plain
    attributes or state objects (bitsandbytes keeps absmax in a QuantState, not a buffer)."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(value: object, depth: int) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            key = (value.data_ptr(), value.numel())
            if key not in seen:
                seen.add(key)
                total += value.numel() * value.element_size()
        elif depth < 2 and not isinstance(value, (torch.nn.Module, type)) and hasattr(value, "__dict__"):
            for v in vars(value).values():
                add(v, depth + 1)

    for t in list(module.parameters()) + list(module.buffers()):
        add(t, 0)
    for m in module.modules():
        for v in vars(m).values():
            add(v, 0)
    return total


class Dense(torch.nn.Module):
    kernel_name = "F.linear"

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def relative_error(module: torch.nn.Module, truth: torch.Tensor, x: torch.Tensor) -> float:
    """max |y - y_ref| / max |y_ref| against the module's own dequantized weight, both from bf16 x."""
    with torch.inference_mode():
        y = module(x.to(ACT)).float()
        ref = F.linear(x.to(ACT).float(), truth)
    if y.shape != ref.shape:  # the plain read computes no product
        return float("nan")
    return float((y - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def time_interleaved(copies: dict[str, list[torch.nn.Module]], inputs: dict[str, torch.Tensor], budget_s: float,
                     max_rounds: int, keep: tuple[str, ...] = DENSE) -> dict[str, list[float]]:
    """Seconds per call for each label. Rounds call every label once, each on its next copy, so a
    change in machine load hits all labels alike. After MIN_ROUNDS rounds, labels whose median is
    SLOW_FACTOR times bf16's leave the rounds (a few samples say enough about a kernel that slow,
    and they would starve the others of rounds); then rounds go on for `budget_s` or `max_rounds`."""
    times: dict[str, list[float]] = {label: [] for label in copies}
    active = list(copies)
    with torch.inference_mode():
        for label, mods in copies.items():
            for m in mods[:2]:
                m(inputs[label])  # warm up code paths and the allocator
        rounds, start = 0, math.inf
        while rounds < max_rounds and (rounds < MIN_ROUNDS or time.perf_counter() - start < budget_s):
            for label in active:
                m, x = copies[label][rounds % len(copies[label])], inputs[label]
                t0 = time.perf_counter()
                m(x)
                times[label].append(time.perf_counter() - t0)
            rounds += 1
            if rounds == MIN_ROUNDS:
                bar = SLOW_FACTOR * statistics.median(times["bf16"])
                active = [lbl for lbl in active if lbl in keep or statistics.median(times[lbl]) < bar]
                start = time.perf_counter()
    return times


@dataclass
class ShapeResult:
    k: int
    n: int
    copies: int
    kernels: dict[str, str]
    nbytes: dict[str, int]
    errors: dict[str, float]
    times: dict[int, dict[str, list[float]]]  # batch -> label -> seconds per call


def run_shape(k: int, n: int, formats: list[Format], batches: list[int], working_set: int, budget: float,
              reps: int) -> ShapeResult:
    modules: dict[str, torch.nn.Module] = {}
    errors: dict[str, float] = {}
    probe = torch.randn(4, k, generator=torch.Generator().manual_seed(k))
    dense = dense_weight(k, n)
    modules["fp32"], modules["bf16"] = Dense(dense), Dense(dense.to(torch.bfloat16))
    del dense
    for fmt in formats:
        t0 = time.perf_counter()
        module, truth = fmt.build(k, n)
        errors[fmt.key] = relative_error(module, truth, probe)
        del truth
        modules[fmt.key] = module
        print(f"{k}x{n} {fmt.key}: {module.kernel_name}, built in {time.perf_counter() - t0:.1f} s", flush=True)
    nbytes = {label: resident_bytes(m) for label, m in modules.items()}
    # Every round reads each label's next copy, so a copy is read again `count` rounds later,
    # after at least count * (dense bytes) of other weights: the dense labels never leave the
    # rounds (slow quantized ones may), so only their bytes are counted on.
    round_bytes = sum(nbytes[label] for label in DENSE)
    count = 1 if working_set == 0 else max(2, math.ceil(working_set / round_bytes))
    copies = {label: [m] + [copy.deepcopy(m) for _ in range(count - 1)] for label, m in modules.items()}
    kernels = {label: m.kernel_name for label, m in modules.items()}
    del modules
    times: dict[int, dict[str, list[float]]] = {}
    for m in batches:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        inputs = {label: x if label == "fp32" else x.to(ACT) for label in copies}
        times[m] = time_interleaved(copies, inputs, budget * (2 if m == 1 else 1), reps)
        print(f"{k}x{n} batch {m}: " + ", ".join(f"{lbl} {1e3 * statistics.median(t):.2f} ms ({len(t)})"
                                                 for lbl, t in times[m].items()), flush=True)
    return ShapeResult(k, n, count, kernels, nbytes, errors, times)


# -- report ------------------------------------------------------------------------------------
def print_table(res: ShapeResult, formats: list[Format], stat: Callable[[list[float]], float]) -> None:
    batches = list(res.times)
    head = ["format", "kernel", "MiB (vs bf16)", "rel. err"] + [f"batch {m} ms (vs bf16 / vs fp32)" for m in batches]
    rows = []
    for key, label in [(lbl, f"{lbl} dense") for lbl in DENSE] + [(f.key, f.label) for f in formats]:
        mib = res.nbytes[key] / 2**20
        err = f"{res.errors[key]:.1e}" if key in res.errors else "-"
        cells = [label, res.kernels[key], f"{mib:.1f} ({ratio(res.nbytes[key], res.nbytes['bf16'])})", err]
        for m in batches:
            t = {lbl: 1e3 * stat(v) for lbl, v in res.times[m].items()}
            cells.append(f"{t[key]:.2f} ({ratio(t['bf16'], t[key])} / {ratio(t['fp32'], t[key])})")
        rows.append(cells)
    print("\n".join(md_table(head, rows, "llrr" + "r" * len(batches))))
    print()


def print_shares(results: list[ShapeResult], formats: list[Format]) -> None:
    """GB/s of each module's resident bytes at batch 1 (median), and its share of the plain read's GB/s."""
    head = ["K x N", "read GB/s"] + [f"{f.key} GB/s (share)" for f in formats]
    rows = []
    for res in results:
        if 1 not in res.times:
            continue
        gbs = {lbl: res.nbytes[lbl] / statistics.median(t) / 1e9 for lbl, t in res.times[1].items()}
        rows.append([f"{res.k} x {res.n}", f"{gbs['read']:.1f}"]
                    + [f"{gbs[f.key]:.1f} ({gbs[f.key] / gbs['read']:.0%})" for f in formats])
    print("Bandwidth at batch 1 (resident bytes / median time) and its share of the plain read's:")
    print()
    print("\n".join(md_table(head, rows, "l" + "r" * (len(head) - 1))))
    print()


def parse_formats(spec: str) -> list[Format]:
    by_key = {f.key: f for f in FORMATS}
    if spec == "all":
        return list(FORMATS)
    keys = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in keys if s not in by_key]
    if unknown or not keys:
        raise SystemExit(f"--formats: unknown {', '.join(unknown) or '(empty)'}; choose from "
                         f"{', '.join(by_key)} or 'all'")
    return [by_key[s] for s in keys]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="KxN list (in x out)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--formats", default="all", help="comma list of " + ", ".join(f.key for f in FORMATS))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--budget", type=float, default=3.0, help="seconds of timing per shape and batch after the first 3 rounds (doubled at batch 1)")
    ap.add_argument("--reps", type=int, default=25, help="at most this many rounds (one call per format each)")
    ap.add_argument("--working-set-mib", type=int, default=640,
                    help="weights read between two reads of one copy (cold weights)")
    ap.add_argument("--hot", action="store_true", help="reuse one copy of the weights (cache-resident)")
    ap.add_argument("--quick", action="store_true", help="4096x4096, batch 1 and 16")
    ap.add_argument("--qwen15b", action="store_true",
                    help="Qwen2.5-1.5B's layer shapes (qkv, o_proj, gate_up, down) at batch 1")
    ap.add_argument("--contended", action="store_true",
                    help="a busy Python loop pinned to the last core while timing (a shared machine)")
    args = ap.parse_args()
    if args.quick:
        args.shapes, args.batches = "4096x4096", "1,16"
    if args.qwen15b:
        args.shapes, args.batches = ",".join(f"{k}x{n}" for k, n in QWEN15B_SHAPES), "1"
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    formats = parse_formats(args.formats)
    torch.set_num_threads(args.threads)
    working_set = 0 if args.hot else args.working_set_mib << 20

    started = time.time()
    with contended(args.contended) as how:
        start_load = os.getloadavg()[0]
        results = [run_shape(k, n, formats, batches, working_set, args.budget, args.reps) for k, n in shapes]

    print()
    print(f"Command: `{command_line(script='benchmarks/kernels_cpu.py')}`")
    regime = ("cache-resident (--hot)" if args.hot else
              f"cold: >= {args.working_set_mib} MiB of weights read between two reads of one copy "
              f"({', '.join(f'{r.k}x{r.n}: {r.copies} copies' for r in results)})")
    threads = torch.get_num_threads()
    print(f"Machine: {cpu_model()}, {threads} thread{'s' if threads != 1 else ''} ({os.cpu_count()} cores, load average "
          f"{start_load:.2f} -> {os.getloadavg()[0]:.2f}; {how}); torch {torch.__version__}; "
          f"{datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='minutes')}; "
          f"weights {regime}; bf16 activations; up to {args.reps} interleaved rounds (formats over "
          f"{SLOW_FACTOR:g}x slower than bf16 dense: {MIN_ROUNDS}); "
          f"run took {time.time() - started:.0f} s.")
    print("Speed-up = dense time / this time (higher is better). MiB: resident bytes of the module. "
          "rel. err: max |y - y_ref| / max |y_ref| at batch 4 against the format's own dequantized weight.")
    if any(f.key.startswith("marlin") for f in formats):
        print(f"* built with {DISABLE_ENV}=cpu-int4pack,cpu-int8,reference (marlin-layout ranks after the dense "
              "reference on CPU; a Marlin checkpoint otherwise runs on cpu-int4pack or the reference).")
    if any(f.key.endswith("-torch") for f in formats):
        print("* int4-torch, int8-torch: the int4-sym and int8 modules with their native CPU kernels detached "
              "(torch's weight-only op at every batch).")
    if any(f.key == "fp8-resident" for f in formats):
        print(f"* fp8-resident: built with {DISABLE_ENV}=fp8-dense (fp8-dequant keeps the weight in e4m3).")
    if any(f.key == "read" for f in formats):
        print("* read: torch's float32 sum over a bf16 copy of the weight's bytes (the same bytes, the same threads): "
              "the memory's rate for that many bytes.")
        print()
        print_shares(results, [f for f in formats if f.key != "read"])
    print()
    for stat, name in ((statistics.median, "Median"), (min, "Minimum")):
        for res in results:
            print(f"{name} times, K x N = {res.k} x {res.n}:")
            print()
            print_table(res, formats, stat)


if __name__ == "__main__":
    main()
