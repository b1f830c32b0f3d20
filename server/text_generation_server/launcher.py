"""`serve`: the launcher that runs one process per tensor-parallel rank plus the router.

The launcher process owns the router (client gRPC API, metrics) and supervises the
rank processes. A rank that dies takes the whole server down within seconds,
because the surviving ranks would block forever in their next collective; the
orchestrator (systemd, Kubernetes) is the right place to restart. SIGTERM/SIGINT
drain in-flight requests before the ranks are stopped.

Rank processes stay in the launcher's process group so Ctrl-C reaches the
launcher; they ignore SIGINT themselves and wait for the launcher's SIGTERM, so a
terminal interrupt drains instead of killing the ranks under the router. No rank
outlives the launcher: PR_SET_PDEATHSIG delivers SIGTERM when the launcher dies
(even by SIGKILL) and a watchdog thread catches a parent that died before prctl ran.

`run_shard` is also usable without our launcher (`serve --shard-only` with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment), the way TGI's launcher
runs its shards.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import traceback
from datetime import timezone
from pathlib import Path
from typing import Awaitable, Callable, Sequence

from loguru import logger

from text_generation_server.serve_args import ServeArgs
from text_generation_server.serve_flags import (
    ALLOW_DENSE_FALLBACK_ENV,
    DISABLE_KERNELS_ENV,
    disabled_kernels_value,
    parse_log_level,
)

SERVE_ARGS_ENV = "TGS_SERVE_ARGS"  # ServeArgs JSON from the launcher to its ranks
LAUNCHER_PID_ENV = "TGS_LAUNCHER_PID"  # set only for ranks started by our launcher
SUPERVISE_INTERVAL_S = 0.2
STOP_GRACE_S = 5.0  # SIGTERM -> SIGKILL delay when stopping ranks
FORCED_STOP_GRACE_S = 1.0
SHARD_HARD_EXIT_S = 10.0  # a rank stuck in a collective cannot exit cleanly; give up after this
ROUTER_STOP_MARGIN_S = 15.0  # beyond drain_timeout_s before the router task is cancelled
EXIT_INTERRUPTED = 130  # forced exit on a second signal, as shells report SIGINT
_UNIX_PATH_MAX = 107
_PR_SET_PDEATHSIG = 1


# -- logging ----------------------------------------------------------------------
def check_logger_level(level: str) -> str:
    """The loguru level name for ours or TGI's LOG_LEVEL spelling; ValueError naming --logger-level otherwise."""
    return parse_log_level(level, "--logger-level")


def json_log_line(record: dict) -> str:
    """One loguru record as the flat JSON object log collectors expect (TGI's launcher shape):
    timestamp (RFC 3339, UTC), level, message, target (the module), then the bound fields
    (component, request_id, ...) and the traceback, if any, as `exception`."""
    entry: dict[str, object] = {
        "timestamp": record["time"].astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "level": record["level"].name,
        "message": record["message"],
        "target": record["name"],
    }
    for key, value in record["extra"].items():
        if key not in entry:
            entry[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
    if record["exception"] is not None:
        kind, value, tb = record["exception"]
        entry["exception"] = "".join(traceback.format_exception(kind, value, tb))
    return json.dumps(entry)


def _json_sink(message) -> None:
    # sys.stderr looked up per line, so a replaced stderr (pytest's capture) receives it.
    sys.stderr.write(json_log_line(message.record) + "\n")
    sys.stderr.flush()


class _StdlibToLoguru(logging.Handler):
    """Records of the logging module (grpc, torch.distributed, py.warnings) through loguru, so
    JSON output stays one object per line; the target is the stdlib logger's name."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        logger.patch(lambda r: r.update(name=record.name)).opt(exception=record.exc_info).log(
            level, "{}", record.getMessage()
        )


def _log_uncaught(kind, value, tb) -> None:
    logger.opt(exception=(kind, value, tb)).critical("uncaught {}: {}", kind.__name__, value)


def configure_logging(level: str, json_output: bool, component: str) -> None:
    """One stderr sink; `component` ("launcher", "rank 1") tags every line so interleaved output stays readable.

    With json_output every line on stderr is a JSON object (`json_log_line`): Python warnings,
    the logging module and uncaught exceptions go through loguru too.
    """
    level = check_logger_level(level)
    logger.remove()
    logger.configure(extra={"component": component})
    if json_output:
        logger.add(_json_sink, level=level, format="{message}", backtrace=False, diagnose=False)
        logging.basicConfig(handlers=[_StdlibToLoguru()], level=logging.WARNING, force=True)
        logging.captureWarnings(True)
        sys.excepthook = _log_uncaught
        return
    fmt = (
        "<green>{time:YYYY-MM-DD HH:mm:ss.SSS}</green> | <level>{level: <8}</level> | "
        "<cyan>{extra[component]}</cyan> | {name}:{line} - <level>{message}</level>"
    )
    logger.add(sys.stderr, level=level, format=fmt, backtrace=False, diagnose=False)


# -- helpers --------------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free; torch.distributed binds it a moment later (the usual small race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    """Popen reports death by signal as a negative code; name the signal, which is what an operator needs."""
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)


def shard_socket(uds_path: str, rank: int) -> str:
    return f"{uds_path}-{rank}"


def pick_device(args: ServeArgs) -> str:
    """args.device, else cuda when available; checks there is one GPU per rank."""
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < args.num_shard:
            raise ValueError(f"--num-shard {args.num_shard} needs {args.num_shard} CUDA device(s), found {count}")
    return device


def check_model(model: str | None) -> None:
    """Fails fast in the launcher on a model argument that no rank could load."""
    from text_generation_server.utils.checkpoint import EMBEDDED_MODEL_ID, resolve_model

    _, folder = resolve_model(model)  # raises CheckpointError for a missing folder
    if not folder.is_dir():
        raise ValueError(f"the embedded model '{EMBEDDED_MODEL_ID}' is not installed (expected {folder})")


def check_dtype(dtype: str | None) -> None:
    from text_generation_server.models import DTYPES

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype '{dtype}' is not supported (choose from {', '.join(DTYPES)})")


def prepare_sockets(uds_path: str, world_size: int) -> None:
    """Removes stale sockets of a crashed run; refuses a path a live server still listens on."""
    for rank in range(world_size):
        path = shard_socket(uds_path, rank)
        if len(path.encode()) > _UNIX_PATH_MAX:
            raise ValueError(f"--uds-path is too long for a unix socket ({path!r} exceeds {_UNIX_PATH_MAX} bytes)")
        parent = Path(path).parent
        if not parent.is_dir():
            raise ValueError(f"--uds-path: folder {parent} does not exist")
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISSOCK(mode):
            raise ValueError(f"--uds-path: {path} exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # nobody listens: left over from a crashed run
                logger.debug("removed stale socket {}", path)
                continue
        raise ValueError(f"--uds-path: a server is already listening on {path}; choose another --uds-path")


def remove_sockets(uds_path: str, world_size: int) -> None:
    """A SIGKILLed rank cannot remove its own socket."""
    for rank in range(world_size):
        path = shard_socket(uds_path, rank)
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
        except FileNotFoundError:
            pass


# -- the rank processes ---------------------------------------------------------------------
class ShardProcesses:
    """The rank processes of one launch: start, poll, stop (SIGTERM, then SIGKILL)."""

    def __init__(self, args: ServeArgs, master_port: int):
        self.args = args
        self.master_port = master_port
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        payload = self.args.to_json()
        for rank in range(self.args.num_shard):
            env = dict(os.environ)
            env.update({
                SERVE_ARGS_ENV: payload,
                LAUNCHER_PID_ENV: str(os.getpid()),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(self.args.num_shard),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(self.master_port),
            })
            cmd = [sys.executable, "-m", "text_generation_server.cli", "serve", "--shard-only"]
            self.procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
            logger.debug("started rank {} as pid {}", rank, self.procs[-1].pid)

    def first_exited(self) -> tuple[int, int] | None:
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                return rank, code
        return None

    def all_ready(self) -> bool:
        return all(os.path.exists(shard_socket(self.args.uds_path, r)) for r in range(self.args.num_shard))

    async def stop(self, grace_s: float, hurry: asyncio.Event | None = None) -> None:
        """SIGTERM every live rank, SIGKILL what is left after `grace_s` (or once `hurry` is set), reap them all."""
        alive = [p for p in self.procs if p.poll() is None]
        for proc in alive:
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        hurried_already = hurry is not None and hurry.is_set()
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            if hurry is not None and hurry.is_set() and not hurried_already:
                break
            await asyncio.sleep(0.05)
        for rank, proc in enumerate(self.procs):
            if proc.poll() is None:
                logger.warning("rank {} did not stop within {:.0f} s; killing it", rank, grace_s)
                _signal(proc, signal.SIGKILL)
        for proc in self.procs:
            while proc.poll() is None:  # SIGKILL cannot be ignored; this ends at once
                await asyncio.sleep(0.02)
        remove_sockets(self.args.uds_path, self.args.num_shard)


def _signal(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


# -- launch ----------------------------------------------------------------------------------
def launch(args: ServeArgs, startup_timeout_s: float = 600.0, warnings: Sequence[str] = ()) -> int:
    """Runs `serve` until a signal or a failure; returns the process exit code.

    `warnings` are the command line's (ignored TGI flags and the like), logged once logging is set up.
    """
    try:
        configure_logging(args.logger_level, args.json_output, "launcher")
        for warning in warnings:
            logger.warning("{}", warning)
        args.validate()
        check_dtype(args.dtype)
        check_model(args.model)
        args = dataclasses.replace(args, device=pick_device(args), shard_only=False)
        prepare_sockets(args.uds_path, args.num_shard)
    except ValueError as exc:  # CheckpointError is a ValueError
        logger.error("{}", exc)
        return 2
    try:
        from text_generation_server.router import run_router
    except ImportError as exc:
        logger.error("the router cannot be imported: {}", exc)
        return 1
    return asyncio.run(_Launch(args, run_router, startup_timeout_s).run())


RunRouter = Callable[[ServeArgs, list[str], asyncio.Event], Awaitable[None]]


class _Launch:
    """One launch: the ranks, the router task, and the signals that end them."""

    def __init__(self, args: ServeArgs, run_router: RunRouter, startup_timeout_s: float):
        self.args = args
        self.run_router = run_router
        self.startup_timeout_s = startup_timeout_s
        self.shutdown = asyncio.Event()  # first signal: drain
        self.forced = asyncio.Event()  # second signal: leave now
        self.signals = 0

    def _on_signal(self, sig: signal.Signals) -> None:
        self.signals += 1
        if self.signals == 1:
            logger.info("received {}: draining in-flight requests, then stopping", sig.name)
            self.shutdown.set()
        else:
            logger.warning("received {} again: forcing exit", sig.name)
            self.forced.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        shards = ShardProcesses(self.args, free_port())
        code = 1
        try:
            logger.info("starting {} rank(s) on {} for {}", self.args.num_shard, self.args.device,
                        self.args.model or "the embedded model")
            shards.start()
            code = await self._wait_ready(shards)
            if code is None:
                code = await self._serve(shards)
            return code
        finally:
            grace = FORCED_STOP_GRACE_S if self.forced.is_set() or code != 0 else STOP_GRACE_S
            await shards.stop(grace, hurry=self.forced)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            logger.info("stopped (exit code {})", code)

    async def _wait_ready(self, shards: ShardProcesses) -> int | None:
        """None when every rank's socket exists; an exit code when startup ended otherwise."""
        deadline = time.monotonic() + self.startup_timeout_s
        while not shards.all_ready():
            exited = shards.first_exited()
            if exited is not None:
                rank, code = exited
                logger.error("shard rank {} exited with code {} during startup", rank, describe_exit(code))
                return 1
            if self.shutdown.is_set():
                logger.info("stopped during startup")
                return 0
            if time.monotonic() > deadline:
                logger.error("the ranks did not start within {:.0f} s (no socket at {}-<rank>)",
                             self.startup_timeout_s, self.args.uds_path)
                return 1
            await asyncio.sleep(0.1)
        logger.info("all {} rank(s) listening", self.args.num_shard)
        return None

    async def _serve(self, shards: ShardProcesses) -> int:
        urls = [f"unix://{shard_socket(self.args.uds_path, r)}" for r in range(self.args.num_shard)]
        router = asyncio.create_task(self.run_router(self.args, urls, self.shutdown), name="router")
        drain_deadline: float | None = None
        while not router.done():
            await asyncio.wait({router}, timeout=SUPERVISE_INTERVAL_S)
            if self.forced.is_set():
                await _cancel(router)
                return EXIT_INTERRUPTED
            if router.done():
                break
            exited = shards.first_exited()
            if exited is not None:
                rank, code = exited
                logger.error("shard rank {} exited with code {}", rank, describe_exit(code))
                self.shutdown.set()  # no draining: the surviving ranks cannot serve without it
                await _cancel(router)
                return 1
            if self.shutdown.is_set():
                if drain_deadline is None:
                    drain_deadline = time.monotonic() + self.args.drain_timeout_s + ROUTER_STOP_MARGIN_S
                elif time.monotonic() > drain_deadline:
                    logger.error("the router did not stop within {:.0f} s of the shutdown request",
                                 self.args.drain_timeout_s + ROUTER_STOP_MARGIN_S)
                    await _cancel(router)
                    return 1
        if router.cancelled():
            logger.error("the router was cancelled")
            return 1
        exc = router.exception()
        if exc is not None:
            # A dead rank often breaks the router's next call first; name the rank, the real cause.
            for _ in range(5):
                exited = shards.first_exited()
                if exited is not None:
                    rank, code = exited
                    logger.error("shard rank {} exited with code {}", rank, describe_exit(code))
                    return 1
                await asyncio.sleep(SUPERVISE_INTERVAL_S)
            logger.opt(exception=exc if self.args.logger_level.upper() in ("TRACE", "DEBUG") else None).error(
                "{}: {}", type(exc).__name__, exc
            )
            return 1
        if not self.shutdown.is_set():
            logger.error("the router stopped without a shutdown request")
            return 1
        return 0


async def _cancel(task: asyncio.Task, timeout_s: float = 5.0) -> None:
    """Cancels the router without draining; a router that ignores cancellation is abandoned after timeout_s."""
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        logger.warning("the router did not stop within {:.0f} s of cancellation", timeout_s)
    elif not task.cancelled() and task.exception() is not None:
        logger.debug("router ended with {!r}", task.exception())


# -- one rank ----------------------------------------------------------------------------------
def exit_process(code: int) -> None:
    """Ends the process without interpreter teardown, once everything worth cleaning up is cleaned up.

    A rank holds native gloo/NCCL and gRPC threads whose teardown takes seconds (and can
    hang when a peer is gone); the socket is already removed and logs are flushed here.
    """
    logger.complete()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def set_parent_death_signal(sig: signal.Signals = signal.SIGTERM) -> bool:
    """Asks Linux to send `sig` to this process when its parent dies; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: {}", os.strerror(ctypes.get_errno()))
        return False
    return True


def _watch_parent(parent_pid: int, on_gone, interval_s: float = 0.5) -> threading.Thread:
    """Calls `on_gone` once the parent is gone (we are re-parented), including before prctl ran."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        on_gone()

    thread = threading.Thread(target=watch, name="parent-watchdog", daemon=True)
    thread.start()
    return thread


def _hard_exit_later(delay_s: float, code: int) -> None:
    """A rank blocked in a collective (its peer died) cannot finish; exit anyway after `delay_s`."""
    def bail() -> None:
        logger.warning("still running {:.0f} s after the stop request; exiting now", delay_s)
        logger.complete()
        os._exit(code)

    timer = threading.Timer(delay_s, bail)
    timer.daemon = True
    timer.start()


def shard_args_from_env(flag_args: ServeArgs) -> ServeArgs:
    """The launcher's settings when it started us, else the command-line flags."""
    payload = os.environ.get(SERVE_ARGS_ENV)
    if payload is None:
        return flag_args
    try:
        return ServeArgs.from_json(payload)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{SERVE_ARGS_ENV} does not hold valid serve settings: {exc}") from exc


def cpu_threads_per_rank(cores: int, world_size: int) -> int:
    """Torch threads for each CPU rank: the cores split between ranks, one kept back for the
    router and gRPC. A rank using every core stalls each time the router runs (its threads
    wait on the one that was descheduled), and the decode step computed ahead overlaps the
    router only if there is a core to overlap on (on 2 cores, see BENCHMARKS.md: 1 thread with
    decode ahead outran 2 threads with or without it, at concurrency 1 and 32)."""
    return max(1, (cores - 1) // world_size) if cores > 1 else 1


def rank_environment(args: ServeArgs, environ: dict[str, str] | os._Environ = os.environ) -> dict[str, str]:
    """The variables a rank sets for itself before its model loads, for settings that the kernel
    and loader code reads from the environment (they are also settable there directly)."""
    changes = {}
    if args.allow_dense_fallback:
        changes[ALLOW_DENSE_FALLBACK_ENV] = "1"
    if args.disable_custom_kernels:
        changes[DISABLE_KERNELS_ENV] = disabled_kernels_value(environ.get(DISABLE_KERNELS_ENV))
    return changes


def limit_cuda_memory(fraction: float, device) -> None:
    """TGI's --cuda-memory-fraction: this process may allocate at most `fraction` of the GPU's
    total memory (torch's caching allocator refuses beyond it)."""
    import torch

    if fraction < 1.0:
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        total = torch.cuda.get_device_properties(device).total_memory
        logger.info("CUDA memory capped at {:.0%} of {:.1f} GiB", fraction, total / 2**30)


def run_shard(args: ServeArgs, rank: int, world_size: int, warnings: Sequence[str] = ()) -> int:
    """The body of `serve --shard-only`: one rank's model behind its unix-socket gRPC service."""
    configure_logging(args.logger_level, args.json_output, f"rank {rank}")
    for warning in warnings:
        logger.warning("{}", warning)
    for name, value in rank_environment(args).items():
        os.environ[name] = value
        logger.debug("{}={}", name, value)
    launcher_pid = os.environ.get(LAUNCHER_PID_ENV)
    stop_requested = threading.Event()
    loop_ref: list[asyncio.AbstractEventLoop] = []
    stop_ref: list[asyncio.Event] = []

    def request_stop(reason: str) -> None:
        if stop_requested.is_set():
            return
        stop_requested.set()
        logger.info("stopping: {}", reason)
        _hard_exit_later(SHARD_HARD_EXIT_S, 1)
        if loop_ref and stop_ref:
            loop_ref[0].call_soon_threadsafe(stop_ref[0].set)

    if launcher_pid is not None:
        # Started by our launcher: it handles Ctrl-C and tells us to stop with SIGTERM.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        set_parent_death_signal(signal.SIGTERM)
        _watch_parent(int(launcher_pid), lambda: request_stop("the launcher is gone"))

    try:
        args.validate()
        device = _shard_device(args, int(os.environ.get("LOCAL_RANK", rank)))
        if device.type == "cuda":
            limit_cuda_memory(args.cuda_memory_fraction, device)
        if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            import torch

            torch.set_num_threads(cpu_threads_per_rank(os.cpu_count() or 1, world_size))
        from text_generation_server.models import get_model
        from text_generation_server.utils.dist import initialize_process_group

        process_group = initialize_process_group(rank, world_size, device)
        # The router never batches more than --max-batch-size requests, nor holds more than
        # --max-concurrent-requests at once: warmup measures a decode step at that size.
        batch_limit = min(b for b in (args.max_batch_size, args.max_concurrent_requests) if b is not None)
        model = get_model(args.model, args.dtype, device, process_group, args.quantize, args.block_size,
                          attention_backend=args.effective_attention_backend,
                          cuda_graphs=args.effective_cuda_graphs, max_batch_size=batch_limit)
    except ValueError as exc:  # CheckpointError, bad dtype, bad settings
        logger.error("cannot start: {}", exc)
        return 2
    if stop_requested.is_set():
        return 0
    memory_fraction = args.memory_fraction or (0.9 if device.type == "cuda" else 0.1)
    if rank == 0:
        logger.info(
            "model {} | dtype {} | device {} | quantize {} | world size {} | block size {} | memory fraction {} | "
            "max_input_tokens {} | max_total_tokens {} | max_batch_prefill_tokens {} | max_batch_total_tokens {} | "
            "max_batch_size {}",
            model.model_id, str(model.dtype).removeprefix("torch."), device, model.quantize or "none", world_size,
            args.block_size, memory_fraction, args.max_input_tokens, args.max_total_tokens,
            args.max_batch_prefill_tokens, args.max_batch_total_tokens, args.max_batch_size,
        )

    async def serve() -> None:
        from text_generation_server.shard import serve_shard

        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop_ref.append(loop)
        stop_ref.append(stop)
        handled = (signal.SIGTERM,) if launcher_pid is not None else (signal.SIGTERM, signal.SIGINT)
        for sig in handled:
            loop.add_signal_handler(sig, request_stop, f"received {sig.name}")
        if stop_requested.is_set():
            stop.set()
        await serve_shard(model, args.uds_path, rank, world_size, memory_fraction, args.max_batch_total_tokens, stop,
                          prefix_caching=args.prefix_caching, stall_timeout_s=args.rank_stall_timeout_s)

    asyncio.run(serve())
    return 0


def _shard_device(args: ServeArgs, local_rank: int):
    import torch

    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
        raise ValueError(f"rank needs CUDA device {local_rank}, but {torch.cuda.device_count()} are available")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)
