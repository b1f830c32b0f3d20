"""Serving load: streaming clients at several concurrencies against a running (or started) server.

At each concurrency C, C client tasks send GenerateStream requests back to back
(varied prompts, fixed max_new_tokens) until the level's request count or time
budget is spent. From the client side it reports time to first token,
inter-token latency, request latency and aggregate tokens/s; from the server's
Prometheus metrics (scraped before and after each level) it splits the router's
decode step into model forward, the shard's token choice/detokenisation, and the
rest (gRPC and router bookkeeping), because a server that batches well but
spends its steps outside the model does not scale.

    python benchmarks/serve_load.py --start --model tiny-pycoder
    python benchmarks/serve_load.py --target 127.0.0.1:50051 --metrics http://127.0.0.1:9000/metrics
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from dataclasses import dataclass

import grpc

from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc

# benchmarks/ is on sys.path when a script there runs: its siblings import by name.
from bench_common import (  # noqa: E402
    FORWARD, SHARD_DECODE, STEP, StartedServer, StreamedReply, command_line, load_line, machine_line,
    md_table, now_iso, parse_ints, pct, ratio, scrape_steps, steps_delta, stream_generate,
)
from prompts import CODE_PROMPTS  # noqa: E402

PROMPTS = CODE_PROMPTS + [
    "async def fetch(session, url):\n",
    "def merge(a, b):\n    result = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n",
    "import json\n\nwith open('config.json') as f:\n    config = ",
    "class Node:\n    def __init__(self, value, next=None):\n",
]
RequestResult = StreamedReply  # one streamed request: sent, token arrival stamps, error


@dataclass
class Level:
    concurrency: int
    wall_s: float
    results: list[RequestResult]
    steps: dict[str, tuple[float, float]]  # metric -> (sum seconds, count) over the level
    client_cpu_s: float = 0.0  # this process's CPU time: the load generator shares the machine with the server

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.error is None and r.stamps]

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.ok)

    @property
    def decode_tokens(self) -> int:
        return sum(r.tokens - 1 for r in self.ok)


# -- load -------------------------------------------------------------------------------
async def one_request(stub, prompt: str, max_new_tokens: int, do_sample: bool, seed: int) -> RequestResult:
    params = cpb.GenerateParameters(max_new_tokens=max_new_tokens)
    if do_sample:
        params.do_sample = True
        params.seed = seed
        params.temperature = 0.8
    return await stream_generate(stub, cpb.GenerateRequest(inputs=prompt, parameters=params))


async def run_level(stub, concurrency: int, total: int, budget_s: float, max_new_tokens: int,
                    do_sample: bool, metrics_url: str | None) -> Level:
    before = scrape_steps(metrics_url) if metrics_url else {}
    counter = iter(range(total))
    results: list[RequestResult] = []
    cpu_start = time.process_time()
    start = time.perf_counter()
    deadline = start + budget_s

    async def worker() -> None:
        for index in counter:  # shared iterator: each request index is taken once
            if time.perf_counter() > deadline:
                return
            results.append(await one_request(stub, PROMPTS[index % len(PROMPTS)], max_new_tokens, do_sample,
                                             index))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_start
    steps = steps_delta(before, scrape_steps(metrics_url)) if metrics_url else {}
    return Level(concurrency, wall, results, steps, cpu)


def step_split(level: Level) -> dict[str, float] | None:
    """Decode-step accounting from the router's histograms; None when the level saw no decode step."""
    step_sum, step_n = level.steps.get(STEP, (0.0, 0.0))
    if step_n <= 0 or step_sum <= 0:
        return None
    forward = level.steps.get(FORWARD, (0.0, 0.0))[0]
    shard = level.steps.get(SHARD_DECODE, (0.0, 0.0))[0]
    prefill = level.steps.get(f"{STEP}/prefill", (0.0, 0.0))[0]
    forward_all = forward + level.steps.get(f"{FORWARD}/prefill", (0.0, 0.0))[0]
    return {
        "steps": step_n,
        "step_ms": 1e3 * step_sum / step_n,
        "forward": forward / step_sum,
        "shard_rest": shard / step_sum,
        "router_grpc": (step_sum - forward - shard) / step_sum,
        # With decode ahead the forward overlaps the round trip, so "step" (the router's RPC time)
        # can be shorter than the forward; what counts is how much of the wall time the model
        # was not running a forward (prefill or decode): the whole level, ramp-up and tail included.
        "outside": 1 - forward_all / level.wall_s,
        "outside_rpc": 1 - forward / step_sum,
        "mean_batch": level.decode_tokens / step_n,
        # Share of the level's wall time in which a prefill or decode call was in flight; the rest is
        # the router between steps (dispatching tokens, FilterBatch, admission) or an empty queue.
        "busy": (step_sum + prefill) / level.wall_s,
    }


def report(levels: list[Level], args: argparse.Namespace, info: cpb.InfoResponse, server_cmd: str | None) -> str:
    lines = [
        "## Serving load: streaming clients against text-generation-server",
        "",
        f"- command: `{command_line()}`",
    ]
    if server_cmd:
        lines.append(f"- server: `{server_cmd}`")
    lines += [
        f"- model: {info.model_id} ({info.model_dtype} on {info.model_device_type}), max_batch_total_tokens "
        f"{info.max_batch_total_tokens}, {'sampling' if args.do_sample else 'greedy'}, max_new_tokens "
        f"{args.max_new_tokens}, {len(PROMPTS)} prompts in turn",
        f"- machine: {machine_line(load_line(), cores_note='(client and server on the same machine)')}",
        f"- date: {now_iso()}",
        "- client side: TTFT, inter-token latency (ITL) and request latency in ms; tok/s = generated tokens / "
        "level wall time; decode tok/s counts the tokens after each request's first; client CPU = this load "
        "generator's CPU time / wall time (100% = one of the machine's cores)",
        "",
    ]
    base = None
    rows = []
    for level in levels:
        ok = level.ok
        ttft = [1e3 * (r.stamps[0] - r.sent) for r in ok]
        itl = [1e3 * (b - a) for r in ok for a, b in zip(r.stamps, r.stamps[1:])]
        latency = [1e3 * (r.stamps[-1] - r.sent) for r in ok]
        dtps = level.decode_tokens / level.wall_s
        if level.concurrency == 1:
            base = dtps
        rows.append([
            level.concurrency, f"{len(ok)} ({len(level.results) - len(ok)})",
            f"{pct(ttft, 50):.0f} / {pct(ttft, 90):.0f} / {pct(ttft, 99):.0f}",
            f"{pct(itl, 50):.1f} / {pct(itl, 90):.1f} / {pct(itl, 99):.1f}", f"{pct(latency, 50):.0f}",
            f"{level.tokens / level.wall_s:.0f}", f"{dtps:.0f}", ratio(dtps, base),
            f"{100 * level.client_cpu_s / level.wall_s:.0f}%",
        ])
    lines += md_table(["concurrency", "requests (errors)", "TTFT p50 / p90 / p99", "ITL p50 / p90 / p99",
                       "latency p50", "tok/s", "decode tok/s", "decode speedup vs c=1", "client CPU"], rows,
                      "r" * 9)
    lines += [
        "",
        "- server side, from the router's Prometheus histograms over each level (method=decode): a decode step "
        "as the router times it = model forward + shard token choice/detokenisation + the rest (gRPC, protobuf, "
        "shard and router bookkeeping); outside forward (per RPC) = 1 - forward / step as the router times it "
        "(with decode ahead the forward overlaps the round trip, so this can go negative); model idle share = "
        "1 - (decode + prefill forward time) / level wall time, the measure of the target; busy = share of wall "
        "time with a prefill or decode call in flight",
        "",
    ]
    rows = []
    for level in levels:
        split = step_split(level)
        if split is None:
            rows.append([level.concurrency, 0] + ["n/a"] * 8)
            continue
        rows.append([
            level.concurrency, f"{split['steps']:.0f}", f"{split['mean_batch']:.1f}", f"{split['step_ms']:.2f}",
            f"{100 * split['forward']:.0f}%", f"{100 * split['shard_rest']:.0f}%",
            f"{100 * split['router_grpc']:.0f}%", f"{100 * split['outside_rpc']:.1f}%",
            f"**{100 * split['outside']:.1f}%**", f"{100 * split['busy']:.0f}%",
        ])
    lines += md_table(["concurrency", "decode steps", "mean batch", "step ms", "forward", "shard token choice",
                       "gRPC + bookkeeping", "outside forward (per RPC)", "model idle share of wall time", "busy"],
                      rows, "r" * 10)
    lines.append("")
    for level in levels:
        if level.concurrency == 32:
            if base:
                speedup = level.decode_tokens / level.wall_s / base
                lines.append(f"- target: decode throughput at concurrency 32 >= 6x concurrency 1: {speedup:.2f}x, "
                             f"{'met' if speedup >= 6 else 'MISSED'}")
            split = step_split(level)
            if split is not None:
                lines.append(f"- target: time outside the model forward < 15% at concurrency 32 (model idle share): "
                             f"{100 * split['outside']:.1f}%, {'met' if split['outside'] < 0.15 else 'MISSED'}")
        for result in level.results:
            if result.error:
                lines.append(f"- error at concurrency {level.concurrency}: {result.error}")
                break
    return "\n".join(lines)


def parse_levels(text: str) -> list[int]:
    return parse_ints(text, "--concurrency")


async def measure(args: argparse.Namespace, levels: list[int], env: dict[str, str] | None = None
                  ) -> tuple[list[Level], cpb.InfoResponse, str | None]:
    server = None
    target, metrics_url = args.target, args.metrics or None
    try:
        if args.start:
            server = StartedServer(args.model, shlex.split(args.server_args), args.startup_timeout_s, env)
            target, metrics_url = server.target, server.metrics_url
            ready = await server.wait_ready()
            print(f"server ready in {ready:.1f} s on {target}", file=sys.stderr)
        async with grpc.aio.insecure_channel(target) as channel:
            stub = cpb_grpc.TextGenerationStub(channel)
            info = await stub.Info(cpb.InfoRequest(), timeout=30)
            await run_level(stub, 2, 4, 60, args.max_new_tokens, args.do_sample, None)  # warm-up
            done = []
            for concurrency in levels:
                total = args.requests or max(16, 4 * concurrency)
                level = await run_level(stub, concurrency, total, args.level_budget_s, args.max_new_tokens,
                                        args.do_sample, metrics_url)
                print(f"concurrency {concurrency}: {len(level.ok)} requests, {level.tokens / level.wall_s:.0f} tok/s",
                      file=sys.stderr)
                done.append(level)
        return done, info, " ".join(server.command) if server else None
    finally:
        if server is not None:
            server.stop()


def ahead_table(off: list[Level], on: list[Level]) -> str:
    """Decode ahead off and on, side by side, from two servers started in this run."""
    rows = []
    for a, b in zip(off, on):
        sa, sb = step_split(a), step_split(b)
        ta, tb = a.decode_tokens / a.wall_s, b.decode_tokens / b.wall_s
        idle = lambda split: f"{100 * split['outside']:.1f}%" if split else "n/a"  # noqa: E731
        rows.append([a.concurrency, f"{ta:.0f}", f"{tb:.0f}", ratio(tb, ta), idle(sa), idle(sb)])
    return "\n".join(["", "## Decode ahead: off (TGS_DECODE_AHEAD=0) vs on, same run", "", *md_table(
        ["concurrency", "decode tok/s off", "decode tok/s on", "ratio on/off", "model idle off", "model idle on"],
        rows, "r" * 6)])


async def amain(args: argparse.Namespace, levels: list[int]) -> int:
    if args.compare_ahead:
        if not args.start:
            raise SystemExit("--compare-ahead starts its own servers: add --start")
        off, _, _ = await measure(args, levels, {"TGS_DECODE_AHEAD": "0"})
        on, info, command = await measure(args, levels, {"TGS_DECODE_AHEAD": "1"})
        print(report(on, args, info, command))
        print(ahead_table(off, on))
        return 0
    done, info, command = await measure(args, levels)
    print(report(done, args, info, command))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="127.0.0.1:50051", help="client gRPC API of a running server")
    parser.add_argument("--metrics", default="http://127.0.0.1:9000/metrics",
                        help="its Prometheus endpoint ('' to skip the server-side split)")
    parser.add_argument("--start", action="store_true", help="start `text-generation-server serve` on free ports")
    parser.add_argument("--model", default="tiny-pycoder", help="with --start: the model to serve")
    parser.add_argument("--server-args", default="", help="with --start: extra serve flags, one shell string")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--concurrency", default="1,8,32,64", help="comma-separated client concurrencies")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=0,
                        help="requests per level (default max(16, 4 x concurrency))")
    parser.add_argument("--level-budget-s", type=float, default=60.0,
                        help="no new requests start after this many seconds of a level")
    parser.add_argument("--do-sample", action="store_true", help="sample (seeded) instead of greedy")
    parser.add_argument("--compare-ahead", action="store_true",
                        help="with --start: run every level with decode ahead off, then on, and print both")
    args = parser.parse_args(argv)
    try:
        levels = parse_levels(args.concurrency)
        if args.max_new_tokens < 2:
            raise ValueError(f"--max-new-tokens must be >= 2, got {args.max_new_tokens}")
        if args.requests < 0 or args.level_budget_s <= 0:
            raise ValueError("--requests must be >= 0 and --level-budget-s > 0")
        if not args.start and not args.target.startswith("127.0.0.1:"):
            raise ValueError(f"--target must be on 127.0.0.1 (load runs against this machine only), got {args.target}")
        if not args.start and args.metrics and not args.metrics.startswith("http://127.0.0.1:"):
            raise ValueError(f"--metrics must be on 127.0.0.1, got {args.metrics}")
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return asyncio.run(amain(args, levels))
    except (RuntimeError, OSError, grpc.aio.AioRpcError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
