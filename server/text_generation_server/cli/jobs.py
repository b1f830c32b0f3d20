"""The offline jobs: `convert` (pickle to safetensors), `quantize` (GPTQ / round-to-nearest) and
`perplexity`. Each loads its job's module only when it runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from text_generation_server.about import EMBEDDED_MODEL_ID
from text_generation_server.cli.common import LEVEL_HELP, SHARD_SIZE_HELP, fail, setup_logging


def convert(
    model_dir: Path = typer.Argument(..., help="Folder with pytorch_model*.bin / *.pt files, or a .gguf file "
                                     "(or a folder holding one) to dequantize."),
    output: Optional[Path] = typer.Option(None, "--output", help="Where to write (default: in place; for a GGUF, "
                                          "a MODEL-safetensors folder beside the file)."),
    max_shard_size_mb: int = typer.Option(2000, "--max-shard-size-mb", min=1, help=SHARD_SIZE_HELP),
    dtype: str = typer.Option("float32", "--dtype", help="GGUF only: the dense dtype (float32, bfloat16, float16)."),
    logger_level: str = typer.Option("INFO", "--logger-level", help=LEVEL_HELP),
) -> None:
    """Convert pickle weights to safetensors (the only command that unpickles, with weights_only=True), or a
    GGUF file to a dense safetensors folder."""
    setup_logging(logger_level)
    from text_generation_server.jobs.convert import convert_folder
    from text_generation_server.jobs.gguf_export import convert_gguf, default_output, is_gguf

    try:
        if is_gguf(model_dir):
            written = convert_gguf(model_dir, output or default_output(model_dir), max_shard_size_mb * 1024 * 1024,
                                   dtype)
        else:
            written = convert_folder(model_dir, output or model_dir, max_shard_size_mb * 1024 * 1024)
    except ValueError as exc:
        fail(str(exc))
    for path in written:
        typer.echo(str(path))


def quantize(
    model: str = typer.Argument(..., metavar="MODEL", help=f"Dense checkpoint folder, a .gguf file (read "
                                f"dequantized), or '{EMBEDDED_MODEL_ID}'."),
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
    max_shard_size_mb: int = typer.Option(2000, "--max-shard-size-mb", min=1, help=SHARD_SIZE_HELP),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
    logger_level: str = typer.Option("INFO", "--logger-level", help=LEVEL_HELP),
) -> None:
    """Quantize MODEL to GPTQ (or round-to-nearest) layer by layer and write OUTPUT_DIR."""
    setup_logging(logger_level)
    from text_generation_server.jobs.quantize.options import QuantizeOptions
    from text_generation_server.jobs.quantize.pipeline import quantize as run_quantize

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
    kv_cache_dtype: str = typer.Option(
        "auto", "--kv-cache-dtype", help="As serve's: auto, fp8_e4m3fn or fp8_e5m2 (aliases fp8, fp8_e4m3)."
    ),
    kv_cache_fp8_skip_layers: str = typer.Option(
        "auto", "--kv-cache-fp8-skip-layers", help="As serve's: auto, none or layer ids (0,1 or 0-3,9)."
    ),
    json_output: bool = typer.Option(False, "--json", help='Print {"perplexity": ..., "tokens": ...} as JSON.'),
    logger_level: str = typer.Option("WARNING", "--logger-level", help=LEVEL_HELP),
) -> None:
    """Perplexity of MODEL on a text file (every token after each window's first is scored)."""
    setup_logging(logger_level)
    from text_generation_server.jobs.perplexity import perplexity as run_perplexity

    from text_generation_server.settings.serve_args import parse_kv_cache_dtype

    try:
        result = run_perplexity(model, dataset, seqlen=seqlen, max_tokens=max_tokens, dtype=dtype,
                                quantize=quantize_flag,
                                kv_cache_dtype=parse_kv_cache_dtype(kv_cache_dtype, "--kv-cache-dtype"),
                                kv_cache_fp8_skip_layers=kv_cache_fp8_skip_layers)
    except ValueError as exc:
        fail(str(exc))
    if json_output:
        typer.echo(json.dumps(result.to_json()))
    else:
        typer.echo(f"perplexity {result.perplexity:.4f} over {result.tokens} tokens "
                   f"({result.windows} windows of up to {result.seqlen})")
