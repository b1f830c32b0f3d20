"""Reading a GGUF file (or its split parts) with the `gguf` package, as a `TensorSource`.

A GGUF holds metadata (architecture, hyper-parameters, tokenizer) and tensors under llama.cpp's
names (`blk.3.attn_q.weight`), their dims listed innermost first. `GGUFSource` shows them under
the Hugging Face names our families read (gguf_arch.py maps them), shaped [out, in] like a
safetensors checkpoint; a window of a quantized tensor reads dequantized, so embeddings, norms
and anything else that wants a dense tensor get one. Linear layers instead ask for the stored
blocks (`GGUFSource.quantized`), decoded to the canonical quantized form (gguf_blocks.py).

Llama-architecture files store q and k rows permuted for llama.cpp's rotary layout; transformers
undoes that permutation (LlamaTensorProcessor), and so does this source, row by row, which
works for quantized tensors too because a row is a whole number of blocks.

A truncated file, a tensor whose bytes run past the end or an unknown ggml type is refused
naming the tensor and the file.
"""

from __future__ import annotations

import re
import struct
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from text_generation_server.kernels import cpu_native
from text_generation_server.kernels.cpu_kquant import KQUANT_TYPES, kquant_dequant
from text_generation_server.quantizers.gguf_blocks import DENSE_TYPES, FORMATS, BlockFormat, Decoded, decode
from text_generation_server.quantizers.sources import CheckpointError, TensorSlice

_OPEN: dict[tuple, "GGUFFile"] = {}
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def _gguf():
    try:
        import gguf
    except ImportError as exc:  # a runtime dependency; only a broken install lacks it
        raise CheckpointError(f"reading GGUF files needs the `gguf` package ({exc}); pip install gguf") from exc
    return gguf


def gguf_files(path: Path) -> list[Path] | None:
    """The GGUF file(s) `path` names (a .gguf file, the first of split files, or a folder holding
    one model's GGUF), in order; None when `path` is no GGUF and no folder holding only GGUF weights."""
    path = Path(path)
    if path.is_dir():
        if any(path.glob("*.safetensors")) or (path / "config.json").exists():
            return None  # a Hugging Face checkpoint folder, perhaps with a GGUF beside it
        found = sorted(path.glob("*.gguf"))
        if not found:
            return None
        firsts = [p for p in found if (m := _SPLIT.match(p.name)) is None or m["index"] == "00001"]
        if len(firsts) != 1:
            raise CheckpointError(f"{path} holds several GGUF models ({', '.join(p.name for p in firsts)}): "
                                  "name the file to serve")
        path = firsts[0]
    if path.suffix != ".gguf" or not path.is_file():
        return None
    split = _SPLIT.match(path.name)
    if split is None:
        return [path]
    count = int(split["count"])
    parts = [path.with_name(f"{split['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise CheckpointError(f"{path} is part of a {count}-file GGUF whose parts {', '.join(missing)} are missing")
    return parts


# GGUF metadata value types (the spec's gguf_metadata_value_type): struct formats of the scalars.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Metadata:
    """Reads the key/value section with `struct` from one bytes view. The gguf package's reader
    makes several numpy views per value, and a 151k-token vocabulary with its 151k merges took it
    about 10 s of a process's start (py-spy, 2026-11-28); this takes a fraction of a second."""

    def __init__(self, buffer: memoryview, path: Path):
        self.buffer = buffer
        self.path = path

    def string(self, offs: int) -> tuple[str, int]:
        (size,) = struct.unpack_from("<Q", self.buffer, offs)
        end = offs + 8 + size
        if end > len(self.buffer):
            raise struct.error(f"a {size}-byte string at byte {offs} runs past the end")
        return str(self.buffer[offs + 8:end], "utf-8"), end

    def value(self, offs: int, kind: int) -> tuple[Any, int]:
        scalar = _SCALARS.get(kind)
        if scalar is not None:
            return struct.unpack_from("<" + scalar, self.buffer, offs)[0], offs + struct.calcsize(scalar)
        if kind == _STRING:
            return self.string(offs)
        if kind != _ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        item, count = struct.unpack_from("<IQ", self.buffer, offs)
        offs += 12
        scalar = _SCALARS.get(item)
        if scalar is not None:
            end = offs + count * struct.calcsize(scalar)
            if end > len(self.buffer):
                raise struct.error(f"a {count}-value array at byte {offs} runs past the end")
            values = np.frombuffer(self.buffer[offs:end], dtype=np.dtype("<" + scalar)).tolist()
            return values, end
        values = []
        for _ in range(count):
            value, offs = self.value(offs, item)
            values.append(value)
        return values, offs

    def read(self, offs: int, count: int) -> tuple[dict[str, Any], int]:
        """`count` key/value pairs from byte `offs`: the values by key, and the offset after them."""
        values: dict[str, Any] = {}
        for _ in range(count):
            key = f"at byte {offs}"
            try:
                key, offs = self.string(offs)
                (kind,) = struct.unpack_from("<I", self.buffer, offs)
                values[key], offs = self.value(offs + 4, kind)
            except (struct.error, ValueError, UnicodeDecodeError) as exc:
                raise CheckpointError(f"{self.path}: metadata key '{key}' cannot be read ({exc}): the file is "
                                      "truncated or corrupt") from exc
        return values, offs


def _checked_reader(path: Path):
    """A GGUFReader that, before mapping each tensor, checks its type and that its bytes are in the file,
    and reads the metadata with `_Metadata` (into `values`; `fields` keeps general.alignment only)."""
    gguf = _gguf()

    class CheckedReader(gguf.GGUFReader):  # type: ignore[name-defined]
        values: dict[str, Any]

        def _build_fields(self, offs: int, count: int) -> int:
            if self.byte_order == "S":  # a big-endian file: the package's own (slow) reader
                end = super()._build_fields(offs, count)
                self.values = {k: f.contents() for k, f in self.fields.items() if not k.startswith("GGUF.")}
                return end
            self.values, end = _Metadata(memoryview(self.data), path).read(offs, count)
            align = self.values.get("general.alignment")
            if align is not None:
                if not isinstance(align, int):
                    raise CheckpointError(f"{path}: general.alignment is {align!r}, not an integer")
                self.fields["general.alignment"] = gguf.ReaderField(
                    offs, "general.alignment", [np.array([align], dtype=np.uint32)], [0], [gguf.GGUFValueType.UINT32])
            return end

        def _build_tensors(self, start_offs: int, fields: list) -> None:
            size = len(self.data)
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    ggml_type = gguf.GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise CheckpointError(f"tensor '{name}' in {path} has unknown ggml type {int(raw_dtype[0])}") \
                        from None
                block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
                elements = int(np.prod(dims))
                if elements % block:
                    raise CheckpointError(f"tensor '{name}' in {path}: {elements} {ggml_type.name} values are not "
                                          f"whole {block}-value blocks")
                end = start_offs + int(offset[0]) + elements // block * type_size
                if end > size:
                    raise CheckpointError(f"tensor '{name}' in {path} ends at byte {end} but the file has {size} "
                                          "bytes: the file is truncated or corrupt")
            super()._build_tensors(start_offs, fields)

    try:
        return CheckedReader(str(path))
    except CheckpointError:
        raise
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise CheckpointError(f"cannot read GGUF file {path}: {exc}") from exc


def open_gguf(files: Sequence[Path]) -> "GGUFFile":
    """The parsed file, shared by the checkpoint, the config and the weights of one process
    (parsing a 150k-token vocabulary takes a while); re-read when a part changes on disk."""
    key = tuple((str(p), p.stat().st_mtime_ns, p.stat().st_size) for p in files)
    found = _OPEN.get(key)
    if found is None:
        _OPEN.clear()
        found = _OPEN[key] = GGUFFile(files)
    return found


class GGUFFile:
    """The metadata of the first part and the tensors of every part, by GGUF name."""

    def __init__(self, files: Sequence[Path]):
        self.files = list(files)
        self.readers = [_checked_reader(p) for p in self.files]
        self.metadata: dict[str, object] = dict(self.readers[0].values)
        self.tensors: dict[str, Any] = {}  # gguf ReaderTensor by name
        self.where: dict[str, Path] = {}
        for path, reader in zip(self.files, self.readers):
            for tensor in reader.tensors:
                if tensor.name in self.tensors:
                    raise CheckpointError(f"tensor '{tensor.name}' appears in both {self.where[tensor.name]} and {path}")
                self.tensors[tensor.name] = tensor
                self.where[tensor.name] = path

    @property
    def name(self) -> str:
        return str(self.files[0])

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def format_of(self, name: str) -> BlockFormat | None:
        """The block format of a tensor kept quantized; None for a dense one (F32/F16/BF16);
        any other type is refused by name."""
        type_id = int(self.tensors[name].tensor_type)
        if type_id in DENSE_TYPES:
            return None
        fmt = FORMATS.get(type_id)
        if fmt is None:
            supported = ", ".join([n for n, _ in DENSE_TYPES.values()] + [f.name for f in FORMATS.values()])
            raise CheckpointError(f"tensor '{name}' in {self.where[name]} is {self.type_name(name)}, which is not "
                                  f"supported (supported: {supported})")
        return fmt

    def shape(self, name: str) -> list[int]:
        """[out, in] (ggml lists dims innermost first)."""
        return [int(d) for d in reversed(self.tensors[name].shape.tolist())]

    def rows(self, name: str, rows: torch.Tensor | None) -> np.ndarray:
        """The stored rows (all when None), as a copy: [R, bytes per row] for quantized tensors,
        [R, K] values for dense ones."""
        data = self.tensors[name].data
        data = data.reshape(1, -1) if data.ndim == 1 else data.reshape(-1, data.shape[-1])
        return np.array(data if rows is None else data[rows.numpy()])

    def stored_bytes(self, name: str, rows: torch.Tensor | None) -> torch.Tensor:
        """A quantized tensor's rows of blocks, uint8 [R, bytes per row]: a view of the mapped file
        (no copy, nothing read until used) when `rows` is None, else a copy of those rows."""
        data = self.tensors[name].data
        data = data.reshape(1, -1) if data.ndim == 1 else data.reshape(-1, data.shape[-1])
        if rows is not None:
            return torch.from_numpy(np.ascontiguousarray(data[rows.numpy()]))
        with warnings.catch_warnings():  # the map is read-only, and nothing writes weights
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(data)


# Byte offsets of each block's fp16 scales (d, and dmin where the format has one), by block format name.
_HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82),
           "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _finite_halves(fmt: BlockFormat, raw: torch.Tensor) -> bool:
    """Whether every block's fp16 scales are finite: their exponent bits not all set (inf, nan).
    Read as one strided numpy pass per scale (torch's ops over a [rows, blocks] view of a few
    blocks a row took ~15 ms per tensor on a loaded 2-core machine: seconds per file)."""
    data = raw.numpy()
    flat = data.reshape(-1) if data.flags.c_contiguous else np.ascontiguousarray(data).reshape(-1)
    for at in _HALVES[fmt.name]:
        high = flat[at + 1::fmt.block_bytes]
        if bool(((high & 0x7C) == 0x7C).any()):
            return False
    return True


@dataclass(frozen=True)
class TensorView:
    """How a GGUF tensor is seen under a Hugging Face name: its stored name, a row order
    (index HF row -> stored row; None: as stored) and a value map on dense reads."""

    stored: str
    row_order: Callable[[int], torch.Tensor] | None = None
    adjust: Callable[[torch.Tensor], torch.Tensor] | None = None


class _GGUFSlice:
    def __init__(self, source: "GGUFSource", name: str):
        self._source = source
        self._name = name

    def get_shape(self) -> list[int]:
        return self._source.shape(self._name)

    def __getitem__(self, index) -> torch.Tensor:
        shape = self.get_shape()
        if len(shape) == 1:
            return self._source.dense_rows(self._name, None).reshape(-1)[index]
        entries = index if isinstance(index, tuple) else (index,)
        first = entries[0] if entries else slice(None)
        if first is Ellipsis:
            return self._source.dense_rows(self._name, None)[entries]
        if isinstance(first, slice):
            rows = torch.arange(shape[0])[first]
            return self._source.dense_rows(self._name, rows)[(slice(None), *entries[1:])]
        row = first + shape[0] if first < 0 else first
        return self._source.dense_rows(self._name, torch.tensor([row]))[(0, *entries[1:])]


class GGUFSource:
    """GGUF tensors under the names `views` gives them (see the module docstring)."""

    def __init__(self, file: GGUFFile, views: dict[str, TensorView]):
        self.file = file
        self.views = views

    def keys(self) -> Sequence[str]:
        return list(self.views)

    def describe(self, name: str) -> str:
        view = self.views.get(name)
        return str(self.file.where.get(view.stored, self.file.name)) if view else self.file.name

    def stored_name(self, name: str) -> str:
        return self.views[name].stored

    def shape(self, name: str) -> list[int]:
        return self.file.shape(self.views[name].stored)

    def get_slice(self, name: str) -> TensorSlice:
        if name not in self.views:
            raise KeyError(name)
        return _GGUFSlice(self, name)

    def format_of(self, name: str) -> BlockFormat | None:
        return self.file.format_of(self.views[name].stored)

    def _stored_rows(self, name: str, rows: torch.Tensor | None) -> torch.Tensor | None:
        view = self.views[name]
        if view.row_order is None:
            return rows
        order = view.row_order(self.shape(name)[0])
        return order if rows is None else order[rows]

    def quantized(self, name: str, rows: torch.Tensor | None = None) -> tuple[BlockFormat, Decoded]:
        """The rows' stored blocks, decoded (every row when `rows` is None)."""
        stored = self.views[name].stored
        fmt = self.file.format_of(stored)
        if fmt is None:
            raise CheckpointError(f"tensor '{stored}' in {self.describe(name)} is dense ({self.file.type_name(stored)})")
        raw = torch.from_numpy(self.file.rows(stored, self._stored_rows(name, rows)))
        decoded = decode(fmt, raw)
        if not (bool(torch.isfinite(decoded.scales).all())
                and (decoded.offsets is None or bool(torch.isfinite(decoded.offsets).all()))):
            raise CheckpointError(f"tensor '{stored}' in {self.describe(name)} has non-finite block scales: "
                                  "the file is corrupt")
        return fmt, decoded

    def blocks(self, name: str, rows: torch.Tensor | None = None) -> tuple[BlockFormat, torch.Tensor]:
        """The rows' stored blocks as they lie, uint8 [R, bytes per row] (a view of the file when every
        row is asked for in stored order), after checking that their fp16 block scales are finite."""
        stored = self.views[name].stored
        fmt = self.file.format_of(stored)
        if fmt is None:
            raise CheckpointError(f"tensor '{stored}' in {self.describe(name)} is dense ({self.file.type_name(stored)})")
        raw = self.file.stored_bytes(stored, self._stored_rows(name, rows))
        if not _finite_halves(fmt, raw):
            raise CheckpointError(f"tensor '{stored}' in {self.describe(name)} has non-finite block scales: "
                                  "the file is corrupt")
        return fmt, raw

    def dense_rows(self, name: str, rows: torch.Tensor | None) -> torch.Tensor:
        """The rows as float values: dequantized for a quantized tensor, adjusted as the view says."""
        stored = self.views[name].stored
        fmt = self.file.format_of(stored)
        if fmt is None:
            values = torch.from_numpy(self.file.rows(stored, self._stored_rows(name, rows)))
            if int(self.file.tensors[stored].tensor_type) == 30:  # numpy has no bfloat16: stored as raw uint16
                values = values.contiguous().view(torch.bfloat16)
        elif fmt.type_id in KQUANT_TYPES and (module := cpu_native.native()) is not None:
            # the native pass gives the decoder's values bit for bit (tests/test_gguf_kquant.py), 10-50x faster
            values = kquant_dequant(module, self.blocks(name, rows)[1], fmt.type_id)
        else:
            values = self.quantized(name, rows)[1].dequantize(fmt)
        adjust = self.views[name].adjust
        return adjust(values) if adjust is not None else values
