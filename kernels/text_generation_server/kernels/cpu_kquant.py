"""CPU kernel for GGUF's Q4_K and Q6_K layers, reading the file's blocks where they lie.

A GGUF K-quant layer decoded into our canonical forms at load cost most of a start (45 s of the
Qwen2.5-Coder-1.5B Q4_K_M file's) and a second copy of the weights, larger than the blocks
(Q4_K's sub-block scales and minimums as float32). `cpu-kquant` keeps the stored bytes instead (a
view of the mmapped file, or of this rank's rows) and multiplies them in place with llama.cpp's
arithmetic for these files: activations quantized to int8 per 256 columns (Q8_K), integer dot
products per block, one float scaling per block (cpu_native_kquant_src.py says the details). So
on a GGUF file our numerics are llama.cpp's, the reference implementation of the format; the
float reference path (TGS_DISABLE_KERNELS=cpu-kquant,...) still decodes the blocks to the
canonical form, which is what the exactness tests against transformers run.

Every row, prompt or decode, gets the same bits: the kernel's float steps are fixed per row and
output (cpu_native_kquant_src.py: one order, whatever the code path), so a row's result does not
depend on its batch or on how a prompt is chunked (kernels/phase.py). The weight bytes come from
memory once per call whatever the row count: outputs go in tiles of 16, their rows in passes of 8;
from 16 rows a tile's blocks are first decoded into a form VNNI's dot products read with nothing
left to sum across lanes (prompts, large batches).

On AVX-512 builds each layer converts its blocks at load into a packed form (16 outputs' blocks
interleaved, so VNNI keeps one output per lane at any row count: no transposes, no lane sums, the
sub-block scales unpacked once), the same bits as the stored layout, read at memory speed at one
row; the stored bytes are then let go. The trade: a copy of the K-quant weights in anonymous memory
(2.8% / 1% larger than the Q4_K / Q6_K blocks) and ~0.5 s more load on the 1.5B file
(BENCHMARKS.md "K-quant layers packed at load").

The weight (`KQuantBlocks`) carries a way to build its canonical form (`plain`): where this kernel
cannot run (no native build, a GPU, the kernel switched off), kernels/select.py builds that
instead, so every other kernel sees an ordinary integer weight.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from loguru import logger

from text_generation_server.kernels import cpu_native
from text_generation_server.kernels.base import LinearSpec, QuantizedWeight, QuantKernel

QK_K = 256
# ggml type id -> (name, bits, bytes per 256-wide block, weight_format)
KQUANT_TYPES: dict[int, tuple[str, int, int, str]] = {
    12: ("Q4_K", 4, 144, "ggml-q4_k"),
    14: ("Q6_K", 6, 210, "ggml-q6_k"),
}
FORMATS = {fmt: type_id for type_id, (_, _, _, fmt) in KQUANT_TYPES.items()}
_ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Bytes ahead of its reads the kernel prefetches the weights (0: the hardware prefetcher alone). With
# the tiled kernel, every K-quant tensor of the Qwen2.5-Coder-1.5B Q4_K_M file once at one row (2
# threads, quiet 2-core EPYC, 2026-12-06, median of 7): 44.7 ms with none, 40.3 ms at 1 KiB, 41.9 ms
# at 4 KiB (36.3 ms for the previous kernel); at 8 rows no distance changed the time. On cache-resident
# single layers (2026-11-28) 1-16 KiB changed nothing.
PREFETCH_BYTES = 1024
# The same for the packed form (KQuantLinear on AVX-512 builds). One row, cold weights, one thread
# (2026-12-07, benchmarks/gguf_kquant_packed.py, busy 2-core EPYC, load ~5): 1 KiB ahead read Q4_K
# gate_up 1.3x and Q6_K down 1.2x faster than none, 4 KiB faster again (1.4x, 1.7x), while the Q6_K head
# (191 MB) ran best with none (7.3 ms; 8.2 at 1 KiB, 9.3 at 4 KiB). Over a whole decode step of the
# Qwen2.5-Coder-1.5B Q4_K_M file (in-process, 2 threads, 6 interleaved rounds) none / 1 KiB / 4 KiB /
# 4 KiB with none for the head gave 39.6 / 36.7 / 38.1 / 36.4 ms, within the machine's noise; two
# threads, the fastest calls of down and gate_up were again at 4 KiB (Q6_K down 0.132 ms against 0.154
# at 1 KiB, 0.313 with none). So 4 KiB, and none for a layer of more than PACKED_PREFETCH_MAX_BYTES.
# (Those single-layer runs called each variant on the same copy in turn, so all but the first found
# part of a layer under 32 MiB in L3; benchmarks/gguf_kquant_decode.py staggers the copies.) Now the rule
# for a layer that got 4 KiB pages only (TGS_CPU_KQUANT_HUGEPAGES=off, or the advice refused).
PACKED_PREFETCH_BYTES = 4096
PACKED_PREFETCH_MAX_BYTES = 64 << 20
# The packed layers live in an arena of 2 MiB-aligned chunks the kernel is asked to back with huge pages
# (madvise MADV_HUGEPAGE; this machine's transparent huge pages are "madvise", so torch's buffers got
# 4 KiB pages). A one-row call streams its weights once: with 4 KiB pages every 4 KiB is a TLB miss
# and a boundary the hardware prefetchers stop at. One row, cold weights, busy 2-core EPYC, load ~3
# (2026-12-07, the same packed bytes as 4 KiB / 2 MiB pages, GB/s): Q4_K gate_up 25.1 / 32.3 at 2
# threads, Q6_K head 31.6 / 34.1, Q4_K qkv 16.6 / 23.4, o_proj 20.3 / 27.0; a plain read of the same
# bytes 26.6 / 33.3 (gate_up). Layers are laid one after another (a step reads them nearly in order),
# so the small ones share pages instead of each rounding up to 2 MiB. The cost is at load: the 1.5B
# file's get_model took 5.0-5.8 s against 3.0 with 4 KiB pages (the kernel compacts memory for each huge
# page it faults in) and 95 MiB more resident (busy machine, BENCHMARKS.md "#34 one-row K-quant linears on
# huge pages"). TGS_CPU_KQUANT_HUGEPAGES=off: torch's allocator (the same bits; for A/B runs, or a start
# that matters more than the decode speed).
# On huge pages the software prefetch is worth less (no 4 KiB boundaries for the hardware prefetchers to
# stop at) and costs the Q6_K kernel, which is compute-bound at one thread, issue slots: one row, cold,
# 2 threads, load ~1.9 (2026-12-07, GB/s at 0 / 1 KiB / 4 KiB ahead, two rounds): Q6_K down 30.3-33.7 /
# 25.4-26.8 / 23.4-24.5, Q6_K head 54.4-55.2 / 43.2-44.1 / 36.4-36.9, Q4_K down 24.1-33.4 / 24.9-35.8 /
# 24.5-34.2, Q4_K o_proj 29.5-29.7 / 31.3-31.4 / 31.0-31.3, Q4_K gate_up 48.1-48.6 / 47.0-50.5 / 48.7-48.9.
# So per type on huge pages: Q4_K 1 KiB ahead, Q6_K none; PACKED_PREFETCH_BYTES where a layer got 4 KiB pages.
PACKED_PREFETCH_HUGE = {12: 1024, 14: 0}
HUGEPAGES_ENV = "TGS_CPU_KQUANT_HUGEPAGES"
HUGE_PAGE = 2 << 20
ARENA_CHUNK = 64 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


@dataclass
class KQuantBlocks:
    """A Q4_K or Q6_K weight as stored: blocks uint8 [N, K / 256 * block bytes], in one or more parts
    stacked along N (a fused layer's tensors, each still a view of the file: never concatenated;
    rows may be strided: a rank's column slice of whole super-blocks is a view), and how to build
    its canonical form."""

    parts: tuple[torch.Tensor, ...]
    type_id: int
    make_plain: Callable[[], QuantizedWeight] | None = field(default=None, repr=False)
    structure: ClassVar[str] = "K-quant blocks read in place"

    def __post_init__(self) -> None:
        if self.type_id not in KQUANT_TYPES:
            raise ValueError(f"ggml type {self.type_id} is not a K-quant this kernel reads (Q4_K=12, Q6_K=14)")
        _, _, size, _ = KQUANT_TYPES[self.type_id]
        self.parts = tuple(self.parts)
        if not self.parts:
            raise ValueError(f"a {self.ggml} weight needs at least one part")
        for part in self.parts:
            if part.dim() != 2 or part.dtype != torch.uint8 or part.shape[1] % size or \
                    part.shape[1] != self.parts[0].shape[1]:
                raise ValueError(f"{self.ggml} blocks must be uint8 [N, blocks * {size}] of one width, got "
                                 f"{[(p.dtype, list(p.shape)) for p in self.parts]}")

    @property
    def ggml(self) -> str:
        return KQUANT_TYPES[self.type_id][0]

    @property
    def in_features(self) -> int:
        return self.parts[0].shape[1] // KQUANT_TYPES[self.type_id][2] * QK_K

    @property
    def out_features(self) -> int:
        return sum(p.shape[0] for p in self.parts)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def plain(self) -> QuantizedWeight:
        """The canonical form (blocks decoded), built when asked: the other kernels' input."""
        if self.make_plain is None:
            raise ValueError(f"this {self.ggml} weight has no canonical form to fall back to")
        return self.make_plain()

    def spec(self, act_dtype: torch.dtype, device_type: str) -> LinearSpec:
        _, bits, _, fmt = KQUANT_TYPES[self.type_id]
        return LinearSpec(in_features=self.in_features, out_features=self.out_features, bits=bits, group_size=QK_K,
                          has_zeros=self.type_id == 12, act_order=False, act_dtype=act_dtype,
                          device_type=device_type, weight_format=fmt)

    def describe_layer(self, spec: LinearSpec, kernel: type[QuantKernel]) -> str:
        if kernel is CpuKQuantKernel:  # what the startup log and Info.kernels say the layer reads
            module = cpu_native.native()
            if module is not None and module.kquant_packed_isa():
                return f"{self.ggml} blocks packed at load (16 outputs interleaved)"
        return f"{self.ggml} blocks in place"


def quantize_q8k(module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] (float32, bfloat16 or float16) -> llama.cpp's Q8_K activations (codes, d per 256
    columns, sums per 16); a bfloat16 or float16 x is read as it is (its float32 values, exactly)."""
    if x.dtype not in _ACT_DTYPES:
        x = x.float()
    return tuple(module.kquant_quantize_q8k(x.contiguous()))  # type: ignore[return-value]


def kquant_mm(module, x: torch.Tensor, blocks: torch.Tensor, type_id: int, prefetch: int = -1) -> torch.Tensor:
    """x [M, K] @ W^T for the blocks of `type_id`, float32 [M, N] (activations quantized to Q8_K;
    weights prefetched `prefetch` bytes ahead, -1: PREFETCH_BYTES)."""
    q, d, s = quantize_q8k(module, x)
    return module.kquant_mm(q, d, s, blocks, type_id, PREFETCH_BYTES if prefetch < 0 else prefetch)


def kquant_dequant(module, blocks: torch.Tensor, type_id: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The blocks as values [N, K] (ggml's dequantize roundings; float32 or bfloat16)."""
    n = blocks.shape[0]
    out = torch.empty(n, blocks.shape[1] // KQUANT_TYPES[type_id][2] * QK_K, dtype=dtype)
    module.kquant_dequant(blocks, type_id, 0, n, out)
    return out


def _file_mappings() -> tuple[list[int], list[tuple[int, int]]]:
    """This process's read-only shared mappings of regular files, as sorted (start, end) address
    ranges (from /proc/self/maps): the only memory `release_file_pages` may drop."""
    starts: list[int] = []
    ranges: list[tuple[int, int]] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or not fields[1].startswith("r-") or fields[1][3] != "s":
                    continue  # not read-only, or private (copy-on-write pages may hold changes)
                if not fields[5].startswith("/") or not os.path.isfile(fields[5].strip()):
                    continue
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                starts.append(lo)
                ranges.append((lo, hi))
    except OSError:
        return [], []
    order = sorted(range(len(starts)), key=starts.__getitem__)
    return [starts[i] for i in order], [ranges[i] for i in order]


def release_file_pages(tensors: list[torch.Tensor]) -> int:
    """Drops this process's pages of `tensors` where they lie in a read-only shared mapping of a file
    (a GGUF file's blocks, once packed): madvise(MADV_DONTNEED), so the packed copy does not sit in
    resident memory beside the file's pages it came from. The file is untouched, and a later read of
    those bytes faults them back in from it, so nothing can read other values; anonymous or private
    memory is never dropped (there DONTNEED would zero it). Returns the bytes dropped."""
    if not tensors or not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    name = ctypes.util.find_library("c")
    if name is None:
        return 0
    libc = ctypes.CDLL(name, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    starts, ranges = _file_mappings()
    page = mmap.PAGESIZE
    dropped = 0
    for t in tensors:
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        i = bisect.bisect_right(starts, lo) - 1
        if i < 0 or not (ranges[i][0] <= lo and hi <= ranges[i][1]):
            continue
        a, b = -(-lo // page) * page, hi // page * page  # whole pages inside the tensor only
        if b > a and libc.madvise(a, b - a, mmap.MADV_DONTNEED) == 0:
            dropped += b - a
    return dropped


def hugepages_enabled() -> bool:
    """False when TGS_CPU_KQUANT_HUGEPAGES is 0/false/no/off."""
    return os.environ.get(HUGEPAGES_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _libc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc


class PackArena:
    """Buffers for packed layers, cut one after another (64-byte aligned) from chunks that start on a
    2 MiB boundary and are madvised MADV_HUGEPAGE before anything touches them, so the pages faulted in
    when a layer is packed are huge pages where the system grants them (4 KiB pages otherwise: the same
    bytes, only slower to stream; `huge` says whether the advice was taken). A chunk stays alive as long
    as a buffer cut from it (each buffer is a view of it); a chunk's unused tail is never touched, so it
    holds no memory. The arena cuts forward only: the chunk being filled stays alive with the pages of
    layers already freed in it (at most one chunk, ARENA_CHUNK, until the next chunk replaces it)."""

    def __init__(self, chunk: int = ARENA_CHUNK):
        self.chunk = chunk
        self._lock = threading.Lock()
        self._buffer: torch.Tensor | None = None
        self._used = 0
        self.huge = False

    def take(self, nbytes: int) -> torch.Tensor:
        """A contiguous uint8 tensor of nbytes, 64-byte aligned, inside a chunk advised huge pages."""
        if nbytes < 0:
            raise ValueError(f"a packed buffer of {nbytes} bytes")
        size = -(-nbytes // 64) * 64
        with self._lock:
            if self._buffer is None or self._used + size > self._buffer.numel():
                self._buffer, self._used = self._chunk(max(size, self.chunk)), 0
            out = self._buffer[self._used:self._used + nbytes]
            self._used += size
        return out

    def _chunk(self, size: int) -> torch.Tensor:
        size = -(-size // HUGE_PAGE) * HUGE_PAGE
        raw = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)
        start = -(-raw.data_ptr() // HUGE_PAGE) * HUGE_PAGE - raw.data_ptr()
        chunk = raw[start:start + size]
        libc = _libc()
        if libc is not None and libc.madvise(chunk.data_ptr(), size, _MADV_HUGEPAGE) == 0:
            self.huge = True
        else:
            logger.debug("cpu-kquant: madvise(MADV_HUGEPAGE) refused (errno {}): packed layers on 4 KiB pages",
                         ctypes.get_errno())
        return chunk


_ARENA = PackArena()


def in_arena(t: torch.Tensor) -> torch.Tensor:
    """`t` (uint8, contiguous) copied into the packed layers' huge-page arena; `t` itself when
    TGS_CPU_KQUANT_HUGEPAGES is off. For other layouts prepared at load that a one-row call streams."""
    if not hugepages_enabled():
        return t
    out = _ARENA.take(t.numel()).view(t.shape)
    out.copy_(t)
    return out


def pack(module, blocks: torch.Tensor, type_id: int, arena: PackArena | None = _ARENA) -> torch.Tensor:
    """The blocks in the packed form (kquant_pack), in a buffer of `arena` (None: torch's allocator)."""
    if arena is None:
        return module.kquant_pack(blocks, type_id)
    size = KQUANT_TYPES[type_id][2]
    if blocks.dim() != 2 or blocks.shape[1] % size or not blocks.shape[1]:
        raise ValueError(f"{KQUANT_TYPES[type_id][0]} blocks must be uint8 [N, blocks * {size}], "
                         f"got {list(blocks.shape)}")
    out = arena.take(module.kquant_packed_bytes(type_id, blocks.shape[0], blocks.shape[1] // size * QK_K))
    module.kquant_pack_into(blocks, type_id, out)
    return out


class KQuantLinear(torch.nn.Module):
    """Where the build has AVX-512BW, each part is converted at load to the packed form
    (cpu_native_kquant_src.py, pack_blocks: 16 outputs' blocks interleaved, scales unpacked; 2.8% more
    bytes than Q4_K's blocks, 1% more than Q6_K's) and the stored blocks are let go: at one row the
    kernel on the file's layout was compute-bound (BENCHMARKS.md "One-row quantized decode"), the
    packed one reads at memory speed, with the same bits. Elsewhere the blocks are read as stored.

    The parts of a fused layer may be of different types (`type_id` one per part: a Q4_K_M file's
    Q4_K q and k beside its Q6_K v); `join` makes one layer of several built ones. Either way the
    layer is one native call writing every part into one output: a layer split by type into two
    calls and a torch.cat cost the 1.5B file's qkv 18 GB/s against 28-36 for the other linears.
    """

    # x: [..., K] -> [..., N]
    def __init__(self, parts: tuple[torch.Tensor, ...], type_id: int | Sequence[int], bias: torch.Tensor | None,
                 act_dtype: torch.dtype, packed: bool | None = None):
        super().__init__()
        self.native = cpu_native.native()
        if self.native is None:
            raise ValueError(f"cpu-kquant: native kernels unavailable ({cpu_native.unavailable_reason()})")
        types = [int(type_id)] * len(parts) if isinstance(type_id, int) else [int(t) for t in type_id]
        if len(types) != len(parts) or not parts:
            raise ValueError(f"cpu-kquant: {len(parts)} parts need one K-quant type each, got {types}")
        for t in types:
            if t not in KQUANT_TYPES:
                raise ValueError(f"ggml type {t} is not a K-quant this kernel reads (Q4_K=12, Q6_K=14)")
        available = bool(self.native.kquant_packed_isa())
        if packed and not available:
            raise ValueError("cpu-kquant: the packed form needs native kernels built with AVX-512BW")
        self.packed = available if packed is None else packed
        self.count = len(parts)
        self.types = types
        # each part's N (the packed form's tensor is flat: N is not in its shape); empty: blocks as stored
        self._ns = [p.shape[0] for p in parts] if self.packed else []
        arena = _ARENA if hugepages_enabled() and self.packed else None
        for i, part in enumerate(parts):
            if self.packed:
                self.register_buffer(f"packed{i}", pack(self.native, part, types[i], arena))
            else:
                self.register_buffer(f"blocks{i}", part)
        if self.packed:
            # The file's pages of the packed blocks are read no more: out of resident memory.
            dropped = release_file_pages(list(parts))
            if dropped:
                logger.debug("cpu-kquant: {:.1f} MiB of the file's pages let go after packing", dropped / 2**20)
        self._huge = [arena is not None and arena.huge] * self.count  # each part on pages advised huge
        self.register_buffer("bias", bias)
        self.act_dtype = act_dtype
        self.out_features = sum(p.shape[0] for p in parts)
        self.in_features = parts[0].shape[1] // KQUANT_TYPES[types[0]][2] * QK_K
        for part, t in zip(parts, types):
            if part.shape[1] // KQUANT_TYPES[t][2] * QK_K != self.in_features or part.shape[1] % KQUANT_TYPES[t][2]:
                raise ValueError(f"cpu-kquant: parts of {[list(p.shape) for p in parts]} bytes, types {types}, "
                                 "are not blocks of one input width")
        self._refresh()

    @property
    def type_id(self) -> int:
        """The parts' K-quant type (a layer of mixed types has none: `types` holds each part's)."""
        if len(set(self.types)) != 1:
            raise ValueError(f"this cpu-kquant layer mixes types {self.types}")
        return self.types[0]

    @staticmethod
    def can_join(layers: Sequence[torch.nn.Module]) -> bool:
        """Whether `join` takes these: KQuantLinear layers of one form (packed or not), activation dtype
        and input width."""
        return bool(layers) and all(isinstance(m, KQuantLinear) for m in layers) and len(
            {(m.packed, m.act_dtype, m.in_features) for m in layers}) == 1  # type: ignore[union-attr]

    @classmethod
    def join(cls, layers: Sequence["KQuantLinear"]) -> "KQuantLinear":
        """One layer computing `layers` side by side (their outputs concatenated along N), sharing their
        packed or stored buffers (nothing copied or packed again): a fused layer whose parts were built
        apart (one per ggml type) as one native call. The bias is theirs concatenated (zeros for a part
        without one, where another has one: the same values). Raises where they cannot be one call."""
        if not layers:
            raise ValueError("cpu-kquant: nothing to join")
        if not cls.can_join(layers):
            raise ValueError("cpu-kquant: only KQuantLinear layers of one form, activation dtype and input width "
                             f"join, got {[type(m).__name__ for m in layers]} "
                             f"{[(getattr(m, 'packed', None), getattr(m, 'act_dtype', None)) for m in layers]}")
        first = layers[0]
        out = cls.__new__(cls)
        torch.nn.Module.__init__(out)
        out.native = first.native
        out.packed = first.packed
        out.types = [t for layer in layers for t in layer.types]
        out.count = len(out.types)
        out._ns = [n for layer in layers for n in layer._ns]
        out._huge = [h for layer in layers for h in layer._huge]
        for i, buffer in enumerate(b for layer in layers for b in layer._parts):
            out.register_buffer(f"{'packed' if out.packed else 'blocks'}{i}", buffer)
        biases: list[torch.Tensor | None] = [layer._bias() for layer in layers]
        if all(b is None for b in biases):
            out.register_buffer("bias", None)
        else:
            out.register_buffer("bias", torch.cat([
                b if b is not None else torch.zeros(layer.out_features, dtype=first.act_dtype)
                for b, layer in zip(biases, layers)]))
        out.act_dtype = first.act_dtype
        out.out_features = sum(layer.out_features for layer in layers)
        out.in_features = first.in_features
        out._refresh()
        return out

    def split(self, groups: Sequence[Sequence[int]]) -> list["KQuantLinear"]:
        """join's inverse: a layer per group of this layer's part indices (consecutive, in order, covering
        every part once), each sharing this layer's buffers and its slice of the bias. What a fused layer
        of mixed types ran as before join (benchmarks/gguf_kquant_step.py times both in one process)."""
        flat = [i for g in groups for i in g]
        if flat != list(range(self.count)) or any(not g for g in groups):
            raise ValueError(f"cpu-kquant: groups {groups} must split parts 0..{self.count - 1} in order")
        sizes = self._ns if self.packed else [p.shape[0] for p in self._parts]
        out, start = [], 0
        for group in groups:
            layer = type(self).__new__(type(self))
            torch.nn.Module.__init__(layer)
            layer.native, layer.packed = self.native, self.packed
            layer.types = [self.types[i] for i in group]
            layer.count = len(group)
            layer._ns = [self._ns[i] for i in group] if self.packed else []
            layer._huge = [self._huge[i] for i in group]
            for n, i in enumerate(group):
                layer.register_buffer(f"{'packed' if self.packed else 'blocks'}{n}", self._parts[i])
            n_out = sum(sizes[i] for i in group)
            bias = self._bias()
            layer.register_buffer("bias", None if bias is None else bias[start:start + n_out])
            layer.act_dtype, layer.out_features, layer.in_features = self.act_dtype, n_out, self.in_features
            layer._refresh()
            out.append(layer)
            start += n_out
        return out

    def _bias(self) -> torch.Tensor | None:
        bias = self.bias
        return bias if isinstance(bias, torch.Tensor) else None

    def _refresh(self) -> None:
        """The native call's arguments, kept ready (Python lists of the parts, types and prefetch
        distances, the bias or an empty tensor): building them per call cost several microseconds of a
        one-row layer's ~10."""
        self._parts = [getattr(self, f"{'packed' if self.packed else 'blocks'}{i}") for i in range(self.count)]
        self._prefetch = [self._part_prefetch(i) for i in range(self.count)]
        bias = self.bias if self.bias is not None else torch.empty(0, dtype=self.act_dtype)
        # x of this dtype goes to `_call` alone: the native call with everything else bound (forward's whole
        # work at one row; each attribute read and check in Python cost ~0.1 us of a small layer's few)
        self._call_dtype = self.act_dtype if self.act_dtype in (torch.bfloat16, torch.float32) else None
        self._call = functools.partial(self.native.kquant_linear, self._parts, self.types, bias, self._prefetch,
                                       self._ns)

    def _part_prefetch(self, i: int) -> int:
        """Part i's prefetch distance: by type on huge pages, by the layer's size on 4 KiB pages."""
        if self.packed and self._huge[i]:
            return PACKED_PREFETCH_HUGE[self.types[i]]
        if self.packed:
            size = sum(p.numel() for p in self._parts)
            return PACKED_PREFETCH_BYTES if size <= PACKED_PREFETCH_MAX_BYTES else 0
        return PREFETCH_BYTES

    def _apply(self, fn, recurse=True):  # .to(), .share_memory_() ... replace the buffers: refresh
        out = super()._apply(fn, recurse)
        self._refresh()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is self._call_dtype:
            # one native call: quantized once into the kernel's scratch, the parts side by side, the bias
            # added as torch adds it (the bits of the steps below, without their tensors and ops)
            return self._call(x)
        lead = x.shape[:-1]
        q, d, s = quantize_q8k(self.native, x.reshape(-1, self.in_features))  # once for every part
        # the parts' products side by side in one tensor of the model's dtype (rounded as torch rounds)
        y = torch.empty(q.shape[0], self.out_features, dtype=self.act_dtype if self.act_dtype != torch.float16
                        else torch.float32)
        col = 0
        for i, part in enumerate(self._parts):
            if self.packed:
                self.native.kquant_mm_packed_into(q, d, s, part, self._ns[i], self.types[i], self._prefetch[i], y, col)
                col += self._ns[i]
            else:
                self.native.kquant_mm_into(q, d, s, part, self.types[i], self._prefetch[i], y, col)
                col += part.shape[0]
        y = y.to(self.act_dtype)  # float16: rounded from float32 here (no copy otherwise)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)


class KQuantEmbedding(torch.nn.Module):
    """A Q4_K / Q6_K token embedding kept as stored, rows decoded when looked up.

    Why: decoding a whole GGUF embedding at load (Qwen2.5-Coder-1.5B's Q4_K 151936 x 1536) costs
    1.4-2.7 s of a start and 445 MiB of bfloat16 (890 MiB of float32 on the way), for a step that
    reads a few rows. The looked-up rows get the values the full decode gives, bit for bit: ggml's
    roundings in float32, then (bfloat16 models) rounded to nearest even as torch rounds, or (float16)
    converted by torch from float32, as the dense read's cast does (tests/test_gguf_kquant.py).
    """

    # ids: [tokens] -> [tokens, K]
    def __init__(self, blocks: torch.Tensor, type_id: int, dtype: torch.dtype):
        super().__init__()
        if type_id not in KQUANT_TYPES:
            raise ValueError(f"ggml type {type_id} is not a K-quant this module reads (Q4_K=12, Q6_K=14)")
        if dtype not in _ACT_DTYPES:
            raise ValueError(f"embedding dtype {dtype} not in bfloat16/float16/float32")
        _, _, size, _ = KQUANT_TYPES[type_id]
        if blocks.dim() != 2 or blocks.dtype != torch.uint8 or blocks.shape[1] % size or blocks.stride(1) != 1:
            raise ValueError(f"{KQUANT_TYPES[type_id][0]} blocks must be uint8 [rows, blocks * {size}] with contiguous "
                             f"rows, got {blocks.dtype} {list(blocks.shape)}")
        self.native = cpu_native.native()
        if self.native is None:
            raise ValueError(f"K-quant embedding: native kernels unavailable ({cpu_native.unavailable_reason()})")
        self.register_buffer("blocks", blocks)
        self.type_id = type_id
        self.dtype = dtype
        self.embedding_dim = blocks.shape[1] // size * QK_K

    @property
    def num_embeddings(self) -> int:
        return self.blocks.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token ids outside the embedding's {self.num_embeddings} rows")
        rows = self.blocks.index_select(0, flat)
        out_dtype = torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float32
        out = torch.empty(flat.numel(), self.embedding_dim, dtype=out_dtype)
        self.native.kquant_dequant(rows, self.type_id, 0, rows.shape[0], out)
        return out.to(self.dtype).reshape(*ids.shape, self.embedding_dim)


class CpuKQuantKernel(QuantKernel):
    """GGUF Q4_K / Q6_K blocks multiplied in place with Q8_K activations (llama.cpp's arithmetic)."""

    name = "cpu-kquant"

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        if spec.device_type != "cpu":
            return False, f"device {spec.device_type}"
        if spec.weight_format not in FORMATS:
            return False, f"reads GGUF Q4_K/Q6_K blocks, not {spec.weight_format} weights"
        if spec.act_dtype not in _ACT_DTYPES:
            return False, f"activation dtype {spec.act_dtype} not in bfloat16/float16/float32"
        if spec.in_features % QK_K:
            return False, f"in_features {spec.in_features} not a multiple of the {QK_K}-wide super-block"
        module = cpu_native.native()
        if module is None:
            return False, f"native kernels unavailable ({cpu_native.unavailable_reason()})"
        if not module.kquant_native_isa():
            return False, "native kernels built without AVX2 (their scalar loops lose to the decoded form's kernels)"
        return True, ""

    @classmethod
    def build(cls, weight: KQuantBlocks, bias: torch.Tensor | None, act_dtype: torch.dtype) -> torch.nn.Module:
        ok, reason = cls.can_implement(weight.spec(act_dtype, "cpu"))
        if not ok:
            raise ValueError(f"{cls.name} cannot run this weight: {reason}")
        return KQuantLinear(weight.parts, weight.type_id, None if bias is None else bias.to(act_dtype), act_dtype)
