"""`convert model.gguf`: the GGUF's weights dequantized into a dense safetensors folder.

Every tensor is read the way serving reads it (quantizers/gguf_arch.py: Hugging Face names, llama's
q/k rows un-permuted, Gemma's norms back from 1 + w), dequantized to `dtype`, and written in
shards with config.json and the tokenizer files made from the metadata, so the folder loads here
and in transformers like any checkpoint. The folder is written beside OUTPUT first and renamed
into place when complete.
"""

from __future__ import annotations

from pathlib import Path

import torch
from loguru import logger

from text_generation_server.jobs.quantize.writer import ShardWriter, Staging
from text_generation_server.quantizers.gguf_arch import open_source, side_files
from text_generation_server.quantizers.gguf_file import gguf_files
from text_generation_server.quantizers.sources import CheckpointError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def is_gguf(path: Path) -> bool:
    return gguf_files(Path(path)) is not None


def default_output(path: Path) -> Path:
    """Beside the file: model.gguf -> model-safetensors/."""
    first = gguf_files(Path(path))[0]  # type: ignore[index]
    return first.with_name(first.name.removesuffix(".gguf") + "-safetensors")


def write_side_files(files: list[Path], folder: Path) -> None:
    for name, text in side_files(files).items():
        (folder / name).write_text(text)


def convert_gguf(path: Path, output: Path, max_shard_bytes: int, dtype: str = "float32") -> list[Path]:
    """Writes the dense folder; returns its weight files."""
    files = gguf_files(Path(path))
    if files is None:
        raise CheckpointError(f"{path} is not a GGUF file or a folder holding one")
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    output = Path(output).expanduser().resolve()
    if output.exists():
        raise CheckpointError(f"{output} already exists: remove it or name another --output")
    source = open_source(files)
    with Staging(output) as staging:
        writer = ShardWriter(staging, max_shard_bytes)
        for name in source.keys():
            writer.add(name, source.get_slice(name)[...].to(DTYPES[dtype]))
        written = writer.finish()
        write_side_files(files, staging)
        config = staging / "config.json"
        config.write_text(config.read_text().replace('"torch_dtype": "float32"', f'"torch_dtype": "{dtype}"'))
    logger.info("wrote {} ({} tensors, {:.1f} MB)", output, len(source.keys()), writer.total_bytes / 1e6)
    return [output / p.name for p in written]
