"""The `text-generation-server` command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import typer
from loguru import logger

from text_generation_server.utils.checkpoint import EMBEDDED_MODEL_ID

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
        lm = get_model(model, dtype=dtype)
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
