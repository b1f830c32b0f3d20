"""Where checkpoint tensors come from: safetensors files in production, dicts in tests.

A `TensorSource` answers names, shapes and slices; views over one (transposed tensors, tensors
derived from a stored one) keep model code unaware of how a checkpoint happened to store them.
Every error is a `CheckpointError` naming the file and the tensor.
"""

from __future__ import annotations

import json
import mmap
import struct
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


# safetensors' dtype names (its format spec) -> torch dtypes read in place.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class _MappedSlice:
    """A stored tensor as a view of its file's one mapping: a window of it is a view too where the
    window is contiguous (whole tensors, blocks of rows), a copy otherwise (as safetensors gives)."""

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self._tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self._tensor[index].contiguous()


class _MappedFile:
    """One safetensors file mapped privately (copy-on-write: the file is never written) as ONE
    storage, every tensor a view of it.

    Why not safetensors' own reader: it gives each tensor a storage of its own, so two tensors
    stored back to back (gate_proj and up_proj of a layer, which the format's name order puts next
    to each other) cannot be seen as one: fusing them meant copying both. Over one storage a fused
    weight whose parts are adjacent is a view (`fused_view`): no copy at load, no second copy
    resident. Tensors whose dtype or offset does not allow a view are read by safetensors."""

    def __init__(self, path: Path):
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"cannot read safetensors file {path}: shorter than its header length")
            (length,) = struct.unpack("<Q", head)
            try:
                self.header = json.loads(f.read(length))
            except (ValueError, UnicodeDecodeError) as exc:
                raise CheckpointError(f"cannot read safetensors file {path}: its header is not JSON ({exc})") from exc
            size = f.seek(0, 2)
            self.data_start = 8 + length
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        # The storage, not a tensor of it: a live tensor over the whole file would keep every page
        # of it counted as used (engine/resident.py releases the pages no tensor covers).
        self.storage = None if self._map is None else torch.frombuffer(self._map, dtype=torch.uint8).untyped_storage()
        self.size = size

    def view(self, name: str) -> torch.Tensor | None:
        entry = self.header.get(name)
        if not isinstance(entry, dict) or self.storage is None:
            return None
        dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype"))
        try:
            begin, end = (int(x) for x in entry["data_offsets"])
            shape = [int(n) for n in entry["shape"]]
        except (KeyError, TypeError, ValueError):
            return None
        if dtype is None:
            return None
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for n in shape:
            numel *= n
        start = self.data_start + begin
        if (start % itemsize or end - begin != numel * itemsize or self.data_start + end > self.size
                or start < self.data_start):
            return None  # safetensors reads it (and names what is wrong if it is malformed)
        stride, acc = [], 1
        for n in reversed(shape):
            stride.append(acc)
            acc *= n
        return torch.empty(0, dtype=dtype).set_(self.storage, start // itemsize, shape, list(reversed(stride)))


class SafetensorsSource:
    """Tensors spread over safetensors files, opened lazily (mmap) and kept open."""

    def __init__(self, files: Sequence[Path]):
        if not files:
            raise CheckpointError("no safetensors files given")
        self._routing: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        self._mapped: dict[Path, _MappedFile | None] = {}
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

    def _mapping(self, path: Path) -> _MappedFile | None:
        if path not in self._mapped:
            try:
                self._mapped[path] = _MappedFile(path)
            except (OSError, ValueError, CheckpointError):
                self._mapped[path] = None  # safetensors' reader then reads (and reports) it
        return self._mapped[path]

    def get_slice(self, name: str) -> TensorSlice:
        path = self._routing[name]
        mapped = self._mapping(path)
        view = None if mapped is None else mapped.view(name)
        if view is not None:
            return _MappedSlice(view)
        try:
            return self._open(path).get_slice(name)
        except SafetensorError as exc:
            raise CheckpointError(f"cannot read tensor '{name}' from {path}: {exc}") from exc

    def describe(self, name: str) -> str:
        return str(self._routing.get(name, "<unknown file>"))


def fused_view(parts: Sequence[torch.Tensor], dim: int) -> torch.Tensor | None:
    """`torch.cat(parts, dim)` as a view when the parts already lie back to back in one storage in
    that order (dim 0 of contiguous tensors, e.g. gate_proj and up_proj read from one mapped
    file); None when they do not."""
    if dim != 0 or len(parts) < 2:
        return None
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    rest = tuple(first.shape[1:])
    offset = first.storage_offset()
    for part in parts:
        if (not part.is_contiguous() or part.dtype != first.dtype or part.device != first.device
                or tuple(part.shape[1:]) != rest or part.untyped_storage().data_ptr() != storage
                or part.storage_offset() != offset):
            return None
        offset += part.numel()
    rows = sum(p.shape[0] for p in parts)
    if (offset - first.storage_offset()) * first.element_size() > first.untyped_storage().nbytes():
        return None
    return first.as_strided((rows, *rest), (first.stride(0) if first.dim() else 1, *first.stride()[1:]))


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
