"""Where a model argument points: the embedded model shipped in the package, or a local folder.

Models are never downloaded: `serve`, `generate` and the jobs take a checkpoint folder or the
embedded model's id, and every error names what was given.
"""

from __future__ import annotations

from pathlib import Path

from text_generation_server.about import EMBEDDED_MODEL_ID
from text_generation_server.quantizers.checkpoint import Checkpoint
from text_generation_server.quantizers.sources import CheckpointError

_ASSETS = Path(__file__).resolve().parent.parent / "assets"


def embedded_model_path() -> Path:
    return _ASSETS / EMBEDDED_MODEL_ID


def resolve_model(model: str | None) -> tuple[str, Path]:
    """Maps a model argument (None, the embedded id, or a folder) to (model_id, folder)."""
    if model is None or model == EMBEDDED_MODEL_ID:
        return EMBEDDED_MODEL_ID, embedded_model_path()
    folder = Path(model).expanduser()
    if not folder.is_dir():
        raise CheckpointError(
            f"model '{model}' is neither a checkpoint folder nor the embedded model id '{EMBEDDED_MODEL_ID}' "
            "(models are never downloaded)"
        )
    return str(folder), folder


def open_checkpoint(model: str | None) -> Checkpoint:
    """The non-weight parts of the checkpoint a model argument names."""
    model_id, folder = resolve_model(model)
    return Checkpoint.read(model_id, folder)
