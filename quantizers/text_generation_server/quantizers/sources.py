"""Where checkpoint tensors come from: safetensors files in production, dicts in tests.

A `TensorSource` answers names, shapes and slices; views over one (transposed tensors, tensors
derived from a stored one) keep model code unaware of how a checkpoint happened to store them.
Every error is a `CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open

from text_generation_server.quantizers.errors import CheckpointError  # noqa: F401  (defined apart: no torch)


class TensorSlice(Protocol):
    def get_shape(self) -> list[int]: ...

    def __getitem__(self, index) -> torch.Tensor: ...


class TensorSource(Protocol):
    """Where tensors come from: safetensors files in production, a dict in tests."""

    def keys(self) -> Sequence[str]: ...

    def get_slice(self, name: str) -> TensorSlice: ...

    def describe(self, name: str) -> str: ...


class _DictSlice:
    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self._tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self._tensor[index]


class DictTensorSource:
    """In-memory tensors, so loaders can be tested without writing files."""

    def __init__(self, tensors: dict[str, torch.Tensor], name: str = "<memory>"):
        self._tensors = tensors
        self._name = name

    def keys(self) -> Sequence[str]:
        return list(self._tensors)

    def get_slice(self, name: str) -> TensorSlice:
        return _DictSlice(self._tensors[name])

    def describe(self, name: str) -> str:
        return self._name


class SafetensorsSource:
    """Tensors spread over safetensors files, opened lazily (mmap) and kept open."""

    def __init__(self, files: Sequence[Path]):
        if not files:
            raise CheckpointError("no safetensors files given")
        self._routing: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        for path in files:
            handle = self._open(path)
            for key in handle.keys():
                if key in self._routing:
                    raise CheckpointError(
                        f"tensor '{key}' appears in both {self._routing[key]} and {path}"
                    )
                self._routing[key] = path

    def _open(self, path: Path):
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError, ValueError) as exc:
                raise CheckpointError(f"cannot read safetensors file {path}: {exc}") from exc
            self._handles[path] = handle
        return handle

    def keys(self) -> Sequence[str]:
        return list(self._routing)

    def get_slice(self, name: str) -> TensorSlice:
        path = self._routing[name]
        try:
            return self._open(path).get_slice(name)
        except SafetensorError as exc:
            raise CheckpointError(f"cannot read tensor '{name}' from {path}: {exc}") from exc

    def describe(self, name: str) -> str:
        return str(self._routing.get(name, "<unknown file>"))


class _TransposedSlice:
    """A stored [in, out] matrix seen as [out, in]: indices are swapped, the window transposed."""

    def __init__(self, inner: TensorSlice, name: str):
        self._inner = inner
        self._name = name

    def get_shape(self) -> list[int]:
        return list(reversed(self._inner.get_shape()))

    def __getitem__(self, index) -> torch.Tensor:
        if index is Ellipsis:
            index = (slice(None), slice(None))
        elif not isinstance(index, tuple):
            index = (index, slice(None))
        if len(index) != 2 or any(not isinstance(i, slice) for i in index):
            raise CheckpointError(f"tensor '{self._name}' is a transposed (Conv1D) matrix: read it by a window of "
                                  f"rows and columns, not {index!r}")
        return self._inner[(index[1], index[0])].t().contiguous()


class TransposedSource:
    """Tensors whose names `transposed(name)` selects appear transposed (GPT-2's Conv1D stores
    weights as [in, out]); every loader and sharding rule then sees the Linear layout."""

    def __init__(self, inner: TensorSource, transposed):
        self.inner = inner
        self._transposed = transposed

    def keys(self) -> Sequence[str]:
        return self.inner.keys()

    def get_slice(self, name: str) -> TensorSlice:
        found = self.inner.get_slice(name)
        if not self._transposed(name):
            return found
        if len(found.get_shape()) != 2:
            raise CheckpointError(f"tensor '{name}' has shape {found.get_shape()}: a Conv1D weight is a matrix "
                                  f"(in {self.inner.describe(name)})")
        return _TransposedSlice(found, name)

    def describe(self, name: str) -> str:
        return self.inner.describe(name)


@dataclass(frozen=True)
class DerivedTensor:
    """A tensor the model reads that the checkpoint stores inside another one: `take` maps the
    stored tensor `stored[index]` to it (gpt-oss keeps every expert of a layer in one
    interleaved [E, H, 2I] tensor; the model reads expert e's gate as a Linear [I, H])."""

    stored: str
    index: int
    take: Callable[[torch.Tensor], torch.Tensor]
    shape: tuple[int, ...]


class _DerivedSlice:
    def __init__(self, inner: TensorSlice, view: DerivedTensor):
        self._inner = inner
        self._view = view

    def get_shape(self) -> list[int]:
        return list(self._view.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self._view.take(self._inner[self._view.index])[index].contiguous()


class DerivedSource:
    """The stored tensors plus derived ones (`DerivedTensor`) under their own names, so every
    loader and sharding rule reads a stacked checkpoint as if it stored each part apart."""

    def __init__(self, inner: TensorSource, views: dict[str, DerivedTensor]):
        self.inner = inner
        self.views = views

    def keys(self) -> Sequence[str]:
        return list(self.inner.keys()) + list(self.views)

    def get_slice(self, name: str) -> TensorSlice:
        view = self.views.get(name)
        if view is None:
            return self.inner.get_slice(name)
        return _DerivedSlice(self.inner.get_slice(view.stored), view)

    def describe(self, name: str) -> str:
        view = self.views.get(name)
        return self.inner.describe(view.stored if view is not None else name)


def safetensors_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, honouring a sharded index.

    Pickle checkpoints are never loaded here: they point the user to `convert`.
    """
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = sorted({folder / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{index} names missing files: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    if pickles:
        raise CheckpointError(
            f"{folder} has only pickle weights ({', '.join(pickles)}); they are never loaded "
            f"when serving. Run `text-generation-server convert {folder}` to write safetensors."
        )
    raise CheckpointError(f"{folder} has no *.safetensors weight files")
