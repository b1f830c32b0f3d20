"""What runs inside one rank process (`serve --shard-only`): its settings, environment and device,
then its model behind the rank's unix-socket gRPC service until it is told to stop.

A rank started by our launcher gets the launcher's settings whole (SERVE_ARGS_ENV) and the
launcher's pid (LAUNCHER_PID_ENV). It stays in the launcher's process group so Ctrl-C reaches
the launcher, ignores SIGINT itself and waits for the launcher's SIGTERM, so a terminal
interrupt drains instead of killing the ranks under the router; it ignores SIGHUP, the
launcher's reload signal, so `kill -HUP -<pgid>` reloads instead of killing the ranks; it stops
on its own when the launcher is gone (see process_exit). A SIGTERM from anyone but the launcher
(a stop sent to the whole process group or cgroup, as systemd's default KillMode sends it) does not
stop it at once: the launcher got the same signal, drains, then stops the ranks; the rank stops by
itself only if that has not happened within the drain timeout and a margin.

`run_shard` is also usable without our launcher (`serve --shard-only` with RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment), the way TGI's launcher
runs its shards; SIGINT and SIGTERM then both stop it, and SIGHUP keeps its default action.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from typing import TYPE_CHECKING, Sequence

from loguru import logger

from text_generation_server.utils import event_loop
from text_generation_server.utils.logging_setup import configure_logging
from text_generation_server.utils.progress import StartupProgress, finish_startup, startup_phase
from text_generation_server.launcher.cpu_affinity import available_cpus, pin_rank
from text_generation_server.launcher.process_exit import (
    exit_process,
    hard_exit_later,
    set_parent_death_signal,
    wait_for_stop_signals,
    watch_parent,
)
from text_generation_server.settings.serve_args import CPU_INT8_ACTIVATIONS_ENV, LM_HEAD_AUTO, ServeArgs
from text_generation_server.settings.serve_flags import (
    ALLOW_DENSE_FALLBACK_ENV,
    DISABLE_KERNELS_ENV,
    cpu_isa_environment,
    disabled_kernels_value,
)

if TYPE_CHECKING:
    import torch

    from text_generation_server.engine.causal_lm import CausalLM

SERVE_ARGS_ENV = "TGS_SERVE_ARGS"  # ServeArgs JSON from the launcher to its ranks
LAUNCHER_PID_ENV = "TGS_LAUNCHER_PID"  # set only for ranks started by our launcher
SHARD_HARD_EXIT_S = 10.0  # a rank stuck in a collective cannot exit cleanly; give up after this
# A SIGTERM not from the launcher: the launcher drains (drain_timeout_s), cancels a router that overruns it
# (15 s) and stops the ranks (5 s grace); past all that, the rank stops by itself.
OUTSIDE_STOP_MARGIN_S = 30.0


def shard_args_from_env(flag_args: ServeArgs) -> ServeArgs:
    """The launcher's settings when it started us, else the command-line flags."""
    payload = os.environ.get(SERVE_ARGS_ENV)
    if payload is None:
        return flag_args
    try:
        return ServeArgs.from_json(payload)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{SERVE_ARGS_ENV} does not hold valid serve settings: {exc}") from exc


# Weights a rank streams per decode step above which its step is matmul-bound: the cores the
# matmuls lose then cost more than the router's interference (BENCHMARKS.md, "CPU threads").
MATMUL_BOUND_BYTES = 256 * 2**20


def weight_bytes_of(model: torch.nn.Module) -> int:
    """Bytes of a model's state on this rank: what cpu_threads_per_rank's size rule reads."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def cpu_threads_per_rank(cores: int, world_size: int, weight_bytes: int = 0) -> int:
    """Torch threads for each CPU rank: the cores split between ranks, one kept back for the
    router and gRPC when the model is small. A rank using every core stalls each time the router
    runs (its threads wait on the one that was descheduled), and the decode step computed ahead
    overlaps the router only if there is a core to overlap on (on 2 cores with the embedded
    model, 1 thread with decode ahead outran 2 threads). A model of `weight_bytes` >=
    MATMUL_BOUND_BYTES on the rank spends its step in matmuls that scale with threads: on 2 cores
    a 0.5B model's step takes 1.6x as long on 1 thread, far more than the router costs it."""
    if cores <= 1:
        return 1
    if weight_bytes >= MATMUL_BOUND_BYTES:
        return max(1, cores // world_size)
    return max(1, (cores - 1) // world_size)


def rank_environment(args: ServeArgs, environ: dict[str, str] | os._Environ = os.environ) -> dict[str, str]:
    """The variables a rank sets for itself before its model loads, for settings that the kernel
    and loader code reads from the environment (they are also settable there directly)."""
    changes = {}
    if args.allow_dense_fallback:
        changes[ALLOW_DENSE_FALLBACK_ENV] = "1"
    if args.disable_custom_kernels:
        changes[DISABLE_KERNELS_ENV] = disabled_kernels_value(environ.get(DISABLE_KERNELS_ENV))
    # Also in the environment the launcher starts ranks with (torch reads its variables at import);
    # set here too for a rank started by hand (--shard-only), where the kernels warn if torch's came late.
    changes.update(cpu_isa_environment(args.cpu_isa))
    if args.cpu_int8_activations != environ.get(CPU_INT8_ACTIVATIONS_ENV, "auto"):  # kernels/cpu_act_int8.py reads it
        changes[CPU_INT8_ACTIVATIONS_ENV] = args.cpu_int8_activations
    return changes


def limit_cuda_memory(fraction: float, device) -> None:
    """TGI's --cuda-memory-fraction: this process may allocate at most `fraction` of the GPU's
    total memory (torch's caching allocator refuses beyond it)."""
    import torch

    if fraction < 1.0:
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        total = torch.cuda.get_device_properties(device).total_memory
        logger.info("CUDA memory capped at {:.0%} of {:.1f} GiB", fraction, total / 2**30)


def ignore_hangup() -> None:
    """SIGHUP is the launcher's "re-read the key and TLS files", and `kill -HUP -<pgid>` (what a
    service manager's reload may send) reaches every process of the group: a rank must ignore it,
    not die of its default action. The launcher starts ranks with SIGHUP blocked
    (shard_procs.ShardProcesses.start), so one sent while this process was still starting is
    pending, not fatal; ignoring it discards it, and unblocking is then safe."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGHUP})


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
        if not loop_ref and launcher_pid is not None:
            # Still loading: nothing to drain or close. Leave now, as SIGTERM's default action did
            # before the stop-signals thread took it (the launcher counts on a prompt exit).
            exit_process(0)
        hard_exit_later(SHARD_HARD_EXIT_S, 1)
        if loop_ref and stop_ref:
            loop_ref[0].call_soon_threadsafe(stop_ref[0].set)

    def outside_stop(sender: int) -> None:
        if outside_timer:
            return
        delay = args.drain_timeout_s + OUTSIDE_STOP_MARGIN_S
        logger.warning("received SIGTERM from {}, not from the launcher (pid {}): a stop sent to the whole process "
                       "group or cgroup; the launcher drains the requests in flight and then stops this rank (this "
                       "rank stops by itself in {:.0f} s otherwise)", f"pid {sender}" if sender else "outside",
                       launcher_pid, delay)
        timer = threading.Timer(delay, request_stop, (f"a SIGTERM from outside {delay:.0f} s ago, none from the "
                                                      "launcher since",))
        timer.daemon = True
        timer.start()
        outside_timer.append(timer)

    outside_timer: list[threading.Timer] = []
    stop_signals = None
    if launcher_pid is not None:
        # Started by our launcher: it handles Ctrl-C and tells us to stop with SIGTERM.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        ignore_hangup()
        stop_signals = wait_for_stop_signals(int(launcher_pid), lambda: request_stop("received SIGTERM"),
                                             outside_stop)
        set_parent_death_signal(signal.SIGTERM)
        watch_parent(int(launcher_pid), lambda: request_stop("the launcher is gone"))

    try:
        args.validate()
        model, device = load_rank(args, rank, world_size)
    except ValueError as exc:  # CheckpointError, bad dtype, bad settings
        finish_startup()
        logger.error("cannot start: {}", exc)
        return 2
    if stop_requested.is_set():
        finish_startup()
        return 0
    memory_fraction = rank_memory_fraction(args, device)
    if rank == 0:
        log_rank_settings(args, model, device, world_size, memory_fraction)

    async def serve() -> None:
        from text_generation_server.shard.service import serve_shard

        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop_ref.append(loop)
        stop_ref.append(stop)
        # Under our launcher SIGTERM is the stop-signals thread's (unless the platform lacks sigwaitinfo).
        handled = (() if stop_signals is not None else (signal.SIGTERM,)) if launcher_pid is not None \
            else (signal.SIGTERM, signal.SIGINT)
        for sig in handled:
            loop.add_signal_handler(sig, request_stop, f"received {sig.name}")
        if stop_requested.is_set():
            stop.set()
        await serve_shard(model, args.uds_path, rank, world_size, memory_fraction, args.max_batch_total_tokens, stop,
                          prefix_caching=args.prefix_caching, stall_timeout_s=args.rank_stall_timeout_s,
                          speculate=args.speculate)

    startup_phase("waiting for the router's warmup")
    try:
        event_loop.run(serve())
    finally:
        finish_startup()
    return 0


def load_rank(args: ServeArgs, rank: int, world_size: int, pin: bool = True) -> tuple["CausalLM", "torch.device"]:
    """One rank's device, torch threads, native kernels, model and LoRA slots: everything a rank
    does before its service starts, in a rank process or (--shard-in-process) in the launcher's.
    `pin`: a CPU rank binds its process to its cores (launcher/cpu_affinity.py); not in the
    launcher's process, which the router shares. Raises ValueError (CheckpointError among them)
    for bad settings or checkpoints."""
    device = _shard_device(args, int(os.environ.get("LOCAL_RANK", rank)))
    if device.type == "cuda":
        limit_cuda_memory(args.cuda_memory_fraction, device)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(cpu_threads_per_rank(len(available_cpus()), world_size))
    from text_generation_server.models.loader import get_model
    from text_generation_server.quantizers.dist import initialize_process_group

    if rank == 0:
        startup = StartupProgress(live=False if args.json_output else None)
        startup.__enter__()  # ended by warmup (finish_startup) or when the rank stops
        startup.phase("connecting the ranks")
    process_group = initialize_process_group(rank, world_size, device)
    if device.type == "cpu" and needs_native_kernels(args):
        startup_phase("building native CPU kernels (cached per machine)")
        from text_generation_server.kernels import cpu_native

        cpu_native.native()
    # The router never batches more than --max-batch-size requests, nor holds more than
    # --max-concurrent-requests at once: warmup measures a decode step at that size.
    batch_limit = min(b for b in (args.max_batch_size, args.max_concurrent_requests) if b is not None)
    model = get_model(args.model, args.dtype, device, process_group, args.quantize, args.block_size,
                      attention_backend=args.effective_attention_backend,
                      cuda_graphs=args.effective_cuda_graphs, max_batch_size=batch_limit,
                      model_impl=args.model_impl, quantize_lm_head=args.quantize_lm_head or LM_HEAD_AUTO,
                      kv_cache_dtype=args.kv_cache_dtype,
                      kv_cache_fp8_skip_layers=args.kv_cache_fp8_skip_layers)
    if args.lora_slots:  # before warmup, which sizes the KV cache around the adapter slots
        from text_generation_server.models.adapters import start_lora

        start_lora(model, args.lora_slots, args.max_lora_rank, args.lora_adapters)
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        import torch

        weight_bytes = weight_bytes_of(model.model)
        cores = len(available_cpus())
        threads = cpu_threads_per_rank(cores, world_size, weight_bytes)
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
        if rank == 0:
            logger.info("{} torch thread(s) per rank ({:.0f} MiB of weights on this rank, {} cores)", threads,
                        weight_bytes / 2**20, cores)
        if pin:
            pin_rank(args.cpu_affinity, rank, world_size, threads)
    return model, device


def rank_memory_fraction(args: ServeArgs, device: "torch.device") -> float:
    """--memory-fraction, or its default for the device (the KV cache's share of free memory)."""
    return args.memory_fraction or (0.9 if device.type == "cuda" else 0.1)


def log_rank_settings(args: ServeArgs, model: "CausalLM", device: "torch.device", world_size: int,
                      memory_fraction: float) -> None:
    logger.info(
        "model {} | dtype {} | device {} | quantize {} | world size {} | block size {} | memory fraction {} | "
        "max_input_tokens {} | max_total_tokens {} | max_batch_prefill_tokens {} | max_batch_total_tokens {} | "
        "max_batch_size {}",
        model.model_id, str(model.dtype).removeprefix("torch."), device, model.quantize or "none", world_size,
        args.block_size, memory_fraction, args.max_input_tokens, args.max_total_tokens,
        args.max_batch_prefill_tokens, args.max_batch_total_tokens, args.max_batch_size,
    )


def needs_native_kernels(args: ServeArgs) -> bool:
    """Whether a CPU rank's layers will use the native CPU kernels (float32, bfloat16 or quantized
    weights: float32 and bfloat16 layers decode through its matrix-vector products and fused small
    ops), so their build (a minute once per machine, under a second cached) is a phase of its own
    rather than a silent part of the first forward. Only float16 layers of an unquantized model
    keep torch's ops alone."""
    import json

    from text_generation_server.utils.locate import resolve_model

    if args.dtype in (None, "float32", "bfloat16") or args.quantize:
        return True
    try:
        _, folder = resolve_model(args.model)
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return "quantization_config" in config or (folder / "quantize_config.json").exists()


def _shard_device(args: ServeArgs, local_rank: int):
    import torch

    name = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
        raise ValueError(f"rank needs CUDA device {local_rank}, but {torch.cuda.device_count()} are available")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)
