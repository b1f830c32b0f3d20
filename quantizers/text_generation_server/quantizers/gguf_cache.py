"""A disk cache of what is derived from a GGUF's metadata alone: its converted tokenizer and chat template.

transformers converts a GGUF tokenizer by parsing the whole metadata again with its own reader
and building the tokenizer from 151k tokens and 151k merges (Qwen2.5): 10-20 s of every process
that serves the file (py-spy, 2026-11-28), for a result that depends on nothing but the file's
metadata and the converter's version. The first process stores `tokenizer.json` and the chat
template; later ones read them back in well under a second.

The key is a hash of the file's header bytes (every metadata value and tensor description, up to
where the tensor data starts), of the tokenizer files beside it (transformers reads a
tokenizer_config.json or chat template from the GGUF's folder: `SIDE_FILES`), and of the transformers and tokenizers
versions: a changed file, side file or converter misses the cache, never reads a stale entry.
TGS_GGUF_CACHE names the folder (default ~/.cache/text-generation-server/gguf); "off" disables it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from importlib import metadata as package_metadata
from pathlib import Path

from loguru import logger
from tokenizers import Tokenizer

from text_generation_server.quantizers.gguf_file import GGUFFile

CACHE_ENV = "TGS_GGUF_CACHE"
_VERSION = 1  # of the entry's layout
# Files beside a GGUF that transformers' tokenizer loading reads from its folder (logs, conversions
# and other files there do not change the tokenizer, and must not invalidate the entry).
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.json",
              "chat_template.jinja", "chat_template.json")


def _version(package: str) -> str:
    try:
        return package_metadata.version(package)
    except package_metadata.PackageNotFoundError:
        return "missing"


def cache_path(file: GGUFFile) -> Path | None:
    """Where this file's tokenizer entry lives (None when the cache is off)."""
    folder = os.environ.get(CACHE_ENV, "").strip()
    if folder.lower() in ("off", "0", "none", "false"):
        return None
    root = Path(folder).expanduser() if folder else Path.home() / ".cache" / "text-generation-server" / "gguf"
    reader = file.readers[0]
    digest = hashlib.sha256()
    digest.update(memoryview(reader.data)[:int(reader.data_offset)])
    folder = Path(file.files[0]).parent
    for name in SIDE_FILES:
        side = folder / name
        if side.is_file():
            stat = side.stat()
            digest.update(f"{name} {stat.st_size} {stat.st_mtime_ns}\n".encode())
    digest.update(f"v{_VERSION} transformers {_version('transformers')} tokenizers {_version('tokenizers')}".encode())
    return root / f"tokenizer-{digest.hexdigest()[:32]}.json"


def cached_tokenizer(file: GGUFFile, convert: Callable[[], tuple[Tokenizer, str | None]]
                     ) -> tuple[Tokenizer, str | None]:
    """The file's (tokenizer, chat template): from the cache when an entry for it exists, else from
    `convert()`, then stored. An unreadable entry is converted again; an unwritable cache only logs."""
    path = cache_path(file)
    if path is not None and path.is_file():
        try:
            entry = json.loads(path.read_text())
            return Tokenizer.from_str(entry["tokenizer"]), entry.get("chat_template")
        except Exception as exc:  # OSError, bad JSON, a missing key, or tokenizers' own error type
            logger.warning("GGUF tokenizer cache entry {} unreadable ({}): converting again", path, exc)
    backend, template = convert()
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps({"tokenizer": backend.to_str(), "chat_template": template}))
            os.replace(partial, path)
            logger.info("GGUF tokenizer of {} cached at {} (later starts skip its conversion)", file.name, path)
        except OSError as exc:
            logger.warning("GGUF tokenizer cache {} not written ({}): each start converts the tokenizer", path, exc)
    return backend, template
