"""`serve`: the router and its ranks, configured by flags and the environment as TGI's launcher is.

The options are the ServeArgs fields' flags (settings/serve_args.py), built into the command by
cli/serve_options.py; `serve_args_from_flags` reads them back into ServeArgs, resolving what
involves several settings (HOSTNAME, --sharded) here.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, NoReturn

import typer
from loguru import logger

from text_generation_server.cli.common import fail
from text_generation_server.cli.serve_options import check_tgi_only_flags, flag_value, origin, serve_options
from text_generation_server.settings.serve_args import ServeArgs, flag_of
from text_generation_server.settings.serve_flags import hostname_from_env, is_loopback, resolve_num_shard

SERVE_EPILOG = (
    "Every option can also be set by the environment variable shown; a flag given on the command "
    "line wins. TGI launcher flags that mean nothing here (--revision, --rope-scaling, "
    "--otlp-endpoint, ...) are refused with the reason; harmless ones (--max-best-of, --usage-stats, "
    "--trust-remote-code, ...) are ignored with a warning."
)


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        fail(f"environment variable {name} must be an integer, got {value!r}")


@serve_options
def serve(ctx: typer.Context, **flags: Any) -> None:
    """Serve MODEL_DIR over gRPC: the router plus one process per tensor-parallel rank."""
    from text_generation_server.launcher.supervisor import launch
    from text_generation_server.launcher.process_exit import exit_process
    from text_generation_server.launcher.rank import SERVE_ARGS_ENV, run_shard, shard_args_from_env

    shard_only = flags["shard_only"]
    if shard_only and SERVE_ARGS_ENV in os.environ:
        # A rank of our launcher: its settings come whole from the launcher, which checked them.
        try:
            args = shard_args_from_env(ServeArgs())
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
    warnings = check_tgi_only_flags(ctx)
    values: dict[str, Any] = {}
    companions: dict[str, Any] = {}
    for item in dataclasses.fields(ServeArgs):
        flag = flag_of(item)
        if flag is None:
            continue
        values[item.name] = flag_value(ctx, flag.param or item.name, flag)
        for companion in flag.companions:
            companions[companion.param or ""] = flag_value(ctx, companion.param or "", companion)

    default_hostname = ServeArgs().hostname
    if origin(ctx, "hostname").startswith("environment"):
        address = hostname_from_env(values["hostname"])
        if address is None:
            warnings.append(
                f"HOSTNAME={values['hostname']!r} is a host name (container runtimes set it), not an address: "
                f"serving on {default_hostname}; pass --hostname 0.0.0.0 (or set HOSTNAME to an address) to listen "
                "on every interface"
            )
        values["hostname"] = address or default_hostname

    def cuda_device_count() -> int:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    values["num_shard"] = resolve_num_shard(companions["sharded"], values["num_shard"], values["device"],
                                            cuda_device_count)
    if values["cuda_memory_fraction"] != 1.0 and values["device"] == "cpu":
        warnings.append("--cuda-memory-fraction has no effect on CPU ranks")
    args = ServeArgs(**values)
    args.validate()
    if not args.shard_only:
        warnings += check_security_files(args)
    return dataclasses.replace(args, attention_backend=args.effective_attention_backend), warnings


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


def _serve_fail(message: str, ctx: typer.Context) -> NoReturn:
    """A startup error as a log line when JSON logs were asked for (log collectors parse every
    line), else as the plain `error:` line of every command."""
    if ctx.params.get("json_output"):
        from text_generation_server.utils.logging_setup import configure_logging

        configure_logging("INFO", True, "launcher")
        logger.error("{}", message)
        logger.complete()
        raise typer.Exit(2)
    fail(message)
