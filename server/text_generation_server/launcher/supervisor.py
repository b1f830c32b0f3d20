"""`serve`: the launcher that runs one process per tensor-parallel rank plus the router.

The launcher process owns the router (client gRPC API, metrics) and supervises the
rank processes. A rank that dies takes the whole server down within seconds,
because the surviving ranks would block forever in their next collective; the
orchestrator (systemd, Kubernetes) is the right place to restart. SIGTERM/SIGINT
drain in-flight requests before the ranks are stopped; a second signal stops the
ranks at once and exits with EXIT_INTERRUPTED. SIGHUP stops nothing: it asks the
router to re-read its API key file and TLS certificate files; the ranks ignore it, so it may
be sent to the whole process group (`kill -HUP -<pgid>`).

Rank processes stay in the launcher's process group so Ctrl-C reaches the
launcher; they ignore SIGINT themselves and wait for the launcher's SIGTERM, so a
terminal interrupt drains instead of killing the ranks under the router. What runs
inside a rank is rank.py; how a rank follows its launcher out is process_exit.py;
starting, polling and stopping the rank processes is shard_procs.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from typing import TYPE_CHECKING, Awaitable, Callable, Sequence

from loguru import logger

from text_generation_server.launcher.cpu_affinity import pin_router
from text_generation_server.launcher.process_exit import hard_exit_later
from text_generation_server.utils import event_loop
from text_generation_server.utils.logging_setup import configure_logging
from text_generation_server.utils.progress import finish_startup
from text_generation_server.settings.serve_args import ServeArgs
from text_generation_server.launcher.shard_procs import (
    ShardProcesses,
    describe_exit,
    free_port,
    prepare_sockets,
    shard_socket,
)

if TYPE_CHECKING:
    from text_generation_server.launcher.in_process import LocalShardClient

SUPERVISE_INTERVAL_S = 0.2
STOP_GRACE_S = 5.0  # SIGTERM -> SIGKILL delay when stopping ranks
FORCED_STOP_GRACE_S = 1.0
ROUTER_STOP_MARGIN_S = 15.0  # beyond drain_timeout_s before the router task is cancelled
EXIT_INTERRUPTED = 130  # forced exit on a second signal, as shells report SIGINT


# -- checks before any rank starts -------------------------------------------------------------
# Where a GPU driver leaves its device files; without any, `serve` runs on the CPU, known
# without importing torch (seconds the ranks then spend importing it alongside the launcher).
GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def no_gpu_driver(paths: Sequence[str] = GPU_DEVICE_FILES) -> bool:
    return not any(os.path.exists(p) for p in paths)


def pick_device(args: ServeArgs) -> str:
    """args.device, else cuda when available; checks there is one GPU per rank."""
    if args.device == "cpu" or (args.device is None and no_gpu_driver()):
        return "cpu"
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count < args.num_shard:
            raise ValueError(f"--num-shard {args.num_shard} needs {args.num_shard} CUDA device(s), found {count}")
    return device


def check_model(model: str | None) -> None:
    """Fails fast in the launcher on a model argument that no rank could load."""
    from text_generation_server.about import EMBEDDED_MODEL_ID
    from text_generation_server.utils.locate import resolve_model

    _, folder = resolve_model(model)  # raises CheckpointError for a missing folder or file
    if not folder.exists():
        raise ValueError(f"the embedded model '{EMBEDDED_MODEL_ID}' is not installed (expected {folder})")


# models.loader.DTYPES' names (a test keeps them equal): importing it here would import torch and
# every model before any rank starts.
DTYPE_NAMES = ("float32", "float16", "bfloat16")


def check_dtype(dtype: str | None) -> None:
    if dtype is not None and dtype not in DTYPE_NAMES:
        raise ValueError(f"--dtype '{dtype}' is not supported (choose from {', '.join(DTYPE_NAMES)})")


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
    return event_loop.run(_Launch(args, import_router, startup_timeout_s).run())


RunRouter = Callable[[ServeArgs, list[str], asyncio.Event, asyncio.Event], Awaitable[None]]


def import_router() -> RunRouter:
    """The router's entry point, imported once the ranks are starting: it imports torch and the
    model registry, seconds of a CPU start that then overlap the ranks' own imports."""
    from text_generation_server.router.main import run_router

    return run_router


class _Launch:
    """One launch: the ranks, the router task, and the signals that end them."""

    def __init__(self, args: ServeArgs, router: Callable[[], RunRouter], startup_timeout_s: float):
        """`router` gives the router's entry point (imported after the ranks start)."""
        self.args = args
        self.router = router
        self.run_router: RunRouter | None = None
        self.startup_timeout_s = startup_timeout_s
        self.shutdown = asyncio.Event()  # first signal: drain
        self.forced = asyncio.Event()  # second signal: leave now
        self.reload = asyncio.Event()  # SIGHUP: re-read the key and certificate files
        self.signals = 0

    def _on_signal(self, sig: signal.Signals) -> None:
        self.signals += 1
        if self.signals == 1:
            logger.info("received {}: draining in-flight requests, then stopping", sig.name)
            self.shutdown.set()
        else:
            logger.warning("received {} again: forcing exit", sig.name)
            self.forced.set()

    def _on_hangup(self) -> None:
        logger.info("received SIGHUP: re-reading the API key file and TLS files (if any)")
        self.reload.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._on_hangup)  # its default action would kill us
        if self.args.shard_in_process:
            code = 1
            try:
                code = await self._run_in_process()
                return code
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    loop.remove_signal_handler(sig)
                logger.info("stopped (exit code {})", code)
        shards = ShardProcesses(self.args, free_port())
        code = 1
        try:
            logger.info("starting {} rank(s) on {} for {}", self.args.num_shard, self.args.device,
                        self.args.model or "the embedded model")
            shards.start()
            try:
                self.run_router = self.router()
            except ImportError as exc:
                logger.error("the router cannot be imported: {}", exc)
                return 1
            code = await self._wait_ready(shards)
            if code is None:
                code = await self._serve(shards)
            return code
        finally:
            grace = FORCED_STOP_GRACE_S if self.forced.is_set() or code != 0 else STOP_GRACE_S
            await shards.stop(grace, hurry=self.forced)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
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
        # CPU ranks pinned themselves before listening; the router takes a core they left over.
        pin_router(self.args.cpu_affinity, [p.pid for p in shards.procs])
        return None

    async def _run_in_process(self) -> int:
        """--shard-in-process: the rank's model loads in this process (on a thread, so signals are
        still heard), and the router drives its service directly (launcher/in_process.py)."""
        from text_generation_server.launcher.in_process import local_client
        from text_generation_server.launcher.rank import load_rank, log_rank_settings, rank_environment, \
            rank_memory_fraction

        logger.info("starting the rank in this process (--shard-in-process) on {} for {}", self.args.device,
                    self.args.model or "the embedded model")
        for name, value in rank_environment(self.args).items():
            os.environ[name] = value
        try:
            self.run_router = self.router()
        except ImportError as exc:
            logger.error("the router cannot be imported: {}", exc)
            return 1
        loading = asyncio.ensure_future(asyncio.to_thread(load_rank, self.args, 0, 1, pin=False))
        forced = asyncio.ensure_future(self.forced.wait())
        try:
            await asyncio.wait({loading, forced}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            forced.cancel()
        if not loading.done():
            logger.warning("stopping while the model loads: exiting without waiting for it")
            hard_exit_later(0.0, EXIT_INTERRUPTED)
            return EXIT_INTERRUPTED
        try:
            model, device = loading.result()
        except ValueError as exc:  # CheckpointError, bad dtype, bad settings
            finish_startup()
            logger.error("cannot start: {}", exc)
            return 2
        except Exception as exc:  # noqa: BLE001: what a rank process would die of, reported as its exit is
            finish_startup()
            logger.opt(exception=exc).error("the rank failed while loading: {}: {}", type(exc).__name__, exc)
            return 1
        if self.shutdown.is_set():
            finish_startup()
            logger.info("stopped during startup")
            return 0
        memory_fraction = rank_memory_fraction(self.args, device)
        log_rank_settings(self.args, model, device, 1, memory_fraction)
        client = local_client(model, self.args, memory_fraction)
        try:
            return await self._serve(None, client)
        finally:
            finish_startup()

    async def _serve(self, shards: ShardProcesses | None, client: LocalShardClient | None = None) -> int:
        """Runs the router until it stops; with `shards`, over their sockets, watching that none
        exits; else over `client`, the rank in this process."""
        urls = [f"unix://{shard_socket(self.args.uds_path, r)}" for r in range(self.args.num_shard)]
        assert self.run_router is not None  # imported by run() once the ranks started
        extra = {} if client is None else {"client": client}
        router = asyncio.create_task(self.run_router(self.args, urls, self.shutdown, self.reload, **extra),
                                     name="router")
        drain_deadline: float | None = None
        while not router.done():
            await asyncio.wait({router}, timeout=SUPERVISE_INTERVAL_S)
            if self.forced.is_set():
                await _cancel(router)
                return EXIT_INTERRUPTED
            if router.done():
                break
            exited = shards.first_exited() if shards is not None else None
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
            for _ in range(5 if shards is not None else 0):
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
