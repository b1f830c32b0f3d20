"""GGUF layers on the CPU kernels the table picks, against the dense reference, side by side.

Qwen2.5-1.5B's layer shapes (qkv 1536->2048, o 1536->1536, gate_up 1536->17920, down 8960->1536),
each in the ggml types a Q4_K_M / Q5_K_M / Q8_0 file stores (random blocks written the way
tests/gguf_writer.py writes them, decoded by quantizers/gguf_blocks.py): the layer built through
build_linear (cpu-int4pack for Q4_K, cpu-int8-group for Q5_K, Q6_K, Q8_0) and the same weight on
the `reference` kernel (dequantized once, dense matmul), timed in interleaved rounds at each row
count. Where the table picks cpu-int8-group-native, the torch kernel (cpu-int8-group) on the same
weight runs in the same rounds too; Q4_K and Q6_K also run on `cpu-kquant`, their blocks read as stored
(what a GGUF file loads to on the CPU now: for them "chosen" is the decoded form's kernel, the one
TGS_DISABLE_KERNELS=cpu-kquant leaves). Prints resident MiB and time per call, and the ratio reference / chosen (above 1: the
chosen kernel is faster).

    python benchmarks/gguf_kernels.py                 # rows 1, 8, 64, float32 and bfloat16
    python benchmarks/gguf_kernels.py --rows 1 --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from gguf_writer import T, k_quant_bytes  # noqa: E402

from bench_common import load_line, machine_line, md_table, now_iso  # noqa: E402
from text_generation_server.kernels.base import ReferenceKernel  # noqa: E402
from text_generation_server.kernels.cpu_group_int8 import CpuGroupInt8Kernel, CpuGroupInt8NativeKernel  # noqa: E402
from text_generation_server.kernels.cpu_kquant import KQUANT_TYPES, CpuKQuantKernel, KQuantBlocks  # noqa: E402
from text_generation_server.kernels.select import build_linear  # noqa: E402
from text_generation_server.quantizers.gguf import GGUFWeight  # noqa: E402
from text_generation_server.quantizers.gguf_blocks import FORMATS, decode  # noqa: E402

SHAPES = {"qkv": (1536, 2048), "o": (1536, 1536), "gate_up": (1536, 17920), "down": (8960, 1536),
          "v": (1536, 256), "lm_head": (1536, 151936)}
DEFAULT_SHAPES = "qkv,o,gate_up,down"
TYPES = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0)


def weight(qtype, k: int, n: int, dtype: torch.dtype) -> tuple[GGUFWeight, torch.Tensor]:
    import gguf
    import numpy as np

    fmt = FORMATS[int(qtype)]
    rng = np.random.default_rng(0)
    if fmt.block == 256:
        raw = k_quant_bytes(rng, qtype, n, k)
    else:
        raw = gguf.quants.quantize(rng.normal(0, 0.02, (n, k)).astype(np.float32), qtype)
    codes, scales, zeros = decode(fmt, torch.from_numpy(raw)).canonical_zeros()
    return GGUFWeight(qweight=codes.t().contiguous(), scales=scales.t().contiguous(),
                      zeros=None if zeros is None else zeros.t().contiguous(),
                      g_idx=torch.arange(k, dtype=torch.int32) // fmt.group, bits=fmt.bits, group_size=fmt.group,
                      ggml=fmt.name, act_dtype=dtype), torch.from_numpy(raw)


def resident_mib(module: torch.nn.Module) -> float:
    return sum(t.numel() * t.element_size() for t in list(module.buffers()) + list(module.parameters())) / 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--types", default=",".join(t.name for t in TYPES), help="ggml types to run")
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"layers among {','.join(SHAPES)}")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    load_start = os.getloadavg()[0]
    print(f"# GGUF layers: chosen kernel vs reference ({now_iso()})\n")
    print(machine_line(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)"))
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        table = []
        for qtype in [T[name] for name in args.types.split(",")]:
            for shape in args.shapes.split(","):
                k, n = SHAPES[shape]
                w, raw = weight(qtype, k, n, dtype)
                chosen = build_linear(w, None, dtype, "cpu")  # the decoded (canonical) form's kernel
                reference = ReferenceKernel.build(w, None, dtype)
                layers = [("chosen", chosen), ("reference", reference)]
                if int(qtype) in KQUANT_TYPES and CpuKQuantKernel.can_implement(
                        KQuantBlocks((raw,), int(qtype)).spec(dtype, "cpu"))[0]:
                    layers.append(("in place", CpuKQuantKernel.build(KQuantBlocks((raw,), int(qtype)), None, dtype)))
                if chosen.kernel_name == CpuGroupInt8NativeKernel.name:
                    layers.append(("torch", CpuGroupInt8Kernel.build(w, None, dtype)))
                xs = {r: torch.randn(r, k).to(dtype) for r in rows}
                times: dict[tuple[str, int], list[float]] = {}
                for _ in range(args.rounds):
                    for r in rows:
                        for name, layer in layers:
                            t = time.perf_counter()
                            with torch.inference_mode():
                                layer(xs[r])
                            times.setdefault((name, r), []).append(time.perf_counter() - t)
                for r in rows:
                    c, ref = (statistics.median(times[n_, r]) for n_ in ("chosen", "reference"))
                    tk = statistics.median(times["torch", r]) if ("torch", r) in times else None
                    kq = statistics.median(times["in place", r]) if ("in place", r) in times else None
                    table.append([qtype.name, shape, chosen.kernel_name, r, f"{resident_mib(chosen):.1f}",
                                  f"{resident_mib(reference):.1f}", f"{c * 1e3:.2f}", f"{ref * 1e3:.2f}",
                                  f"{ref / c:.2f}", "" if tk is None else f"{tk * 1e3:.2f}",
                                  "" if tk is None else f"{tk / c:.2f}", "" if kq is None else f"{kq * 1e3:.2f}",
                                  "" if kq is None else f"{c / kq:.2f}"])
        print(f"\n## activations {dtype_name}\n")
        print("\n".join(md_table(["type", "layer", "kernel", "rows", "MiB", "reference MiB", "ms", "reference ms",
                                  "reference / chosen", "cpu-int8-group ms", "cpu-int8-group / chosen",
                                  "cpu-kquant ms", "chosen / cpu-kquant"], table)))
    print("\n" + load_line(start=load_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
