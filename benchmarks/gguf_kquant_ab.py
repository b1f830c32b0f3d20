"""cpu-kquant's kernel against another commit's, side by side in one process (issue #34).

Both sources (this checkout's kernels/text_generation_server/kernels/cpu_native_kquant_src.py and
the same file at `--against`, read with `git show`) are built as two small extensions with the
native kernels' flags; each layer's Q8_K activations are made once and both kernels run on them
in interleaved calls, random blocks of Qwen2.5-1.5B's shapes (tests/gguf_writer.py k_quant_bytes).
Prints the minimum and median per call, the ratio of the minimums (above 1: this checkout is
faster), the weights' GB/s and the largest relative difference of the outputs (the float order
changed with 8cf5211, so older commits differ in the last bits).

    python benchmarks/gguf_kquant_ab.py --against cdb0e06 --rows 1,8,128 --threads 1
"""

from __future__ import annotations

import argparse
import hashlib
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
from gguf_writer import T, k_quant_bytes  # noqa: E402

from text_generation_server.kernels.cpu_native import LDFLAGS, build_directory, build_lock, cflags  # noqa: E402

SRC = "kernels/text_generation_server/kernels/cpu_native_kquant_src.py"
SHAPES = {"gate_up": (17920, 1536), "down": (1536, 8960), "qkv": (2048, 1536), "head": (151936, 1536)}


def pool_source() -> str:
    """The native pool (tgs::parallel_for, cpu_native_src.py's first section) the K-quant kernels call:
    this checkout's, put in front of either commit's K-quant source so both split work the same way."""
    from text_generation_server.kernels.cpu_native_src import SOURCE as NATIVE

    end = NATIVE.index("}  // namespace tgs")
    return NATIVE[:end] + "}  // namespace tgs\n"


def build(text: str, tag: str, extra: str = "", extra_functions: list[str] | None = None):
    """One commit's K-quant source (its SOURCE and FUNCTIONS) built alone, the pool in front and `extra`
    (more C++ with its `extra_functions`) after it."""
    from torch.utils.cpp_extension import load_inline

    scope: dict = {}
    exec(compile(text, f"<{tag}>", "exec"), scope)  # the module defines SOURCE and FUNCTIONS only
    source = pool_source() + scope["SOURCE"] + extra
    digest = hashlib.sha1((source + " ".join(cflags())).encode()).hexdigest()[:10]
    name = f"tgs_kquant_ab_{tag}_{digest}"
    with build_lock(build_directory(name)):  # a killed build's lock removed
        return load_inline(name, cpp_sources=[source], functions=[*scope["FUNCTIONS"], *(extra_functions or [])],
                           extra_cflags=list(cflags()), extra_ldflags=list(LDFLAGS))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="the commit whose kernel to compare with")
    parser.add_argument("--rows", default="1,8,128")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=7)
    parser.add_argument("--cases", default="Q4_K:gate_up,Q6_K:down,Q4_K:down,Q6_K:head",
                        help=f"type:layer pairs, layers among {','.join(SHAPES)}")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    theirs_text = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.against}:{SRC}"], check=True,
                                 capture_output=True, text=True).stdout
    theirs, ours = build(theirs_text, "theirs"), build((ROOT / SRC).read_text(), "ours")
    print(f"# cpu-kquant: this checkout vs {args.against}, {args.threads} thread(s), "
          f"1-min load {os.getloadavg()[0]:.2f}\n")
    print("| type | layer (N x K) | rows | theirs min / median ms | ours min / median ms | theirs / ours | ours GB/s "
          "| max rel diff |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for case in args.cases.split(","):
        tname, layer = case.split(":")
        qtype = T[tname]
        n, k = SHAPES[layer]
        raw = torch.from_numpy(k_quant_bytes(np.random.default_rng(0), qtype, n, k))
        for m in (int(r) for r in args.rows.split(",")):
            q, d, s = ours.kquant_quantize_q8k(torch.randn(m, k))
            yt, yo = theirs.kquant_mm(q, d, s, raw, int(qtype), 0), ours.kquant_mm(q, d, s, raw, int(qtype), 0)
            diff = ((yt - yo).abs().max() / yt.abs().max()).item()
            tt: list[float] = []
            to: list[float] = []
            for _ in range(args.calls):
                for module, times in ((theirs, tt), (ours, to)):
                    start = time.perf_counter()
                    module.kquant_mm(q, d, s, raw, int(qtype), 0)
                    times.append(time.perf_counter() - start)
            print(f"| {tname} | {layer} {n} x {k} | {m} | {min(tt) * 1e3:.2f} / {statistics.median(tt) * 1e3:.2f} "
                  f"| {min(to) * 1e3:.2f} / {statistics.median(to) * 1e3:.2f} | {min(tt) / min(to):.2f} "
                  f"| {raw.numel() / min(to) / 1e9:.1f} | {diff:.1e} |")
    print(f"\n1-min load {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
