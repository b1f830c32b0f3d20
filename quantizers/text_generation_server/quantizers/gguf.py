"""GGUF weights: llama.cpp's block formats kept quantized, through the loader factory like any format.

On the CPU, Q4_K and Q6_K layers (all of a Q4_K_M file's) keep the file's blocks as they lie: a
view of the mapped file, nothing decoded at load, read in place by `cpu-kquant`
(kernels/cpu_kquant.py, llama.cpp's arithmetic). Every other quantized layer, and a K-quant layer
where cpu-kquant cannot run (a GPU, no native build, the kernel switched off), decodes its blocks
once to the canonical `QuantizedWeight` (gguf_blocks.py), so the kernel tables choose for them as
for any integer format: the 2- to 4-bit formats (Q4_0, Q4_1, Q4_K, Q2_K, Q3_K) fit the int4
kernels, the 5- to 8-bit ones (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) the group-scale int8 kernel
(kernels/cpu_group_int8.py). F32, F16 and BF16 tensors load dense. A fused layer whose parts are
stored in different types (Q4_K_M files keep attn_v in Q6_K beside Q4_K q and k) builds each part on
its own kernel (`SplitWeight`), so no part is widened to another's format; where every part runs on
cpu-kquant they are joined into one layer (one native call writing each part's columns of one output),
else the parts' outputs are concatenated.

Sharding rule: column-parallel ranks own whole rows, and a GGUF row is a whole number of blocks,
so any row split is exact. Row-parallel ranks own K / world columns. Where the rank's boundary
falls on a 256-column super-block, K-quant blocks stay as stored (a view of those columns).
Elsewhere the blocks are decoded whole and the canonical codes are cut at the rank's boundary,
which must fall on a canonical group (16 or 32 columns: the K-quants' sub-blocks); the startup log
says so for each such tensor kind. Qwen2.5-1.5B's ffn_down (K = 8960) splits at 4480 = 140 x 32 on
two ranks: inside a super-block, on a sub-block boundary, so that layer runs decoded on two ranks.
A boundary inside a group is refused naming the tensor; it is never cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import ClassVar

import torch
from loguru import logger

from text_generation_server.kernels.base import LinearSpec, QuantizedWeight, QuantKernel
from text_generation_server.kernels import cpu_native
from text_generation_server.kernels.cpu_kquant import KQUANT_TYPES, QK_K, KQuantBlocks, KQuantEmbedding, KQuantLinear
from text_generation_server.kernels.select import build_linear
from text_generation_server.quantizers.config import QuantizerConfig
from text_generation_server.quantizers.gguf_arch import open_source
from text_generation_server.quantizers.gguf_blocks import BlockFormat, Decoded, decode
from text_generation_server.quantizers.gguf_file import GGUFSource, gguf_files
from text_generation_server.quantizers.sharding import layer_kind, part_sizes
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import UnquantizedWeight, Weights, WeightsLoader


@dataclass(frozen=True)
class GGUFConfig(QuantizerConfig):
    """A GGUF file: each tensor says its own type, so the config only names the file."""

    method: ClassVar[str] = "gguf"
    types: tuple[str, ...] = ()  # the ggml types of its tensors, for the startup log

    def describe(self) -> str:
        return f"GGUF ({', '.join(self.types)})"

    @classmethod
    def from_config(cls, data: dict, source: str, prefix: str = "") -> "GGUFConfig":
        raise CheckpointError(f"{source}: '{prefix}quant_method' = 'gguf' names no file: serve the .gguf file itself")

    @classmethod
    def for_dense_checkpoint(cls, flag: str, folder: Path) -> "GGUFConfig":
        raise CheckpointError(f"--quantize {flag}: {folder} is not a GGUF file; GGUF weights are read from a .gguf "
                              "file (serve the file, or a folder holding only it)")

    def keeps_head_quantized(self, weights: Weights, prefix: str) -> bool:
        """A Q4_K/Q6_K head on the CPU stays as stored (cpu-kquant reads it in place: 191 MiB of Q6_K
        for Qwen2.5-1.5B's, against 445 MiB dequantized to bfloat16, read every decode step), where
        the vocabulary splits evenly into the ranks (the quantized head's rule)."""
        source = weights.stored
        name = f"{prefix}.weight"
        if not isinstance(source, GGUFSource) or weights.device.type != "cpu" or not weights.has_tensor(name):
            return False
        key = weights._resolve(name) or name
        fmt = source.format_of(key)
        return (fmt is not None and fmt.type_id in KQUANT_TYPES
                and source.shape(key)[0] % weights.process_group.size == 0)

    def quantized_embedding(self, weights: Weights, prefix: str) -> torch.nn.Module | None:
        """A Q4_K/Q6_K token embedding on the CPU of one rank, kept as stored and decoded a row at a
        time on lookup (KQuantEmbedding: the full decode's values), instead of dequantized whole at
        load (1.4-2.7 s and 445 MiB of bfloat16 for Qwen2.5-1.5B's); None: loaded dense as before
        (another type, several ranks, a view that reorders or adjusts values, no native kernels)."""
        source = weights.stored
        name = f"{prefix}.weight"
        if (not isinstance(source, GGUFSource) or weights.device.type != "cpu" or weights.process_group.size != 1
                or not weights.has_tensor(name) or cpu_native.native() is None):
            return None
        key = weights._resolve(name) or name
        fmt, view = source.format_of(key), source.views[key]
        if fmt is None or fmt.type_id not in KQUANT_TYPES or view.row_order is not None or view.adjust is not None:
            return None
        return KQuantEmbedding(source.blocks(key)[1], fmt.type_id, weights.dtype)

    @classmethod
    def from_source(cls, source: GGUFSource) -> "GGUFConfig":
        types = sorted({source.file.type_name(name) for name in source.file.tensors})
        return cls(source=source.file.name, types=tuple(types))


@dataclass
class GGUFWeight(QuantizedWeight):
    """A canonical quantized weight that remembers its ggml type, so the kernel log names it."""

    ggml: str = ""
    layer: str = ""
    act_dtype: torch.dtype = torch.float32
    device_type: str = "cpu"

    def describe_layer(self, spec: LinearSpec, kernel: type[QuantKernel]) -> str:
        return f"{self.ggml} as {super().describe_layer(spec, kernel)}"

    def get_linear(self, bias: torch.Tensor | None) -> torch.nn.Module:
        return build_linear(self, bias, self.act_dtype, self.device_type, self.layer)


@dataclass
class GGUFBlocksWeight(KQuantBlocks):
    """Q4_K / Q6_K blocks as stored, for cpu-kquant; its `plain` form is the canonical GGUFWeight."""

    layer: str = ""
    act_dtype: torch.dtype = torch.float32

    def get_linear(self, bias: torch.Tensor | None) -> torch.nn.Module:
        return build_linear(self, bias, self.act_dtype, "cpu", self.layer)


class SplitLinear(torch.nn.Module):
    """Parts of one fused linear on their own kernels; outputs concatenated along N."""

    # x: [..., K] -> [..., sum(N_i)]
    def __init__(self, parts: list[torch.nn.Module]):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


@dataclass
class SplitWeight:
    """A fused weight whose parts (in output order) are stored in different types."""

    parts: list = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    def get_linear(self, bias: torch.Tensor | None) -> torch.nn.Module:
        modules, start = [], 0
        for part in self.parts:
            n = part.shape[0]
            modules.append(part.get_linear(None if bias is None else bias[start:start + n]))
            start += n
        return join_parts(modules)


def join_parts(modules: list[torch.nn.Module]) -> torch.nn.Module:
    """The parts of a fused layer as one module: where all are cpu-kquant layers of one form, one
    KQuantLinear over all their buffers (one native call: each part's tiles shared out among the threads
    in one region, written into its columns of one output; the outputs' bits unchanged); otherwise a
    SplitLinear. On the Qwen2.5-Coder-1.5B Q4_K_M file half of the layers' qkv mix Q4_K and Q6_K: as two
    calls and a torch.cat the qkv projections read 18 GB/s at one row, against 28-36 for the others."""
    if len(modules) > 1 and KQuantLinear.can_join(modules):
        joined = KQuantLinear.join(modules)  # type: ignore[arg-type]  # can_join checked the class
        name = getattr(modules[0], "kernel_name", None)
        if name:  # what build_linear set on each part (Info.kernels)
            setattr(joined, "kernel_name", name)
        described = [getattr(m, "computes", "") for m in modules]
        if all(described):
            setattr(joined, "computes", " + ".join(described))
        return joined
    return SplitLinear(modules)


def _source(weights: Weights) -> GGUFSource:
    source = weights.stored
    if not isinstance(source, GGUFSource):
        raise CheckpointError("the GGUF loader reads GGUF files only")
    return source


@dataclass
class _Rows:
    """One stored tensor's rows for this rank: K-quant blocks as stored, decoded blocks, or dense values."""

    name: str
    fmt: BlockFormat | None
    decoded: Decoded | None = None
    dense: torch.Tensor | None = None
    blocks: torch.Tensor | None = None

    @property
    def matrix(self) -> torch.Tensor:
        """The [rows, K] values or codes, for shapes."""
        if self.decoded is not None:
            return self.decoded.codes
        assert self.dense is not None
        return self.dense

    @property
    def in_features(self) -> int:
        if self.blocks is not None:
            assert self.fmt is not None
            return self.blocks.shape[1] // self.fmt.block_bytes * self.fmt.block
        return self.matrix.shape[1]

    def decode_blocks(self) -> None:
        """Stored blocks -> the canonical decoded form (for a rank slice that cuts a super-block)."""
        if self.blocks is not None:
            assert self.fmt is not None
            self.decoded, self.blocks = decode(self.fmt, self.blocks.contiguous()), None


class GGUFLoader(WeightsLoader):
    """Builds each linear from its GGUF tensors (see the module docstring for the sharding rule)."""

    def __init__(self, config: GGUFConfig):
        self.config = config

    def describe(self) -> str:
        return f"GGUFLoader({self.config.describe()})"

    def _read(self, weights: Weights, name: str, rows: torch.Tensor | None) -> _Rows:
        source = _source(weights)
        key = weights._resolve(name) or name  # raises, naming the tensor, when it is missing
        fmt = source.format_of(key)
        if fmt is None:
            return _Rows(key, None, dense=source.dense_rows(key, rows))
        if fmt.type_id in KQUANT_TYPES and weights.device.type == "cpu":
            return _Rows(key, fmt, blocks=source.blocks(key, rows)[1])
        return _Rows(key, fmt, decoded=source.quantized(key, rows)[1])

    def _weight(self, weights: Weights, parts: list[_Rows], label: str) -> object:
        """One weight from row blocks in output order; parts of the same type merge into one."""
        groups: list[list[_Rows]] = []
        for part in parts:
            if groups and groups[-1][0].fmt == part.fmt and (groups[-1][0].blocks is None) == (part.blocks is None):
                groups[-1].append(part)
            else:
                groups.append([part])
        built = [self._merged(weights, group, label) for group in groups]
        return built[0] if len(built) == 1 else SplitWeight(built)

    def _merged(self, weights: Weights, parts: list[_Rows], label: str):
        ks = {p.in_features for p in parts}
        if len(ks) > 1:
            raise CheckpointError(f"tensors {', '.join(repr(p.name) for p in parts)} fused along the output "
                                  f"dimension disagree in their input features ({sorted(ks)})")
        fmt = parts[0].fmt
        if fmt is None:
            dense = torch.cat([p.matrix for p in parts]).to(device=weights.device, dtype=weights.dtype)
            return UnquantizedWeight(dense)
        if parts[0].blocks is not None:
            blocks = tuple(p.blocks for p in parts if p.blocks is not None)
            return GGUFBlocksWeight(blocks, fmt.type_id, partial(self._decoded, weights, fmt, blocks, label),
                                    layer=label, act_dtype=weights.dtype)
        return self._canonical_weight(weights, fmt, [p.decoded for p in parts if p.decoded is not None], label)

    def _decoded(self, weights: Weights, fmt: BlockFormat, blocks: tuple[torch.Tensor, ...], label: str) -> "GGUFWeight":
        """The canonical form of stored blocks: what every kernel but cpu-kquant reads."""
        return self._canonical_weight(weights, fmt, [decode(fmt, b.contiguous()) for b in blocks], label)

    def _canonical_weight(self, weights: Weights, fmt: BlockFormat, decoded: list[Decoded], label: str) -> "GGUFWeight":
        codes, scales, zeros = _canonical(fmt, decoded)
        k = codes.shape[1]
        device = weights.device
        return GGUFWeight(qweight=codes.t().contiguous().to(device), scales=scales.t().contiguous().to(device),
                          zeros=None if zeros is None else zeros.t().contiguous().to(device),
                          g_idx=(torch.arange(k, dtype=torch.int32) // fmt.group).to(device), bits=fmt.bits,
                          group_size=fmt.group, ggml=fmt.name, layer=label, act_dtype=weights.dtype,
                          device_type=device.type)

    def _rank_rows(self, weights: Weights, name: str, sizes: list[int]) -> torch.Tensor | None:
        """This rank's rows of a column-parallel tensor; None for every row (one rank: stored blocks stay a view)."""
        rank, world = weights.process_group.rank, weights.process_group.size
        if world == 1:
            return None
        picked, offset = [], 0
        for size in sizes:
            if size % world:
                raise CheckpointError(f"tensor '{name}': a fused part of {size} rows does not divide into {world} "
                                      "shards")
            share = size // world
            picked.append(torch.arange(offset + rank * share, offset + (rank + 1) * share))
            offset += size
        return torch.cat(picked)

    def get_weights(self, weights: Weights, prefix: str):
        return self._weight(weights, [self._read(weights, f"{prefix}.weight", None)], layer_kind(prefix))

    def get_weights_col_packed(self, weights: Weights, prefix: str, block_sizes: int | list[int]):
        name = f"{prefix}.weight"
        sizes = part_sizes(weights.get_shape(name)[0], block_sizes, name)
        return self._weight(weights, [self._read(weights, name, self._rank_rows(weights, name, sizes))],
                            layer_kind(prefix))

    def get_multi_weights_col(self, weights: Weights, prefixes: list[str], dim: int):
        if dim != 0:
            raise ValueError(f"GGUF weights fuse along the output dimension (dim 0), not dim {dim}")
        parts = []
        for p in prefixes:
            name = f"{p}.weight"
            parts.append(self._read(weights, name, self._rank_rows(weights, name, [weights.get_shape(name)[0]])))
        return self._weight(weights, parts, layer_kind(prefixes))

    def get_weights_row(self, weights: Weights, prefix: str):
        name = f"{prefix}.weight"
        part = self._read(weights, name, None)
        world, rank = weights.process_group.size, weights.process_group.rank
        if world > 1:
            k = weights.get_shape(name)[1]
            if k % world:
                raise CheckpointError(f"tensor '{name}' has {k} input features, which do not divide into {world} "
                                      "shards")
            share = k // world
            cols = slice(rank * share, (rank + 1) * share)
            if part.blocks is not None and share % QK_K == 0:  # whole super-blocks: a view of the stored bytes
                assert part.fmt is not None
                size = part.fmt.block_bytes
                part.blocks = part.blocks[:, cols.start // QK_K * size:cols.stop // QK_K * size]
            elif part.fmt is None:
                part.dense = part.matrix[:, cols]
            else:
                if part.blocks is not None:
                    if _once_per_file(name, share):
                        logger.info("tensor '{}': {} row-parallel shards of {} columns cut its {}-column super-blocks: "
                                    "decoded at load and cut on a {}-column sub-block (the canonical form's kernels, "
                                    "not cpu-kquant)", name, world, share, QK_K, part.fmt.group)
                    part.decode_blocks()
                group = part.fmt.group
                if share % group:
                    raise CheckpointError(
                        f"tensor '{name}' ({part.fmt.name}, {group}-column groups) cannot be split into {world} "
                        f"row-parallel shards of {share} columns: a shard boundary would cut a group")
                d = part.decoded
                gcols = slice(cols.start // group, cols.stop // group)
                part.decoded = Decoded(d.codes[:, cols].contiguous(), d.scales[:, gcols].contiguous(),
                                       None if d.offsets is None else d.offsets[:, gcols].contiguous())
        return self._weight(weights, [part], layer_kind(prefix))


_LOGGED: set[tuple[str, int]] = set()


def _once_per_file(name: str, share: int) -> bool:
    """True the first time a tensor kind and shard width are seen (layers repeat the same message)."""
    key = (name.split(".")[-2] if "." in name else name, share)
    if key in _LOGGED:
        return False
    _LOGGED.add(key)
    return True


def _canonical(fmt: BlockFormat, parts: list[Decoded]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows of one format stacked: codes [N, K], scales and zeros [N, G]."""
    pieces = [p.canonical_zeros() for p in parts]
    codes = torch.cat([c for c, _, _ in pieces])
    scales = torch.cat([s for _, s, _ in pieces]).float()
    zeros = None if fmt.symmetric else torch.cat([z for _, _, z in pieces if z is not None]).float()
    return codes, scales, zeros


def read_config(path: Path) -> GGUFConfig | None:
    """The GGUF config of a model path (a .gguf file or a folder holding one); None otherwise."""
    files = gguf_files(path)
    if files is None:
        return None
    return GGUFConfig.from_source(open_source(files))


CONFIGS: dict[str, type[QuantizerConfig]] = {"gguf": GGUFConfig}
LOADERS = {GGUFConfig: GGUFLoader}
