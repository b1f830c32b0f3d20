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


@app.command()
def health(
    hostname: str = typer.Option("127.0.0.1", "--hostname", help="Address of the server's client gRPC API."),
    port: int = typer.Option(_SERVE_DEFAULTS.port, "--port", min=1, max=65535, help="Port of the client gRPC API."),
    service: str = typer.Option("", "--service", help="Service to check ('' is the whole server)."),
    timeout_s: float = typer.Option(5.0, "--timeout-s", min=0.1, help="Give up (unhealthy) after this long."),
) -> None:
    """Exit 0 when the server's grpc.health.v1 reports SERVING, else 1: a container HEALTHCHECK without grpcurl."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    host = f"[{hostname}]" if ":" in hostname and not hostname.startswith("[") else hostname
    target = f"{host}:{port}"
    try:
        with grpc.insecure_channel(target) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
    except grpc.RpcError as exc:
        fail(f"{target}: health check failed: {exc.code().name}: {exc.details()}", code=1)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    if resp.status != health_pb2.HealthCheckResponse.SERVING:
        fail(f"{target}: {service or 'the server'} is {status}", code=1)
    typer.echo(f"{target}: SERVING")


@app.command()
def quantize(
    model: str = typer.Argument(..., metavar="MODEL", help=f"Dense checkpoint folder, or '{EMBEDDED_MODEL_ID}'."),
    output_dir: Path = typer.Argument(..., metavar="OUTPUT_DIR", help="Where to write the GPTQ checkpoint."),
    bits: int = typer.Option(4, "--bits", help="2, 3, 4 or 8."),
    groupsize: int = typer.Option(128, "--groupsize", help="Input rows per scale group; -1 for per-channel."),
    sym: bool = typer.Option(True, "--sym/--no-sym", help="Symmetric (implied zero point) or asymmetric grids."),
    act_order: bool = typer.Option(False, "--act-order", help="Quantize columns by decreasing activation size."),
    static_groups: bool = typer.Option(False, "--static-groups", help="With --act-order: groups fixed up front."),
    percdamp: float = typer.Option(0.01, "--percdamp", help="Dampening, as a fraction of the mean diag(H)."),
    true_sequential: bool = typer.Option(
        True, "--true-sequential/--no-true-sequential",
        help="Quantize q/k/v, o, gate/up, down in turn, each calibrated on the quantized ones before it.",
    ),
    dataset: Optional[Path] = typer.Option(
        None, "--dataset", help="Calibration text: a .txt or .jsonl ('text' per line) file (default: the "
        "stdlib corpus train split; no download).",
    ),
    nsamples: int = typer.Option(128, "--nsamples", help="Calibration samples."),
    seqlen: Optional[int] = typer.Option(
        None, "--seqlen", help="Tokens per sample (default min(2048, max positions))."
    ),
    seed: int = typer.Option(0, "--seed", help="Seed for choosing the calibration samples."),
    method: str = typer.Option("gptq", "--method", help="gptq, or rtn (round-to-nearest, no calibration)."),
    checkpoint_format: str = typer.Option("gptq", "--checkpoint-format", help="gptq (v1) or gptq_v2."),
    modules_to_not_convert: List[str] = typer.Option(
        [], "--modules-to-not-convert", help="Module names left dense (repeatable or comma-separated)."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing OUTPUT_DIR."),
    max_shard_size_mb: int = typer.Option(2000, "--max-shard-size-mb", min=1),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    logger_level: str = typer.Option("INFO", "--logger-level"),
) -> None:
    """Quantize MODEL to GPTQ (or round-to-nearest) layer by layer and write OUTPUT_DIR."""
    setup_logging(logger_level)
    from text_generation_server.quantize import QuantizeOptions, quantize as run_quantize

    names = tuple(n.strip() for item in modules_to_not_convert for n in item.split(",") if n.strip())
    options = QuantizeOptions(
        bits=bits, group_size=groupsize, sym=sym, act_order=act_order, static_groups=static_groups,
        percdamp=percdamp, true_sequential=true_sequential, method=method, checkpoint_format=checkpoint_format,
        modules_to_not_convert=names, dataset=dataset, nsamples=nsamples, seqlen=seqlen, seed=seed,
        overwrite=overwrite, max_shard_bytes=max_shard_size_mb * 1024 * 1024, device=device,
    )
    try:
        written = run_quantize(model, output_dir, options)
    except ValueError as exc:  # CheckpointError, QuantizeError, DatasetError
        fail(str(exc))
    typer.echo(str(written))


@app.command()
def perplexity(
    model: Optional[str] = typer.Argument(
        None, metavar="MODEL", help=f"Checkpoint folder (quantized or not), or '{EMBEDDED_MODEL_ID}' (default)."
    ),
    dataset: Optional[Path] = typer.Option(
        None, "--dataset", help="A .txt or .jsonl ('text' per line) file (default: the stdlib corpus held-out split)."
    ),
    seqlen: Optional[int] = typer.Option(None, "--seqlen", help="Window length (default min(max positions, 512))."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Score at most the first N tokens."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32, float16 or bfloat16."),
    quantize_flag: Optional[str] = typer.Option(
        None, "--quantize", help="Quantization method; must agree with the checkpoint (default: from the checkpoint)."
    ),
    json_output: bool = typer.Option(False, "--json", help='Print {"perplexity": ..., "tokens": ...} as JSON.'),
    logger_level: str = typer.Option("WARNING", "--logger-level"),
) -> None:
    """Perplexity of MODEL on a text file (every token after each window's first is scored)."""
    setup_logging(logger_level)
    from text_generation_server.perplexity import perplexity as run_perplexity

    try:
        result = run_perplexity(model, dataset, seqlen=seqlen, max_tokens=max_tokens, dtype=dtype,
                                quantize=quantize_flag)
    except ValueError as exc:
        fail(str(exc))
    if json_output:
        typer.echo(json.dumps(result.to_json()))
    else:
        typer.echo(f"perplexity {result.perplexity:.4f} over {result.tokens} tokens "
                   f"({result.windows} windows of up to {result.seqlen})")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
