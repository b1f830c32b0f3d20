"""Argument checks the paged attention launchers (kernels/paged_attention.py) share: each raises
ValueError naming the launcher and what is wrong, before anything reaches a kernel."""

from __future__ import annotations

import torch


def check_out(name: str, out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"{name}: out must be {q.dtype} {list(q.shape)} on {q.device} with unit stride along "
                         f"head_dim, got {out.dtype} {list(out.shape)} on {out.device} strides {out.stride()}")
    return out


def check_workspace(name: str, workspace, rows: int, dim: int, device: torch.device):
    if not isinstance(workspace, (tuple, list)) or len(workspace) != 3:
        raise ValueError(f"{name}: workspace must be the 3 tensors decode_workspace returns")
    needs = (rows, rows, rows * dim)
    views = []
    for i, (t, need) in enumerate(zip(workspace, needs)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device != device or t.numel() < need:
            raise ValueError(f"{name}: workspace[{i}] must be contiguous float32 on {device} with at least {need} "
                             f"elements, got {t.dtype} {list(t.shape)} on {t.device}")
        views.append(t.view(-1)[:need])
    return views


def check_lengths_cpu(name: str, seq_lens: torch.Tensor, capacity: int) -> None:
    """CPU tensors only (the interpreter): bounds the GPU path cannot check without a host sync."""
    if seq_lens.numel() and (int(seq_lens.min()) < 0 or int(seq_lens.max()) > capacity):
        raise ValueError(f"{name}: seq_lens must lie in 0..{capacity} (block_tables columns x block_size), "
                         f"got {seq_lens.tolist()}")
