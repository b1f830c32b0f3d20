"""Process-group handling for tensor parallelism.

Layers talk to a `ProcessGroup` object instead of torch.distributed directly, so the
same layer code runs at world size 1 without any distributed initialisation (the
CLI `generate` path and most unit tests) and at world size N under gloo or NCCL.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from loguru import logger


@dataclass
class ProcessGroup:
    """Rank and size of the tensor-parallel group, with the two collectives TP needs."""

    rank: int = 0
    size: int = 1
    group: object | None = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenates every rank's tensor along the last dimension (same shapes)."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)


def single_process_group() -> ProcessGroup:
    return ProcessGroup(rank=0, size=1, group=None)


def initialize_process_group(
    rank: int, world_size: int, device: torch.device, timeout_s: float = 120.0
) -> ProcessGroup:
    """Initialises torch.distributed from MASTER_ADDR/MASTER_PORT (env://).

    gloo on CPU, NCCL on CUDA. World size 1 never touches torch.distributed.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"invalid rank {rank} for world size {world_size}")
    if world_size == 1:
        return single_process_group()
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise ValueError(f"{var} must be set in the environment for world size {world_size}")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
    logger.debug("rank {} of {} joined the {} process group", rank, world_size, backend)
    return ProcessGroup(rank=rank, size=world_size, group=dist.group.WORLD)
