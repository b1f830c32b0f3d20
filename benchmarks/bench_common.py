"""Scaffolding the benchmark scripts share: a started `serve` process, the machine line, Markdown tables.

Each script here used to carry its own copy of these (three ways of finding the CPU model, two
of starting a server, a table printer per script); one copy keeps their reports comparable and
their fixes in one place. Nothing here decides what a benchmark measures.

Scripts import it as a sibling (`from bench_common import ...`): benchmarks/ is on sys.path
when a script there runs. Its top-level imports are the standard library only, so the CUDA
kernel scripts and gpu_bench_logic (tested on machines without a server) load it cheaply;
grpc, the health stubs, prometheus_client and numpy are imported where they are used.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Iterable, Iterator, Mapping, Sequence

# -- the run: command and date ------------------------------------------------------------------


def openmp_as_serve() -> dict[str, str]:
    """Gives this process the OpenMP settings `serve` starts its ranks with (unless the user set
    their own), and returns what it set. Call it before torch is imported: libgomp reads them then.

    Why: an in-process step measured with torch's idle OpenMP threads spinning is not the step a rank
    runs. On the 2-core EPYC with other work running, a step's first small op (rotary's `cos`) waited
    a whole scheduler slice (3-15 ms) behind the spinning threads, and the 1.5B GGUF step read 100 ms
    in-process against 61 with the ranks' passive waits (BENCHMARKS.md, issue #32 session 9)."""
    from text_generation_server.settings.serve_flags import openmp_environment

    changes = openmp_environment(os.environ)
    if changes and "torch" in sys.modules:
        sys.stderr.write(f"bench_common: torch was imported before {changes} could take effect; the in-process "
                         "step runs with OpenMP's own waits\n")
    os.environ.update(changes)
    return changes


def command_line(python: str = "python", script: str | None = None, argv: Sequence[str] | None = None) -> str:
    """The command that ran this script, quoted so it can be pasted back into a shell.

    `script` replaces argv[0] (the kernel scripts print the path relative to the repository,
    whatever directory they ran from)."""
    args = list(sys.argv if argv is None else argv)
    if script is not None:
        args = [script, *args[1:]]
    return shlex.join([python, *args])


def now_iso() -> str:
    """Local time with its UTC offset, to the second: the date line of a report."""
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


# -- the machine ---------------------------------------------------------------------------------
BUSY_NOTE = "BUSY MACHINE: more runnable work than cores, timings are unreliable"


def parse_cpu_model(text: str) -> str | None:
    """The CPU model named in /proc/cpuinfo (`model name\\t: ...`) or lscpu (`Model name: ...`)
    output; None when neither names one (some ARM kernels do not)."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() == "model name" and value.strip():
            return value.strip()
    return None


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """This machine's CPU model, else what `platform` knows (often just the architecture)."""
    try:
        found = parse_cpu_model(cpuinfo.read_text(errors="replace"))
    except OSError:
        found = None
    return found or platform.processor() or platform.machine() or "unknown cpu"


def is_busy(load: float, cores: int | None = None) -> bool:
    """More runnable work than cores: every timing then includes waits for the scheduler."""
    return load > (cores or os.cpu_count() or 1)


def load_line(end: float | None = None, start: float | None = None, hint: str = "", cores: int | None = None) -> str:
    """'1-min load average [S at the start, ]E at the end', flagged when the machine was busy.

    Other work on the machine shifts every timing; the load average says how much there was.
    `end` defaults to the load average now; `hint` is added to the busy flag (what to do about it)."""
    end = os.getloadavg()[0] if end is None else end
    text = "1-min load average " + (f"{start:.2f} at the start, " if start is not None else "")
    text += f"{end:.2f} at the end"
    if is_busy(max(end, start if start is not None else end), cores):
        text += f" ({BUSY_NOTE}{'; ' + hint if hint else ''})"
    return text


def load_averages() -> str:
    """The 1, 5 and 15-minute load averages as 'a/b/c'."""
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def machine_line(*details: str, cores_note: str = "", cpu: str | None = None, cores: int | None = None) -> str:
    """'<CPU model>, <N> cores[ <cores_note>][, <detail>...]', the machine line of every report."""
    count = f"{cores or os.cpu_count()} cores" + (f" {cores_note}" if cores_note else "")
    return ", ".join([cpu or cpu_model(), count, *details])


# -- tables --------------------------------------------------------------------------------------
_RULES = {"l": "---", "r": "---:", "c": ":---:"}


def fmt_value(value: float | None, fmt: str = "{:.0f}", missing: str = "n/a") -> str:
    """`value` formatted, or `missing` when there is none."""
    return missing if value is None else fmt.format(value)


def ratio(num: float | None, den: float | None, digits: int = 2, missing: str = "n/a") -> str:
    """'1.23x' = num / den, or `missing` when either side is absent or den is zero."""
    if num is None or not den:
        return missing
    return f"{num / den:.{digits}f}x"


def md_row(cells: Iterable[object]) -> str:
    """One Markdown table row: '| a | b |'."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def md_rule(align: str) -> str:
    """The rule under a header, one character per column: l (---), r (---:) or c (:---:)."""
    try:
        return "|" + "".join(_RULES[a] + "|" for a in align)
    except KeyError as exc:
        raise ValueError(f"column alignment must be l, r or c, got {align!r}") from exc


def md_table(header: Sequence[object], rows: Iterable[Sequence[object]] = (), align: str | None = None) -> list[str]:
    """A Markdown table as lines: header, rule, rows. `align` as md_rule (default: all left).

    A row with another number of cells than the header raises, so that a column cannot go
    missing from a report unnoticed."""
    align = align if align is not None else "l" * len(header)
    if len(align) != len(header):
        raise ValueError(f"{len(header)} columns but {len(align)} alignments ({align!r})")
    lines = [md_row(header), md_rule(align)]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row has {len(row)} cells, the header {len(header)}: {list(row)}")
        lines.append(md_row(row))
    return lines


# -- arguments and statistics --------------------------------------------------------------------
def parse_ints(text: str, what: str) -> list[int]:
    """A comma-separated list of integers >= 1 (batch sizes, concurrencies); ValueError naming `what`."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise ValueError(f"{what} must be a comma-separated list of integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{what} needs integers >= 1, got {text!r}")
    return values


def pct(values: Sequence[float], q: float) -> float:
    """The q-th percentile (linear interpolation), NaN for no values."""
    import numpy as np

    return float(np.percentile(values, q)) if len(values) else float("nan")


# -- the server process --------------------------------------------------------------------------
def file_tail(path: Path, lines: int = 30) -> str:
    """The last `lines` lines of a server's log ("" when it cannot be read): for error messages."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, outside the ephemeral range (shard_procs.free_port)."""
    from text_generation_server.launcher.shard_procs import free_port as outside_ephemeral

    return outside_ephemeral()


def cli_entry() -> list[str]:
    """How to run `text-generation-server`: the console script when installed, the module otherwise
    (the same entry point)."""
    launcher = shutil.which("text-generation-server")
    return [launcher] if launcher else [sys.executable, "-m", "text_generation_server.cli"]


def _threads_cpu_ns(proc_dir: Path) -> int | None:
    """The summed on-CPU nanoseconds of a process's live threads (schedstat's first field), or None
    where the kernel does not keep schedstat."""
    total, seen = 0, False
    for path in proc_dir.glob("task/*/schedstat"):
        try:
            total += int(path.read_text().split()[0])
            seen = True
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total if seen else None


class StartedServer:
    """`text-generation-server serve MODEL` on free local ports; always stopped by `stop()` (or a `with`).

    The process gets its own session (process group), so the whole tree (launcher, router, ranks)
    can be stopped even if the launcher hangs, and its CPU time can be summed. Its output goes to
    a log file in a temporary folder (with the shard socket), removed by `stop()`.
    """

    def __init__(self, model: str, extra: Sequence[str] = (), startup_timeout_s: float = 300.0,
                 env: Mapping[str, str] | None = None):
        self.dir = tempfile.TemporaryDirectory(prefix="tgs-serve-")
        self.port, self.metrics_port = free_port(), free_port()
        self.log_path = Path(self.dir.name) / "server.log"
        self.command = [
            *cli_entry(), "serve", model, "--hostname", "127.0.0.1", "--port", str(self.port),
            "--metrics-port", str(self.metrics_port), "--uds-path", str(Path(self.dir.name) / "shard"), *extra,
        ]
        self.startup_timeout_s = startup_timeout_s
        self._log = open(self.log_path, "wb")
        self._stopped = False
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})

    @property
    def target(self) -> str:
        """Its client gRPC address."""
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def returncode(self) -> int | None:
        """The exit code once the process has exited, None while it runs."""
        return self.proc.poll()

    def log_tail(self, lines: int = 30) -> str:
        """The last `lines` lines of its output (for error messages)."""
        return file_tail(self.log_path, lines)

    async def wait_ready(self) -> float:
        """Seconds until the gRPC health service answers SERVING (the router serves only after warmup).

        RuntimeError, with the log's tail, if the process exits first or the startup timeout passes."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

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

    def cpu_s(self) -> float:
        """CPU seconds of the processes in its session now: unlike wall time, barely moved by other
        jobs on the machine. Processes that already ended are not counted.

        Each live thread's on-CPU nanoseconds (/proc/<pid>/task/<tid>/schedstat) where the kernel keeps
        them: utime + stime count 10 ms clock ticks, too coarse for a cell of a few milliseconds (a
        short cell's difference could come out below the stand-in's own CPU, i.e. negative host CPU).
        Where schedstat is missing, the ticks; threads that ended are then counted too."""
        sid, total = self.proc.pid, 0.0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # a process that ended meanwhile
            if int(fields[3]) != sid:
                continue
            ns = _threads_cpu_ns(stat.parent)
            total += ns / 1e9 if ns is not None else \
                (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, ticks
        return total

    def stop(self) -> None:
        """SIGTERM, then SIGKILL to the whole session after 30 s; removes the log. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
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

    def __enter__(self) -> StartedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- its metrics -----------------------------------------------------------------------------------
# Decode-step histograms of the router (see server/metrics.py).
STEP = "tgi_batch_inference_duration"
FORWARD = "tgi_batch_forward_duration"
SHARD_DECODE = "tgi_batch_decode_duration"


def metrics_text(url: str) -> str:
    """The Prometheus exposition text at `url`."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def scrape_steps(url: str, names: Sequence[str] = (STEP, FORWARD, SHARD_DECODE)) -> dict[str, tuple[float, float]]:
    """(sum, count) of each step histogram, keyed "name" for method="decode" and "name/prefill"."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(metrics_text(url)):
        if family.name not in names:
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


def steps_delta(before: Mapping[str, tuple[float, float]],
                after: Mapping[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """(sum, count) moved between two scrape_steps() results."""
    return {name: (after[name][0] - before.get(name, (0, 0))[0], after[name][1] - before.get(name, (0, 0))[1])
            for name in after}


# -- a streamed request -------------------------------------------------------------------------------
@dataclass
class StreamedReply:
    """One streamed request as the client saw it: when it was sent and when each token arrived."""

    sent: float
    stamps: list[float] = field(default_factory=list)  # arrival time of each streamed token
    error: str | None = None
    text: str = ""  # generated_text of the last message, when the server sent one

    @property
    def tokens(self) -> int:
        return len(self.stamps)

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.sent


async def stream_generate(stub: Any, request: Any) -> StreamedReply:
    """Sends `request` by GenerateStream on the client API `stub`, stamping each token's arrival
    (time.perf_counter). An RPC error ends the stream and is kept in `error`, not raised."""
    import grpc

    reply = StreamedReply(sent=time.perf_counter())
    try:
        async for msg in stub.GenerateStream(request):
            reply.stamps.append(time.perf_counter())
            if msg.HasField("generated_text"):
                reply.text = msg.generated_text
    except grpc.aio.AioRpcError as exc:
        reply.error = f"{exc.code().name}: {exc.details()}"
    return reply


@contextmanager
def environment(changes: Mapping[str, str]) -> Iterator[None]:
    """os.environ with `changes` while the block runs, restored after (a benchmark's switches must
    not outlive it when a test runs it in the test's own process)."""
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
