"""Scratch space shared by every quantized linear of a process, sized once at warmup.

Why shared: kernels need temporary memory (split-K partial sums and their tile locks, a
dequantized weight for large batches, a permuted input). One buffer per layer would multiply
that by the layer count; one allocation per call would put allocator traffic on every decode
step and make the memory warmup measures a lie. Layers run one at a time on one CUDA stream,
so one buffer per purpose, as large as the most demanding layer needs, serves them all.

Protocol:
- A module registers itself at build (`register`); it answers `scratch_needs(max_tokens,
  max_input_tokens) -> {buffer name: bytes}` and names its device in `scratch_device`.
  Registration is weak: a module that is dropped stops counting.
- Warmup calls `prepare(max_tokens, max_input_tokens)` (through each module's
  `prepare_scratch`), which sizes every buffer to the largest need of the live modules,
  allocates it zeroed and freezes the space. It runs before warmup measures free memory.
- Forward calls `get(name, device, nbytes)`. A request larger than what warmup reserved still
  works (the buffer grows) but is counted in `allocations_after_freeze` and logged: it means
  warmup sized the space from limits the server then exceeded.

Buffers start zeroed and kernels that keep counters in them (split-K locks) return them to
zero before they finish, so no call needs a memset.

One instance per process (`SCRATCH`): a process serves one model, and `build_linear` has no
context to carry a per-model instance. Tests build their own `ScratchSpace`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol

import torch
from loguru import logger


class ScratchUser(Protocol):
    scratch_device: torch.device

    def scratch_needs(self, max_tokens: int, max_input_tokens: int) -> dict[str, int]:
        """Bytes per buffer name this module needs for forwards of up to `max_tokens` tokens."""


@dataclass(frozen=True)
class ScratchStats:
    reserved_bytes: int
    allocations: int  # buffer allocations since creation (or reset)
    allocations_after_freeze: int  # of those, how many came after warmup sized the space
    frozen: bool
    sized_for: tuple[int, int] | None  # (max_tokens, max_input_tokens) of the last prepare


class ScratchSpace:
    """Named, growable, zero-initialised byte buffers per device, sized from registered needs."""

    def __init__(self) -> None:
        self._users: weakref.WeakSet = weakref.WeakSet()
        self._buffers: dict[tuple[torch.device, str], torch.Tensor] = {}
        self._registrations = 0  # bumps on register, so prepare knows when to re-size
        self._prepared_at: tuple[int, int, int] | None = None
        self.frozen = False
        self.allocations = 0
        self.allocations_after_freeze = 0
        self.sized_for: tuple[int, int] | None = None

    # -- sizing --------------------------------------------------------------------------
    def register(self, user: ScratchUser) -> None:
        self._users.add(user)
        self._registrations += 1

    def needs(self, max_tokens: int, max_input_tokens: int) -> dict[tuple[torch.device, str], int]:
        """The largest need of any live user, per (device, buffer name)."""
        sizes: dict[tuple[torch.device, str], int] = {}
        for user in list(self._users):
            for name, nbytes in user.scratch_needs(max_tokens, max_input_tokens).items():
                key = (user.scratch_device, name)
                sizes[key] = max(sizes.get(key, 0), int(nbytes))
        return sizes

    def prepare(self, max_tokens: int, max_input_tokens: int) -> int:
        """Sizes every buffer for forwards of up to `max_tokens` tokens and freezes; returns bytes allocated.

        Idempotent: warmup calls it once per module, and only the first call (or one after new
        modules registered or the limits changed) does any work. Buffers sized for other
        limits are replaced, so a second warmup with lower limits gives memory back.
        """
        if max_tokens < 1 or max_input_tokens < 1:
            raise ValueError(f"scratch limits must be positive, got max_tokens={max_tokens}, "
                             f"max_input_tokens={max_input_tokens}")
        stamp = (max_tokens, max_input_tokens, self._registrations)
        if self.frozen and self._prepared_at == stamp:
            return 0
        sizes = self.needs(max_tokens, max_input_tokens)
        for key in [k for k in self._buffers if sizes.get(k, 0) != self._buffers[k].numel()]:
            del self._buffers[key]  # free before allocating, so peak memory is the new size only
        allocated = 0
        for key, nbytes in sizes.items():
            if nbytes > 0 and key not in self._buffers:
                self._allocate(key, nbytes)
                allocated += nbytes
        self.frozen = True
        self.sized_for = (max_tokens, max_input_tokens)
        self._prepared_at = stamp
        if allocated:
            logger.info("kernel scratch: {:.1f} MiB for forwards of up to {} tokens ({})",
                        self.reserved_bytes / 2**20, max_tokens,
                        ", ".join(f"{name} {n / 2**20:.1f} MiB" for (_, name), n in sorted(sizes.items(),
                                                                                         key=lambda kv: kv[0][1])))
        return allocated

    def _allocate(self, key: tuple[torch.device, str], nbytes: int) -> torch.Tensor:
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=key[0])
        self._buffers[key] = buf
        self.allocations += 1
        if self.frozen:
            self.allocations_after_freeze += 1
        return buf

    # -- use -----------------------------------------------------------------------------
    def get(self, name: str, device: torch.device, nbytes: int) -> torch.Tensor:
        """A zero-offset uint8 buffer of at least `nbytes` bytes (more when sized for a larger layer)."""
        key = (device, name)
        buf = self._buffers.get(key)
        if buf is not None and buf.numel() >= nbytes:
            return buf
        if self.frozen:
            logger.warning("kernel scratch '{}' on {} grows from {} to {} bytes after warmup: a forward exceeded "
                           "the limits warmup sized it for ({})", name, device,
                           0 if buf is None else buf.numel(), nbytes, self.sized_for)
        if buf is not None:
            del self._buffers[key]
            del buf
        return self._allocate(key, nbytes)

    @property
    def reserved_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())

    def stats(self) -> ScratchStats:
        return ScratchStats(self.reserved_bytes, self.allocations, self.allocations_after_freeze, self.frozen,
                            self.sized_for)

    def reset(self) -> None:
        """Forgets every buffer and user (tests; a process that loads a different model)."""
        self.__init__()


SCRATCH = ScratchSpace()


def typed_view(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The first prod(shape) elements of a uint8 scratch buffer as `dtype`, contiguous."""
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * dtype.itemsize
    if nbytes > buf.numel():
        raise ValueError(f"scratch buffer of {buf.numel()} bytes cannot hold {list(shape)} {dtype}")
    return buf[:nbytes].view(dtype).view(shape)
