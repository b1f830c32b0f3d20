"""Finding and reading a checkpoint folder: config, generation config, tokenizer.

Every error names the file and the key, because a user pointing the server at a
half-downloaded folder needs to know exactly what to fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from text_generation_server.quantizers.sources import CheckpointError

__all__ = ["Checkpoint", "load_tokenizer", "read_json"]


def read_json(path: Path, required: bool = True) -> dict | None:
    if not path.exists():
        if required:
            raise CheckpointError(f"{path} is missing")
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def load_tokenizer(folder: Path) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.exists():
        raise CheckpointError(f"{path} is missing (a tokenizer.json for the `tokenizers` library is required)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises a bare Exception on bad files
        raise CheckpointError(f"{path} cannot be loaded by the tokenizers library: {exc}") from exc


def _ids(value, path: Path, key: str) -> set[int]:
    if value is None:
        return set()
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise CheckpointError(f"{path}: '{key}' must be a token id or a list of ids, got {value!r}")
    return set(values)


@dataclass
class Checkpoint:
    """The parts of a checkpoint folder that are not weights."""

    model_id: str
    folder: Path
    config: dict
    tokenizer: Tokenizer
    eos_token_ids: set[int]

    @classmethod
    def read(cls, model_id: str, folder: Path) -> "Checkpoint":
        """The config, tokenizer and end-of-sequence ids of the checkpoint in `folder`."""
        config = read_json(folder / "config.json")
        tokenizer = load_tokenizer(folder)
        gen_path = folder / "generation_config.json"
        gen = read_json(gen_path, required=False) or {}
        eos = _ids(gen.get("eos_token_id"), gen_path, "eos_token_id")
        if not eos:
            eos = _ids(config.get("eos_token_id"), folder / "config.json", "eos_token_id")
        vocab = config.get("vocab_size")
        if isinstance(vocab, int):
            bad = sorted(i for i in eos if i >= vocab)
            if bad:
                raise CheckpointError(f"eos_token_id {bad} is outside the vocabulary of {vocab} tokens")
        return cls(model_id=model_id, folder=folder, config=config, tokenizer=tokenizer, eos_token_ids=eos)
