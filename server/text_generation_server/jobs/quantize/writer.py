"""Writing `quantize`'s output: safetensors shards as tensors are produced, the side files, and
the staging folder that becomes OUTPUT_DIR only once complete (an interrupted run never leaves
a folder that looks like a valid checkpoint)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from loguru import logger
from safetensors.torch import save_file

from text_generation_server.jobs.quantize.options import QuantizeError

SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
              "tokenizer.model", "vocab.json", "merges.txt", "chat_template.json", "chat_template.jinja")


class ShardWriter:
    """Tensors go to safetensors shards as they are produced, so memory holds at most one shard."""

    def __init__(self, folder: Path, max_bytes: int):
        self.folder = folder
        self.max_bytes = max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.total_bytes = 0
        self.files: list[Path] = []
        self.weight_map: dict[str, int] = {}  # tensor -> shard number

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.weight_map or name in self.pending:
            raise QuantizeError(f"tensor '{name}' written twice")
        tensor = tensor.contiguous()
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.folder / f"shard-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        for name in self.pending:
            self.weight_map[name] = len(self.files)
        self.files.append(path)
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[Path]:
        """Names the shards model-0000i-of-0000n.safetensors and writes the index."""
        self.flush()
        count = len(self.files)
        names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        for path, name in zip(self.files, names):
            os.rename(path, self.folder / name)
        index = {"metadata": {"total_size": self.total_bytes},
                 "weight_map": {k: names[v] for k, v in sorted(self.weight_map.items())}}
        index_path = self.folder / "model.safetensors.index.json"
        index_path.write_text(json.dumps(index, indent=2) + "\n")
        self.files = [self.folder / n for n in names]
        for path in self.files:  # save_file creates owner-only files; give shards the umask's mode
            os.chmod(path, index_path.stat().st_mode & 0o777)
        return self.files


def copy_side_files(source: Path, target: Path) -> None:
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)


class Staging:
    """A hidden folder beside OUTPUT_DIR that is renamed into place when the run succeeds."""

    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self.path = output_dir.parent / f".{output_dir.name}.partial-{os.getpid()}"

    def __enter__(self) -> Path:
        self.output_dir.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            shutil.rmtree(self.path)
        self.path.mkdir()
        return self.path

    def __exit__(self, kind, value, tb) -> None:
        if kind is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        try:
            self.commit()
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    def commit(self) -> None:
        """Moves the finished folder into place; an existing OUTPUT_DIR is replaced only now."""
        old = None
        if self.output_dir.exists():
            old = self.output_dir.parent / f".{self.output_dir.name}.old-{os.getpid()}"
            os.rename(self.output_dir, old)
        try:
            os.rename(self.path, self.output_dir)
        except OSError:
            if old is not None:
                os.rename(old, self.output_dir)  # put the previous output back
            raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("quantized checkpoint written to {}", self.output_dir)
