"""Quantization quality on the embedded model: held-out perplexity of RTN vs GPTQ, time and peak memory.

For every setting (4-bit g128, 3-bit g128, 4-bit per-channel, 8-bit per-channel),
symmetric and asymmetric, the model is quantized twice by the real CLI, once with
round-to-nearest and once with GPTQ (each a subprocess, so its wall time and
peak RSS are its own: VmHWM read at its exit), and each result's
perplexity is measured on the held-out split of the stdlib corpus, which the
embedded model never trained on and GPTQ never calibrated on (it calibrates on the
train split). Prints a markdown table and checks the targets:
- GPTQ 4-bit g128 within 3% of the original's perplexity;
- GPTQ below RTN at every setting;
- GPTQ 3-bit clearly better than RTN 3-bit (the ordering the GPTQ paper reports).

Run: python benchmarks/quantize_quality.py [--model tiny-pycoder] [--eval-tokens 49152] [--threads 2]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench_common import command_line, machine_line, md_table  # benchmarks/ is on sys.path here
from text_generation_server.models.loader import get_model
from text_generation_server.jobs.perplexity import default_text, evaluate

SETTINGS = [("4-bit g128", 4, 128), ("3-bit g128", 3, 128), ("4-bit per-channel", 4, -1), ("8-bit per-channel", 8, -1)]


@dataclass
class Run:
    perplexity: float
    seconds: float
    peak_rss_mb: float


# Runs a module's main() and, at exit, saves /proc/self/status. VmHWM there is the peak RSS of this
# process image alone: getrusage's ru_maxrss would also count the benchmark process itself, whose
# pages a (v)forked child holds until exec.
_WRAPPER = (
    "import atexit, runpy, sys\n"
    "status = sys.argv.pop(1)\n"
    "atexit.register(lambda: open(status, 'w').write(open('/proc/self/status').read()))\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_module(sys.argv[0], run_name='__main__')\n"
)


def run_measured(module: str, args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, peak RSS in MB) of `python -m module args` as a child process."""
    with tempfile.TemporaryDirectory() as tmp:
        status = Path(tmp) / "status"
        cmd = [sys.executable, "-c", _WRAPPER, str(status), module, *args]
        start = time.monotonic()
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        seconds = time.monotonic() - start
        if done.returncode != 0:
            raise SystemExit(f"{module} {shlex.join(args)} failed ({done.returncode}):\n"
                             f"{done.stderr.decode()[-3000:]}")
        fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
    return seconds, int(fields["VmHWM"].split()[0]) / 1024  # kB


def perplexity_of(model: str, text: str, args) -> float:
    lm = get_model(model)
    return evaluate(lm, text, seqlen=args.eval_seqlen, max_tokens=args.eval_tokens).perplexity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-pycoder")
    parser.add_argument("--nsamples", type=int, default=128)
    parser.add_argument("--seqlen", type=int, default=256, help="calibration tokens per sample")
    parser.add_argument("--eval-tokens", type=int, default=49152, help="held-out tokens scored")
    parser.add_argument("--eval-seqlen", type=int, default=256, help="the length the embedded model trained at")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--act-order", action="store_true", help="also run GPTQ with --act-order")
    parser.add_argument("--work-dir", type=Path, default=None, help="where quantized folders go (default: temp)")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="quantize-quality-"))
    text = default_text("heldout", max_chars=args.eval_tokens * 8)
    common = ["--nsamples", str(args.nsamples), "--seqlen", str(args.seqlen), "--overwrite", "--logger-level",
              "WARNING"]

    _, baseline_mb = run_measured("text_generation_server.jobs.quantize", [], env)  # imports only
    original = perplexity_of(args.model, text, args)
    print(f"original: perplexity {original:.4f}", file=sys.stderr)

    methods = ["rtn", "gptq"] + (["gptq-act-order"] if args.act_order else [])
    results: dict[tuple[str, bool, str], Run] = {}
    for label, bits, group in SETTINGS:
        for sym in (True, False):
            for method in methods:
                out = work / f"{method}-{bits}b-g{group}-{'sym' if sym else 'asym'}"
                flags = ["--bits", str(bits), "--groupsize", str(group), "--sym" if sym else "--no-sym",
                         "--method", method.split("-")[0]] + (["--act-order"] if "act-order" in method else [])
                seconds, peak = run_measured("text_generation_server.cli.main",
                                             ["quantize", args.model, str(out)] + flags + common, env)
                ppl = perplexity_of(str(out), text, args)
                results[(label, sym, method)] = Run(ppl, seconds, peak)
                print(f"{label} {'sym' if sym else 'asym'} {method}: perplexity {ppl:.4f}, {seconds:.1f} s, "
                      f"peak RSS {peak:.0f} MB", file=sys.stderr)

    print(f"Command: `{command_line(sys.executable.rsplit('/', 1)[-1])}`  ")
    print(f"Machine: {machine_line(f'torch {torch.__version__}', f'Python {platform.python_version()}')}  ")
    print(f"Date: {datetime.datetime.now().isoformat(timespec='minutes')}  ")
    print(f"Model: {args.model}; calibration: {args.nsamples} x {args.seqlen} tokens of the corpus train split; "
          f"evaluation: {args.eval_tokens} held-out tokens in windows of {args.eval_seqlen}.  ")
    print(f"Original perplexity: **{original:.3f}**. Quantize time and peak RSS are per CLI process; "
          f"a process that only imports torch and the quantize module peaks at {baseline_mb:.0f} MB.\n")
    header = ["setting", "grid", *(f"{m} ppl" for m in methods), "GPTQ vs original",
              *(f"{m} time / peak RSS" for m in methods)]
    rows = []
    for label, _, _ in SETTINGS:
        for sym in (True, False):
            row = [results[(label, sym, m)] for m in methods]
            delta = (results[(label, sym, "gptq")].perplexity / original - 1) * 100
            rows.append([label, "sym" if sym else "asym", *(f"{r.perplexity:.3f}" for r in row), f"{delta:+.2f}%",
                         *(f"{r.seconds:.1f} s / {r.peak_rss_mb:.0f} MB" for r in row)])
    print("\n".join(md_table(header, rows)))

    print()
    checks = []
    for sym in (True, False):
        grid = "sym" if sym else "asym"
        g4 = results[("4-bit g128", sym, "gptq")].perplexity
        checks.append((f"GPTQ 4-bit g128 {grid} within 3% of the original", g4 <= original * 1.03,
                       f"{(g4 / original - 1) * 100:+.2f}%"))
        for label, _, _ in SETTINGS:
            gptq, rtn = results[(label, sym, "gptq")].perplexity, results[(label, sym, "rtn")].perplexity
            checks.append((f"GPTQ below RTN at {label} {grid}", gptq < rtn, f"{gptq:.3f} vs {rtn:.3f}"))
        gptq3, rtn3 = results[("3-bit g128", sym, "gptq")], results[("3-bit g128", sym, "rtn")]
        # "Clearly": GPTQ removes at least a third of RTN's perplexity increase over the original.
        gain = (rtn3.perplexity - gptq3.perplexity) / max(rtn3.perplexity - original, 1e-9)
        checks.append((f"GPTQ 3-bit {grid} clearly better than RTN 3-bit", gain >= 1 / 3,
                       f"removes {gain * 100:.0f}% of RTN's increase"))
    for name, ok, detail in checks:
        print(f"- {'PASS' if ok else 'MISS'}: {name} ({detail})")


if __name__ == "__main__":
    main()
