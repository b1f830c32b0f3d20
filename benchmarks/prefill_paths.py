"""What a short prefill costs on the prompt path, against the row-count path it took before.

A prefill forward takes one path per layer whatever its row count (kernels/phase.py), so a
prompt's rows never depend on its chunking. For the CPU kernels that path is the dequantized
bfloat16 GEMM (int8, int4) or torch's GEMM on inputs padded to PROMPT_MIN_ROWS rows (dense and
the reference): what a prompt of many rows always took. A prefill of a few rows (a short prompt,
or the last few tokens of a chunked or prefix-cached one) used to take the decode path of its row
count instead (the int8 or bf16 matrix-vector kernel, torch's weight-only op); this script times
both, interleaved, on cold weights (copies cycled so each call streams its weights from DRAM).

    python benchmarks/prefill_paths.py                         # Qwen2.5-1.5B MLP up: 1536 x 8960
    python benchmarks/prefill_paths.py --shape 4096x4096 --rows 1,2,4,8,16 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import datetime
import math
import os
import statistics
import time

import torch

from bench_common import command_line, cpu_model, md_table, ratio  # benchmarks/ is on sys.path here
from text_generation_server.kernels import cpu_native
from text_generation_server.kernels.base import QuantizedWeight
from text_generation_server.kernels.dense import DenseLinear
from text_generation_server.kernels.phase import forward_phase
from text_generation_server.kernels.select import build_linear


def codes(k: int, n: int, bits: int, group: int) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(k + n + bits)
    q = torch.randint(0, 2**bits, (k, n), dtype=torch.uint8, generator=gen)
    scales = torch.rand(-(-k // group), n, generator=gen) * 0.01 + 0.001
    return QuantizedWeight(q, scales, None, torch.arange(k, dtype=torch.int32) // group, bits, group)


def layers(k: int, n: int) -> dict[str, torch.nn.Module]:
    dense = torch.randn(n, k, generator=torch.Generator().manual_seed(k * n)) * 0.02
    return {
        "int8 per-channel": build_linear(codes(k, n, 8, k), None, torch.bfloat16, "cpu"),
        "int4 g128": build_linear(codes(k, n, 4, 128), None, torch.bfloat16, "cpu"),
        "bf16 dense": DenseLinear(dense.bfloat16(), None),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="1536x8960", help="K x N (in x out)")
    ap.add_argument("--rows", default="1,2,4,8", help="prefill row counts")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--reps", type=int, default=30, help="interleaved rounds")
    ap.add_argument("--working-set-mib", type=int, default=640, help="weights read between two reads of one copy")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    k, n = (int(v) for v in args.shape.split("x"))
    rows = [int(r) for r in args.rows.split(",")]
    if cpu_native.native() is None:
        raise SystemExit(f"native CPU kernels unavailable ({cpu_native.unavailable_reason()}): nothing to compare")
    built = layers(k, n)
    per_round = sum(sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])
                    for m in built.values())
    count = max(2, math.ceil((args.working_set_mib << 20) / per_round))
    copies = {name: [m] + [copy.deepcopy(m) for _ in range(count - 1)] for name, m in built.items()}
    times: dict[tuple[str, int, bool], list[float]] = {}
    started = time.time()
    with torch.inference_mode():
        for r in rows:
            x = torch.randn(r, k, generator=torch.Generator().manual_seed(r)).bfloat16()
            for i in range(args.reps + 2):  # the first two rounds warm up
                for name, mods in copies.items():
                    for prefill in (False, True):
                        module = mods[(2 * i + prefill) % count]
                        with forward_phase(prefill):
                            t0 = time.perf_counter()
                            module(x)
                            elapsed = time.perf_counter() - t0
                        if i >= 2:
                            times.setdefault((name, r, prefill), []).append(elapsed)
    head = ["layer", "rows", "before: row-count path ms", "now: prompt path ms", "now / before"]
    body = []
    for name in copies:
        for r in rows:
            before = statistics.median(times[(name, r, False)]) * 1e3
            now = statistics.median(times[(name, r, True)]) * 1e3
            body.append([name, r, f"{before:.3f}", f"{now:.3f}", ratio(now, before)])
    print(f"Command: `{command_line(script='benchmarks/prefill_paths.py')}`")
    print(f"Machine: {cpu_model()}, {torch.get_num_threads()} threads ({os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}); torch {torch.__version__}; {datetime.date.today().isoformat()}; K x N = "
          f"{k} x {n}, bf16 activations, cold weights ({count} copies), median of {args.reps} interleaved rounds; "
          f"run took {time.time() - started:.0f} s.")
    print()
    print("\n".join(md_table(head, body, "lrrrr")))


if __name__ == "__main__":
    main()
