"""How much memory is left for the KV cache, on CPU and CUDA, and how many blocks that buys.

Warmup reads memory once, after it has run the largest prefill and a decode at the largest
batch (CUDA graphs captured), and never empties the CUDA caching allocator first: the memory
those forwards took stays reserved by the allocator, where later forwards of the same sizes
find it again. On CUDA the KV budget is therefore the driver's free memory (which excludes
everything the allocator holds), not the allocator's view.

`plan_kv_cache` is the arithmetic as a pure function of the readings, so it is tested on
mocked figures; `read_memory` takes the readings.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass
from typing import Callable

import torch

MIB = 2**20
# Kept free on CUDA beyond everything warmup measured: allocator fragmentation, NCCL and
# cuBLAS handles created later, and the drift of activation sizes between the warmup batch
# and real ones. max(256 MiB, 2% of the device).
CUDA_MARGIN_MIN_BYTES = 256 * MIB
CUDA_MARGIN_SHARE = 0.02


@dataclass(frozen=True)
class MemoryReading:
    """One reading of a device's memory.

    free_bytes: what the device can still hand out (CUDA: the driver's free memory, which
    excludes what this process's caching allocator holds; CPU: MemAvailable).
    reserved_bytes: held by the caching allocator (CUDA), allocated or cached; 0 on CPU.
    cap_fraction: the per-process cap (`torch.cuda.set_per_process_memory_fraction`,
    --cuda-memory-fraction) as a share of total_bytes; 1.0 = none.
    """

    device_type: str
    free_bytes: int
    total_bytes: int
    reserved_bytes: int = 0
    cap_fraction: float = 1.0

    @property
    def available_bytes(self) -> int:
        """What new allocations may take: driver-free memory, within the per-process cap
        (the allocator refuses once reserved + new would pass cap x total)."""
        free = self.free_bytes
        if self.cap_fraction < 1.0:
            free = min(free, int(self.cap_fraction * self.total_bytes) - self.reserved_bytes)
        return max(free, 0)

    @property
    def margin_bytes(self) -> int:
        """Memory the KV cache leaves untouched: max(256 MiB, 2% of the device) on CUDA; none
        on CPU, where memory_fraction (0.1 by default) already leaves the rest to the system."""
        if self.device_type != "cuda":
            return 0
        return max(CUDA_MARGIN_MIN_BYTES, int(CUDA_MARGIN_SHARE * self.total_bytes))


def read_memory(device: torch.device) -> MemoryReading:
    """The device's memory now. Never empties the CUDA caching allocator (see the module doc)."""
    gc.collect()  # dead Python cycles may still hold tensors
    if device.type == "cuda":
        if device.index is None:  # torch.cuda.get_per_process_memory_fraction refuses a bare "cuda"
            device = torch.device("cuda", torch.cuda.current_device())
        free, total = torch.cuda.mem_get_info(device)
        return MemoryReading(
            "cuda", int(free), int(total), int(torch.cuda.memory_reserved(device)),
            float(torch.cuda.get_per_process_memory_fraction(device)),
        )
    return MemoryReading(device.type, _cpu_available(), _cpu_total())


def available_bytes(device: torch.device) -> int:
    """Free memory new allocations may draw from right now (no allocator cache emptied)."""
    return read_memory(device).available_bytes


def _cpu_available() -> int:
    value = _meminfo("MemAvailable:")
    if value is not None:
        return value
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cpu_total() -> int:
    value = _meminfo("MemTotal:")
    if value is not None:
        return value
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _meminfo(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class KVCachePlan:
    """The KV cache warmup allocates, and the figures it came from (all bytes)."""

    num_blocks: int  # block 0 included (reserved, never handed out)
    available_bytes: int
    margin_bytes: int
    transient_bytes: int  # the attention backend's decode transient at this cache size
    budget_bytes: int  # (available - margin - transient) x memory_fraction
    capped_by_max_batch_total_tokens: bool
    activation_bytes: int = 0  # the largest forwards' estimated peak, where warmup did not run them (CPU)

    def usable_tokens(self, block_size: int) -> int:
        return max(self.num_blocks - 1, 0) * block_size


def plan_kv_cache(
    reading: MemoryReading,
    *,
    bytes_per_block: int,
    block_size: int,
    memory_fraction: float,
    transient_bytes: Callable[[int], int] = lambda kv_bytes: 0,
    max_batch_total_tokens: int | None = None,
    activation_bytes: int = 0,
) -> KVCachePlan:
    """The largest block count n with n x bytes_per_block <= memory_fraction x (available -
    margin - activations - transient(n x bytes_per_block)), at most max_batch_total_tokens' worth
    plus the reserved block 0.

    `activation_bytes` is the estimated peak of the largest prefill and decode where warmup
    scaled small forwards instead of running those (a CPU: engine/warmup_probe.py); where it ran
    them, their memory is already out of the reading.

    `reading` is taken after warmup's forwards, so what they needed (activation peak, kernel
    scratch, the CUDA graph pool) is already out of its available bytes. `transient_bytes`
    is what a decode step over a full cache allocates beyond that (the torch backend gathers
    a layer's K/V); it grows with the cache, so the count is searched, not divided out.
    """
    if bytes_per_block < 1 or block_size < 1:
        raise ValueError(f"bytes_per_block and block_size must be >= 1, got {bytes_per_block}, {block_size}")
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {memory_fraction}")
    if activation_bytes < 0:
        raise ValueError(f"activation_bytes must be >= 0, got {activation_bytes}")
    available = reading.available_bytes - activation_bytes
    margin = reading.margin_bytes

    def fits(n: int) -> bool:
        kv = n * bytes_per_block
        return kv <= memory_fraction * (available - margin - transient_bytes(kv))

    hi = max(int(memory_fraction * (available - margin)) // bytes_per_block, 0)
    lo = 0
    while lo < hi:  # largest n in [0, hi] that fits; fits() is monotone
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    blocks = lo
    capped = False
    if max_batch_total_tokens is not None:
        cap = -(-max_batch_total_tokens // block_size) + 1
        if blocks > cap:
            blocks, capped = cap, True
    transient = transient_bytes(blocks * bytes_per_block)
    budget = max(int(memory_fraction * (available - margin - transient)), 0)
    return KVCachePlan(blocks, reading.available_bytes, margin, transient, budget, capped, activation_bytes)


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text.lower()
    )
