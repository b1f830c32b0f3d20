"""The low-rank term of many LoRA adapters over one batch: out += (x A_s^T) B_s^T per row, where
s is the adapter slot of the row (Punica / S-LoRA's segmented matmul).

Adapters live in fixed slots of preallocated banks, one pair per linear:
    a_bank: [slots, W, K]  each slot's A rows (the adapter's scaling folded in), zero past its width
    b_bank: [slots, W, N]  each slot's B transposed, zero past its width (rows of the product h @ B^T
                           read in order: on the CPU 1.5-2.5x torch's time with B [N, W] strided)
Two ways to route rows to slots, giving the same sums:
- runs: (slot, start, stop) ranges of rows that share a slot (rows of one request are contiguous
  in a flattened step, so a batch has at most one run per request). The torch path on the CPU:
  two small matmuls per run over only the slot's used width, no gather, no copy of the weights.
- per-row slots: an int32 tensor [rows], -1 for a row of the base model. The form a CUDA graph
  can capture (a fixed buffer the step writes into); on CUDA the Triton kernels of
  kernels/lora_triton.py read it, and `lora_rows_torch` here is their reference.
"""

from __future__ import annotations

from typing import Sequence

import torch

Run = tuple[int, int, int]  # (slot, first row, row past the last)


def runs_of(slots: Sequence[int], counts: Sequence[int]) -> list[Run]:
    """Runs of rows from per-request slots and row counts (requests in row order); requests of the
    base model (slot < 0) get none, neighbours with the same slot share one."""
    runs: list[Run] = []
    start = 0
    for slot, count in zip(slots, counts):
        stop = start + count
        if slot >= 0 and count > 0:
            if runs and runs[-1][0] == slot and runs[-1][2] == start:
                runs[-1] = (slot, runs[-1][1], stop)
            else:
                runs.append((slot, start, stop))
        start = stop
    return runs


def check_banks(name: str, x: torch.Tensor, out: torch.Tensor, a_bank: torch.Tensor, b_bank: torch.Tensor) -> None:
    if x.dim() != 2 or out.dim() != 2 or x.shape[0] != out.shape[0]:
        raise ValueError(f"{name}: x and out must be [rows, K] and [rows, N], got {list(x.shape)} and "
                         f"{list(out.shape)}")
    if a_bank.dim() != 3 or b_bank.dim() != 3 or a_bank.shape[:2] != b_bank.shape[:2]:
        raise ValueError(f"{name}: banks must be [slots, W, K] and [slots, W, N], got {list(a_bank.shape)} and "
                         f"{list(b_bank.shape)}")
    if a_bank.shape[2] != x.shape[1] or b_bank.shape[2] != out.shape[1]:
        raise ValueError(f"{name}: banks {list(a_bank.shape)} / {list(b_bank.shape)} do not fit x {list(x.shape)} "
                         f"and out {list(out.shape)}")


def lora_runs_torch(x: torch.Tensor, out: torch.Tensor, a_bank: torch.Tensor, b_bank: torch.Tensor,
                    runs: Sequence[Run], widths: Sequence[int]) -> torch.Tensor:
    """out[start:stop] += (x[start:stop] A_s[:w]^T) Bt_s[:w] for each run, in place; `widths`:
    each slot's used width (its ranks summed), so a rank-8 adapter in a rank-64 bank costs rank 8."""
    # x: [rows, K], out: [rows, N]
    for slot, start, stop in runs:
        w = widths[slot]
        if w == 0:
            continue
        h = torch.mm(x[start:stop], a_bank[slot, :w].t())  # [run, w]
        out[start:stop].addmm_(h.to(out.dtype), b_bank[slot, :w])
    return out


def lora_all_slots_torch(x: torch.Tensor, out: torch.Tensor, a_bank: torch.Tensor, b_bank: torch.Tensor,
                         row_slots: torch.Tensor) -> torch.Tensor:
    """Every row against every slot, one GEMM each way, the terms of slots a row does not use masked
    to zero. For a small batch whose rows use most slots (8 rows of 8 adapters): the banks are read
    once either way, and two GEMMs cost far less on the CPU than two small products per run."""
    # x: [rows, K], out: [rows, N], row_slots: [rows] int (-1: none)
    slots, width, k = a_bank.shape
    h = torch.mm(x, a_bank.view(slots * width, k).t())  # [rows, slots * W]
    owner = torch.arange(slots * width, device=x.device) // width
    h = h * (owner[None, :] == row_slots[:, None]).to(h.dtype)
    out.addmm_(h.to(out.dtype), b_bank.view(slots * width, -1))
    return out


def lora_rows_torch(x: torch.Tensor, out: torch.Tensor, a_bank: torch.Tensor, b_bank: torch.Tensor,
                    row_slots: torch.Tensor) -> torch.Tensor:
    """The per-row form: each row gathers its slot's A and B (-1: nothing added). Fixed shapes and
    no host reads, so a captured graph replays it for any mix of adapters."""
    # x: [rows, K], out: [rows, N], row_slots: [rows] int
    check_banks("lora_rows_torch", x, out, a_bank, b_bank)
    use = row_slots >= 0
    index = row_slots.clamp(min=0).long()
    h = torch.bmm(a_bank.index_select(0, index), x.to(a_bank.dtype).unsqueeze(2))  # [rows, W, 1]
    h = (h * use.to(h.dtype)[:, None, None]).transpose(1, 2)  # [rows, 1, W]
    out += torch.bmm(h, b_bank.index_select(0, index)).squeeze(1).to(out.dtype)
    return out
