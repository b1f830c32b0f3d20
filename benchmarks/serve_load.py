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
import datetime
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc

from prompts import CODE_PROMPTS  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

PROMPTS = CODE_PROMPTS + [
    "async def fetch(session, url):\n",
    "def merge(a, b):\n    result = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n",
    "import json\n\nwith open('config.json') as f:\n    config = ",
    "class Node:\n    def __init__(self, value, next=None):\n",
]
# Decode-step metric names of the router (see server/metrics.py).
STEP = "tgi_batch_inference_duration"
FORWARD = "tgi_batch_forward_duration"
SHARD_DECODE = "tgi_batch_decode_duration"


@dataclass
class RequestResult:
    sent: float
    stamps: list[float] = field(default_factory=list)  # arrival time of each streamed token
    error: str | None = None

    @property
    def tokens(self) -> int:
        return len(self.stamps)


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


# -- server process -------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StartedServer:
    """`text-generation-server serve` on free local ports; always stopped by `stop()`."""

    def __init__(self, model: str, extra: list[str], startup_timeout_s: float, env: dict[str, str] | None = None):
        self.dir = tempfile.TemporaryDirectory(prefix="serve-load-")
        self.port, self.metrics_port = free_port(), free_port()
        self.log_path = Path(self.dir.name) / "server.log"
        # The console script when installed; the module otherwise (same entry point).
        launcher = shutil.which("text-generation-server")
        entry = [launcher] if launcher else [sys.executable, "-m", "text_generation_server.cli"]
        command = [
            *entry, "serve", model, "--hostname", "127.0.0.1", "--port", str(self.port),
            "--metrics-port", str(self.metrics_port), "--uds-path", str(Path(self.dir.name) / "shard"), *extra,
        ]
        self.command = command
        self._log = open(self.log_path, "wb")
        # Its own session, so the whole tree can be stopped even if the launcher hangs.
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})
        self.startup_timeout_s = startup_timeout_s

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def wait_ready(self) -> float:
        started = time.monotonic()
        deadline = started + self.startup_timeout_s
        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the server exited with code {self.proc.returncode} during startup:\n{self.log_tail()}"
                    )
                try:
                    resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                    if resp.status == health_pb2.HealthCheckResponse.SERVING:
                        return time.monotonic() - started
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.5)
        raise RuntimeError(f"the server was not SERVING after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # any rank left behind in the session
        except ProcessLookupError:
            pass
        self._log.close()
        self.dir.cleanup()


# -- metrics ----------------------------------------------------------------------------
def scrape(url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each step histogram, keyed "name" for method="decode" and "name/prefill"."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in (STEP, FORWARD, SHARD_DECODE):
            continue
        for sample in family.samples:
            method = sample.labels.get("method")
            if method not in ("decode", "prefill"):
                continue
            key = family.name if method == "decode" else f"{family.name}/prefill"
            entry = found.setdefault(key, [0.0, 0.0])
            if sample.name.endswith("_sum"):
                entry[0] = sample.value
            elif sample.name.endswith("_count"):
                entry[1] = sample.value
    return {name: (v[0], v[1]) for name, v in found.items()}


def delta(before: dict, after: dict) -> dict[str, tuple[float, float]]:
    return {name: (after[name][0] - before.get(name, (0, 0))[0], after[name][1] - before.get(name, (0, 0))[1])
            for name in after}


# -- load -------------------------------------------------------------------------------
async def one_request(stub, prompt: str, max_new_tokens: int, do_sample: bool, seed: int) -> RequestResult:
    params = cpb.GenerateParameters(max_new_tokens=max_new_tokens)
    if do_sample:
        params.do_sample = True
        params.seed = seed
        params.temperature = 0.8
    result = RequestResult(sent=time.perf_counter())
    try:
        async for _msg in stub.GenerateStream(cpb.GenerateRequest(inputs=prompt, parameters=params)):
            result.stamps.append(time.perf_counter())
    except grpc.aio.AioRpcError as exc:
        result.error = f"{exc.code().name}: {exc.details()}"
    return result


async def run_level(stub, concurrency: int, total: int, budget_s: float, max_new_tokens: int,
                    do_sample: bool, metrics_url: str | None) -> Level:
    before = scrape(metrics_url) if metrics_url else {}
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
    steps = delta(before, scrape(metrics_url)) if metrics_url else {}
    return Level(concurrency, wall, results, steps, cpu)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def machine_line() -> str:
    cpu = "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = os.getloadavg()[0]
    busy = " (BUSY MACHINE: more runnable work than cores, timings are unreliable)" if load > (os.cpu_count() or 1) else ""
    return (f"{cpu}, {os.cpu_count()} cores (client and server on the same machine), 1-min load average "
            f"{load:.2f} at the end{busy}")


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
        f"- command: `{' '.join(shlex.quote(a) for a in ['python'] + sys.argv)}`",
    ]
    if server_cmd:
        lines.append(f"- server: `{server_cmd}`")
    lines += [
        f"- model: {info.model_id} ({info.model_dtype} on {info.model_device_type}), max_batch_total_tokens "
        f"{info.max_batch_total_tokens}, {'sampling' if args.do_sample else 'greedy'}, max_new_tokens "
        f"{args.max_new_tokens}, {len(PROMPTS)} prompts in turn",
        f"- machine: {machine_line()}",
        f"- date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        "- client side: TTFT, inter-token latency (ITL) and request latency in ms; tok/s = generated tokens / "
        "level wall time; decode tok/s counts the tokens after each request's first; client CPU = this load "
        "generator's CPU time / wall time (100% = one of the machine's cores)",
        "",
        "| concurrency | requests (errors) | TTFT p50 / p90 / p99 | ITL p50 / p90 / p99 | latency p50 | tok/s | "
        "decode tok/s | decode speedup vs c=1 | client CPU |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base = None
    for level in levels:
        ok = level.ok
        ttft = [1e3 * (r.stamps[0] - r.sent) for r in ok]
        itl = [1e3 * (b - a) for r in ok for a, b in zip(r.stamps, r.stamps[1:])]
        latency = [1e3 * (r.stamps[-1] - r.sent) for r in ok]
        dtps = level.decode_tokens / level.wall_s
        if level.concurrency == 1:
            base = dtps
        lines.append(
            f"| {level.concurrency} | {len(ok)} ({len(level.results) - len(ok)}) | {pct(ttft, 50):.0f} / "
            f"{pct(ttft, 90):.0f} / {pct(ttft, 99):.0f} | {pct(itl, 50):.1f} / {pct(itl, 90):.1f} / "
            f"{pct(itl, 99):.1f} | {pct(latency, 50):.0f} | {level.tokens / level.wall_s:.0f} | {dtps:.0f} | "
            f"{f'{dtps / base:.2f}x' if base else 'n/a'} | {100 * level.client_cpu_s / level.wall_s:.0f}% |"
        )
    lines += [
        "",
        "- server side, from the router's Prometheus histograms over each level (method=decode): a decode step "
        "as the router times it = model forward + shard token choice/detokenisation + the rest (gRPC, protobuf, "
        "shard and router bookkeeping); outside forward (per RPC) = 1 - forward / step as the router times it "
        "(with decode ahead the forward overlaps the round trip, so this can go negative); model idle share = "
        "1 - (decode + prefill forward time) / level wall time, the measure of the target; busy = share of wall "
        "time with a prefill or decode call in flight",
        "",
        "| concurrency | decode steps | mean batch | step ms | forward | shard token choice | gRPC + bookkeeping "
        "| outside forward (per RPC) | model idle share of wall time | busy |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for level in levels:
        split = step_split(level)
        if split is None:
            lines.append(f"| {level.concurrency} | 0 | n/a | n/a | n/a | n/a | n/a | n/a | n/a | n/a |")
            continue
        lines.append(
            f"| {level.concurrency} | {split['steps']:.0f} | {split['mean_batch']:.1f} | {split['step_ms']:.2f} | "
            f"{100 * split['forward']:.0f}% | {100 * split['shard_rest']:.0f}% | {100 * split['router_grpc']:.0f}% | "
            f"{100 * split['outside_rpc']:.1f}% | **{100 * split['outside']:.1f}%** | {100 * split['busy']:.0f}% |"
        )
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
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"--concurrency must be a comma-separated list of integers, got {text!r}") from exc
    if not levels or any(c < 1 for c in levels):
        raise ValueError(f"--concurrency needs integers >= 1, got {text!r}")
    return levels


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
    lines = ["", "## Decode ahead: off (TGS_DECODE_AHEAD=0) vs on, same run", "",
             "| concurrency | decode tok/s off | decode tok/s on | ratio on/off | model idle off | model idle on |",
             "|---:|---:|---:|---:|---:|---:|"]
    for a, b in zip(off, on):
        sa, sb = step_split(a), step_split(b)
        ta, tb = a.decode_tokens / a.wall_s, b.decode_tokens / b.wall_s
        idle = lambda split: f"{100 * split['outside']:.1f}%" if split else "n/a"  # noqa: E731
        lines.append(f"| {a.concurrency} | {ta:.0f} | {tb:.0f} | {tb / ta:.2f}x | {idle(sa)} | {idle(sb)} |")
    return "\n".join(lines)


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
