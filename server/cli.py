"""The `text-generation-server` command line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from loguru import logger

from text_generation_server.serve_args import ServeArgs
from text_generation_server import EMBEDDED_MODEL_ID

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Serve, run, convert and quantize large language models.",
    pretty_exceptions_enable=False,
)


def setup_logging(level: str = "INFO", json_output: bool = False) -> None:
    """Loguru to stderr, so stdout stays clean for results (--json)."""
    level = level.upper()
    if level not in ("TRACE", "DEBUG", "INFO", "SUCCESS", "WARNING", "ERROR", "CRITICAL"):
        raise typer.BadParameter(f"unknown logger level '{level}'", param_hint="--logger-level")
    logger.remove()
    logger.add(sys.stderr, level=level, serialize=json_output, backtrace=False, diagnose=False)


def fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@app.command()
def generate(
    prompts: List[str] = typer.Argument(..., help="One or more prompts; all run as one batch."),
    model: Optional[str] = typer.Option(
        None, "--model", help=f"Checkpoint folder, or '{EMBEDDED_MODEL_ID}' (the embedded default)."
    ),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", min=1),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32, float16 or bfloat16."),
    quantize: Optional[str] = typer.Option(
        None, "--quantize", help="Quantization method; must agree with the checkpoint (default: from the checkpoint)."
    ),
    do_sample: bool = typer.Option(False, "--do-sample", help="Sample instead of greedy decoding."),
    temperature: float = typer.Option(1.0, "--temperature"),
    top_k: int = typer.Option(0, "--top-k"),
    top_p: float = typer.Option(1.0, "--top-p"),
    typical_p: float = typer.Option(1.0, "--typical-p"),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty"),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty"),
    seed: Optional[int] = typer.Option(None, "--seed", min=0),
    stop: List[str] = typer.Option([], "--stop", help="Stop sequence (repeatable)."),
    json_lines: bool = typer.Option(False, "--json", help="One JSON object per prompt, one per line."),
    logger_level: str = typer.Option("WARNING", "--logger-level"),
) -> None:
    """Generate completions for PROMPTS with a local model."""
    setup_logging(logger_level)
    from text_generation_server.generation.sampling import SamplingParams
    from text_generation_server.models import get_model
    from text_generation_server.models.types import GenerationRequest

    sampling = SamplingParams(
        temperature=temperature, top_k=top_k, top_p=top_p, typical_p=typical_p, do_sample=do_sample,
        seed=seed, repetition_penalty=repetition_penalty, frequency_penalty=frequency_penalty,
    )
    try:
        sampling.validate()
        lm = get_model(model, dtype=dtype, quantize=quantize)
        requests = [
            GenerationRequest(id=i, inputs=p, sampling=sampling, max_new_tokens=max_new_tokens, stop_sequences=stop)
            for i, p in enumerate(prompts)
        ]
        completions = lm.generate(requests)
    except ValueError as exc:  # CheckpointError is a ValueError
        fail(str(exc))
    for prompt, done in zip(prompts, completions):
        if json_lines:
            typer.echo(json.dumps({
                "model": lm.model_id,
                "prompt": prompt,
                "text": done.text,
                "token_ids": done.token_ids,
                "generated_tokens": len(done.token_ids),
                "finish_reason": done.finish_reason.name.lower(),
                "seed": done.seed,
            }))
        else:
            typer.echo(prompt + done.text)
            if len(prompts) > 1:
                typer.echo("")


@app.command()
def convert(
    model_dir: Path = typer.Argument(..., help="Folder with pytorch_model*.bin / *.pt files."),
    output: Optional[Path] = typer.Option(None, "--output", help="Where to write (default: in place)."),
    max_shard_size_mb: int = typer.Option(2000, "--max-shard-size-mb", min=1),
    logger_level: str = typer.Option("INFO", "--logger-level"),
) -> None:
    """Convert pickle weights to safetensors: the only command that unpickles, with weights_only=True."""
    setup_logging(logger_level)
    from text_generation_server.utils.convert import convert_folder

    try:
        written = convert_folder(model_dir, output or model_dir, max_shard_size_mb * 1024 * 1024)
    except ValueError as exc:
        fail(str(exc))
    for path in written:
        typer.echo(str(path))


_SERVE_DEFAULTS = ServeArgs()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        fail(f"environment variable {name} must be an integer, got {value!r}")


@app.command()
def serve(
    model_dir: Optional[str] = typer.Argument(
        None, metavar="MODEL_DIR", help=f"Checkpoint folder, or '{EMBEDDED_MODEL_ID}' (the embedded default)."
    ),
    hostname: str = typer.Option(_SERVE_DEFAULTS.hostname, "--hostname", help="Address of the client gRPC API."),
    port: int = typer.Option(_SERVE_DEFAULTS.port, "--port", help="Port of the client gRPC API."),
    metrics_port: int = typer.Option(_SERVE_DEFAULTS.metrics_port, "--metrics-port", help="Prometheus /metrics port."),
    num_shard: int = typer.Option(_SERVE_DEFAULTS.num_shard, "--num-shard", help="Tensor-parallel ranks."),
    quantize: Optional[str] = typer.Option(
        None, "--quantize", help="Quantization method (default: from the checkpoint)."
    ),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32, float16 or bfloat16."),
    uds_path: str = typer.Option(_SERVE_DEFAULTS.uds_path, "--uds-path", help="Shard sockets are {uds_path}-{rank}."),
    max_input_tokens: Optional[int] = typer.Option(None, "--max-input-tokens"),
    max_total_tokens: Optional[int] = typer.Option(None, "--max-total-tokens"),
    max_batch_prefill_tokens: Optional[int] = typer.Option(None, "--max-batch-prefill-tokens"),
    max_batch_total_tokens: Optional[int] = typer.Option(None, "--max-batch-total-tokens"),
    max_batch_size: Optional[int] = typer.Option(None, "--max-batch-size"),
    max_concurrent_requests: int = typer.Option(_SERVE_DEFAULTS.max_concurrent_requests, "--max-concurrent-requests"),
    max_stop_sequences: int = typer.Option(_SERVE_DEFAULTS.max_stop_sequences, "--max-stop-sequences"),
    max_stop_sequence_length: int = typer.Option(
        _SERVE_DEFAULTS.max_stop_sequence_length, "--max-stop-sequence-length"
    ),
    max_top_n_tokens: int = typer.Option(_SERVE_DEFAULTS.max_top_n_tokens, "--max-top-n-tokens"),
    max_input_chars: int = typer.Option(_SERVE_DEFAULTS.max_input_chars, "--max-input-chars"),
    max_message_bytes: int = typer.Option(_SERVE_DEFAULTS.max_message_bytes, "--max-message-bytes"),
    block_size: int = typer.Option(_SERVE_DEFAULTS.block_size, "--block-size", help="KV cache block size in tokens."),
    memory_fraction: Optional[float] = typer.Option(
        None, "--memory-fraction", help="Share of free memory for the KV cache (default 0.1 on CPU, 0.9 on CUDA)."
    ),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)."),
    drain_timeout_s: float = typer.Option(
        _SERVE_DEFAULTS.drain_timeout_s, "--drain-timeout-s", min=0.0,
        help="On SIGTERM/SIGINT, how long in-flight requests may run before they are cancelled.",
    ),
    logger_level: str = typer.Option(_SERVE_DEFAULTS.logger_level, "--logger-level"),
    json_output: bool = typer.Option(False, "--json-output", help="Log lines as JSON objects."),
    shard_only: bool = typer.Option(
        False, "--shard-only",
        help="Run one rank only (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment).",
    ),
) -> None:
    """Serve MODEL_DIR over gRPC: the router plus one process per tensor-parallel rank."""
    from text_generation_server.launcher import (
        check_logger_level, exit_process, launch, run_shard, shard_args_from_env,
    )

    args = ServeArgs(
        model=model_dir, hostname=hostname, port=port, metrics_port=metrics_port, num_shard=num_shard,
        quantize=quantize, dtype=dtype, uds_path=uds_path, max_input_tokens=max_input_tokens,
        max_total_tokens=max_total_tokens, max_batch_prefill_tokens=max_batch_prefill_tokens,
        max_batch_total_tokens=max_batch_total_tokens, max_batch_size=max_batch_size,
        max_concurrent_requests=max_concurrent_requests, max_stop_sequences=max_stop_sequences,
        max_stop_sequence_length=max_stop_sequence_length, max_top_n_tokens=max_top_n_tokens,
        max_input_chars=max_input_chars, max_message_bytes=max_message_bytes, block_size=block_size,
        memory_fraction=memory_fraction, device=device, logger_level=logger_level, json_output=json_output,
        shard_only=shard_only, drain_timeout_s=drain_timeout_s,
    )
    try:
        if shard_only:
            args = shard_args_from_env(args)
        check_logger_level(args.logger_level)
        args.validate()
    except ValueError as exc:
        fail(str(exc))
    if shard_only:
        exit_process(run_shard(args, _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)))
    raise typer.Exit(launch(args))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
