"""`serve`: the router and its ranks, configured by flags and the environment as TGI's launcher is."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, List, Optional

import typer
from loguru import logger

from text_generation_server.about import EMBEDDED_MODEL_ID
from text_generation_server.cli.common import fail, version_option
from text_generation_server.settings.serve_args import ATTENTION_BACKENDS, MAX_SPECULATE, PORTABLE_ATTENTION_BACKEND, ServeArgs
from text_generation_server.settings.serve_flags import (
    CUSTOM_KERNELS,
    TGI_ALIASES,
    add_tgi_only_flags,
    check_tgi_only_flags,
    choose,
    hostname_from_env,
    is_loopback,
    origin,
    parse_api_keys,
    parse_bool,
    parse_cuda_graphs,
    parse_log_level,
    resolve_num_shard,
)

_SERVE_DEFAULTS = ServeArgs()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        fail(f"environment variable {name} must be an integer, got {value!r}")


def _env_option(default: Any, *decls: str, help: str, envvar: Optional[List[str]] = None, **kwargs: Any) -> Any:
    """An option also read from the environment, as TGI's launcher reads every flag: by default
    from its long name in upper snake case (--max-total-tokens: MAX_TOTAL_TOKENS)."""
    long_name = decls[0].split("/")[0]
    names = envvar or [long_name.lstrip("-").replace("-", "_").upper()]
    # A single name as a string: click then names just that variable in its parse errors.
    return typer.Option(default, *decls, envvar=names[0] if len(names) == 1 else names, show_envvar=True,
                        help=help, **kwargs)


def _tgi_name(ours: str) -> str:
    return f"TGI's name for {ours}."


SERVE_EPILOG = (
    "Every option can also be set by the environment variable shown; a flag given on the command "
    "line wins. TGI launcher flags that mean nothing here (--revision, --kv-cache-dtype, "
    "--lora-adapters, ...) are refused with the reason; harmless ones (--max-best-of, --usage-stats, "
    "--trust-remote-code, ...) are ignored with a warning."
)


@add_tgi_only_flags
def serve(
    ctx: typer.Context,
    model_dir: Optional[str] = typer.Argument(
        None, metavar="MODEL_DIR", show_default=False,
        help=f"Checkpoint folder, or '{EMBEDDED_MODEL_ID}' (the embedded default); or --model-id / MODEL_ID.",
    ),
    model_id: Optional[str] = _env_option(None, "--model-id", help=_tgi_name("MODEL_DIR")),
    # -- network
    hostname: str = _env_option(
        _SERVE_DEFAULTS.hostname, "--hostname",
        help="Address of the client gRPC API. HOSTNAME is used only when it holds an address "
        "(container runtimes set it to a host name).",
    ),
    port: int = _env_option(_SERVE_DEFAULTS.port, "--port", help="Port of the client gRPC API."),
    metrics_port: int = _env_option(_SERVE_DEFAULTS.metrics_port, "--metrics-port", help="Prometheus /metrics port."),
    prometheus_port: Optional[int] = _env_option(None, "--prometheus-port", help=_tgi_name("--metrics-port")),
    uds_path: str = _env_option(
        _SERVE_DEFAULTS.uds_path, "--uds-path", help="Shard sockets are {uds_path}-{rank}."
    ),
    shard_uds_path: Optional[str] = _env_option(None, "--shard-uds-path", help=_tgi_name("--uds-path")),
    metrics_hostname: Optional[str] = _env_option(
        None, "--metrics-hostname", help="Address of /metrics (default: --hostname's). It is plain HTTP."
    ),
    # -- who may call
    api_key: List[str] = _env_option(
        [], "--api-key", metavar="KEY",
        help="Calls must send metadata 'authorization: Bearer KEY' (repeatable; API_KEY may hold several, "
        "comma-separated, to rotate keys).",
    ),
    api_key_file: Optional[str] = _env_option(
        None, "--api-key-file", help="API keys, one per line; re-read when it changes or on SIGHUP."
    ),
    api_key_protects_health: bool = _env_option(
        False, "--api-key-protects-health",
        help="Health and reflection need the key too (default: open, for probes).",
    ),
    tls_cert_path: Optional[str] = _env_option(
        None, "--tls-cert-path",
        help="PEM certificate chain: the client API speaks TLS. Re-read when it changes or on SIGHUP.",
    ),
    tls_key_path: Optional[str] = _env_option(
        None, "--tls-key-path", help="PEM private key of --tls-cert-path (unencrypted)."
    ),
    tls_client_ca_path: Optional[str] = _env_option(
        None, "--tls-client-ca-path",
        help="PEM CA certificates: clients must present a certificate they signed (mutual TLS).",
    ),
    # -- model and ranks
    num_shard: Optional[int] = _env_option(None, "--num-shard", help="Tensor-parallel ranks (default 1)."),
    sharded: Optional[str] = _env_option(
        None, "--sharded", metavar="true|false",
        help="TGI's switch: true runs one rank per visible GPU (or --num-shard ranks), false one rank.",
    ),
    quantize: Optional[str] = _env_option(
        None, "--quantize", help="Quantization method (default: from the checkpoint)."
    ),
    dtype: Optional[str] = _env_option(None, "--dtype", help="float32, float16 or bfloat16."),
    device: Optional[str] = _env_option(None, "--device", help="cpu or cuda (default: cuda when available)."),
    model_impl: str = _env_option(
        "auto", "--model-impl", metavar="auto|native|transformers",
        help="auto: this server's implementation of the family, else transformers' modeling code over its "
        "paged cache; native refuses other types; transformers always takes the latter.",
    ),
    quantize_lm_head: Optional[str] = _env_option(
        None, "--quantize-lm-head", metavar="int8",
        help="Run a dense lm_head as per-row int8 (the head is a small model's largest matrix and decode "
        "reads it every step). Default: as the checkpoint stores it.",
    ),
    # -- request limits
    max_input_tokens: Optional[int] = _env_option(
        None, "--max-input-tokens",
        help="Longest prompt in tokens (default: --max-total-tokens - 1).",
    ),
    max_input_length: Optional[int] = _env_option(None, "--max-input-length", help=_tgi_name("--max-input-tokens")),
    max_total_tokens: Optional[int] = _env_option(
        None, "--max-total-tokens",
        help="Longest prompt + generation in tokens (default: min(max positions, 4096)).",
    ),
    max_stop_sequences: int = _env_option(
        _SERVE_DEFAULTS.max_stop_sequences, "--max-stop-sequences", help="Most stop sequences per request."
    ),
    max_stop_sequence_length: int = _env_option(
        _SERVE_DEFAULTS.max_stop_sequence_length, "--max-stop-sequence-length",
        help="Longest stop sequence, in characters.",
    ),
    max_top_n_tokens: int = _env_option(
        _SERVE_DEFAULTS.max_top_n_tokens, "--max-top-n-tokens",
        help="Most alternative tokens a request may ask for per step.",
    ),
    max_input_chars: int = _env_option(
        _SERVE_DEFAULTS.max_input_chars, "--max-input-chars",
        help="Longest prompt in characters, checked before tokenizing.",
    ),
    max_message_bytes: int = _env_option(
        _SERVE_DEFAULTS.max_message_bytes, "--max-message-bytes", help="Largest gRPC request accepted, in bytes."
    ),
    payload_limit: Optional[int] = _env_option(None, "--payload-limit", help=_tgi_name("--max-message-bytes")),
    # -- batching and scheduling
    max_concurrent_requests: int = _env_option(
        _SERVE_DEFAULTS.max_concurrent_requests, "--max-concurrent-requests",
        help="Requests in flight before new ones are refused (RESOURCE_EXHAUSTED).",
    ),
    max_batch_prefill_tokens: Optional[int] = _env_option(
        None, "--max-batch-prefill-tokens",
        help="Most prompt tokens in one prefill (default: --max-input-tokens + 50).",
    ),
    max_batch_total_tokens: Optional[int] = _env_option(
        None, "--max-batch-total-tokens",
        help="Most tokens (prompts + generations) in a running batch (default: what the KV cache holds).",
    ),
    max_batch_size: Optional[int] = _env_option(
        None, "--max-batch-size", help="Most requests in a running batch (default: no limit)."
    ),
    max_waiting_tokens: int = _env_option(
        _SERVE_DEFAULTS.max_waiting_tokens, "--max-waiting-tokens",
        help="Decode steps a waiting request may wait before the running batch pauses to admit it.",
    ),
    waiting_served_ratio: float = _env_option(
        _SERVE_DEFAULTS.waiting_served_ratio, "--waiting-served-ratio",
        help="Admit waiting requests early once waiting / running exceeds this ratio.",
    ),
    speculate: int = _env_option(
        _SERVE_DEFAULTS.speculate, "--speculate", metavar="N",
        help=f"Speculative decoding: each decode step checks up to N tokens proposed from the request's own "
        f"earlier tokens (n-gram lookup) in one forward; the output is unchanged (0 to {MAX_SPECULATE}, 0 = off).",
    ),
    # -- memory and kernels
    block_size: int = _env_option(_SERVE_DEFAULTS.block_size, "--block-size", help="KV cache block size in tokens."),
    memory_fraction: Optional[float] = _env_option(
        None, "--memory-fraction",
        help="Share of the memory free after warmup given to the KV cache (default 0.1 on CPU, 0.9 on CUDA).",
    ),
    cuda_memory_fraction: float = _env_option(
        _SERVE_DEFAULTS.cuda_memory_fraction, "--cuda-memory-fraction",
        help="TGI's cap on each rank's CUDA memory, as a share of the GPU's total; the KV cache takes "
        "--memory-fraction of what is free inside it.",
    ),
    prefix_caching: bool = _env_option(
        _SERVE_DEFAULTS.prefix_caching, "--prefix-caching/--no-prefix-caching",
        help="Reuse the KV cache of prompt prefixes seen before (USE_PREFIX_CACHING is read too).",
    ),
    use_prefix_caching: Optional[bool] = _env_option(
        None, "--use-prefix-caching/--no-use-prefix-caching", hidden=True,
        help="TGI's older name for --prefix-caching.",
    ),
    cuda_graphs: Optional[str] = _env_option(
        None, "--cuda-graphs", metavar="SIZES",
        help="Batch sizes captured as CUDA graphs, e.g. 1,2,4,8 (default 1,2,4,8,16,32; 0 disables).",
    ),
    attention_backend: Optional[str] = _env_option(
        None, "--attention-backend", metavar="|".join(ATTENTION_BACKENDS),
        help="Attention implementation (default: the best for the device).",
    ),
    disable_custom_kernels: bool = _env_option(
        False, "--disable-custom-kernels",
        help=f"No custom CUDA kernels: turns off {', '.join(CUSTOM_KERNELS)} and uses "
        f"{PORTABLE_ATTENTION_BACKEND} attention.",
    ),
    allow_dense_fallback: bool = _env_option(
        False, "--allow-dense-fallback",
        help="Let quantized layers with no CUDA kernel run dequantized (more memory) instead of failing.",
    ),
    disable_grammar_support: bool = _env_option(
        False, "--disable-grammar-support",
        help="Refuse requests with parameters.grammar (JSON schema / regex constrained output).",
    ),
    # -- lifecycle and logs
    drain_timeout_s: float = _env_option(
        _SERVE_DEFAULTS.drain_timeout_s, "--drain-timeout-s",
        help="On SIGTERM/SIGINT, how long in-flight requests may run before they are cancelled.",
    ),
    graceful_termination_timeout: Optional[float] = _env_option(
        None, "--graceful-termination-timeout", help=_tgi_name("--drain-timeout-s"),
    ),
    rank_stall_timeout_s: float = _env_option(
        _SERVE_DEFAULTS.rank_stall_timeout_s, "--rank-stall-timeout-s",
        help="A rank whose model call runs longer than this is reported unhealthy.",
    ),
    logger_level: str = _env_option(
        _SERVE_DEFAULTS.logger_level, "--logger-level", envvar=["LOGGER_LEVEL", "LOG_LEVEL"],
        help="trace, debug, info, warning or error; TGI's LOG_LEVEL values are accepted too.",
    ),
    json_output: bool = _env_option(
        False, "--json-output",
        help="Log one JSON object per line (timestamp, level, message, target, component, request_id).",
    ),
    shard_only: bool = _env_option(
        False, "--shard-only",
        help="Run one rank only (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment).",
    ),
    version: bool = version_option(),
    **tgi_only_flags: Any,
) -> None:
    """Serve MODEL_DIR over gRPC: the router plus one process per tensor-parallel rank."""
    from text_generation_server.launcher.supervisor import launch
    from text_generation_server.launcher.process_exit import exit_process
    from text_generation_server.launcher.rank import SERVE_ARGS_ENV, run_shard, shard_args_from_env

    if shard_only and SERVE_ARGS_ENV in os.environ:
        # A rank of our launcher: its settings come whole from the launcher, which checked them.
        try:
            args = shard_args_from_env(_SERVE_DEFAULTS)
        except ValueError as exc:
            fail(str(exc))
        exit_process(run_shard(args, _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)))
    try:
        args, warnings = serve_args_from_flags(ctx)
    except ValueError as exc:
        _serve_fail(str(exc), ctx)
    if shard_only:
        exit_process(run_shard(args, _env_int("RANK", 0), _env_int("WORLD_SIZE", 1), warnings))
    raise typer.Exit(launch(args, warnings=warnings))


def serve_args_from_flags(ctx: typer.Context) -> tuple[ServeArgs, list[str]]:
    """`serve`'s flags and environment as ServeArgs, with the warnings to log once logging is set up."""
    params = ctx.params
    warnings = check_tgi_only_flags(ctx)
    chosen = {ours: choose(ctx, ours, tgi) for ours, tgi in TGI_ALIASES.items()}

    hostname = params["hostname"]
    if origin(ctx, "hostname").startswith("environment"):
        address = hostname_from_env(hostname)
        if address is None:
            warnings.append(
                f"HOSTNAME={hostname!r} is a host name (container runtimes set it), not an address: serving on "
                f"{_SERVE_DEFAULTS.hostname}; pass --hostname 0.0.0.0 (or set HOSTNAME to an address) to listen "
                "on every interface"
            )
        hostname = address or _SERVE_DEFAULTS.hostname
    sharded = None if params["sharded"] is None else parse_bool(params["sharded"], origin(ctx, "sharded"))
    device = params["device"]

    def cuda_device_count() -> int:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    num_shard = resolve_num_shard(sharded, params["num_shard"], device, cuda_device_count)
    cuda_graphs = None
    if params["cuda_graphs"] is not None:
        cuda_graphs = parse_cuda_graphs(params["cuda_graphs"], origin(ctx, "cuda_graphs"))
    if params["cuda_memory_fraction"] != 1.0 and device == "cpu":
        warnings.append("--cuda-memory-fraction has no effect on CPU ranks")
    args = ServeArgs(
        model=chosen["model_dir"], hostname=hostname, port=params["port"], metrics_port=chosen["metrics_port"],
        num_shard=num_shard, quantize=params["quantize"], dtype=params["dtype"], uds_path=chosen["uds_path"],
        max_input_tokens=chosen["max_input_tokens"], max_total_tokens=params["max_total_tokens"],
        max_batch_prefill_tokens=params["max_batch_prefill_tokens"],
        max_batch_total_tokens=params["max_batch_total_tokens"], max_batch_size=params["max_batch_size"],
        max_concurrent_requests=params["max_concurrent_requests"], max_stop_sequences=params["max_stop_sequences"],
        max_stop_sequence_length=params["max_stop_sequence_length"], max_top_n_tokens=params["max_top_n_tokens"],
        max_input_chars=params["max_input_chars"], max_message_bytes=chosen["max_message_bytes"],
        block_size=params["block_size"], memory_fraction=params["memory_fraction"], device=device,
        logger_level=parse_log_level(params["logger_level"], origin(ctx, "logger_level")),
        json_output=params["json_output"], shard_only=params["shard_only"], drain_timeout_s=chosen["drain_timeout_s"],
        max_waiting_tokens=params["max_waiting_tokens"], waiting_served_ratio=params["waiting_served_ratio"],
        prefix_caching=choose(ctx, "prefix_caching", "use_prefix_caching"), cuda_graphs=cuda_graphs,
        attention_backend=params["attention_backend"], disable_custom_kernels=params["disable_custom_kernels"],
        allow_dense_fallback=params["allow_dense_fallback"], cuda_memory_fraction=params["cuda_memory_fraction"],
        rank_stall_timeout_s=params["rank_stall_timeout_s"], model_impl=params["model_impl"],
        speculate=params["speculate"],
        quantize_lm_head=params["quantize_lm_head"], disable_grammar_support=params["disable_grammar_support"],
        api_keys=_api_keys(ctx), api_key_file=params["api_key_file"],
        api_key_protects_health=params["api_key_protects_health"], tls_cert_path=params["tls_cert_path"],
        tls_key_path=params["tls_key_path"], tls_client_ca_path=params["tls_client_ca_path"],
        metrics_hostname=params["metrics_hostname"],
    )
    args.validate()
    if not args.shard_only:
        warnings += check_security_files(args)
    return dataclasses.replace(args, attention_backend=args.effective_attention_backend), warnings


def _api_keys(ctx: typer.Context) -> list[str]:
    """--api-key values, or API_KEY split on commas only: click splits a repeatable option's
    variable on whitespace, which would turn a key with a space into two keys instead of an error."""
    where = origin(ctx, "api_key")
    values = ctx.params["api_key"]
    if where.startswith("environment variable "):
        values = [os.environ[where.removeprefix("environment variable ")]]
    return parse_api_keys(values, where)


def check_security_files(args: ServeArgs) -> list[str]:
    """Reads the key file and the TLS files now, so a missing, empty or mismatched one is a
    startup error naming it rather than a failure after warmup; returns warnings."""
    warnings = []
    if args.api_key_protects_health and not args.requires_api_key:  # here: the ranks' copy has no keys
        raise ValueError("--api-key-protects-health needs --api-key or --api-key-file")
    if args.requires_api_key or args.tls_cert_path is not None:
        from text_generation_server.router.auth import api_keys
        from text_generation_server.router.tls import load_tls, tls_files

        api_keys(args)
        files = tls_files(args)
        if files is not None:
            load_tls(files)
    if args.requires_api_key and args.tls_cert_path is None and not is_loopback(args.hostname):
        warnings.append(
            f"API keys are checked on {args.hostname}, but the client API is plaintext: keys and prompts cross "
            "the network readable; add --tls-cert-path/--tls-key-path or a TLS proxy"
        )
    return warnings


def _serve_fail(message: str, ctx: typer.Context) -> None:
    """A startup error as a log line when JSON logs were asked for (log collectors parse every
    line), else as the plain `error:` line of every command."""
    if ctx.params.get("json_output"):
        from text_generation_server.utils.logging_setup import configure_logging

        configure_logging("INFO", True, "launcher")
        logger.error("{}", message)
        logger.complete()
        raise typer.Exit(2)
    fail(message)
