"""LoRA adapters in the linear layers: fixed slots, and which rows of a forward use which slot.

Each linear an adapter may change gets a `LoraLinear` hook (tensor_parallel.py calls it on its
output before a row layer's all-reduce): two banks preallocated once, `max_loras` slots of width
max_lora_rank per checkpoint tensor the linear fuses (a fused q/k/v linear holds an adapter's q, k
and v terms side by side, with B block-structured, so one matmul pair serves all three). Loading
an adapter writes its tensors into a free slot; nothing is allocated after startup, and a CUDA
graph sees the same pointers whatever is loaded.

`LoraRouting` is what one forward shares: per request, its slot (-1: the base model). The CPU path
runs two small matmuls per run of rows of one adapter over only the adapter's own width; CUDA (and
any captured graph) reads a per-row slot index from a fixed buffer (kernels/lora_triton.py).

Tensor parallel: a column layer's B holds this rank's output rows (A whole); a row layer's A holds
this rank's input columns (B whole), and its low-rank partial is added to the base layer's partial
output before the layer's one all-reduce: sum over ranks of (x_r A_r^T) B^T is (x A^T) B^T.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from text_generation_server.kernels.lora import Run, lora_all_slots_torch, lora_rows_torch, lora_runs_torch, runs_of
from text_generation_server.kernels.lora_triton import lora_rows_triton


@dataclass(frozen=True)
class LoraLayout:
    """What an adapter must match to change one linear on this rank (recorded when it loads)."""

    path: str  # the module's path in the model (messages)
    row_parallel: bool
    # Column layers: this rank's output rows, in order, as (checkpoint tensor, first row, row past
    # the last) of each tensor's full rows; a row layer: its one tensor, all rows.
    outputs: tuple[tuple[str, int, int], ...]
    out_features: dict[str, int]  # each tensor's full output rows
    in_features: int  # full input features
    in_range: tuple[int, int]  # this rank's input columns (row layers); (0, in_features) otherwise

    @property
    def tensors(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t for t, _, _ in self.outputs))

    @property
    def local_out(self) -> int:
        return sum(stop - start for _, start, stop in self.outputs)

    @property
    def local_in(self) -> int:
        return self.in_range[1] - self.in_range[0]


class LoraRouting:
    """Which slot each row of the current forward uses (set by the engine before each forward).

    `decode_slots` is a fixed device buffer (a captured decode graph reads it); forwards with more
    rows, or on the CPU without graphs, use runs."""

    # CPU: a forward of at most this many rows whose rows use at least half the slots runs every
    # slot in one GEMM each way (lora_all_slots_torch) instead of two small products per run.
    ALL_SLOTS_MAX_ROWS = 64

    def __init__(self, device: torch.device, decode_capacity: int, slots: int = 1):
        self.device = device
        self.slots = slots
        self.all_slots: torch.Tensor | None = None  # per-row slots when the all-slots path runs
        self.use_rows = False
        self.runs: list[Run] = []
        self.decode_slots = torch.full((max(1, decode_capacity),), -1, dtype=torch.int32, device=device)
        self.rows_slots: torch.Tensor | None = None  # the per-row index of the current forward (rows mode)
        self.active = False  # some row of the current forward uses an adapter, or a graph is being captured

    def route(self, slots: Sequence[int], counts: Sequence[int], graph: bool = False) -> None:
        """Requests' slots and rows in row order. `graph`: the forward may be a captured graph's
        replay, which reads the fixed per-row buffer."""
        self.runs = runs_of(slots, counts)
        rows = sum(counts)
        self.use_rows = self.device.type == "cuda" or graph
        self.active = bool(self.runs) or graph
        self.all_slots = None
        if not self.use_rows and self.active and rows <= self.ALL_SLOTS_MAX_ROWS and \
                2 * len({s for s in slots if s >= 0}) >= max(self.slots, 3):
            self.all_slots = torch.tensor([s for s, n in zip(slots, counts) for _ in range(n)], dtype=torch.long)
        if not self.use_rows or not self.active:
            return
        per_row = [s for s, n in zip(slots, counts) for _ in range(n)]
        if rows <= self.decode_slots.shape[0]:
            per_row += [-1] * (self.decode_slots.shape[0] - rows)  # rows a graph pads with
            host = torch.tensor(per_row, dtype=torch.int32)
            self.decode_slots.copy_(host, non_blocking=self.device.type == "cuda")
            self.rows_slots = self.decode_slots
        else:
            self.rows_slots = torch.tensor(per_row, dtype=torch.int32).to(self.device)

    def capture(self) -> None:
        """A graph is about to be captured: every hooked linear runs its per-row path (no adapter)."""
        self.decode_slots.fill_(-1)
        self.rows_slots = self.decode_slots
        self.use_rows = self.active = True
        self.runs = []
        self.all_slots = None


class LoraLinear:
    """One linear's adapter slots (not a Module: no state_dict entry, never quantized or saved)."""

    def __init__(self, layout: LoraLayout, routing: LoraRouting, slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.layout = layout
        self.routing = routing
        self.max_rank = max_rank
        width = max_rank * len(layout.tensors)
        # a: [slots, W, K_local] (scaling folded in), b: [slots, W, N_local] (B transposed)
        self.a = torch.zeros(slots, width, layout.local_in, dtype=dtype, device=device)
        self.b = torch.zeros(slots, width, layout.local_out, dtype=dtype, device=device)
        self.widths = [0] * slots

    @property
    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()

    def write(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Puts an adapter's (already sliced for this rank) A [w, K_local] and B [N_local, w] in a slot."""
        w = a.shape[0]
        if a.shape != (w, self.a.shape[2]) or b.shape != (self.b.shape[2], w) or w > self.a.shape[1]:
            raise ValueError(f"{self.layout.path}: adapter parts {list(a.shape)} / {list(b.shape)} do not fit the slot "
                             f"{list(self.a.shape[1:])} / {list(self.b.shape[1:])} (B transposed)")
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.a[slot, :w].copy_(a)
        self.b[slot, :w].copy_(b.t())
        self.widths[slot] = w

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.widths[slot] = 0

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out += each row's adapter term (in place; returns out). x: [..., K_local], out: [..., N_local]."""
        routing = self.routing
        if not routing.active:
            return out
        x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        if routing.use_rows and routing.rows_slots is not None:
            slots = routing.rows_slots[: x2.shape[0]]
            if x2.is_cuda:
                lora_rows_triton(x2, out2, self.a, self.b, slots)
            else:
                lora_rows_torch(x2, out2, self.a, self.b, slots)
        elif routing.all_slots is not None:
            lora_all_slots_torch(x2, out2, self.a, self.b, routing.all_slots)
        else:
            lora_runs_torch(x2, out2, self.a, self.b, routing.runs, self.widths)
        return out
