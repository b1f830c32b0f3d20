"""`quantize` speed: the README command end to end and by phase, and what one 7B-shaped layer costs.

1. The README command (`quantize tiny-pycoder OUT --bits 4 --groupsize 128 --act-order`: 4
   layers, 128 calibration samples x 1024 tokens) as a CLI subprocess, wall time with the
   load average around it; with `--baseline-rev REV` the same command from that git revision
   (extracted with `git archive`, run with its own server/quantizers/kernels packages) is
   timed alternately with this tree's, so both see the same machine load.
2. The same run in process with its phases timed: calibration (tokenize + embed), the
   calibration passes by kind (their Hessian accumulation shown apart), GPTQ solves, the
   output-error figures, packing and writing.
3. One Llama-2-7B-shaped decoder layer (hidden 4096, intermediate 11008, 32 heads of 128):
   its 7 linears as the 4 GPTQ problems the pipeline solves (q/k/v fused, o, gate/up fused,
   down). Measured on --tokens calibration tokens: Hessian accumulation (2048-token
   forwards, as the pipeline runs a 7B layer), the calibration forwards' matmuls and
   attention, the GPTQ solve (4-bit g128 act-order), the output error and packing; then
   extrapolated to 128 x 2048 tokens (accumulation and forwards scale with tokens, the
   solve does not). Weights and activations are random (with uneven channel scales), so
   the times, not the errors, are the point.

Run: python benchmarks/quantize_speed.py [--threads 2] [--tokens 4096] [--baseline-rev REV]
     [--skip-readme] [--skip-7b]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_common import (  # benchmarks/ is on sys.path when a script here runs
    command_line, load_averages, machine_line, md_row, md_table,
)

README_ARGS = ["tiny-pycoder", "--bits", "4", "--groupsize", "128", "--act-order"]
REPO = Path(__file__).resolve().parent.parent
FULL_TOKENS = 128 * 2048  # the calibration a 7B model gets by default


# -- 1. the README command as a user runs it ------------------------------------------------------------
# A revision has either the namespace layout (server/text_generation_server and its two
# portions: the three folders go on sys.path) or the older mapped one (server/ itself was the
# package, quantizers/ and kernels/ its subpackages), so older revisions stay comparable.
_SHIM = """import importlib.util, os, sys
root = sys.argv.pop(1)
if os.path.isdir(f"{root}/server/text_generation_server"):
    sys.path[:0] = [f"{root}/server", f"{root}/quantizers", f"{root}/kernels"]
else:
    for name, folder in (("text_generation_server", "server"), ("text_generation_server.quantizers", "quantizers"),
                         ("text_generation_server.kernels", "kernels")):
        spec = importlib.util.spec_from_file_location(name, f"{root}/{folder}/__init__.py",
                                                      submodule_search_locations=[f"{root}/{folder}"])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
from text_generation_server.cli.main import app
sys.argv[0] = "text-generation-server"
app()
"""


def extract(rev: str, into: Path) -> Path:
    """server/, quantizers/ and kernels/ of `rev`, runnable through _SHIM."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "server", "quantizers", "kernels"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def time_cli(prefix: list[str], out: Path, env: dict[str, str]) -> tuple[float, str, str]:
    """(wall seconds, load average before, after) of one README quantize."""
    shutil.rmtree(out, ignore_errors=True)
    before = load_averages()
    start = time.monotonic()
    done = subprocess.run(prefix + ["quantize", README_ARGS[0], str(out)] + README_ARGS[1:], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"quantize failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return seconds, before, load_averages()


def readme_end_to_end(args, work: Path, env: dict[str, str]) -> list[str]:
    runs = [("this tree", [sys.executable, "-m", "text_generation_server.cli"])]
    if args.baseline_rev:
        root = extract(args.baseline_rev, Path(tempfile.mkdtemp(prefix="quantize-baseline-")))
        runs.append((f"git {args.baseline_rev}", [sys.executable, "-c", _SHIM, str(root)]))
    rows = []
    for repeat in range(args.repeats):
        for label, prefix in runs:
            seconds, before, after = time_cli(prefix, work / f"readme-{len(rows)}", env)
            rows.append([label, repeat + 1, f"{seconds:.1f} s", before, after])
            print(md_row(rows[-1]), file=sys.stderr)
    return md_table(["code", "run", "wall", "load avg before (1/5/15 min)", "after"], rows)


# -- 2. the README command by phase ---------------------------------------------------------------------
class Timer:
    """Accumulates wall seconds and calls per phase by wrapping functions in place."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.restore: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, phase) -> None:
        original = getattr(owner, name)

        def timed(*a, **k):
            label = phase(*a, **k) if callable(phase) else phase
            start = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        self.restore.append((owner, name, original))
        setattr(owner, name, timed)

    def undo(self) -> None:
        for owner, name, original in reversed(self.restore):
            setattr(owner, name, original)


def pass_kind(runner, layer, inputs, outputs, record=None, replay=None, on_batch=None) -> str:
    if outputs is inputs:
        return "pass: outputs for the next layer (attention replayed)"
    if outputs is not None:
        return "pass 1: reference outputs + q/k/v inputs"
    if record is not None:
        return "pass 2: attention once, o_proj inputs recorded"
    return "passes 3-4: gate/up, down inputs (attention replayed)"


def readme_phases(work: Path) -> list[str]:
    from loguru import logger

    from text_generation_server.jobs.quantize import calibration, pipeline, writer
    from text_generation_server.quantizers import gptq_solver

    timer = Timer()
    timer.wrap(pipeline.Quantizer, "_embedded_samples", "calibration: tokenize + embed")
    timer.wrap(calibration.LayerRunner, "run", pass_kind)
    timer.wrap(gptq_solver.HessianAccumulator, "add", "hessian accumulation (inside the passes)")
    timer.wrap(pipeline, "gptq_quantize", "gptq solve")
    timer.wrap(pipeline, "output_error", "output error figures")
    timer.wrap(pipeline.Quantizer, "_write_layer", "pack + queue tensors")
    timer.wrap(writer.ShardWriter, "finish", "write shards")
    sink_ids = []
    logger.remove()
    sink_ids.append(logger.add(sys.stderr, level="WARNING"))
    start = time.perf_counter()
    try:
        pipeline.quantize(README_ARGS[0], work / "phases", pipeline.QuantizeOptions(
            bits=4, group_size=128, act_order=True, overwrite=True))
    finally:
        timer.undo()
    total = time.perf_counter() - start
    hessian = timer.seconds["hessian accumulation (inside the passes)"]
    passes = sum(v for k, v in timer.seconds.items() if k.startswith("pass"))
    rows: list[list[object]] = [
        [label, timer.calls[label], f"{timer.seconds[label]:.2f}", f"{timer.seconds[label] / total:.0%}"]
        for label in sorted(timer.seconds, key=lambda k: -timer.seconds[k])
    ]
    rows.append(["passes without their Hessian accumulation", "", f"{passes - hessian:.2f}",
                 f"{(passes - hessian) / total:.0%}"])
    rows.append(["**total (in process, after imports)**", "", f"**{total:.2f}**", "100%"])
    return md_table(["phase", "calls", "seconds", "share"], rows)


# -- 3. one 7B-shaped layer --------------------------------------------------------------------------
def best_of(fn, repeats: int = 2) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def layer_7b(args) -> list[str]:
    from text_generation_server.quantizers.gptq_solver import (
        HessianAccumulator, gptq_quantize, gptq_tensors, output_error, split_columns,
    )

    hidden, inter, heads, head_dim = 4096, 11008, 32, 128
    groups = {  # name: (out rows per tensor, in features)
        "q/k/v": ((hidden, hidden, hidden), hidden), "o": ((hidden,), hidden),
        "gate/up": ((inter, inter), hidden), "down": ((hidden,), inter),
    }
    gen = torch.Generator().manual_seed(0)
    tokens, chunk = args.tokens, 2048
    scale = FULL_TOKENS / tokens
    rows: list[tuple[str, float, float]] = []  # (step, measured seconds, extrapolated seconds)

    # Calibration forwards: the matmuls each pass runs (per 2048-token sample) and attention.
    x_hidden = torch.randn(chunk, hidden, generator=gen)
    weights = {name: torch.randn(sum(outs), k, generator=gen) * 0.02 for name, (outs, k) in groups.items()}
    x_of = {name: (x_hidden if k == hidden else torch.randn(chunk, inter, generator=gen)) for name, (_, k) in
            groups.items()}
    linear = {name: best_of(lambda n=name: F.linear(x_of[n], weights[n])) for name in groups}
    q = torch.randn(1, heads, chunk, head_dim, generator=gen)
    attention = best_of(lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True))
    samples = tokens / chunk
    full = sum(linear.values()) + attention
    ref = min(16 / 128, 1.0)  # share of samples the first pass runs to the end (REFERENCE_SAMPLES of 128)
    forwards = samples * (ref * full + linear["q/k/v"] + attention + linear["o"] + (linear["o"] + linear["gate/up"])
                          + (linear["o"] + linear["gate/up"] + linear["down"]))
    rows.append((f"calibration forwards (5 passes, {samples:.0f} x 2048 tokens)", forwards, forwards * scale))

    hessians = {}
    for name, (_, k) in groups.items():
        acc = HessianAccumulator(k)
        source = torch.randn(tokens, k, generator=gen) * torch.exp(0.5 * torch.randn(k, generator=gen))
        start = time.perf_counter()
        for piece in source.split(chunk):
            acc.add(piece)
        seconds = time.perf_counter() - start
        hessians[name] = acc.hessian
        rows.append((f"Hessian {name} (K={k})", seconds, seconds * scale))
        del source

    for name, (outs, k) in groups.items():
        w = weights[name]
        start = time.perf_counter()
        result = gptq_quantize(w, hessians[name], args.bits, 128, True, act_order=True)
        rows.append((f"GPTQ solve {name} [{w.shape[0]}x{k}]", time.perf_counter() - start, None))
        start = time.perf_counter()
        offset = 0
        for part in outs:
            output_error(w[offset:offset + part], result.dequantized[offset:offset + part], hessians[name])
            offset += part
        rows.append((f"output error {name}", time.perf_counter() - start, None))
        start = time.perf_counter()
        offset = 0
        for i, part in enumerate(outs):
            gptq_tensors(f"{name}.{i}", split_columns(result.weight, offset, part), "gptq")
            offset += part
        rows.append((f"pack {name}", time.perf_counter() - start, None))
        del result

    cells: list[list[object]] = []
    total_measured = total_full = 0.0
    for step, seconds, extrapolated in rows:
        full_seconds = seconds if extrapolated is None else extrapolated
        total_measured += seconds
        total_full += full_seconds
        cells.append([step, f"{seconds:.2f} s", f"{full_seconds:.1f} s"])
    cells.append(["**one 7B layer**", f"**{total_measured:.1f} s**", f"**{total_full / 60:.1f} min**"])
    lines = md_table(["step", f"on {tokens} tokens", "at 128 x 2048 tokens"], cells)
    lines.append(f"\nPer 2048-token forward: q/k/v {linear['q/k/v']:.3f} s, o {linear['o']:.3f} s, gate/up "
                 f"{linear['gate/up']:.3f} s, down {linear['down']:.3f} s, attention {attention:.3f} s.")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--tokens", type=int, default=4096, help="calibration tokens the 7B layer is measured on")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1, help="end-to-end runs of the README command per code")
    parser.add_argument("--baseline-rev", default=None, help="also time the README command at this git revision")
    parser.add_argument("--skip-readme", action="store_true")
    parser.add_argument("--skip-7b", action="store_true")
    args = parser.parse_args()
    if args.tokens < 2048 or args.tokens % 2048:
        parser.error("--tokens must be a positive multiple of 2048 (the 7B layer runs 2048-token samples)")

    torch.set_num_threads(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    work = Path(tempfile.mkdtemp(prefix="quantize-speed-"))
    out = [f"Command: `{command_line()}`  ",
           f"Machine: {machine_line(f'torch {torch.__version__}', f'Python {platform.python_version()}')}, "
           f"{args.threads} torch threads  ",
           f"Date: {datetime.datetime.now().isoformat(timespec='minutes')}, load average at start {load_averages()}\n"]
    try:
        if not args.skip_readme:
            out += ["README command end to end (`text-generation-server quantize "
                    f"{README_ARGS[0]} OUT {shlex.join(README_ARGS[1:])}`):\n"]
            out += readme_end_to_end(args, work, env) + [""]
            out += ["The same run in process, by phase:\n"] + readme_phases(work) + [""]
        if not args.skip_7b:
            out += [f"One Llama-2-7B-shaped layer, {args.bits}-bit g128 act-order:\n"] + layer_7b(args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n".join(out))


if __name__ == "__main__":
    main()
