"""bitsandbytes: LLM.int8 and 4-bit NF4/FP4, from pre-quantized checkpoints or quantized on load.

Flags: `--quantize bitsandbytes` (int8), `bitsandbytes-nf4`, `bitsandbytes-fp4`. A checkpoint whose
config.json says quant_method "bitsandbytes" loads with no flag or with the flag of its kind.

4-bit layout (per linear, bitsandbytes' own serialization; specs/formats.md): `weight` uint8
[ceil(N*K/2), 1], two codes per byte, first in the high nibble, over the row-major flattened [N, K];
`weight.absmax` one scale per `blocksize` flattened elements (uint8 when double-quantized, then
with `weight.nested_absmax` / `weight.nested_quant_map` / the JSON's nested_offset);
`weight.quant_map` the 16-entry code table; `weight.quant_state.bitsandbytes__<type>` JSON bytes
(quant_type, blocksize, dtype, shape, nested_*). W = table[code] * absmax[block].

Sharding a 4-bit weight: a rank's rows [r0, r1) are one flat range, exact whenever r0 * K starts
a block (always when K % blocksize == 0). A row-parallel rank's columns [k0, k1) are N segments;
with K % blocksize == 0 the rank keeps the whole blocks around its columns and zero-pads its input
to their width, so codes and scales are the unsharded ones (no requantization: padding columns
meet zero inputs). Only with K % blocksize != 0 (blocks straddle rows) can a slice, or a fusion of
separate tensors, start inside a block: that rank then holds the layer dequantized (exact, not
compact; a warning names the layer). Quantizing on load
reads the dense tensor sharded the same way (whole blocks), so sharded equals unsharded exactly
when K % blocksize == 0; otherwise each rank quantizes its own part (a warning says so).

Kernels: kernels/bitsandbytes.py (bnb-cpu-4bit, reference, bnb-matmul-4bit), chosen like the others.

int8 (LLM.int8): `weight` int8 [N, K] and `SCB` float32 [N] (row absmax): W = weight * SCB / 127,
i.e. per-channel symmetric int8, run weight-only through the canonical QuantizedWeight (torch's
int8 kernel on CPU). LLM.int8's int8 activations and fp16 outlier decomposition are not emulated:
activations stay in the model dtype, which equals the dequantized weight exactly and is at least as
accurate. int8 needs no bitsandbytes package; 4-bit does (quantization and kernels).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from loguru import logger

from text_generation_server.kernels.base import LinearSpec, QuantKernel
from text_generation_server.kernels.bitsandbytes import CODES, bnb_functional, dequantize_flat
from text_generation_server.kernels.select import build_linear
from text_generation_server.quantizers.config import QuantizerConfig
from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.eetq import (
    ChannelInt8Weight,
    Int8OnLoadLoader,
    dense_weight,
    matrix_shape,
    read_block,
)
from text_generation_server.quantizers.sharding import layer_kind, part_sizes, rank_rows
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import UnquantizedWeight, Weights, WeightsLoader

FLAGS = {"bitsandbytes": "int8", "bitsandbytes-nf4": "nf4", "bitsandbytes-fp4": "fp4"}
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)  # what bitsandbytes' quantize_4bit accepts
ON_LOAD_BLOCKSIZE = 64

# -- config ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BnbConfig(QuantizerConfig):
    method: ClassVar[str] = "bitsandbytes"
    on_load: ClassVar[bool] = True
    kind: str = "int8"  # "int8", "nf4" or "fp4"
    prequantized: bool = True  # False: a dense checkpoint quantized on load
    double_quant: bool = False  # informational: absmax is expanded to float32 at load either way
    compute_dtype: str | None = None  # informational: activations run in the model dtype

    @property
    def flag(self) -> str:
        """bitsandbytes (int8), bitsandbytes-nf4 or bitsandbytes-fp4: the method alone hides the kind."""
        return next(f for f, k in FLAGS.items() if k == self.kind)

    def describe(self) -> str:
        what = "LLM.int8 (run weight-only)" if self.kind == "int8" else f"4-bit {self.kind}"
        nested = " double-quant" if self.double_quant else ""
        return f"bitsandbytes {what}{nested}{'' if self.prequantized else ' (quantized on load)'}"

    def check_flag(self, flag: str) -> None:
        wanted = FLAGS.get(flag.lower())
        if wanted is not None and wanted != self.kind:
            raise CheckpointError(f"--quantize {flag} disagrees with the checkpoint: {self.source} says bitsandbytes "
                                  f"{self.kind} (use --quantize {self.flag}, or leave --quantize out)")

    @classmethod
    def for_dense_checkpoint(cls, flag: str, folder: Path) -> "BnbConfig":
        return cls(source=f"--quantize {flag} (dense checkpoint {folder})", kind=FLAGS[flag.lower()],
                   prequantized=False)

    @classmethod
    def from_config(cls, data: dict, source: str, prefix: str = "") -> "BnbConfig":
        keys = ConfigReader(data, source, prefix)
        in4 = keys.bool("load_in_4bit", False) or keys.bool("_load_in_4bit", False)
        in8 = keys.bool("load_in_8bit", False) or keys.bool("_load_in_8bit", False)
        if in4 == in8:
            raise CheckpointError(f"{keys.where('load_in_4bit')} and '{prefix}load_in_8bit': exactly one must be "
                                  f"true, got {in4} and {in8}")
        skip = keys.names("llm_int8_skip_modules") + keys.names("modules_to_not_convert")
        if in8:
            if keys.bool("llm_int8_has_fp16_weight", False):
                raise keys.unsupported("llm_int8_has_fp16_weight", True, "bitsandbytes", "false (int8 weights)")
            return cls(source=source, kind="int8", modules_to_not_convert=skip)
        kind = keys.str("bnb_4bit_quant_type", "fp4")  # transformers' default
        if kind not in ("nf4", "fp4"):
            raise keys.unsupported("bnb_4bit_quant_type", kind, "bitsandbytes", "nf4, fp4")
        compute = keys.str("bnb_4bit_compute_dtype")
        if compute is not None and compute.removeprefix("torch.") not in ("float16", "bfloat16", "float32"):
            raise keys.unsupported("bnb_4bit_compute_dtype", compute, "bitsandbytes", "float16, bfloat16, float32")
        return cls(source=source, kind=kind, double_quant=keys.bool("bnb_4bit_use_double_quant", False),
                   compute_dtype=compute, modules_to_not_convert=skip)


# -- 4-bit weight and kernels ---------------------------------------------------------------------
@dataclass
class Bnb4bitWeight:
    """One rank's 4-bit weight in bitsandbytes' layout: a stored [rows, cols] matrix, flat blocks.

    Row-parallel ranks store whole blocks around their columns: `pad` = (columns before, after)
    that are not this rank's input; the matmul zero-pads the input to match.
    """

    packed: torch.Tensor  # uint8 [ceil(rows*cols/2)], row-major, high nibble first
    absmax: torch.Tensor  # float32 [ceil(rows*cols/blocksize)]
    rows: int
    cols: int
    quant_type: str
    blocksize: int
    pad: tuple[int, int] = (0, 0)
    prefix: str = ""
    layer: str = ""
    act_dtype: torch.dtype = torch.float32
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        numel = self.rows * self.cols
        if self.packed.dtype != torch.uint8 or self.packed.shape != (-(-numel // 2),):
            raise CheckpointError(f"'{self.prefix}': {self.rows}x{self.cols} 4-bit codes need {-(-numel // 2)} "
                                  f"bytes, got {self.packed.dtype} {list(self.packed.shape)}")
        if self.absmax.shape != (-(-numel // self.blocksize),):
            raise CheckpointError(f"'{self.prefix}': {self.rows}x{self.cols} codes in blocks of {self.blocksize} need "
                                  f"{-(-numel // self.blocksize)} absmax values, got {list(self.absmax.shape)}")
        if min(self.pad) < 0 or sum(self.pad) >= self.cols:
            raise ValueError(f"'{self.prefix}': padding {self.pad} does not fit {self.cols} stored columns")

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of this rank's partition (padding excluded)."""
        return self.rows, self.cols - sum(self.pad)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ground truth: dense [N, K] of this rank's partition."""
        dense = dequantize_flat(self.packed, self.absmax, self.rows * self.cols, self.quant_type, self.blocksize)
        return dense.view(self.rows, self.cols)[:, self.pad[0]:self.cols - self.pad[1]].to(dtype)

    def spec(self, act_dtype: torch.dtype, device_type: str) -> LinearSpec:
        return LinearSpec(in_features=self.cols, out_features=self.rows, bits=4, group_size=self.blocksize,
                          has_zeros=False, act_order=False, act_dtype=act_dtype, device_type=device_type,
                          weight_format=f"bnb-{self.quant_type}")

    def describe_layer(self, spec: LinearSpec, kernel: type[QuantKernel]) -> str:
        return f"bitsandbytes {self.quant_type} blocksize {self.blocksize}"

    def get_linear(self, bias: torch.Tensor | None) -> torch.nn.Module:
        return build_linear(self, bias, self.act_dtype, self.device_type, self.layer or self.prefix)


# -- reading 4-bit tensors ---------------------------------------------------------------------------
_WARNED: set[tuple[str, str]] = set()


def _warn_once(layer: str, what: str, message: str) -> None:
    if (layer, what) not in _WARNED:
        _WARNED.add((layer, what))
        logger.warning(message)


class _Source4bit(ABC):
    """One linear's 4-bit weight, sliced by rows (column-parallel) or columns (row-parallel)."""

    prefix: str
    n: int
    k: int
    quant_type: str
    blocksize: int

    @abstractmethod
    def rows(self, weights: Weights, r0: int, r1: int) -> Bnb4bitWeight | UnquantizedWeight:
        """Rows [r0, r1) of the weight, on the unsharded blocks wherever they allow."""

    @abstractmethod
    def columns(self, weights: Weights, k0: int, k1: int) -> Bnb4bitWeight | UnquantizedWeight:
        """Columns [k0, k1) of every row, on the unsharded blocks wherever they allow."""

    def _piece(self, weights: Weights, packed: torch.Tensor, absmax: torch.Tensor, rows: int, cols: int,
               pad: tuple[int, int] = (0, 0)) -> Bnb4bitWeight:
        return Bnb4bitWeight(packed=packed.reshape(-1).contiguous(), absmax=absmax.float().contiguous(), rows=rows,
                             cols=cols, quant_type=self.quant_type, blocksize=self.blocksize, pad=pad,
                             prefix=self.prefix, layer=layer_kind(self.prefix), act_dtype=weights.dtype,
                             device_type=weights.device.type)

    def _dense(self, weights: Weights, dense: torch.Tensor, why: str) -> UnquantizedWeight:
        _warn_once(layer_kind(self.prefix), "dense", f"{self.prefix}: {why}; this rank runs the layer dequantized "
                   f"(exact, {list(dense.shape)} {str(weights.dtype).removeprefix('torch.')} in memory)")
        return UnquantizedWeight(dense.to(weights.dtype))


class _Checkpoint4bit(_Source4bit):
    """A pre-quantized 4-bit tensor: validated from its quant_state, absmax expanded to float32."""

    def __init__(self, weights: Weights, prefix: str, config: BnbConfig):
        self.prefix, self.name = prefix, f"{prefix}.weight"
        self.files = weights.files_of(self.name)
        base = f"{self.name}.quant_state.bitsandbytes__"
        found = [t for t in ("nf4", "fp4") if weights.has_tensor(base + t)]
        if not weights.has_tensor(self.name):
            raise CheckpointError(f"tensor '{self.name}' not found (in {weights.files_of(prefix)})")
        if not found:
            raise CheckpointError(f"tensor '{base}{config.kind}' not found (in {self.files}): every 4-bit "
                                  "bitsandbytes weight stores its quant_state there")
        if config.kind not in found:
            raise CheckpointError(f"tensor '{base}{found[0]}' (in {self.files}) says this weight is {found[0]}, but "
                                  f"{config.source} says bnb_4bit_quant_type '{config.kind}'")
        key = base + config.kind
        raw = weights.get_tensor(key, to_dtype=False)
        where = f"tensor '{key}' (in {self.files})"
        try:
            if raw.dtype != torch.uint8:
                raise ValueError(f"dtype {raw.dtype}, expected uint8 JSON bytes")
            data = json.loads(bytes(raw.reshape(-1).tolist()).decode("utf-8"))
            if not isinstance(data, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
            raise CheckpointError(f"{where} is not a bitsandbytes quant_state: {exc}") from exc
        keys = ConfigReader(data, where)
        self.quant_type = keys.str("quant_type")
        if self.quant_type != config.kind:
            raise CheckpointError(f"{keys.where('quant_type')} = {self.quant_type!r} disagrees with the tensor name "
                                  f"and {config.source} ('{config.kind}')")
        self.blocksize = keys.int("blocksize")
        if self.blocksize not in BLOCKSIZES:
            raise keys.unsupported("blocksize", self.blocksize, "bitsandbytes 4-bit", ", ".join(map(str, BLOCKSIZES)))
        shape = data.get("shape")
        if (not isinstance(shape, list) or len(shape) != 2
                or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape)):
            raise CheckpointError(f"{keys.where('shape')} must be [out_features, in_features], got {shape!r}")
        self.n, self.k = shape
        numel = self.n * self.k
        self.blocks = -(-numel // self.blocksize)
        self._check_packed(weights, -(-numel // 2), keys)
        self.absmax = self._read_absmax(weights, keys)
        self._check_quant_map(weights)

    def _check_packed(self, weights: Weights, nbytes: int, keys: ConfigReader) -> None:
        shape = weights.get_shape(self.name)
        first = weights.get_slice(self.name, slice(0, 1))  # its dtype: uint8, or a bnb_4bit_quant_storage type
        self.storage = first.dtype
        have = int(torch.Size(shape).numel()) * first.element_size()
        if have != nbytes:
            raise CheckpointError(f"tensor '{self.name}' ({first.dtype} {shape}, in {self.files}) holds {have} bytes, "
                                  f"but {keys.where('shape')} [{self.n}, {self.k}] needs {nbytes} (two codes per byte)")

    def _read_absmax(self, weights: Weights, keys: ConfigReader) -> torch.Tensor:
        name = f"{self.name}.absmax"
        if not weights.has_tensor(name):
            raise CheckpointError(f"tensor '{name}' not found (in {self.files}): every 4-bit bitsandbytes weight "
                                  "stores its block scales there")
        absmax = weights.get_tensor(name, to_dtype=False).reshape(-1)
        if absmax.numel() != self.blocks:
            raise CheckpointError(
                f"tensor '{name}' has {absmax.numel()} blocks, but [{self.n}, {self.k}] in blocks of "
                f"{keys.where('blocksize')} = {self.blocksize} makes {self.blocks}: blocksize and tensors disagree")
        nested = weights.has_tensor(f"{self.name}.nested_absmax")
        if not nested:
            if not absmax.is_floating_point():
                raise CheckpointError(f"tensor '{name}' is {absmax.dtype} without '{self.name}.nested_absmax': "
                                      "double-quantized absmax needs its nested scales")
            return absmax.float()
        # Double quantization: absmax = nested_quant_map[code] * nested_absmax[i // nested_blocksize] + offset.
        nested_bs = keys.int("nested_blocksize")
        offset = keys.data.get("nested_offset")
        if isinstance(offset, bool) or not isinstance(offset, (int, float)):
            raise CheckpointError(f"{keys.where('nested_offset')} must be a number, got {offset!r}")
        if absmax.dtype != torch.uint8 or nested_bs <= 0:
            raise CheckpointError(f"tensor '{name}' must hold uint8 codes ({absmax.dtype}) with a positive "
                                  f"{keys.where('nested_blocksize')} ({nested_bs}) when double-quantized")
        for suffix in ("nested_absmax", "nested_quant_map"):
            if not weights.has_tensor(f"{self.name}.{suffix}"):
                raise CheckpointError(f"tensor '{self.name}.{suffix}' not found (in {self.files})")
        scales = weights.get_tensor(f"{self.name}.nested_absmax", to_dtype=False).reshape(-1).float()
        table = weights.get_tensor(f"{self.name}.nested_quant_map", to_dtype=False).reshape(-1).float()
        if scales.numel() != -(-self.blocks // nested_bs) or table.numel() != 256:
            raise CheckpointError(
                f"tensors '{self.name}.nested_absmax' ({scales.numel()}) and '{self.name}.nested_quant_map' "
                f"({table.numel()}) do not fit {self.blocks} absmax codes in nested blocks of {nested_bs} "
                f"(in {self.files})")
        expanded = table[absmax.long()] * scales.repeat_interleave(nested_bs)[:self.blocks]
        return expanded + torch.tensor(float(offset), dtype=torch.float32, device=expanded.device)

    def _check_quant_map(self, weights: Weights) -> None:
        name = f"{self.name}.quant_map"
        if weights.has_tensor(name):  # informational: the kernels use the standard table
            table = weights.get_tensor(name, to_dtype=False).reshape(-1).float().cpu()
            if table.shape != (16,) or not torch.allclose(table, CODES[self.quant_type], atol=1e-6):
                raise CheckpointError(f"tensor '{name}' (in {self.files}) is not the standard {self.quant_type} code "
                                      "table; custom 4-bit tables are not supported")

    def _bytes(self, weights: Weights, start: int, stop: int) -> torch.Tensor:
        """Bytes [start, stop) of the flattened packed weight: from a flat tensor ([M] or [M, 1], as
        bitsandbytes stores it) only the elements holding them are read, whatever the storage dtype."""
        shape = weights.get_shape(self.name)
        if len(shape) == 1 or shape[1:] == [1]:
            size = torch.empty((), dtype=self.storage).element_size()
            first, last = start // size, -(-stop // size)
            window = weights.get_slice(self.name, slice(first, last)).reshape(-1).view(torch.uint8)
            return window[start - first * size:stop - first * size]
        return weights.get_tensor(self.name, to_dtype=False).reshape(-1).view(torch.uint8)[start:stop]

    def _dequant_rows(self, weights: Weights, r0: int, r1: int) -> torch.Tensor:
        e0, e1 = r0 * self.k, r1 * self.k
        b0, b1 = e0 // self.blocksize, -(-e1 // self.blocksize)
        s0, s1 = b0 * self.blocksize, min(b1 * self.blocksize, self.n * self.k)
        flat = dequantize_flat(self._bytes(weights, s0 // 2, -(-s1 // 2)), self.absmax[b0:b1], s1 - s0,
                               self.quant_type, self.blocksize)
        return flat[e0 - s0:e1 - s0].view(r1 - r0, self.k)

    def rows(self, weights: Weights, r0: int, r1: int) -> Bnb4bitWeight | UnquantizedWeight:
        e0, e1 = r0 * self.k, r1 * self.k
        if e0 % self.blocksize:
            return self._dense(weights, self._dequant_rows(weights, r0, r1),
                               f"rows from {r0} start inside a {self.blocksize}-element block (K = {self.k})")
        packed = self._bytes(weights, e0 // 2, -(-e1 // 2))
        return self._piece(weights, packed, self.absmax[e0 // self.blocksize:-(-e1 // self.blocksize)], r1 - r0, self.k)

    def columns(self, weights: Weights, k0: int, k1: int) -> Bnb4bitWeight | UnquantizedWeight:
        if (k0, k1) == (0, self.k):
            return self.rows(weights, 0, self.n)
        bs = self.blocksize
        if self.k % bs:
            return self._dense(weights, self._dequant_rows(weights, 0, self.n)[:, k0:k1],
                               f"blocks of {bs} straddle rows (K = {self.k}), so columns {k0}..{k1} are no whole "
                               "blocks")
        kb0, kb1 = k0 // bs, -(-k1 // bs)
        packed = self._bytes(weights, 0, self.n * self.k // 2).view(self.n, self.k // 2)[:, kb0 * bs // 2:kb1 * bs // 2]
        absmax = self.absmax.view(self.n, self.k // bs)[:, kb0:kb1]
        pad = (k0 - kb0 * bs, kb1 * bs - k1)
        return self._piece(weights, packed, absmax.reshape(-1), self.n, (kb1 - kb0) * bs, pad)


class _Dense4bit(_Source4bit):
    """A dense tensor quantized on load, the rank's part read as whole blocks where blocks allow."""

    def __init__(self, weights: Weights, prefix: str, config: BnbConfig):
        self.prefix, self.name = prefix, f"{prefix}.weight"
        self.n, self.k = matrix_shape(weights, self.name)
        self.quant_type, self.blocksize = config.kind, ON_LOAD_BLOCKSIZE

    def _quantize(self, weights: Weights, w: torch.Tensor, pad: tuple[int, int] = (0, 0)) -> Bnb4bitWeight:
        w = dense_weight(weights, self.name, w)
        packed, state = bnb_functional().quantize_4bit(w.float().contiguous(), blocksize=self.blocksize,
                                                       quant_type=self.quant_type, compress_statistics=False)
        return self._piece(weights, packed, state.absmax, w.shape[0], w.shape[1], pad)

    def _unequal(self, what: str) -> None:
        _warn_once(layer_kind(self.prefix), "requantized",
                   f"{self.prefix}: K = {self.k} is not a multiple of the blocksize {self.blocksize}, so blocks "
                   f"straddle rows and this rank's {what} is quantized on its own blocks: sharded output differs "
                   "from unsharded within 4-bit quantization error")

    def rows(self, weights: Weights, r0: int, r1: int) -> Bnb4bitWeight:
        if self.k % self.blocksize and (r0, r1) != (0, self.n):
            self._unequal(f"rows {r0}..{r1}")
        return self._quantize(weights, read_block(weights, self.name, rows=slice(r0, r1)))

    def columns(self, weights: Weights, k0: int, k1: int) -> Bnb4bitWeight:
        if (k0, k1) == (0, self.k):
            return self.rows(weights, 0, self.n)
        bs = self.blocksize
        if self.k % bs:
            self._unequal(f"columns {k0}..{k1}")
            return self._quantize(weights, read_block(weights, self.name, cols=slice(k0, k1)))
        kb0, kb1 = k0 // bs, -(-k1 // bs)
        w = read_block(weights, self.name, cols=slice(kb0 * bs, kb1 * bs))
        return self._quantize(weights, w, (k0 - kb0 * bs, kb1 * bs - k1))


def _concat(weights: Weights, pieces: list, prefixes: list[str]) -> Bnb4bitWeight | UnquantizedWeight:
    """Pieces stacked along N: flat concatenation when every piece but the last is whole blocks."""
    if len(pieces) == 1:
        return pieces[0]
    first = pieces[0]
    if all(isinstance(p, Bnb4bitWeight) and (p.cols, p.pad, p.quant_type, p.blocksize)
           == (first.cols, first.pad, first.quant_type, first.blocksize) for p in pieces) and \
            all(p.rows * p.cols % p.blocksize == 0 for p in pieces[:-1]):
        return Bnb4bitWeight(packed=torch.cat([p.packed for p in pieces]), absmax=torch.cat([p.absmax for p in pieces]),
                             rows=sum(p.rows for p in pieces), cols=first.cols, quant_type=first.quant_type,
                             blocksize=first.blocksize, pad=first.pad, prefix="+".join(prefixes),
                             layer=layer_kind(prefixes), act_dtype=weights.dtype, device_type=weights.device.type)
    dense = torch.cat([p.dequantize() if isinstance(p, Bnb4bitWeight) else p.weight.float() for p in pieces])
    _warn_once(layer_kind(prefixes), "concat", f"{'+'.join(prefixes)}: fused parts are not whole 4-bit blocks; this "
               f"rank runs the fused layer dequantized (exact, {list(dense.shape)} in memory)")
    return UnquantizedWeight(dense.to(weights.dtype))


class Bnb4bitLoader(WeightsLoader):
    """4-bit NF4/FP4: bitsandbytes' layout kept, sliced on block boundaries (see the module docstring)."""

    def __init__(self, config: BnbConfig):
        self.config = config
        bnb_functional()  # fail before any weight is read when the package is missing

    def describe(self) -> str:
        return f"Bnb4bitLoader({self.config.describe()})"

    def _source(self, weights: Weights, prefix: str) -> _Source4bit:
        return (_Checkpoint4bit if self.config.prequantized else _Dense4bit)(weights, prefix, self.config)

    def get_weights(self, weights: Weights, prefix: str):
        src = self._source(weights, prefix)
        return src.rows(weights, 0, src.n)

    def get_weights_col_packed(self, weights: Weights, prefix: str, block_sizes: int | list[int]):
        src = self._source(weights, prefix)
        world, rank = weights.process_group.size, weights.process_group.rank
        sizes = part_sizes(src.n, block_sizes, f"{prefix}.weight")
        if world == 1:
            return src.rows(weights, 0, src.n)  # every part whole, in order
        pieces, offset = [], 0
        for size in sizes:
            if size % world:
                raise CheckpointError(f"tensor '{prefix}.weight': a part of {size} output features does not divide "
                                      f"into {world} shards")
            local = size // world
            pieces.append(src.rows(weights, offset + rank * local, offset + (rank + 1) * local))
            offset += size
        return _concat(weights, pieces, [prefix])

    def get_multi_weights_col(self, weights: Weights, prefixes: list[str], dim: int):
        if dim != 0:
            raise ValueError(f"bitsandbytes weights fuse along the output dimension (dim 0), not dim {dim}")
        pieces = [self.get_weights_col(weights, p) for p in prefixes]
        if len({p.shape[1] for p in pieces}) > 1:
            shapes = ", ".join(f"'{p}' {list(w.shape)}" for p, w in zip(prefixes, pieces))
            raise CheckpointError(f"weights fused along dim 0 disagree in their input features: {shapes} "
                                  f"(in {weights.files_of(prefixes[0])})")
        return _concat(weights, pieces, prefixes)

    def get_weights_row(self, weights: Weights, prefix: str):
        src = self._source(weights, prefix)
        cols = rank_rows(weights, src.k, f"{prefix}.weight")
        return src.columns(weights, cols.start, cols.stop)


# -- int8 checkpoints ----------------------------------------------------------------------------
class BnbInt8Loader(WeightsLoader):
    """LLM.int8 checkpoints: int8 weight [N, K] + SCB [N]; run weight-only as per-channel int8."""

    def __init__(self, config: BnbConfig):
        self.config = config

    def describe(self) -> str:
        return f"BnbInt8Loader({self.config.describe()})"

    def _names(self, weights: Weights, prefix: str) -> tuple[str, str]:
        name = f"{prefix}.weight"
        scb = next((s for s in (f"{prefix}.SCB", f"{name}.SCB") if weights.has_tensor(s)), None)
        if scb is None:
            raise CheckpointError(f"tensor '{prefix}.SCB' not found (in {weights.files_of(prefix)}): every int8 "
                                  "bitsandbytes weight stores its row scales there")
        fmt = f"{prefix}.weight_format"
        if weights.has_tensor(fmt):
            value = weights.get_tensor(fmt, to_dtype=False).reshape(-1)  # stored 0-dim
            if value.numel() != 1 or int(value[0]) != 0:
                raise CheckpointError(f"tensor '{fmt}' = {value.tolist()} (in {weights.files_of(fmt)}) is not yet "
                                      "supported (supported: 0, row-major)")
        return name, scb

    def _weight(self, weights: Weights, prefixes: list[str], q: torch.Tensor, scb: torch.Tensor) -> ChannelInt8Weight:
        label = "+".join(prefixes)
        if q.dtype != torch.int8 or q.dim() != 2:
            raise CheckpointError(f"tensor '{prefixes[0]}.weight' is {q.dtype} {list(q.shape)} (in "
                                  f"{weights.files_of(prefixes[0])}): an int8 bitsandbytes checkpoint stores int8 "
                                  "[N, K]")
        if scb.shape != (q.shape[0],) or not scb.is_floating_point():
            raise CheckpointError(f"'{label}': SCB is {scb.dtype} {list(scb.shape)} "
                                  f"(in {weights.files_of(prefixes[0])}), "
                                  f"expected float [{q.shape[0]}] to match the int8 weight {list(q.shape)}")
        return ChannelInt8Weight(qweight=q, scales=scb.float() / 127, prefix=label, layer=layer_kind(prefixes),
                                 act_dtype=weights.dtype, device_type=weights.device.type)

    def get_weights(self, weights: Weights, prefix: str) -> ChannelInt8Weight:
        name, scb = self._names(weights, prefix)
        return self._weight(weights, [prefix], weights.get_tensor(name, to_dtype=False),
                            weights.get_tensor(scb, to_dtype=False))

    def get_weights_col_packed(self, weights: Weights, prefix: str, block_sizes: int | list[int]) -> ChannelInt8Weight:
        name, scb = self._names(weights, prefix)
        sizes = part_sizes(weights.get_shape(name)[0], block_sizes, name)
        return self._weight(weights, [prefix],
                            weights.get_packed_sharded(name, dim=0, block_sizes=sizes, to_dtype=False),
                            weights.get_packed_sharded(scb, dim=0, block_sizes=sizes, to_dtype=False))

    def get_multi_weights_col(self, weights: Weights, prefixes: list[str], dim: int) -> ChannelInt8Weight:
        if dim != 0:
            raise ValueError(f"bitsandbytes weights fuse along the output dimension (dim 0), not dim {dim}")
        parts = [self.get_weights_col(weights, p) for p in prefixes]
        if len({p.shape[1] for p in parts}) > 1:
            shapes = ", ".join(f"'{p}.weight' {list(w.shape)}" for p, w in zip(prefixes, parts))
            raise CheckpointError(f"tensors fused along dim 0 disagree in their input features: {shapes} "
                                  f"(in {weights.files_of(prefixes[0])})")
        return ChannelInt8Weight(qweight=torch.cat([p.qweight for p in parts]),
                                 scales=torch.cat([p.scales for p in parts]), prefix="+".join(prefixes),
                                 layer=layer_kind(prefixes), act_dtype=weights.dtype, device_type=weights.device.type)

    def get_weights_row(self, weights: Weights, prefix: str) -> ChannelInt8Weight:
        name, scb = self._names(weights, prefix)
        # SCB is the absmax of the full row: every rank keeps all of it, so shards equal the whole.
        return self._weight(weights, [prefix], weights.get_sharded(name, dim=1, to_dtype=False),
                            weights.get_tensor(scb, to_dtype=False))


def _bnb_loader(config: BnbConfig) -> WeightsLoader:
    if config.kind != "int8":
        return Bnb4bitLoader(config)
    return BnbInt8Loader(config) if config.prequantized else Int8OnLoadLoader(config, "bitsandbytes int8")


CONFIGS: dict[str, type[QuantizerConfig]] = {flag: BnbConfig for flag in FLAGS}
LOADERS = {BnbConfig: _bnb_loader}
