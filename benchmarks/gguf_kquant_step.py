"""A GGUF decode step with each fused K-quant layer of mixed types as one call or as a call per type (issue #34).

A Q4_K_M file keeps attn_v in Q6_K beside Q4_K q and k in half of its layers; the loader joins such a
qkv into one cpu-kquant call (quantizers/gguf.py join_parts); before, it ran a call per type and a
torch.cat (SplitLinear). This loads the file once as `serve` does (cpu_step_profile.py's load: get_model,
warmup, 2 threads), builds the per-type form of every mixed layer from the joined one's own buffers
(KQuantLinear.split: the same packed bytes, nothing copied), checks both give the same bits, then decodes
in interleaved rounds (the order alternating), timing the step and its parts with cpu_step_profile.py's
clock. Prints each form's median step, its qkv time and GB/s, and the ratio per round pair.

    flock /tmp/tgs-bench.lock python benchmarks/gguf_kquant_step.py \\
        ~/.cache/tgs-bench/models/qwen2.5-coder-1.5b/qwen2.5-coder-1.5b-instruct.gguf
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import openmp_as_serve  # noqa: E402

openmp_as_serve()  # the ranks' OpenMP waits, set before torch loads libgomp

import torch  # noqa: E402

import cpu_step_profile as csp  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a GGUF file with fused K-quant layers of mixed types (a Q4_K_M file)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per form, interleaved")
    args = parser.parse_args(argv)
    args.quantize_lm_head = "auto"
    from text_generation_server.kernels.cpu_kquant import KQuantLinear
    from text_generation_server.quantizers.gguf import SplitLinear

    torch.set_num_threads(args.threads)
    lm = csp.load(args)
    forms: dict[str, list[torch.nn.Module]] = {"one call": [], "a call per type": []}
    for layer in lm.model.layers:
        joined = layer.self_attn.qkv.linear
        forms["one call"].append(joined)
        if isinstance(joined, KQuantLinear) and len(set(joined.types)) > 1:
            groups: list[list[int]] = []
            for i, t in enumerate(joined.types):
                if groups and joined.types[groups[-1][-1]] == t:
                    groups[-1].append(i)
                else:
                    groups.append([i])
            forms["a call per type"].append(SplitLinear(list[torch.nn.Module](joined.split(groups))))
        else:
            forms["a call per type"].append(joined)
    mixed = sum(isinstance(m, SplitLinear) for m in forms["a call per type"])
    if not mixed:
        raise SystemExit(f"{args.model}: no fused K-quant layer of mixed types (nothing to compare)")
    x = torch.randn(3, int(getattr(forms["one call"][0], "in_features"))).to(lm.dtype)
    with torch.inference_mode():
        for a, b in zip(*forms.values()):
            if not torch.equal(a(x), b(x)):
                raise SystemExit("the two forms' outputs differ")
    clock = csp.Clock()
    nbytes, _ = csp.instrument(lm, clock)
    print(f"# {args.model}: {mixed} of {len(forms['one call'])} layers' qkv mix K-quant types; {args.rounds} "
          f"interleaved rounds of {args.steps} steps, {args.threads} threads; 1-min load {os.getloadavg()[0]:.2f}\n")
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in forms}
    names = list(forms)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            for layer, module in zip(lm.model.layers, forms[name]):
                layer.self_attn.qkv.linear = module
            clock.reset()
            times = csp.decode_steps(lm, args, seed=r + 1, clock=clock)
            results[name].append((statistics.mean(times) * 1e3, clock.exclusive.get("linear qkv", 0.0) / len(times) * 1e3))
    for layer, module in zip(lm.model.layers, forms["one call"]):
        layer.self_attn.qkv.linear = module
    print("| qkv form | step ms (median) | rounds | qkv ms/step | qkv GB/s |")
    print("|---|---:|---|---:|---:|")
    for name, rows in results.items():
        step, qkv = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        print(f"| {name} | {step:.2f} | {', '.join(f'{r[0]:.1f}' for r in rows)} | {qkv:.2f} | "
              f"{nbytes['linear qkv'] / qkv / 1e6:.1f} |")
    ratios = [a[0] / b[0] for a, b in zip(results["a call per type"], results["one call"])]
    print(f"\nstep (a call per type) / (one call) per round: {', '.join(f'{v:.3f}' for v in ratios)}; median "
          f"{statistics.median(ratios):.3f}; 1-min load {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
