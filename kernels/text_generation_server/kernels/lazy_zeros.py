"""Large zeroed CPU tensors whose pages the kernel zero-fills on first touch.

Why: `torch.zeros` on a CPU allocates and then writes every byte. For the KV cache that is the
whole share of memory warmup gives it (2 GB by default on the embedded model, more on real
ones): seconds of every start spent writing zeros, and the cache's full size resident from the
first second whether or not a request ever reaches its last blocks. An anonymous private
mapping (`mmap(-1, n)`) is zero by definition and costs nothing until a page is written, so the
start skips the fill and resident memory grows with the blocks requests actually use.

The tensor is exactly as `torch.zeros` makes it for every reader (zeros, contiguous, the given
dtype), so a cache that attention reads past its written slots (masked rows) sees zeros, never
garbage that could be NaN. The mapping lives as long as any view of the tensor does: torch keeps
the buffer object alive through `frombuffer`.

Small tensors and other devices keep `torch.zeros` (a mapping per tiny tensor would waste a page
each and gains nothing). TGS_LAZY_ZEROS=0 turns it off (every tensor through `torch.zeros`).
"""

from __future__ import annotations

import math
import mmap
import os

import torch

ENV = "TGS_LAZY_ZEROS"
# Below this many bytes a plain allocation is cheaper than a mapping (and glibc's calloc would
# use a mapping above its own threshold anyway).
MIN_BYTES = 1 << 20


def enabled() -> bool:
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def zeros(shape: tuple[int, ...] | list[int], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.zeros(shape, dtype=dtype, device=device)`, lazily zeroed where that saves work (large, CPU)."""
    device = torch.device(device)
    element = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * element
    if device.type != "cpu" or nbytes < MIN_BYTES or not enabled():
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # Transparent huge pages where the system allows them on request: fewer TLB misses when
    # attention walks a long cache (a no-op where THP is off or the call is unknown).
    if hasattr(buffer, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(*shape)
