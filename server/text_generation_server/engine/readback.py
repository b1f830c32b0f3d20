"""The step's transfers between host and device: inputs up in one copy, results down in one.

A decode step's inputs are Python ints the host already holds (each row's last token, its
position, slot and length). They are written into a pinned host buffer and go up with one
non-blocking copy (`UploadBuffer`): no `torch.tensor(list, device=)`, which on CUDA is a
synchronous copy, and no gathers on the device to rebuild them.

Everything the Python side of a step needs back (chosen ids, their logprobs, the top-n
alternatives, prompt-token logprobs) is packed into one float64 tensor and comes down with one
copy into a pinned buffer, then one wait on an event recorded after it (`Readback.fetch`): the
one sync of a step, however many requests ask for how much. On a CPU the same copies run (the
"device" is host memory already), so CPU tests count the same operations a GPU step issues.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import torch


def _pinned(device: torch.device) -> bool:
    return device.type == "cuda"


class UploadBuffer:
    """A device buffer fed from a pinned host mirror with one copy.

    Write the values into `host()` (a numpy view of a pinned mirror), then `push()`: one
    non-blocking copy of the whole mirror, so a step's inputs cost one launch however many
    rows and columns they have. Two mirrors take turns: a step launched before the last one is
    read back (launch ahead) writes the other one, and `host()` waits only for the push before
    last to have left its mirror (it has, once the step it fed was read back; the wait only
    guards a step that failed before its readback). The values written are the whole row set:
    a mirror holds what was written into it two pushes ago, so write every value a step reads."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.device = torch.device(device)
        self.tensor = torch.zeros(shape, dtype=dtype, device=self.device)  # what the device reads
        mirrors = [torch.zeros(shape, dtype=dtype, pin_memory=_pinned(self.device)) for _ in range(2)]
        self._mirrors = mirrors
        self._views = [m.numpy() for m in mirrors]
        self._events = [torch.cuda.Event() if self.device.type == "cuda" else None for _ in range(2)]
        self._pending = [False, False]  # a push from that mirror may not have left it yet
        self._turn = 0  # the mirror `host()` gives
        self._rows: dict[int, tuple[torch.Tensor, ...]] = {}

    @property
    def turn(self) -> int:
        """Which mirror `host()` gives now (0 or 1)."""
        return self._turn

    def zero(self) -> None:
        """Both mirrors to zeros."""
        for _ in range(2):
            self.host()[:] = 0
            self._turn ^= 1

    def rows(self, count: int) -> tuple[torch.Tensor, ...]:
        """The device buffer's rows, each cut to its first `count` entries (views, made once)."""
        views = self._rows.get(count)
        if views is None:
            views = self._rows[count] = self.tensor[:, :count].unbind(0)
        return views

    def host(self) -> np.ndarray:
        turn = self._turn
        if self._pending[turn]:
            self._events[turn].synchronize()
            self._pending[turn] = False
        return self._views[turn]

    def push(self) -> torch.Tensor:
        """Copies the mirror to the device (one launch); returns the device buffer. The next
        `host()` is the other mirror."""
        turn = self._turn
        self.tensor.copy_(self._mirrors[turn], non_blocking=True)
        event = self._events[turn]
        if event is not None:
            event.record(torch.cuda.current_stream(self.device))
            self._pending[turn] = True
        self._turn = turn ^ 1
        return self.tensor


class DeviceClock:
    """How long the device worked on a step's forward: what a step costs the accelerator, apart
    from the host time around it (issue #31's inter-token minus device step).

    On CUDA two timing events are recorded around the forward's launches; they are read after
    the step's readback has waited on the device, so reading them never waits. On a CPU the
    device is the host, and the forward's wall time is its time; on an `EmulatedStream` (the
    benchmarks' stand-in device) it is the device time of the launches between start and stop."""

    def __init__(self, device: torch.device, stream: "EmulatedStream | None" = None):
        self._cuda = torch.device(device).type == "cuda" and stream is None
        self._stream = stream
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
        self._t0 = self._t1 = 0

    def start(self) -> None:
        self._t0 = self._stream.launches if self._stream is not None else time.perf_counter_ns()
        if self._cuda:
            self._start.record()

    def stop(self) -> None:
        """After the forward's last launch (on CUDA: not its end, which `elapsed_ns` reads later)."""
        self._t1 = self._stream.launches if self._stream is not None else time.perf_counter_ns()
        if self._cuda:
            self._end.record()

    def elapsed_ns(self) -> int:
        """The forward's device time; on CUDA call it once the step's readback has waited."""
        if self._stream is not None:
            return self._stream.device_ns(self._t0, self._t1)
        if self._cuda:
            return int(self._start.elapsed_time(self._end) * 1e6)
        return self._t1 - self._t0


class EmulatedStream:
    """A device queue in time only, for the benchmarks' stand-in forward (engine/standin.py) in its
    "stream" mode: a launch returns at once and occupies the emulated device for its duration after
    whatever was launched before it, and the step's one sync (`Readback.fetch`) sleeps until the
    queue is empty. So the host's work overlaps the device's as it does beside a GPU, and what the
    host adds to a step (issue #31's exposed host time) is measured on a machine without one.

    A sleep wakes late on a busy machine; the lateness is counted as the last launch's device time
    (the emulation's, not the host's), as the blocking stand-in counts it inside its own wait.
    `on_complete(prefill, device_ns)` is told each launch's device time when a sync completes it."""

    HISTORY = 64  # completed launches kept for DeviceClock (a step reads its last one or two)

    def __init__(self, on_complete=None):
        self.launches = 0  # launches so far; a launch's index is its count before it
        self.ready_ns = 0  # perf_counter_ns when the last launch ends
        self._pending: deque[list] = deque()  # [index, begin_ns, end_ns, prefill] not yet synchronized
        self._done: deque[tuple[int, int]] = deque(maxlen=self.HISTORY)  # (index, device ns)
        self._on_complete = on_complete

    def launch(self, duration_ns: int, prefill: bool = False) -> None:
        """Enqueues `duration_ns` of device work after what is queued (from now when it is idle)."""
        begin = max(time.perf_counter_ns(), self.ready_ns)
        self.ready_ns = begin + max(0, duration_ns)
        self._pending.append([self.launches, begin, self.ready_ns, prefill])
        self.launches += 1

    def record(self) -> int:
        """An event after what is queued now (CUDA's `Event.record`): `wait` on it waits for that
        work, not for what is launched after it."""
        return self.launches

    def synchronize(self) -> None:
        """Waits (sleeping, so other threads run) until every launch has ended."""
        self.wait(self.launches)

    def wait(self, event: int) -> None:
        """Waits until the launches before `event` (a `record`) have ended."""
        pending = self._pending
        if not pending or pending[0][0] >= event:
            return
        last = pending[0]
        for item in pending:
            if item[0] >= event:
                break
            last = item
        remaining = last[2] - time.perf_counter_ns()
        if remaining > 0:
            time.sleep(remaining / 1e9)
            late = time.perf_counter_ns() - last[2]
            if late > 0:
                # The emulated device ran late (the sleep woke late): that launch ended now, and
                # every launch queued behind it starts that much later.
                for item in pending:
                    if item[0] > last[0]:
                        item[1] += late
                    if item[0] >= last[0]:
                        item[2] += late
                self.ready_ns += late
        while pending and pending[0][0] < event:
            index, begin, end, prefill = pending.popleft()
            self._done.append((index, end - begin))
            if self._on_complete is not None:
                self._on_complete(prefill, end - begin)

    def device_ns(self, first: int, stop: int) -> int:
        """The device time of launches first..stop-1 that a sync completed (0 for any it has not)."""
        total = 0
        for index, ns in reversed(self._done):  # the newest first: a step asks for its last launch or two
            if index < first:
                break
            if index < stop:
                total += ns
        return total


class Readback:
    """One device-to-host transfer per step, into a pinned buffer kept between steps."""

    def __init__(self, device: torch.device, stream: EmulatedStream | None = None):
        self.device = torch.device(device)
        self._host: torch.Tensor | None = None
        self._event = torch.cuda.Event() if self.device.type == "cuda" and stream is None else None
        self._stream = stream
        self._mark = 0  # the emulated stream's event of the copy in flight

    def fetch(self, packed: torch.Tensor) -> list[float]:
        """The values of `packed` (float64, contiguous) on the host: one copy and one wait."""
        return self.wait(self.start(packed))

    def start(self, packed: torch.Tensor) -> torch.Tensor:
        """Enqueues the copy of `packed` (float64, contiguous) into the pinned buffer; returns the
        host view that `wait` reads. Work enqueued after it (the next step's launch) may overwrite
        `packed` on the device: the copy reads it first, in stream order."""
        flat = packed.reshape(-1)
        count = flat.numel()
        if self._host is None or self._host.numel() < count:
            size = max(count, 2 * (self._host.numel() if self._host is not None else 0), 256)
            self._host = torch.empty(size, dtype=torch.float64, pin_memory=_pinned(self.device))
        host = self._host[:count]
        host.copy_(flat, non_blocking=True)
        if self._event is not None:
            self._event.record(torch.cuda.current_stream(self.device))
        if self._stream is not None:
            self._mark = self._stream.record()
        return host

    def wait(self, host: torch.Tensor) -> list[float]:
        """The step's one sync: waits for the copy `start` enqueued; its values."""
        if self._stream is not None:
            self._stream.wait(self._mark)
        if self._event is not None:
            self._event.synchronize()
        return host.tolist()


def to_host(readback: Readback, next_ids: torch.Tensor, logprobs: torch.Tensor, top_n: list[int],
            prompt_values: list[torch.Tensor]
            ) -> tuple[list[int], list[float], list[tuple[list[int], list[float]]] | None, list[list[float]]]:
    """(chosen ids, their logprobs, per row its top_n[row] (ids, logprobs) or None when nobody
    asked, the prompt logprobs of each of `prompt_values`), in one transfer.

    next_ids: [rows]; logprobs: [rows, vocab]; prompt_values: [count] each."""
    chosen_lp = logprobs.gather(1, next_ids[:, None]).squeeze(1)
    parts = [next_ids.to(torch.float64), chosen_lp.to(torch.float64)]
    width = min(max(top_n, default=0), logprobs.shape[1])
    if width:
        values, ids = logprobs.topk(width, dim=-1)
        parts += [ids.flatten().to(torch.float64), values.flatten().to(torch.float64)]
    parts += [v.to(torch.float64) for v in prompt_values]
    flat = readback.fetch(torch.cat(parts))
    n = len(next_ids)
    next_list = [int(x) for x in flat[:n]]
    chosen = flat[n:2 * n]
    offset = 2 * n
    tops = None
    if width:
        ids_flat = flat[offset:offset + n * width]
        vals_flat = flat[offset + n * width:offset + 2 * n * width]
        offset += 2 * n * width
        tops = [([int(t) for t in ids_flat[r * width:r * width + k]], vals_flat[r * width:r * width + k])
                for r, k in enumerate(top_n)]
    prompt_lps = []
    for v in prompt_values:
        count = v.shape[0]
        prompt_lps.append(flat[offset:offset + count])
        offset += count
    return next_list, chosen, tops, prompt_lps


def unpack_choices(values: list[float]) -> tuple[list[int], list[float]]:
    """(ids, logprobs) from a fetched [rows, 2] block of (id, logprob) pairs (`greedy_choice`)."""
    return [int(v) for v in values[0::2]], values[1::2]
