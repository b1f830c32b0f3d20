"""Where a model argument points: the embedded model shipped in the package, a local folder, or a
GGUF file (or a folder holding only one GGUF model, split files included).

Models are never downloaded: `serve`, `generate` and the jobs take a checkpoint folder, a .gguf
file or the embedded model's id, and every error names what was given.
"""

from __future__ import annotations

from pathlib import Path

from typing import TYPE_CHECKING

from text_generation_server.about import EMBEDDED_MODEL_ID
from text_generation_server.quantizers.errors import CheckpointError

if TYPE_CHECKING:
    from text_generation_server.quantizers.checkpoint import Checkpoint

_ASSETS = Path(__file__).resolve().parent.parent / "assets"


def embedded_model_path() -> Path:
    return _ASSETS / EMBEDDED_MODEL_ID


def resolve_model(model: str | None) -> tuple[str, Path]:
    """Maps a model argument (None, the embedded id, a folder or a .gguf file) to (model_id, path):
    the folder, or for a GGUF model its (first) .gguf file."""
    if model is None or model == EMBEDDED_MODEL_ID:
        return EMBEDDED_MODEL_ID, embedded_model_path()
    path = Path(model).expanduser()
    if path.is_dir() and ((path / "config.json").exists() or any(path.glob("*.safetensors"))):
        return str(path), path  # a Hugging Face folder: decided without importing the GGUF reader (or torch)
    gguf_file = path.is_file() and path.suffix == ".gguf"
    if not gguf_file and not path.is_dir():
        raise CheckpointError(
            f"model '{model}' is neither a checkpoint folder, a .gguf file nor the embedded model id "
            f"'{EMBEDDED_MODEL_ID}' (models are never downloaded)"
        )
    from text_generation_server.quantizers.gguf_file import gguf_files

    if gguf_file:
        return str(path), gguf_files(path)[0]  # type: ignore[index]  # a split model's parts must all be there
    files = gguf_files(path)
    if files is not None:
        return str(path), files[0]
    return str(path), path


def open_checkpoint(model: str | None) -> Checkpoint:
    """The non-weight parts of the checkpoint a model argument names."""
    from text_generation_server.quantizers.checkpoint import Checkpoint
    from text_generation_server.quantizers.gguf_arch import read_checkpoint
    from text_generation_server.quantizers.gguf_file import gguf_files

    model_id, path = resolve_model(model)
    files = gguf_files(path)
    if files is not None:
        return read_checkpoint(model_id, files)[0]
    return Checkpoint.read(model_id, path)
