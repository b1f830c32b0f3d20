"""Sharded access to checkpoint tensors, and the loader interface.

`Weights` knows where every tensor lives (a routing table over safetensors files,
or any injected `TensorSource`) and how to take one rank's shard of it. What a
*linear layer's* weight is made of differs per checkpoint format; that knowledge
lives in a `WeightsLoader` (one per format, built by the quantizers' factory), so
model and tensor-parallel code never ask which format they are loading.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from text_generation_server.kernels.base import LinearSpec, QuantKernel
from text_generation_server.kernels.dense import dense_spec
from text_generation_server.kernels.select import build_linear
from text_generation_server.quantizers.dist import ProcessGroup, single_process_group
from text_generation_server.quantizers.sources import (
    CheckpointError,
    DerivedSource,
    DerivedTensor,
    DictTensorSource,
    SafetensorsSource,
    TensorSlice,
    TensorSource,
    TransposedSource,
    fused_view,
)


@dataclass
class UnquantizedWeight:
    """A dense weight [out_features, in_features] of this rank's partition."""

    weight: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)  # type: ignore[return-value]

    def spec(self, act_dtype: torch.dtype, device_type: str) -> LinearSpec:
        return dense_spec(self.weight, act_dtype, device_type)

    def describe_layer(self, spec: LinearSpec, kernel: type[QuantKernel]) -> str:
        return ""  # dense layers are not named in the kernel log

    def get_linear(self, bias: torch.Tensor | None) -> torch.nn.Module:
        """The `dense` kernel (chosen through kernels/table.py like every format), in the weight's dtype."""
        return build_linear(self, bias, self.weight.dtype, self.weight.device.type)


class WeightsLoader(ABC):
    """Builds the typed Weight of one linear layer from checkpoint tensors.

    Loaders own sharding: column-parallel weights are split along the output
    dimension, row-parallel ones along the input dimension, whatever the format.
    """

    @abstractmethod
    def get_weights(self, weights: Weights, prefix: str):
        """The whole, unsharded weight of `prefix`."""

    @abstractmethod
    def get_weights_col_packed(self, weights: Weights, prefix: str, block_sizes: int | list[int]):
        """A fused column weight (qkv, gate_up) whose parts are sharded separately."""

    def get_weights_col(self, weights: Weights, prefix: str):
        return self.get_weights_col_packed(weights, prefix, 1)

    @abstractmethod
    def get_multi_weights_col(self, weights: Weights, prefixes: list[str], dim: int):
        """Several column weights (q, k, v) sharded and concatenated along the output dim."""

    @abstractmethod
    def get_weights_row(self, weights: Weights, prefix: str):
        """A row-parallel weight, sharded along the input dimension."""

    def describe(self) -> str:
        return type(self).__name__


class DefaultWeightsLoader(WeightsLoader):
    """Unquantized checkpoints: `{prefix}.weight` in a floating dtype."""

    def get_weights(self, weights: Weights, prefix: str) -> UnquantizedWeight:
        return UnquantizedWeight(weights.get_tensor(f"{prefix}.weight"))

    def get_weights_col_packed(
        self, weights: Weights, prefix: str, block_sizes: int | list[int]
    ) -> UnquantizedWeight:
        return UnquantizedWeight(weights.get_packed_sharded(f"{prefix}.weight", dim=0, block_sizes=block_sizes))

    def get_multi_weights_col(self, weights: Weights, prefixes: list[str], dim: int) -> UnquantizedWeight:
        parts = [weights.get_sharded(f"{p}.weight", dim=0) for p in prefixes]
        others = {tuple(s for d, s in enumerate(t.shape) if d != dim) for t in parts}
        if len(others) > 1:
            shapes = ", ".join(f"'{p}.weight' {list(t.shape)}" for p, t in zip(prefixes, parts))
            raise CheckpointError(
                f"tensors fused along dim {dim} disagree in their other dimensions: {shapes} "
                f"(in {weights.files_of(prefixes[0])})"
            )
        fused = fused_view(parts, dim)  # stored back to back (gate, up): no copy
        return UnquantizedWeight(torch.cat(parts, dim=dim) if fused is None else fused)

    def get_weights_row(self, weights: Weights, prefix: str) -> UnquantizedWeight:
        return UnquantizedWeight(weights.get_sharded(f"{prefix}.weight", dim=1))


_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _format_index(index: tuple) -> str:
    def one(entry) -> str:
        if entry is Ellipsis:
            return "..."
        if isinstance(entry, slice):
            text = f"{'' if entry.start is None else entry.start}:{'' if entry.stop is None else entry.stop}"
            return text + ("" if entry.step in (None, 1) else f":{entry.step}")
        return str(entry)

    return "[" + ", ".join(one(e) for e in index) + "]"


def _checked_index(index, shape: list[int], what: str) -> tuple:
    """`index` as a tuple, every int and slice bound checked against `shape`.

    Python clips slices that run past the end; a window read from a checkpoint must not, so
    any bound outside [-size, size] (ints: outside [-size, size)) is a CheckpointError.
    """
    entries = index if isinstance(index, tuple) else (index,)
    for entry in entries:
        if not (entry is Ellipsis or isinstance(entry, slice)
                or (isinstance(entry, int) and not isinstance(entry, bool))):
            raise TypeError(f"window index entries must be ints, slices or ..., got {entry!r}")
    ellipses = sum(entry is Ellipsis for entry in entries)
    if ellipses > 1:
        raise TypeError(f"window index {_format_index(entries)} has more than one '...'")
    rank = len(entries) - ellipses
    if rank > len(shape):
        raise CheckpointError(f"{what} has shape {shape}: window {_format_index(entries)} indexes {rank} dimensions")
    dims = list(entries)
    if ellipses:
        at = dims.index(Ellipsis)
        dims[at:at + 1] = [slice(None)] * (len(shape) - rank)
    for dim, (entry, size) in enumerate(zip(dims, shape)):
        if isinstance(entry, slice):
            bounds = [b for b in (entry.start, entry.stop) if b is not None]
            if entry.step is not None and entry.step <= 0:
                raise TypeError(f"window index {_format_index(entries)}: slices must step forward")
            ok = all(-size <= b <= size for b in bounds)
        else:
            ok = -size <= entry < size
        if not ok:
            raise CheckpointError(f"{what} has shape {shape}: window {_format_index(entries)} reaches past "
                                  f"dimension {dim} (size {size})")
    return entries


class Weights:
    """Checkpoint tensors for one rank: lookups, sharding, and the active loader."""

    def __init__(
        self,
        source: TensorSource | Sequence[Path],
        device: torch.device,
        dtype: torch.dtype,
        process_group: ProcessGroup | None = None,
        loader: WeightsLoader | None = None,
        aliases: dict[str, list[str]] | None = None,
    ):
        if not isinstance(source, (DictTensorSource, SafetensorsSource, TransposedSource, DerivedSource)) \
                and isinstance(source, (list, tuple)):
            source = SafetensorsSource([Path(p) for p in source])
        self.source: TensorSource = source  # type: ignore[assignment]
        self._keys = set(self.source.keys())
        self.device = device
        self.dtype = dtype
        self.process_group = process_group or single_process_group()
        self.loader = loader or DefaultWeightsLoader()
        self.aliases = aliases or {}

    def transpose(self, transposed) -> None:
        """From now on, tensors `transposed(name)` selects are read transposed (Conv1D weights)."""
        self.source = TransposedSource(self.source, transposed)

    def derive(self, views: dict[str, DerivedTensor]) -> None:
        """From now on, the `views` names read parts of stored tensors (stacked experts)."""
        self.source = DerivedSource(self.source, views)
        self._keys |= set(views)

    @property
    def derived(self) -> dict[str, DerivedTensor]:
        """The derived tensors this view adds (stacked experts read per expert), by name."""
        views: dict[str, DerivedTensor] = {}
        source = self.source
        while isinstance(source, (TransposedSource, DerivedSource)):
            if isinstance(source, DerivedSource):
                views.update(source.views)
            source = source.inner
        return views

    @property
    def stored(self) -> TensorSource:
        """The tensors as stored on disk (no Conv1D or derived view): what `quantize` copies unchanged."""
        source = self.source
        # Views change what the model reads; a transparent wrapper (serve's tensor counter,
        # utils/progress.py CountingSource) declares `wraps_source` and is looked through too.
        while isinstance(source, (TransposedSource, DerivedSource)) or getattr(type(source), "wraps_source", False):
            source = source.inner
        return source

    def read_names(self) -> dict[str, str]:
        """Each stored tensor's name -> the name the model reads it by: itself, or the name an alias
        resolves to it (GPT2Model checkpoints store "h.0..." for the family's "transformer.h.0...").
        `quantize` sorts stored tensors into layers by these names and writes them back under the
        stored ones."""
        names = {key: key for key in self._keys}
        for name in self.aliases:
            stored = self._resolve(name, required=False)
            if stored is not None and stored != name and names[stored] == stored:
                names[stored] = name
        return names

    # -- lookups -------------------------------------------------------------
    def tensor_names(self) -> set[str]:
        return set(self._keys)

    def has_tensor(self, name: str) -> bool:
        return self._resolve(name, required=False) is not None

    def _resolve(self, name: str, required: bool = True) -> str | None:
        if name in self._keys:
            return name
        for alias in self.aliases.get(name, []):
            if alias in self._keys:
                return alias
        if required:
            raise CheckpointError(f"tensor '{name}' not found in the checkpoint ({self._where()})")
        return None

    def _where(self) -> str:
        files = sorted({self.source.describe(k) for k in list(self._keys)[:1000]})
        return ", ".join(files[:4]) + (" ..." if len(files) > 4 else "")

    def files_of(self, prefix: str) -> str:
        """The file(s) holding `prefix` or the tensors under `prefix.`, so shape errors say where to look."""
        key = self._resolve(prefix, required=False)
        names = [key] if key is not None else [k for k in self._keys if k.startswith(prefix + ".")]
        files = sorted({self.source.describe(k) for k in names})
        return ", ".join(files) if files else self._where()

    def get_shape(self, name: str) -> list[int]:
        return self.source.get_slice(self._resolve(name)).get_shape()

    def _finish(self, tensor: torch.Tensor, to_dtype: bool) -> torch.Tensor:
        # Integer and fp8 tensors (packed weights, scales of some formats) keep their dtype.
        if to_dtype and tensor.dtype in _FLOAT_DTYPES:
            tensor = tensor.to(dtype=self.dtype)
        return tensor.to(device=self.device)

    def _read(self, key: str, slice_: TensorSlice, index) -> torch.Tensor:
        """`slice_[index]` of the stored tensor `key`; a file that fails mid-read names the tensor."""
        try:
            return slice_[index]
        except SafetensorError as exc:
            raise CheckpointError(f"cannot read tensor '{key}' from {self.source.describe(key)}: {exc}") from exc

    def _shardable(self, key: str, shape: list[int], dim: int) -> None:
        if not -len(shape) <= dim < len(shape):
            raise CheckpointError(f"tensor '{key}' has shape {shape}: no dimension {dim} to shard "
                                  f"(in {self.source.describe(key)})")

    def get_tensor(self, name: str, to_dtype: bool = True) -> torch.Tensor:
        """The whole tensor, of any rank: `[...]`, unlike `[:]`, also reads 0-dim scalars
        (AutoFP8's per-tensor scales, bitsandbytes' weight_format)."""
        key = self._resolve(name)
        return self._finish(self._read(key, self.source.get_slice(key), ...), to_dtype)

    def get_slice(self, name: str, index, to_dtype: bool = False) -> torch.Tensor:
        """`tensor[index]` of a checkpoint tensor, reading only that window from the file.

        For loaders whose shards are not one block of one dimension (Marlin tiles, whole
        bitsandbytes blocks, dense weights quantized on load a column range at a time).
        `index` is basic indexing: an int, a slice, `...`, or a tuple of them. A slice that
        reaches past the tensor raises instead of being clipped as Python would clip it, so a
        layout computed from a wrong config never yields a silently short window. Like
        `get_tensor`, the result is on this rank's device; `to_dtype` casts floating tensors
        to the model dtype (off by default: windows are mostly packed codes and scales).
        """
        key = self._resolve(name)
        slice_ = self.source.get_slice(key)
        index = _checked_index(index, slice_.get_shape(), f"tensor '{key}' (in {self.source.describe(key)})")
        return self._finish(self._read(key, slice_, index), to_dtype)

    def get_partial_sharded(self, name: str, dim: int, to_dtype: bool = True) -> torch.Tensor:
        """This rank's block of `dim`, blocks of ceil(size / world); the last may be short."""
        key = self._resolve(name)
        slice_ = self.source.get_slice(key)
        shape = slice_.get_shape()
        rank, world = self.process_group.rank, self.process_group.size
        self._shardable(key, shape, dim)
        block = (shape[dim] + world - 1) // world
        start, stop = rank * block, min((rank + 1) * block, shape[dim])
        index = [slice(None)] * len(shape)
        index[dim] = slice(start, stop)
        return self._finish(self._read(key, slice_, tuple(index)), to_dtype)

    def get_sharded(self, name: str, dim: int, to_dtype: bool = True) -> torch.Tensor:
        """This rank's equal share of `dim`; the size must divide by the world size."""
        key = self._resolve(name)
        shape = self.source.get_slice(key).get_shape()
        world = self.process_group.size
        self._shardable(key, shape, dim)
        if shape[dim] % world != 0:
            raise CheckpointError(
                f"tensor '{key}' has {shape[dim]} entries along dim {dim}, "
                f"which does not divide into {world} shards"
            )
        return self.get_partial_sharded(name, dim, to_dtype)

    def get_packed_sharded(
        self, name: str, dim: int, block_sizes: int | list[int], to_dtype: bool = True
    ) -> torch.Tensor:
        """Shards a fused tensor part by part, so each rank gets its share of every part.

        `block_sizes` is either a number of equal parts or the list of part sizes
        (in units of this tensor's `dim`, so packed int32 tensors shard the same way).
        """
        key = self._resolve(name)
        slice_ = self.source.get_slice(key)
        shape = slice_.get_shape()
        self._shardable(key, shape, dim)
        total = shape[dim]
        if isinstance(block_sizes, int):
            if total % block_sizes != 0:
                raise CheckpointError(f"tensor '{key}' dim {dim} ({total}) does not split into {block_sizes} parts")
            block_sizes = [total // block_sizes] * block_sizes
        if sum(block_sizes) != total:
            raise CheckpointError(
                f"tensor '{key}' has {total} entries along dim {dim}, expected {sum(block_sizes)} "
                f"(parts {block_sizes})"
            )
        rank, world = self.process_group.rank, self.process_group.size
        pieces = []
        offset = 0
        for size in block_sizes:
            if size % world != 0:
                raise CheckpointError(
                    f"tensor '{key}': a fused part of {size} entries does not divide into {world} shards"
                )
            shard = size // world
            index = [slice(None)] * len(shape)
            index[dim] = slice(offset + rank * shard, offset + (rank + 1) * shard)
            pieces.append(self._read(key, slice_, tuple(index)))
            offset += size
        return self._finish(torch.cat(pieces, dim=dim), to_dtype)

    # -- loader delegation ---------------------------------------------------
    @contextmanager
    def use_loader(self, loader: WeightsLoader) -> Iterator[None]:
        """Loads the enclosed modules with another loader (e.g. an unquantized lm_head)."""
        previous = self.loader
        self.loader = loader
        try:
            yield
        finally:
            self.loader = previous

    @contextmanager
    def sharded_as(self, view: ProcessGroup) -> Iterator[None]:
        """Loads the enclosed modules as if the group were `view` (its rank and size only): K/V
        heads fewer than the ranks are read whole (size 1) or by a narrower split, through every
        loader alike. No collective runs while loading, so the view needs no communicator."""
        previous = self.process_group
        self.process_group = view
        try:
            yield
        finally:
            self.process_group = previous

    def get_weights(self, prefix: str):
        return self.loader.get_weights(self, prefix)

    def get_weights_col(self, prefix: str):
        return self.loader.get_weights_col(self, prefix)

    def get_weights_col_packed(self, prefix: str, block_sizes: int | list[int]):
        return self.loader.get_weights_col_packed(self, prefix, block_sizes)

    def get_multi_weights_col(self, prefixes: list[str], dim: int = 0):
        return self.loader.get_multi_weights_col(self, prefixes, dim)

    def get_weights_row(self, prefix: str):
        return self.loader.get_weights_row(self, prefix)
