"""cpu-kquant's packed form against the blocks read as stored, interleaved in one process (issue #34).

One build of this checkout's kernels (kernels/text_generation_server/kernels/cpu_native_kquant_src.py,
built alone with the native kernels' flags) runs both: `kquant_mm_into` on the file's layout (the
tiled code, PREFETCH_BYTES ahead: what served before) and `kquant_mm_packed_into` on the same blocks
after `kquant_pack` (at each prefetch distance asked). Weights are cold: each case cycles through
copies of random blocks (tests/gguf_writer.py k_quant_bytes) larger than the caches together, one
call per copy, the variants taking turns copy by copy. Prints the median and minimum ms per call
and GB/s of the stored bytes (the packed form reads 2.8% more for Q4_K, 1% for Q6_K), and checks
the outputs are equal (they must be: one float order).

    python benchmarks/gguf_kquant_packed.py --threads 1 --rows 1,2,8,128
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from gguf_kquant_ab import SRC, build  # noqa: E402
from gguf_writer import T, k_quant_bytes  # noqa: E402

# Qwen2.5-1.5B's layers (N x K): q, k, v fused; gate and up fused; the untied head
SHAPES = {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960),
          "head": (151936, 1536)}
CASES = "Q4_K:gate_up,Q4_K:qkv,Q4_K:o,Q4_K:down,Q6_K:qkv,Q6_K:down,Q6_K:head"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,8,128")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7, help="passes over the copies (one call per copy and variant)")
    parser.add_argument("--cold-mb", type=float, default=160.0, help="the copies of a case total at least this")
    parser.add_argument("--stored-prefetch", type=int, default=1024,
                        help="the stored layout's distance (PREFETCH_BYTES)")
    parser.add_argument("--packed-prefetch", default="0,1024", help="the packed form's distances to time")
    parser.add_argument("--cases", default=CASES, help=f"type:layer pairs, layers among {','.join(SHAPES)}")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    module = build((ROOT / SRC).read_text(), "packed")
    if not module.kquant_packed_isa():
        raise SystemExit("this build has no packed kernel (needs AVX-512BW)")
    distances = [int(v) for v in args.packed_prefetch.split(",")]
    names = [f"stored pf{args.stored_prefetch}"] + [f"packed pf{v}" for v in distances]
    print(f"# cpu-kquant packed vs stored, {args.threads} thread(s), cold weights "
          f"(>= {args.cold_mb:.0f} MB of copies), "
          f"median (min) ms per call of {args.rounds} rounds; 1-min load {os.getloadavg()[0]:.2f}\n")
    print("| type | layer (N x K) | rows | " + " | ".join(f"{n} ms" for n in names) + " | stored / best packed | "
          "packed GB/s |")
    print("|---|---|---:|" + "---:|" * (len(names) + 2))
    for case in args.cases.split(","):
        tname, layer = case.split(":")
        qtype = T[tname]
        n, k = SHAPES[layer]
        raw = torch.from_numpy(k_quant_bytes(np.random.default_rng(0), qtype, n, k))
        copies = max(1, math.ceil(args.cold_mb * 1e6 / raw.numel()))
        stored = [raw.clone() for _ in range(copies)]
        start = time.perf_counter()
        packed = [module.kquant_pack(w, int(qtype)) for w in stored]
        pack_s = (time.perf_counter() - start) / copies
        for m in (int(r) for r in args.rows.split(",")):
            q, d, s = module.kquant_quantize_q8k(torch.randn(m, k))
            outs = [torch.empty(m, n) for _ in names]

            def call(i: int, c: int) -> None:
                if i == 0:
                    module.kquant_mm_into(q, d, s, stored[c], int(qtype), args.stored_prefetch, outs[0], 0)
                else:
                    module.kquant_mm_packed_into(q, d, s, packed[c], n, int(qtype), distances[i - 1], outs[i], 0)

            for i in range(len(names)):
                call(i, 0)
            for i in range(1, len(names)):
                if not torch.equal(outs[0], outs[i]):
                    raise SystemExit(f"{case} rows {m}: {names[i]} differs from the stored layout's result")
            times: list[list[float]] = [[] for _ in names]
            for _ in range(args.rounds):
                for c in range(copies):
                    for i in range(len(names)):
                        t0 = time.perf_counter()
                        # each variant a share of the copies behind the last: a copy one variant read is
                        # read by the next only after a cycle's worth of others (calling every variant on
                        # copy c in turn let all but the first find a layer under 32 MB in L3)
                        call(i, (c + i * (copies // len(names))) % copies)
                        times[i].append(time.perf_counter() - t0)
            med = [statistics.median(t) for t in times]
            best = min(med[1:])
            cells = " | ".join(f"{v * 1e3:.3f} ({min(t) * 1e3:.3f})" for v, t in zip(med, times))
            print(f"| {tname} | {layer} {n} x {k} | {m} | {cells} | {med[0] / best:.2f}x "
                  f"| {raw.numel() / best / 1e9:.1f} |", flush=True)
        print(f"<!-- {case}: kquant_pack {pack_s * 1e3:.1f} ms per copy ({raw.numel() / pack_s / 1e9:.1f} GB/s), "
              f"{copies} copies, load {os.getloadavg()[0]:.2f} -->", flush=True)
        del stored, packed
    print(f"\n1-min load {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
