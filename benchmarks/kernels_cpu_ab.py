"""The native CPU kernels of this tree against those of another git revision, interleaved in one process.

A kernel change is judged on a shared machine only when both versions run side by side under the
same load: this builds the revision's C++ source (kernels/cpu_native*_src.py as committed there) as a
second extension beside this tree's, and times the same calls on both in alternation, cold weights
(copies cycled, each larger than the caches together). Figures: the best of each version's calls,
milliseconds, and the weight bytes read per second at that time.

    python benchmarks/kernels_cpu_ab.py --base 2fbacd7              # int4 MLP shapes, the int8/bf16 head
    TGS_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        python benchmarks/kernels_cpu_ab.py --base 2fbacd7 --what int4-op   # AVX2: the int4 kernel vs torch's op
    python benchmarks/kernels_cpu_ab.py --what int4-q8 --rows 1,2,4,8   # int4: exact vs int8 activations
    python benchmarks/kernels_cpu_ab.py --what int4-tiled --rows 1,8 --q8-variants q8,q8-pf0  # torch layout vs tiled
    python benchmarks/kernels_cpu_ab.py --what int8-q8 --rows 1,2,4,8   # int8 (and the int8 head): the same
    python benchmarks/kernels_cpu_ab.py --what int8-table --rows 1,8     # int8 exact: plain vs table layout
    python benchmarks/kernels_cpu_ab.py --base main --what bf16 --rows 1,2  # bf16 matrix-vector product, the
                                                                          # head too, vs F.linear and a plain read
    python benchmarks/kernels_cpu_ab.py --base main --what int8-q8-ab --rows 1,2,4,8  # int8_q8_gemv: base vs this tree
    python benchmarks/kernels_cpu_ab.py --base main --what int4-tiled-ab --rows 1,2,4,8 --tiled-prefetch 1024,256
                                            # the tiled int4 x int8-activation product: base vs this tree
    python benchmarks/kernels_cpu_ab.py --base main --what bf16-gemm --rows 3,8,32,128  # bf16_gemm (prompts,
                                                                          # decode batches of 3+ rows without AVX512-BF16)

The base revision's functions are called with the arguments that revision took (float32 x for its
matrix-vector products where they refuse bfloat16, as before issue #32).
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

from text_generation_server.kernels import cpu_act_int8, cpu_native

ROOT = Path(__file__).resolve().parent.parent
SRC_DIR = "kernels/text_generation_server/kernels"


def base_extension(rev: str, with_gemm: bool = False):
    """The C++ source of `rev` built as its own extension (cached under a name hashing that source);
    `with_gemm`: with the revision's bfloat16 GEMM (cpu_native_gemm_src.py's with_gemm_kernels) appended."""
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", rev, SRC_DIR + "/"], check=True,
                           capture_output=True, text=True).stdout.split()
    sources = {Path(n).stem: subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{n}"], check=True,
                                            capture_output=True, text=True).stdout
               for n in names if Path(n).name.startswith("cpu_native") and n.endswith("_src.py")}
    saved = dict(sys.modules)
    try:  # the revision's modules under their own names while its main source module is executed
        modules = {}
        for stem in sorted(sources, key=lambda s: s == "cpu_native_src"):  # parts first, the main module last
            mod = types.ModuleType(f"text_generation_server.kernels.{stem}")
            sys.modules[mod.__name__] = mod
            exec(compile(sources[stem], f"{rev}:{stem}", "exec"), mod.__dict__)
            modules[stem] = mod
        main = modules["cpu_native_src"]
    finally:
        sys.modules.clear()
        sys.modules.update(saved)
    from torch.utils.cpp_extension import load_inline

    source, functions = main.SOURCE, main.FUNCTIONS
    if with_gemm:
        source, functions = modules["cpu_native_gemm_src"].with_gemm_kernels(source, functions)
    name = "tgs_ab_" + hashlib.sha256((source + " ".join(cpu_native.cflags())).encode()).hexdigest()[:12]
    with cpu_native.build_lock(cpu_native.build_directory(name)):  # a killed build's lock removed
        return load_inline(name, cpp_sources=[source], functions=functions,
                           extra_cflags=list(cpu_native.cflags()), extra_ldflags=list(cpu_native.LDFLAGS))


def accepts_bf16(module) -> bool:
    """Whether a revision's matrix-vector products take bfloat16 x (those before issue #32 took float32 only)."""
    try:
        module.int8_gemv(torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(16, 64, dtype=torch.int8), torch.ones(16), 0)
    except RuntimeError:
        return False
    return True


# Qwen2.5-1.5B's bfloat16 shapes (N outputs, K inputs): qkv, o_proj, gate_up, down, the untied head.
BF16_SHAPES = ((2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (151936, 1536))
# Copies of each weight cycled: together at least this many bytes, past the caches (48 MiB of L3 on the
# Ice Lake VM), so every call reads its weights from memory as a decode step does.
COLD_BYTES = 160 * 2**20


def bf16_rounds(versions: dict, shapes: list[tuple[int, int]], rows: list[int], rounds: int,
                prefetch: list[int]) -> None:
    """The bfloat16 matrix-vector product of each version (`bf16_gemv`) against torch's F.linear and a
    plain read of the same bytes (a float32 sum over the weights' bits: the read bandwidth a kernel can
    hope for), interleaved per round, cold weights. Figures: the median over rounds of each round's
    best call, and the weight bytes read per second at that time. `prefetch`: the distances (bytes)
    each version is timed at (the first unlabelled; the rest as "label pfN")."""
    for k, n in shapes:
        nbytes = n * k * 2
        copies = max(2, -(-COLD_BYTES // nbytes))
        ws = [torch.randn(n, k).bfloat16() for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            res: dict[str, list[float]] = {}
            for _ in range(rounds):
                for pf in prefetch:
                    for label, mod in versions.items():
                        name = label if pf == prefetch[0] else f"{label} pf{pf}"
                        res.setdefault(name, []).append(best(lambda i: mod.bf16_gemv(x, ws[i % copies], pf),
                                                             2 * copies))
                res.setdefault("F.linear", []).append(best(
                    lambda i: torch.nn.functional.linear(x, ws[i % copies]), 2 * copies))
                if m == rows[0]:
                    res.setdefault("read", []).append(best(
                        lambda i: ws[i % copies].view(torch.float32).sum(), 2 * copies))
            print(f"bf16 {k}x{n} rows={m} ({copies} copies): " + "  ".join(
                f"{label} {statistics.median(v) * 1e3:.3f} ms ({nbytes / statistics.median(v) / 1e9:.1f} GB/s)"
                for label, v in res.items()), flush=True)
        del ws


def best(fn: Callable[[int], object], calls: int) -> float:
    times = []
    for i in range(calls):
        t = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - t)
    return min(times)


# Qwen2.5-1.5B's layers as N x K: qkv, o, gate_up, down, the head.
QWEN15_NK = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960), (151936, 1536)]


def int8_q8_ab(versions: dict, rows: list[int], rounds: int) -> None:
    """int8_q8_gemv (int8 weights, int8 activations) of each version, rounds interleaved (base, new, base, ...),
    cold: enough copies of each weight to pass ~200 MiB (past the last-level cache) read in turn."""
    for n, k in QWEN15_NK:
        ws = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(max(2, -(-200 * 2**20 // (n * k))))]
        sc = torch.rand(n)
        for m in [r for r in rows if r <= 8]:
            x = torch.randn(m, k)
            pf = cpu_native.PREFETCH_BYTES
            res: dict[str, list[float]] = {}
            for _ in range(rounds):
                for label, mod in versions.items():
                    res.setdefault(label, []).append(best(
                        lambda i, mod=mod: mod.int8_q8_gemv(x, ws[i % len(ws)], sc, pf, 2, False), 2 * len(ws)))
            med = {label: sorted(v)[len(v) // 2] for label, v in res.items()}
            ratio = f"  base/new {med['base'] / med['new']:.2f}x" if "base" in med else ""
            print(f"int8-q8 {n}x{k} rows={m}: " + "  ".join(
                f"{label} {t * 1e3:.3f} ms ({n * k / t / 1e9:.1f} GB/s)" for label, t in med.items()) + ratio,
                flush=True)


# Qwen2.5-1.5B's int4 layers as N x K (the int8 head is not an int4 layer): qkv, o_proj, gate_up, down.
QWEN15_INT4_NK = QWEN15_NK[:4]


def int4_tiled_ab(versions: dict, rows: list[int], rounds: int, prefetch: list[int]) -> None:
    """The int4 x int8-activation product over the tiled layout (`int4_q8_tiled_linear`, the layers' call, rows
    per pass 2, cpu_native.INT4_BLOCK_GRAIN) of --base against this tree's, rounds interleaved with the order
    turned each round, cold: copies of each layer tiled into the huge-page arena as a loaded model's layers
    are (cpu_act_int8.tile_for_layer), together past COLD_BYTES, cycled. Figures: the median over rounds of
    each round's best call, GB/s of the tiled bytes (codes, scales and offsets), and base/new (speed).
    `prefetch`: the distances each version is timed at (the first unlabelled, the rest as "label pfN")."""
    block = cpu_native.int4_block() or 64
    no_bias = torch.empty(0, dtype=torch.bfloat16)

    def name(label: str, pf: int) -> str:
        return label if pf == prefetch[0] else f"{label} pf{pf}"

    for n, k in QWEN15_INT4_NK:
        codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
        packed = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
        first = cpu_act_int8.tile(packed, torch.rand(k // 128, n), torch.randn(k // 128, n), 128, block)
        nbytes = first.numel()
        copies = max(2, -(-COLD_BYTES // nbytes))
        tiles = [cpu_act_int8.tile_for_layer(packed, torch.rand(k // 128, n), torch.randn(k // 128, n), 128, block)
                 for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            runs = [(label, mod, pf) for pf in prefetch for label, mod in versions.items()]
            res: dict[str, list[float]] = {name(label, pf): [] for label, _, pf in runs}
            for r in range(rounds):
                for label, mod, pf in runs[r % len(runs):] + runs[:r % len(runs)]:
                    res[name(label, pf)].append(best(lambda i, mod=mod, pf=pf: mod.int4_q8_tiled_linear(
                        x, tiles[i % copies], no_bias, 128, block, 2, pf, cpu_native.INT4_BLOCK_GRAIN), copies))
            med = {label: statistics.median(v) for label, v in res.items()}
            ratio = f"  base/new {med['base'] / med['new']:.2f}x" if "base" in med else ""
            print(f"int4-tiled {n}x{k} rows={m} ({copies} copies): " + "  ".join(
                f"{label} {t * 1e3:.3f} ms ({nbytes / t / 1e9:.1f} GB/s)" for label, t in med.items()) + ratio,
                flush=True)
        del tiles
def bf16_gemm_ab(versions: dict, shapes: list[tuple[int, int]], rows: list[int], rounds: int,
                 head_rows: list[int]) -> None:
    """bf16_gemm (bfloat16 weights x bfloat16 rows through float32 FMAs: prompts and decode batches past the
    matrix-vector product on a build without AVX512-BF16) of each version, rounds interleaved (base, new,
    base, ...), cold weights (copies cycled past the caches, as a prompt's layers read them). Figures: the
    median over rounds of each round's best call, GFLOP/s (2 M N K), and base time / new time. The head
    (N > 100000) is timed at `head_rows` only (one copy: it alone is past the caches)."""
    pf = cpu_native.PREFETCH_BYTES
    for n, k in shapes:
        head = n > 100000
        copies = 1 if head else max(2, -(-COLD_BYTES // (n * k * 2)))
        ws = [torch.randn(n, k).bfloat16() for _ in range(copies)]
        empty = torch.empty(0)
        for m in head_rows if head else rows:
            x = torch.randn(m, k).bfloat16()
            res: dict[str, list[float]] = {}
            for _ in range(rounds):
                for label, mod in versions.items():
                    res.setdefault(label, []).append(best(
                        lambda i, mod=mod: mod.bf16_gemm(x, ws[i % copies], empty, True, pf), max(2, copies)))
            med = {label: statistics.median(v) for label, v in res.items()}
            ratio = f"  base/new {med['base'] / med['new']:.2f}x" if "base" in med else ""
            print(f"bf16-gemm {n}x{k} rows={m}: " + "  ".join(
                f"{label} {t * 1e3:.2f} ms ({2 * m * n * k / t / 1e9:.1f} GFLOP/s)" for label, t in med.items())
                + ratio, flush=True)
        del ws


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD", help="git revision whose kernels to compare against")
    parser.add_argument("--what", default="int4,head", help="int4, head, bf16, int4-op, int4-q8, int4-tiled (comma-separated; "
                        "bf16: the bfloat16 matrix-vector product of both versions, F.linear and a plain read; "
                        "int4-tiled: the int8-activation kernel over torch's layout against the tiled one; "
                        "int4-q8 / int8-q8: this tree's int4 / int8 kernels with exact bfloat16 activations against int8 "
                        "ones; int8-q8 also times the 151936 x 1536 head; int8-table: the exact int8 kernel on the plain "
                        "layout against the table one, the head too; int8-q8-ab: int8_q8_gemv of --base against this "
                        "tree's, interleaved, on Qwen2.5-1.5B's five shapes, cold; int4-tiled-ab: the tiled int4 x "
                        "int8-activation product of --base against this tree's, the same way, on Qwen2.5-1.5B's "
                        "int4 shapes; bf16-gemm: bf16_gemm of --base against this tree's, interleaved, cold, on "
                        "--gemm-shapes at --rows, the head at --head-rows)")
    parser.add_argument("--shapes", default="1536x8960,8960x1536", help="int4 K x N shapes")
    parser.add_argument("--bf16-shapes", default=",".join(f"{k}x{n}" for n, k in BF16_SHAPES),
                        help="bf16 K x N shapes (--what bf16; default Qwen2.5-1.5B's qkv, o, gate_up, down and head)")
    parser.add_argument("--bf16-prefetch", default=str(cpu_native.PREFETCH_BYTES),
                        help="prefetch distances in bytes the bf16 products are timed at (comma-separated)")
    parser.add_argument("--tiled-prefetch", default=str(cpu_act_int8.PREFETCH_BYTES),
                        help="prefetch distances in bytes the tiled int4 products are timed at (--what int4-tiled-ab)")
    parser.add_argument("--gemm-shapes", default=",".join(f"{n}x{k}" for n, k in QWEN15_NK),
                        help="bf16-gemm N x K shapes (default Qwen2.5-1.5B's qkv, o, gate_up, down and head)")
    parser.add_argument("--head-rows", default="128", help="bf16-gemm: rows the head (N > 100000) is timed at")
    parser.add_argument("--q8-variants", default="q8", help="names of cpu_act_int8.VARIANTS timed for int4-q8")
    parser.add_argument("--rows", default="1,2,4,8,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    what = set(args.what.split(","))
    rows = [int(r) for r in args.rows.split(",")]
    new = cpu_native.native()
    if new is None:
        print(f"native kernels unavailable: {cpu_native.unavailable_reason()}")
        return 1
    versions = ({"base": base_extension(args.base, with_gemm="bf16-gemm" in what), "new": new}
                if what & {"int4", "head", "bf16", "int8-q8-ab", "int4-tiled-ab", "bf16-gemm"} else {"new": new})
    print(f"torch capability {torch.backends.cpu.get_cpu_capability()}, int4 block {cpu_native.int4_block()}, "
          f"{args.threads} threads, base {args.base}")
    copies = 6
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    for k, n in shapes:
        if not what & {"int4", "int4-op", "int4-q8", "int4-tiled"}:
            break
        codes = [torch.randint(0, 16, (n, k), dtype=torch.int32) for _ in range(copies)]
        packs = [torch._convert_weight_to_int4pack_for_cpu(c, 2) for c in codes]
        s, c = torch.rand(k // 128, n), torch.randn(k // 128, n)
        sz = torch.stack([s, c], dim=-1).bfloat16()
        block = cpu_native.int4_block() or 64
        no_bias = torch.empty(0, dtype=torch.bfloat16)
        tiles = [cpu_act_int8.tile(p, s, c, 128, block) for p in packs] if "int4-tiled" in what else []
        for m in rows:
            x = torch.randn(m, k).bfloat16()
            res: dict[str, list[float]] = {}
            for _ in range(args.rounds):
                if "int4" in what:
                    for label, mod in versions.items():
                        res.setdefault(label, []).append(best(
                            lambda i: cpu_native.int4pack_mm(mod, x, packs[i % copies], s, c, 128), 2 * copies))
                if "int4-op" in what:
                    res.setdefault("native", []).append(best(
                        lambda i: cpu_native.int4pack_mm(new, x, packs[i % copies], s, c, 128), 2 * copies))
                    res.setdefault("torch op", []).append(best(
                        lambda i: torch._weight_int4pack_mm_for_cpu(x, packs[i % copies], 128, sz), 2 * copies))
                if "int4-tiled" in what:  # int8 activations: torch's layout read in place vs tiled at load
                    for name in args.q8_variants.split(","):
                        rows_, pf, grain = cpu_act_int8.VARIANTS[name]
                        pf = cpu_act_int8.PREFETCH_BYTES if pf < 0 else pf
                        res.setdefault(f"{name} torch layout", []).append(best(
                            lambda i: new.int4_q8_linear(x, packs[i % copies], s, c, no_bias, 128, block, rows_,
                                                         pf, grain or cpu_native.INT4_BLOCK_GRAIN), 2 * copies))
                        res.setdefault(f"{name} tiled", []).append(best(
                            lambda i: new.int4_q8_tiled_linear(x, tiles[i % copies], no_bias, 128, block, rows_,
                                                               pf, grain or cpu_native.INT4_BLOCK_GRAIN), 2 * copies))
                if "int4-q8" in what:
                    res.setdefault("exact", []).append(best(
                        lambda i: cpu_native.int4pack_mm(new, x, packs[i % copies], s, c, 128), 2 * copies))
                    for name in args.q8_variants.split(","):
                        res.setdefault(name, []).append(best(
                            lambda i, name=name: cpu_act_int8.int4_q8_mm(new, x, packs[i % copies], s, c, 128,
                                                                         cpu_native.int4_block() or 64, name),
                            2 * copies))
            print(f"int4 {k}x{n} rows={m}: " + "  ".join(
                f"{label} {min(v) * 1e3:.2f} ms ({n * k / 2 / min(v) / 1e9:.1f} GB/s)" for label, v in res.items()),
                flush=True)
    for k, n in [*shapes, (1536, 151936)] if what & {"int8-q8", "int8-table"} else []:
        ws = [torch.randint(-127, 128, (n, k), dtype=torch.int8) for _ in range(2 if n > 100000 else copies)]
        tables = [cpu_native.int8_table_pack(w) for w in ws] if "int8-table" in what else []
        sc = torch.rand(n)
        for m in [r for r in rows if r <= 8]:
            x = torch.randn(m, k).bfloat16()
            res = {}
            for _ in range(args.rounds):
                res.setdefault("exact", []).append(best(
                    lambda i: new.int8_gemv(x, ws[i % len(ws)], sc, cpu_native.PREFETCH_BYTES), 2 * len(ws)))
                if tables:  # the same product (the same bits) on the table layout (cpu_native.int8_table_pack)
                    res.setdefault("table", []).append(best(
                        lambda i: new.int8_table_gemv(x, tables[i % len(tables)], sc, cpu_native.PREFETCH_BYTES),
                        2 * len(tables)))
                for name in args.q8_variants.split(",") if "int8-q8" in what else []:
                    res.setdefault(name, []).append(best(
                        lambda i, name=name: cpu_act_int8.int8_q8_gemv(new, x, ws[i % len(ws)], sc, name), 2 * len(ws)))
            print(f"int8 {k}x{n} rows={m}: " + "  ".join(
                f"{label} {min(v) * 1e3:.2f} ms ({n * k / min(v) / 1e9:.1f} GB/s)" for label, v in res.items()),
                flush=True)
    if "bf16" in what:
        bf16_shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.bf16_shapes.split(",")]
        bf16_rounds(versions, bf16_shapes, [r for r in rows if r <= 8], args.rounds,
                    [int(v) for v in args.bf16_prefetch.split(",")])
    if "int8-q8-ab" in what:
        int8_q8_ab(versions, rows, args.rounds)
    if "int4-tiled-ab" in what:
        int4_tiled_ab(versions, rows, args.rounds, [int(v) for v in args.tiled_prefetch.split(",")])
    if "bf16-gemm" in what:
        bf16_gemm_ab(versions, [tuple(int(v) for v in s.split("x")) for s in args.gemm_shapes.split(",")], rows,
                     args.rounds, [int(r) for r in args.head_rows.split(",")])
    if "head" in what:
        n, k = 151936, 1536
        w, sc = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n)
        wb = torch.randn(n, k).bfloat16()
        takes_bf16 = {label: accepts_bf16(mod) for label, mod in versions.items()}
        for m in [r for r in rows if r <= 8]:
            x = torch.randn(m, k).bfloat16()
            res = {}
            for _ in range(args.rounds):
                for label, mod in versions.items():
                    xin = x if takes_bf16[label] else x.float()
                    res.setdefault(f"int8 {label}", []).append(best(lambda i: mod.int8_gemv(xin, w, sc, 16384), 2))
                    res.setdefault(f"bf16 {label}", []).append(best(lambda i: mod.bf16_gemv(xin, wb, 16384), 2))
                res.setdefault("bf16 oneDNN", []).append(best(lambda i: torch.nn.functional.linear(x, wb), 2))
            print(f"head {n}x{k} rows={m}: " + "  ".join(f"{label} {min(v) * 1e3:.1f} ms" for label, v in res.items()),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
