"""Deterministic text corpus drawn from the running interpreter's standard library.

The embedded model, its calibration data and its evaluation data all come from
the same place because it is the one sizeable body of Python source that every
machine running this server is guaranteed to have, so nothing has to be
downloaded. The train/heldout split depends only on each file's path relative
to the stdlib root, so it is stable across machines and runs with the same
Python version.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterable, Iterator
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from loguru import logger

if TYPE_CHECKING:
    from tokenizers import Tokenizer

EOS_TEXT = "<|endoftext|>"
EOS_ID = 0
SPLITS = ("train", "heldout")
# Held-out share in basis points (300 / 10000 = 3%).
HELDOUT_BASIS_POINTS = 300
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_root() -> Path:
    """Root of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def _validate_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown corpus split {split!r}; expected one of {SPLITS}")


def split_of(relative_path: str) -> str:
    """Assign a file to a split from a hash of its stdlib-relative POSIX path.

    A content-independent hash keeps the assignment stable when a file's text
    changes between patch releases, and sha256 (unlike hash()) is not salted per
    process.
    """
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") % 10_000
    return "heldout" if bucket < HELDOUT_BASIS_POINTS else "train"


@lru_cache(maxsize=None)
def _all_files() -> tuple[tuple[Path, str], ...]:
    root = stdlib_root()
    found = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if any(part in _SKIP_DIRS for part in relative.parts[:-1]):
            continue
        if not path.is_file():
            continue
        found.append((path, relative.as_posix()))
    found.sort(key=lambda item: item[1])
    if not found:
        raise RuntimeError(f"no *.py files found under the stdlib root {root}")
    return tuple(found)


def corpus_files(split: str) -> list[Path]:
    """Sorted stdlib source files of one split ("train" or "heldout")."""
    _validate_split(split)
    return [path for path, relative in _all_files() if split_of(relative) == split]


def read_document(path: Path) -> str | None:
    """Text of one source file, or None when it is not valid UTF-8.

    A handful of stdlib test fixtures are deliberately mis-encoded; skipping them
    is simpler and more predictable than guessing their encodings.
    """
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        logger.debug("skipping non-UTF-8 file {}", path)
        return None


def iter_documents(split: str, max_chars: int | None = None) -> Iterator[str]:
    """Yield one split's documents in path order, stopping once max_chars have been yielded."""
    total = 0
    for path in corpus_files(split):
        if max_chars is not None and total >= max_chars:
            return
        text = read_document(path)
        if text:
            total += len(text)
            yield text


def corpus_text(split: str, max_chars: int | None = None) -> str:
    """One split's documents joined by the EOS token text, optionally truncated.

    Joining by EOS mirrors how the model saw documents during training, so
    perplexity and calibration data measured on this string match training.
    """
    _validate_split(split)
    if max_chars is not None and max_chars <= 0:
        raise ValueError(f"max_chars must be positive or None, got {max_chars}")
    parts: list[str] = []
    total = 0
    for text in iter_documents(split):
        if parts:
            parts.append(EOS_TEXT)
            total += len(EOS_TEXT)
        parts.append(text)
        total += len(text)
        if max_chars is not None and total >= max_chars:
            break
    joined = "".join(parts)
    return joined if max_chars is None else joined[:max_chars]


def tokenize_documents(tokenizer: Tokenizer, documents: Iterable[str], batch: int = 64) -> np.ndarray:
    """One uint16 token stream with EOS after every document, the layout training used.

    Documents are encoded in batches (parallel inside `tokenizers`) and stored as
    uint16, so the ~9M-token stdlib stream stays under 20 MB.
    """
    if tokenizer.get_vocab_size() > 65536:
        raise ValueError(f"vocab size {tokenizer.get_vocab_size()} does not fit uint16 token ids")
    chunks: list[np.ndarray] = []
    pending: list[str] = []

    def flush() -> None:
        for enc in tokenizer.encode_batch(pending, add_special_tokens=False):
            chunks.append(np.asarray(enc.ids + [EOS_ID], dtype=np.uint16))
        pending.clear()

    for doc in documents:
        pending.append(doc)
        if len(pending) == batch:
            flush()
    if pending:
        flush()
    if not chunks:
        raise ValueError("no documents to tokenize")
    return np.concatenate(chunks)


def token_byte_lengths(tokenizer: Tokenizer) -> np.ndarray:
    """UTF-8 bytes per token id, to turn per-token losses into bits per byte.

    Byte-level BPE spells every byte as one character, so a token's byte count is
    its length; the EOS separator counts as one byte (it stands for a boundary).
    """
    lengths = np.ones(tokenizer.get_vocab_size(), dtype=np.float64)
    for token, idx in tokenizer.get_vocab().items():
        if idx != EOS_ID:
            lengths[idx] = len(token)
    return lengths
