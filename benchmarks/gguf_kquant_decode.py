"""cpu-kquant's one-row (decode) layer call against another commit's and a plain read of its bytes (issue #34).

At one row a K-quant layer should take (its packed bytes) / (memory bandwidth): the weights are read
once, everything else is per-call fixed cost. This builds two copies of the kernels (this checkout's
kernels/text_generation_server/kernels/cpu_native_kquant_src.py and the same file at `--against`,
each with the native pool tgs::parallel_for in front, the native kernels' flags) plus a read kernel
(the packed bytes summed with 64-byte loads, split over the same pool in the same tile-sized units),
and times the call the model makes, `kquant_linear` on a bfloat16 row with the layer's parts packed
(activation quantization and output allocation included, no bias): a read of `--against`'s buffers,
a read of this checkout's (cpu_kquant.pack: the arena, huge pages where granted), theirs, ours, call
by call in turn. Weights are cold: each case cycles through copies of random blocks
(tests/gguf_writer.py k_quant_bytes) larger than the caches together, each variant a share of the
copies behind the one before it, so no call finds weights another just read. A case may give each part
its type ("Q4_K/Q4_K/Q6_K:qkv", a Q4_K_M file's mixed qkv): this checkout makes it one call; a commit
whose kquant_linear takes one type runs it as the model did there, a call per run of one type and a
torch.cat (quantizers/gguf.py SplitLinear). `--same-pages` copies
`--against`'s packed layers into an arena too (the kernels alone compared), `--hot` calls one copy over
and over (the kernels' own speed from cache). Prints median ms per call and GB/s of the packed bytes,
and checks that both commits' outputs are equal bit for bit.

    flock /tmp/tgs-bench.lock python benchmarks/gguf_kquant_decode.py --against main --threads 1,2
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
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

from text_generation_server.kernels.cpu_kquant import PACKED_PREFETCH_HUGE, PackArena, pack  # noqa: E402

# Qwen2.5-1.5B's layers as one call each (parts N x K): q, k, v fused; gate and up fused; the untied head
SHAPES = {"qkv": ([1536, 256, 256], 1536), "o": ([1536], 1536), "gate_up": ([8960, 8960], 1536),
          "down": ([1536], 8960), "head": ([151936], 1536), "tiny": ([16], 1536), "small": ([256], 1536)}
CASES = "Q4_K:qkv,Q4_K/Q4_K/Q6_K:qkv,Q4_K:o,Q4_K:gate_up,Q4_K:down,Q6_K:down,Q6_K:head"
PREFETCH, PREFETCH_MAX = 4096, 64 << 20  # cpu_kquant.PACKED_PREFETCH_BYTES / _MAX_BYTES before huge pages

READ = r"""
// The bytes of `parts` summed as uint64 lanes with 64-byte loads (a plain read at memory speed), split
// over tgs::parallel_for in units of `unit` bytes numbered across the parts, as the kernels split tiles.
int64_t kq_read(std::vector<torch::Tensor> parts, int64_t unit) {
  std::vector<int64_t> first(parts.size() + 1, 0);
  for (size_t i = 0; i < parts.size(); ++i) first[i + 1] = first[i] + (parts[i].numel() / 64 * 64 + unit - 1) / unit;
  std::atomic<int64_t> total{0};
  tgs::parallel_for(0, first.back(), 1, [&](int64_t u0, int64_t u1) {
    __m512i acc = _mm512_setzero_si512();
    size_t i = 0;
    for (int64_t u = u0; u < u1; ++u) {
      while (u >= first[i + 1]) ++i;
      const uint8_t* p = parts[i].data_ptr<uint8_t>();
      const int64_t n = parts[i].numel() / 64 * 64, b = (u - first[i]) * unit, e = std::min(n, b + unit);
      for (int64_t at = b; at < e; at += 64) acc = _mm512_add_epi64(acc, _mm512_loadu_si512(p + at));
    }
    total += _mm512_reduce_add_epi64(acc);
  });
  return total.load();
}
"""


def layer_call(module, x: torch.Tensor, parts: list[torch.Tensor], types: list[int], bias: torch.Tensor,
               prefetch: list[int], ns: list[int]) -> torch.Tensor:
    """The model's one-row call of a layer on `module`'s kquant_linear: one call with per-part types and
    prefetch distances, x last (this checkout's signature), or, on a commit whose kquant_linear takes one type and
    one distance, a call per run of parts of one type and a torch.cat of their outputs (its SplitLinear)."""
    if module.tgs_per_part_types:
        return module.kquant_linear(parts, types, bias, prefetch, ns, x)
    outs, i = [], 0
    while i < len(parts):
        j = i
        while j < len(parts) and types[j] == types[i]:
            j += 1
        outs.append(module.kquant_linear(x, parts[i:j], types[i], bias, prefetch[i], ns[i:j]))
        i = j
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", default="main", help="the commit whose kernel to compare with")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=5, help="passes over the copies (one call per copy and variant)")
    parser.add_argument("--cold-mb", type=float, default=128.0, help="the copies of a case total at least this")
    parser.add_argument("--hot", action="store_true",
                        help="one copy, called over and over (weights from cache where they fit: the kernel's "
                             "own speed)")
    parser.add_argument("--same-pages", action="store_true",
                        help="--against's packed layers copied into this checkout's arena too (the kernels "
                             "alone compared)")
    parser.add_argument("--prefetch", type=int, default=-1,
                        help="bytes ahead for both (default: each commit's rule: --against 4 KiB, none above 64 MiB; "
                             "this checkout cpu_kquant.PACKED_PREFETCH_HUGE on huge pages)")
    parser.add_argument("--cases", default=CASES,
                        help=f"type:layer pairs (type: one for all parts, or one per part joined by /), layers among "
                             f"{','.join(SHAPES)}")
    args = parser.parse_args(argv)
    theirs_text = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.against}:{SRC}"], check=True,
                                 capture_output=True, text=True).stdout
    theirs = build(theirs_text, "dtheirs")
    ours = build((ROOT / SRC).read_text(), "dours", extra=READ, extra_functions=["kq_read"])
    if not (theirs.kquant_packed_isa() and ours.kquant_packed_isa()):
        raise SystemExit("this build has no packed kernel (needs AVX-512BW)")
    for module in (theirs, ours):  # kquant_linear(parts, types, bias, prefetches, packed_n, x) or (x, parts, type, ...)
        arg0 = module.kquant_linear.__doc__.split("arg0:")[1].split(" arg1:")[0]
        module.tgs_per_part_types = "Tensor]" in arg0
    print(f"# cpu-kquant one-row layer calls (kquant_linear, bf16 row, packed parts): this checkout vs {args.against}, "
          f"cold weights (>= {args.cold_mb:.0f} MB of copies), median ms per call of {args.rounds} rounds; "
          f"1-min load {os.getloadavg()[0]:.2f}\n")
    print("| type | layer (parts x K) | threads | read theirs ms | read ours ms | theirs ms | ours ms | theirs / ours "
          "| read theirs GB/s | read ours GB/s | theirs GB/s | ours GB/s | load |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for case in args.cases.split(","):
        tnames, layer = case.split(":")
        ns, k = SHAPES[layer]
        names = tnames.split("/")
        if len(names) == 1:
            names = names * len(ns)
        if len(names) != len(ns):
            raise SystemExit(f"{case}: {len(ns)} parts, {len(names)} types")
        types = [int(T[n]) for n in names]
        rng = np.random.default_rng(0)
        raws = [torch.from_numpy(k_quant_bytes(rng, T[n], rows, k)) for n, rows in zip(names, ns)]
        size = sum(r.numel() for r in raws)
        copies = 1 if args.hot else max(1, math.ceil(args.cold_mb * 1e6 / size))
        arena = PackArena()  # this checkout's buffers (cpu_kquant.pack: huge pages where granted)
        mine = [[pack(ours, r, t, arena) for r, t in zip(raws, types)] for _ in range(copies)]
        their = [[theirs.kquant_pack(r, t) for r, t in zip(raws, types)] for _ in range(copies)]
        if args.same_pages:
            their_arena = PackArena()
            their = [[their_arena.take(p.numel()).copy_(p) for p in parts] for parts in their]
        packed_bytes = sum(p.numel() for p in mine[0])
        unit = packed_bytes // sum((n + 15) // 16 for n in ns)  # a tile's bytes
        pf_theirs = [PREFETCH if packed_bytes <= PREFETCH_MAX else 0] * len(ns)
        pf_ours = [PACKED_PREFETCH_HUGE[t] for t in types] if arena.huge else pf_theirs
        if args.prefetch >= 0:
            pf_theirs = pf_ours = [args.prefetch] * len(ns)
        x = torch.randn(1, k).to(torch.bfloat16)
        bias = torch.empty(0, dtype=torch.bfloat16)
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            yt = layer_call(theirs, x, their[0], types, bias, pf_theirs, ns)
            yo = layer_call(ours, x, mine[0], types, bias, pf_ours, ns)
            if not torch.equal(yt, yo):
                raise SystemExit(f"{case}: this checkout's output differs from {args.against}'s")
            calls = [lambda c: ours.kq_read(their[c], unit),
                     lambda c: ours.kq_read(mine[c], unit),
                     lambda c: layer_call(theirs, x, their[c], types, bias, pf_theirs, ns),
                     lambda c: layer_call(ours, x, mine[c], types, bias, pf_ours, ns)]
            times: list[list[float]] = [[] for _ in calls]
            # call by call in turn, each variant a quarter of the copies behind the last (a copy one
            # variant read is read by the next only after a cycle's worth of other copies, so no call
            # finds its weights in the cache: the layers below 32 MB would fit in this L3)
            stagger = 0 if args.hot else copies // len(calls)
            for _ in range(args.rounds * (20 if args.hot else 1)):
                for c in range(copies):
                    for i, call in enumerate(calls):
                        t0 = time.perf_counter()
                        call((c + i * stagger) % copies)
                        times[i].append(time.perf_counter() - t0)
            med = [statistics.median(t) for t in times]
            gbs = " | ".join(f"{packed_bytes / v / 1e9:.1f}" for v in med)
            print(f"| {tnames} | {layer} {'+'.join(map(str, ns))} x {k} | {threads} | "
                  + " | ".join(f"{v * 1e3:.3f}" for v in med)
                  + f" | {med[2] / med[3]:.2f}x | {gbs} | {os.getloadavg()[0]:.2f} |", flush=True)
        del mine, their, arena
    print(f"\n1-min load {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
