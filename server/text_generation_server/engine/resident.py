"""A rank's resident memory: what it holds beyond weights and KV cache, and letting that go.

Measured on a 0.5B bfloat16 model on CPU (BENCHMARKS.md, "Startup and resident memory"), the
rank held, after warmup, two things that are neither weights nor cache:
- checkpoint pages no tensor uses. Weights load zero-copy from the safetensors file's private
  mapping, but fused layers (q/k/v, gate/up) are concatenated copies: the file pages of their
  sources stay resident in the mapping (read once while copying, never again), so those weights
  count twice. `release_checkpoint_pages` drops every page of a checkpoint mapping that no live
  tensor's bytes cover (madvise(MADV_DONTNEED); a page is dropped only while it is still the
  file's, never a privately written one, so nothing can be lost: it would be read back from the
  file if anything touched it);
- freed activations the C allocator keeps: glibc serves allocations under its (adaptive, up to
  32 MiB) mmap threshold from heaps it returns to the system only when asked; `trim_heap` asks
  (malloc_trim), once warmup's forwards are done.
"""

from __future__ import annotations

import ctypes
import gc
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from loguru import logger

MIB = 2**20
_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE
_PAGEMAP_PRESENT = 1 << 63
_PAGEMAP_FILE = 1 << 61  # the page is the file's (or shared); a privately written one is anonymous


@dataclass(frozen=True)
class ResidentMemory:
    """A process's resident set as /proc/self/status reports it (bytes; 0 where unknown)."""

    rss: int
    anon: int
    file: int
    peak: int

    def describe(self) -> str:
        return (f"{self.rss / MIB:.0f} MiB resident ({self.anon / MIB:.0f} MiB anonymous, {self.file / MIB:.0f} MiB "
                f"file-backed; peak {self.peak / MIB:.0f} MiB)")


def read_resident(status: Path = Path("/proc/self/status")) -> ResidentMemory:
    """This process's resident memory now (zeros where the system has no /proc)."""
    fields = {}
    try:
        for line in status.read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return ResidentMemory(fields.get("VmRSS", 0), fields.get("RssAnon", 0),
                          fields.get("RssFile", 0) + fields.get("RssShmem", 0), fields.get("VmHWM", 0))


def _span(tensor: torch.Tensor) -> tuple[int, int] | None:
    """The bytes [start, end) a CPU tensor's elements occupy."""
    if tensor.device.type != "cpu" or tensor.numel() == 0 or tensor.is_sparse or tensor.is_quantized:
        return None
    try:
        start = tensor.data_ptr()
    except RuntimeError:
        return None
    extent = 1 + sum((n - 1) * abs(s) for n, s in zip(tensor.shape, tensor.stride()))
    return start, start + extent * tensor.element_size()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers at their served dtype, each storage once (a tied
    embedding and head count once)."""
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        span = _span(tensor) if tensor.device.type == "cpu" else (tensor.data_ptr(), tensor.data_ptr() +
                                                                  tensor.numel() * tensor.element_size())
        if span is not None:
            seen[span[0]] = max(seen.get(span[0], 0), span[1] - span[0])
    return sum(seen.values())


CHECKPOINT_SUFFIXES = (".safetensors", ".gguf")


def _mappings(suffixes: tuple[str, ...], maps: Path = Path("/proc/self/maps")) -> list[tuple[int, int]]:
    """The address ranges where files named with one of `suffixes` are mapped into this process."""
    ranges: list[tuple[int, int]] = []
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return ranges
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].endswith(suffixes):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            ranges.append((start, end))
    return ranges


def _used_spans() -> list[tuple[int, int]]:
    """The bytes every live CPU tensor covers, merged."""
    tensors = (o for o in gc.get_objects() if issubclass(type(o), torch.Tensor))
    spans = sorted(s for s in map(_span, tensors) if s is not None)
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _gaps(start: int, end: int, used: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Whole pages of [start, end) that no span in `used` touches."""
    gaps, cursor = [], start
    for s, e in used:
        if e <= start or s >= end:
            continue
        if s > cursor:
            gaps.append((cursor, s))
        cursor = max(cursor, e)
    if cursor < end:
        gaps.append((cursor, end))
    out = []
    for s, e in gaps:
        s = -(-s // _PAGE) * _PAGE
        e = e // _PAGE * _PAGE
        if e > s:
            out.append((s, e))
    return out


def _file_page_runs(start: int, end: int, pagemap) -> list[tuple[int, int]]:
    """Runs of [start, end) whose pages are absent or still the file's (never privately written)."""
    first = start // _PAGE
    count = (end - start) // _PAGE
    pagemap.seek(first * 8)
    data = pagemap.read(count * 8)
    if len(data) != count * 8:
        return []
    runs, run_start = [], None
    for i, (entry,) in enumerate(struct.iter_unpack("<Q", data)):
        ok = not entry & _PAGEMAP_PRESENT or entry & _PAGEMAP_FILE
        if ok and run_start is None:
            run_start = i
        elif not ok and run_start is not None:
            runs.append((start + run_start * _PAGE, start + i * _PAGE))
            run_start = None
    if run_start is not None:
        runs.append((start + run_start * _PAGE, end))
    return runs


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def release_checkpoint_pages(suffixes: tuple[str, ...] = CHECKPOINT_SUFFIXES) -> int:
    """Drops the resident pages of mapped checkpoint files (named with `suffixes`) that no live
    tensor covers; returns the bytes of address range advised (0 where /proc or madvise is missing)."""
    libc = _libc()
    ranges = _mappings(suffixes)
    if libc is None or not ranges:
        return 0
    used = _used_spans()
    released = 0
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
            for start, end in ranges:
                for gap_start, gap_end in _gaps(start, end, used):
                    for s, e in _file_page_runs(gap_start, gap_end, pagemap):
                        if libc.madvise(ctypes.c_void_p(s), ctypes.c_size_t(e - s), _MADV_DONTNEED) == 0:
                            released += e - s
    except OSError as exc:
        logger.debug("checkpoint pages kept: {}", exc)
    return released


def trim_heap() -> bool:
    """Returns the C allocator's free heap memory to the system (glibc's malloc_trim)."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    gc.collect()
    return bool(trim(0))


def touched_bytes(tensors: list[torch.Tensor], pagemap: Path = Path("/proc/self/pagemap")) -> int | None:
    """How many bytes of these CPU tensors' pages this process has mapped in (the present bit of
    /proc/self/pagemap, each page once); None where that cannot be read.

    Why: the CPU KV cache is lazily zeroed (kernels/lazy_zeros.py) and weights are read from the
    checkpoint's mapping on first use, so neither's size says what the process holds. (mincore
    would answer for the page cache, not for this process.)
    """
    runs: list[list[int]] = []  # page ranges [first, last], merged: a page two tensors share counts once
    for first, last in sorted((s // _PAGE, (e - 1) // _PAGE) for s, e in filter(None, map(_span, tensors))):
        if runs and first <= runs[-1][1] + 1:
            runs[-1][1] = max(runs[-1][1], last)
        else:
            runs.append([first, last])
    present = 0
    try:
        with open(pagemap, "rb", buffering=0) as f:
            for first, last in runs:
                f.seek(first * 8)
                raw = f.read((last - first + 1) * 8)
                # The present bit is bit 63: as int64 entries, the negative ones.
                present += int((torch.frombuffer(bytearray(raw), dtype=torch.int64) < 0).sum()) if raw else 0
    except (OSError, ValueError):
        return None
    return present * _PAGE


_MADV_POPULATE_READ = 22  # Linux 5.14+: map the pages in (reading the file where needed), no copy


def prefault_weights(model: torch.nn.Module) -> int:
    """Maps every page of the model's CPU weights into the process now; returns the bytes covered.

    Why: weights are views of the checkpoint's mapping (zero-copy), and CPU warmup runs one layer
    of each kind, so most layers' pages would first be read by the first request: seconds of page
    faults (and disk reads, where the file is not in the page cache) that a client would see as a
    slow first answer. Asking here moves that cost into the start, where a server's readiness says
    it is paid. madvise(MADV_POPULATE_READ) where the kernel has it, else one read per page.
    """
    unique = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()] if t.device.type == "cpu"}
    runs: list[list[int]] = []
    for start, end in sorted(filter(None, map(_span, unique.values()))):
        start, end = start // _PAGE * _PAGE, -(-end // _PAGE) * _PAGE
        if runs and start <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([start, end])
    libc = _libc()
    covered = 0
    for start, end in runs:
        done = libc is not None and libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                                                 _MADV_POPULATE_READ) == 0
        covered += end - start
        if not done:
            break
    else:
        return covered
    # No MADV_POPULATE_READ (an older kernel, another OS): touch one element per page.
    for tensor in unique.values():
        if tensor.numel() and tensor.device.type == "cpu":
            flat = tensor.reshape(-1) if tensor.is_contiguous() else tensor.contiguous().reshape(-1)
            step = max(1, _PAGE // tensor.element_size())
            flat[::step].clone()
    return sum(e - s for s, e in runs)


# A transparent huge page (x86-64, arm64 with 4 KiB pages): the lazily zeroed KV cache asks for them
# (kernels/lazy_zeros.py), so its first write into each 2 MiB of a layer's cache zero-fills all of it.
HUGE_PAGE = 2 * MIB


def prefault_first_blocks(kv_tensors: list[torch.Tensor], first_block: int = 1,
                          nbytes: int = HUGE_PAGE) -> int:
    """Writes the KV cache's first blocks (zeros over zeros: nothing changes for a reader) so that
    their pages are resident; returns the bytes written.

    Why: the CPU KV cache is lazily zeroed memory in huge pages, and the router hands blocks out
    from `first_block` upwards (router/block_pool.py). The first request after warmup would
    otherwise be the one to fault in, and zero, the first huge page of every layer's keys and
    values (2 x layers x 2 MiB: 112 MiB on a 28-layer model) inside its prefill. Warmup pays it
    instead; later requests meet a fresh huge page only once every `nbytes` of a layer's cache,
    as any warm request does. Tensors are [num_blocks, ...], blocks first."""
    written = 0
    for tensor in kv_tensors:
        if tensor.device.type != "cpu" or tensor.dim() == 0 or tensor.shape[0] <= first_block:
            continue
        block_bytes = tensor[0].numel() * tensor.element_size()
        blocks = min(tensor.shape[0] - first_block, max(1, -(-nbytes // max(block_bytes, 1))))
        tensor[first_block:first_block + blocks].zero_()
        written += blocks * block_bytes
    return written


def settle(model: torch.nn.Module, kv_bytes: int, device: torch.device,
           kv_tensors: list[torch.Tensor] | None = None) -> ResidentMemory:
    """After warmup: maps the weights and the KV cache's first blocks in (what the first request
    would otherwise fault in), lets go of what is neither weights nor cache, and logs what stays."""
    if device.type == "cpu":
        prefault_weights(model)
        prefault_first_blocks(kv_tensors or [])
    before = read_resident()
    released = release_checkpoint_pages()
    trim_heap()
    after = read_resident()
    let_go = (f"{max(before.rss - after.rss, 0) / MIB:.0f} MiB let go (checkpoint pages no tensor uses: "
              f"{released / MIB:.0f} MiB of address range; freed heap)")
    if not after.rss:
        return after
    if device.type != "cpu":
        logger.info("host memory after warmup: {} (weights and KV cache are on {}); {}", after.describe(), device,
                    let_go)
        return after
    weights = weight_bytes(model)
    unique = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()] if t.device.type == "cpu"}
    weights_resident = touched_bytes(list(unique.values()))
    weights_held = weights if weights_resident is None else min(weights_resident, weights)
    weights_note = ("" if weights_resident is None or weights_resident >= weights else
                    f" ({weights_resident / MIB:.0f} MiB resident: mapped checkpoint pages are read on first use)")
    kv_resident = touched_bytes(kv_tensors) if kv_tensors else None
    kv_held = kv_bytes if kv_resident is None else kv_resident
    kv_note = "" if kv_resident is None else f", {kv_resident / MIB:.0f} MiB of it resident (pages fill as blocks are used)"
    logger.info("resident memory after warmup: {}; weights {:.0f} MiB{} + KV cache {:.0f} MiB{} + {:.0f} MiB other "
                "(the interpreter, libraries, buffers); {}", after.describe(), weights / MIB, weights_note,
                kv_bytes / MIB, kv_note, (after.rss - weights_held - kv_held) / MIB, let_go)
    return after
