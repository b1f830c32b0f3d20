"""A GGUF's start-up cost before its tensors: metadata and tokenizer, old way and new, side by side.

For the registry's Qwen2.5-Coder-1.5B-Instruct Q4_K_M file by default (151k tokens, 151k merges):
- metadata: the gguf package's GGUFReader (every value as numpy views, what gguf_file.py used) against
  gguf_file.GGUFFile (the key/value section read with struct);
- tokenizer: transformers' conversion (`from_pretrained(..., gguf_file=...)`, TGS_GGUF_CACHE=off)
  against a read of the cached entry (quantizers/gguf_cache.py) in a fresh cache folder.
Each in its own fresh process (nothing warm in memory but the page cache), median of --rounds.

    python benchmarks/gguf_parse.py [--file model.gguf] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import load_line, machine_line, md_table, now_iso

DEFAULT = Path.home() / ".cache/tgs-bench/models/qwen2.5-coder-1.5b/qwen2.5-coder-1.5b-instruct.gguf"

# Each step runs in a child: imports first (not timed), then the timed work; prints seconds.
STEPS = {
    "gguf package reader": "import gguf\n" "T()\n" "r = gguf.GGUFReader(F)\n"
                           "m = {k: f.contents() for k, f in r.fields.items()}\n",
    "gguf_file.GGUFFile": "import gguf\n" "from text_generation_server.quantizers.gguf_file import GGUFFile\n" "T()\n"
                          "GGUFFile([Path(F)])\n",
    "tokenizer: transformers' conversion": "from text_generation_server.quantizers import gguf_arch, gguf_file\n"
                                           "import transformers\n" "f = gguf_file.GGUFFile([Path(F)])\n" "T()\n"
                                           "gguf_arch.tokenizer(f)\n",
    "tokenizer: cached entry": "from text_generation_server.quantizers import gguf_arch, gguf_file\n"
                               "f = gguf_file.GGUFFile([Path(F)])\n" "T()\n" "gguf_arch.tokenizer(f)\n",
}
PAIRS = [("metadata", "gguf package reader", "gguf_file.GGUFFile"),
         ("tokenizer", "tokenizer: transformers' conversion", "tokenizer: cached entry")]


def run_step(code: str, file: Path, cache: str) -> float:
    prog = ("import time, sys\nfrom pathlib import Path\nF = sys.argv[1]\n_t = [0.0]\n"
            "def T():\n    _t[0] = time.perf_counter()\n" + code + "print(time.perf_counter() - _t[0])\n")
    env = {**os.environ, "TGS_GGUF_CACHE": cache}
    done = subprocess.run([sys.executable, "-c", prog, str(file)], capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return float(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", type=Path, default=DEFAULT)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    load_start = os.getloadavg()[0]
    times: dict[str, list[float]] = {name: [] for name in STEPS}
    with tempfile.TemporaryDirectory(prefix="gguf-cache-") as cache:
        run_step(STEPS["tokenizer: cached entry"], args.file, cache)  # fills the fresh cache folder
        for _ in range(args.rounds):  # interleaved
            for name, code in STEPS.items():
                times[name].append(run_step(code, args.file, "off" if "conversion" in name else cache))
    print(f"# GGUF metadata and tokenizer at start-up ({now_iso()})\n")
    print(machine_line(f"file {args.file.name}, {args.file.stat().st_size / 2**20:.0f} MiB"))
    rows = []
    for what, old, new in PAIRS:
        o, n = statistics.median(times[old]), statistics.median(times[new])
        rows.append([what, old, f"{o:.2f}", new, f"{n:.2f}", f"{o / n:.1f}x"])
    print("\n".join(md_table(["step", "before", "s", "now", "s", "before / now"], rows)))
    print("\nsamples (s): " + json.dumps({k: [round(v, 2) for v in vs] for k, vs in times.items()}))
    print("\n" + load_line(start=load_start))
    return 0


if __name__ == "__main__":
    sys.exit(main())
