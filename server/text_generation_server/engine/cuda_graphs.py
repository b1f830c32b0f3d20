"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step of a small batch is dominated by kernel launches; a CUDA graph replays the
whole forward with one launch. A graph fixes every address and shape it was captured with,
so the step's inputs go through static buffers sized for the largest bucket:

    inputs [4, B]  int64: input_ids, positions, slots, seq_lens (rows of one buffer)
    block_tables [B, max_blocks]  seq_lens [B]    int32 (what triton-paged reads)
    logits [B, vocab]                             the model's dtype, written by the graph
    tokens [B] int64, picked [B, 2] float64       the greedy choice, written by the graph

`max_blocks` covers max_total_tokens. A batch of n rows replays the smallest bucket b >= n.
The host knows every row's inputs (its last token, position, slot and length), writes them
into a pinned mirror of `inputs` and sends them with one copy (engine/readback.py
`UploadBuffer`); the graph converts seq_lens to int32 itself. The block tables are copied
(device to device) only when the batch's table is another tensor than the last step's: a
steady batch copies nothing else. Rows n..b are padding: seq_len 0 (attention reads nothing
and writes zeros), slot 0, which lies in block 0, reserved by the router and never read.
After the forward the graph also takes each row's greedy choice (`choose`, the sampler's
`greedy_choice`): a batch of greedy rows needs no launch between the replay and the readback
but the history update. Other batches are chosen eagerly from the returned logits[:n].

Everything a graph fixes on the host side is fixed per bucket at capture: the metadata's
`max_seq_len` is max_total_tokens (the rotary bound and the split heuristic read it), and the
attention backend's `capture_memo` supplies the rest (triton-paged: its split count and the
workspace for the split partials, reserved before capture so the graph allocates nothing).

Batches larger than the largest bucket, sequences longer than the graphs were captured for,
and a KV cache other than the one captured against run eagerly (`run` returns None and
counts the reason).

The capture mechanism is injectable (`GraphCapturer`): `CudaGraphCapturer` records real CUDA
graphs; `EagerReplayCapturer` replays by running the recorded callable again against the same
static buffers, checking that each replay issues the same operators on the same shapes as
the capture and never reads a device value on the host. CPU tests drive the whole graph path
through it.
"""

from __future__ import annotations

import sys
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch
from loguru import logger
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from text_generation_server.engine.readback import UploadBuffer
from text_generation_server.layers.attention import AttentionBackend, AttentionMetadata, KVCache

PAD_SLOT = 0  # slot 0 is in block 0, which nothing reads (the zeroed buffers hold it)


class CapturedGraph(Protocol):
    def replay(self) -> None:
        """Runs the captured work again, reading and writing the same buffers."""


class GraphCapturer(Protocol):
    """How a callable becomes a replayable graph (torch.cuda.CUDAGraph's capture + replay)."""

    def capture(self, forward: Callable[[], None]) -> CapturedGraph:
        """Records `forward` (which reads and writes only static buffers); every graph this
        capturer makes shares one memory pool, kept for the capturer's life."""

    def memory_reserved(self) -> int:
        """Bytes the device's allocator holds now (what a capture adds is its cost)."""


# -- CUDA ---------------------------------------------------------------------------------------

class CudaGraphCapturer:
    """torch.cuda.CUDAGraph, captured on a side stream into one `torch.cuda.MemPool`.

    The pool outlives the graphs: when warmup drops the graphs it captured against its
    temporary KV cache, their memory stays in the pool and the graphs captured against the
    real cache reuse it, so warmup measures the pool once and never holds it twice. Capture
    does not go through `torch.cuda.graph`, which empties the allocator's cache on entry and
    would hand back the activation memory warmup keeps for later forwards.

    The capturer also holds the last graph it captured (`_anchor`). torch counts a graph pool's
    users per capture, on the device allocator and (since 2.11) on the pinned host allocator,
    where a `MemPool` object holds no count: once every graph captured into a pool is gone, its
    id is dead, and the next `capture_begin` on it fails an internal assert
    (`it->second->use_count > 0`, CachingHostAllocator.h). Warmup drops its first graphs before
    capturing against the real cache, so without the anchor its second capture died on an H100
    (torch 2.11). The anchor costs one graph's executable; its memory is the shared pool's.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)
            self.pool = torch.cuda.MemPool()
        self._anchor: torch.cuda.CUDAGraph | None = None

    def capture(self, forward: Callable[[], None]) -> torch.cuda.CUDAGraph:
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            # One eager run on the capture stream first: Triton compiles and loads its kernels,
            # cuBLAS creates this stream's handle and workspace, outside the graph's pool.
            forward()
            self.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool.id)
            try:
                forward()
            except BaseException:
                try:
                    graph.capture_end()
                except Exception:  # the capture is already invalid; the forward's error says why
                    pass
                raise
            graph.capture_end()
        current.wait_stream(self.stream)
        self._anchor = graph  # keeps the pool's id alive for the next capture (class docstring)
        return graph

    def memory_reserved(self) -> int:
        return int(torch.cuda.memory_reserved(self.device))


# -- an emulation for any device ------------------------------------------------------------------

class HostSyncError(RuntimeError):
    """A captured forward read a device value on the host (a CUDA graph cannot do that)."""


class GraphReplayMismatch(RuntimeError):
    """A replay issued other operators or shapes than its capture: the real graph would not
    compute what the eager forward does."""


# Tensor methods that bring a device value to the host (or size an output from one).
_SYNCS = frozenset({"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "masked_select",
                    "unique", "numpy", "cpu"})
# Checks that run only on CPU tensors (the paged-attention launcher's bounds, Triton's
# interpreter): on CUDA those lines never run, so they are not a graph's concern.
_CPU_ONLY_MODULES = ("triton", "text_generation_server.kernels.paged_attention")


class _NoHostSync(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _SYNCS and not _called_from(_CPU_ONLY_MODULES):
            raise HostSyncError(f"Tensor.{name} inside a captured decode forward")
        return func(*args, **(kwargs or {}))


def _called_from(modules: tuple[str, ...], depth: int = 40) -> bool:
    frame = sys._getframe(2)
    while frame is not None and depth:
        if frame.f_globals.get("__name__", "").startswith(modules):
            return True
        frame, depth = frame.f_back, depth - 1
    return False


class _OpTrace(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        self.ops.append((str(func), shapes))
        return func(*args, **(kwargs or {}))


class _EagerGraph:
    def __init__(self, owner: "EagerReplayCapturer", forward: Callable[[], None]):
        self._owner = owner
        self._forward = forward
        self._ops = owner._run(forward)

    def replay(self) -> None:
        ops = self._owner._run(self._forward)
        self._owner.replays += 1
        if ops != self._ops:
            first = next((i for i, (a, b) in enumerate(zip(ops, self._ops)) if a != b), min(len(ops), len(self._ops)))
            got = ops[first] if first < len(ops) else "nothing"
            want = self._ops[first] if first < len(self._ops) else "nothing"
            raise GraphReplayMismatch(f"replay op {first} is {got}, the capture's was {want}")


class EagerReplayCapturer:
    """A capturer for any device: replay runs the recorded callable again, so it reads the same
    static buffers the way a graph would. It checks what a CUDA graph would silently get wrong:
    each replay must issue the capture's operators on the capture's shapes (a graph cannot
    follow a data-dependent branch), and no host sync may happen (HostSyncError)."""

    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0
        self.inside = False  # while the recorded callable runs (what a real graph runs on the device)

    def capture(self, forward: Callable[[], None]) -> _EagerGraph:
        self.captures += 1
        return _EagerGraph(self, forward)

    def memory_reserved(self) -> int:
        return 0

    def _run(self, forward: Callable[[], None]) -> list[tuple[str, tuple]]:
        trace = _OpTrace()
        self.inside = True
        try:
            with _NoHostSync(), trace:
                forward()
        finally:
            self.inside = False
        return trace.ops


class _DirectGraph:
    def __init__(self, forward: Callable[[], None]):
        self._forward = forward

    def replay(self) -> None:
        self._forward()


class DirectReplayCapturer(EagerReplayCapturer):
    """The benchmarks' emulated device (engine/standin.py, stream mode): a capture is checked as
    `EagerReplayCapturer` checks it (no host sync inside), and a replay runs the recorded callable
    with nothing around it, so timing a replay times the forward alone, not the checks."""

    def capture(self, forward: Callable[[], None]) -> _DirectGraph:
        self.captures += 1
        self._run(forward)
        return _DirectGraph(forward)


# -- the graphs ------------------------------------------------------------------------------------

@dataclass
class GraphStats:
    captures: int = 0  # capture rounds (each captures every bucket)
    replays: Counter = field(default_factory=Counter)  # bucket -> replays
    eager: Counter = field(default_factory=Counter)  # reason -> decode steps run eagerly
    capture_bytes: list[int] = field(default_factory=list)  # allocator growth of each round


class DecodeGraphs:
    """One captured decode forward per bucket, over shared static buffers (module doc)."""

    def __init__(self, buckets: Sequence[int], max_seq_len: int, block_size: int, device: torch.device,
                 capturer: GraphCapturer):
        buckets = sorted(set(buckets))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"CUDA graph batch sizes must be >= 1, got {list(buckets)}")
        if max_seq_len < 1 or block_size < 1:
            raise ValueError(f"max_seq_len and block_size must be >= 1, got {max_seq_len}, {block_size}")
        self.buckets = buckets
        self.max_seq_len = max_seq_len
        self.block_size = block_size
        self.max_blocks = -(-max_seq_len // block_size)
        self.device = torch.device(device)
        self.capturer = capturer
        rows = buckets[-1]
        self._upload = UploadBuffer((4, rows), torch.long, self.device)  # zeros: PAD_SLOT is 0
        self.inputs = self._upload.tensor
        self.input_ids, self.positions, self.slots, self._seq_lens64 = self.inputs.unbind(0)
        self.block_tables = torch.zeros(rows, self.max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.logits: torch.Tensor | None = None  # [rows, vocab], sized by the first capture
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.picked = torch.zeros(rows, 2, dtype=torch.float64, device=device)
        self.stats = GraphStats()
        self._graphs: dict[int, CapturedGraph] = {}
        self._memos: dict[int, dict] = {}  # keep what each graph fixed (workspaces) alive
        self._cache: weakref.ref | None = None
        self._tables: weakref.ref | None = None  # the batch block table the buffer holds now
        self._table_rows = 0
        self._live_rows = [0, 0]  # rows the last push from each upload mirror held
        self._choose: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
        self._logged: set[str] = set()

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def static_buffers(self) -> dict[str, torch.Tensor]:
        out = {"inputs": self.inputs, "input_ids": self.input_ids, "positions": self.positions, "slots": self.slots,
               "block_tables": self.block_tables, "seq_lens": self.seq_lens, "tokens": self.tokens,
               "picked": self.picked}
        if self.logits is not None:
            out["logits"] = self.logits
        return out

    def fits(self, max_seq_len: int) -> bool:
        return max_seq_len <= self.max_seq_len

    # -- capture ----------------------------------------------------------------------------------
    def capture(self, model: torch.nn.Module, kv_cache: KVCache, backend: AttentionBackend,
                choose: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None) -> int:
        """Captures every bucket (largest first, so the smaller ones reuse its pool memory)
        against `kv_cache`; returns the bytes the device's allocator grew by. `choose`: logits
        [n, vocab] -> (ids [n], (id, logprob) pairs [n, 2]) of a greedy row (the sampler's
        `greedy_choice` over the text vocabulary), run in the graph after the forward."""
        attention_free = getattr(model, "attention_free", False)  # the benchmarks' stand-in
        if not backend.graph_safe and not attention_free:
            raise ValueError(f"attention backend {backend.name} is not graph-safe: its decode syncs with the host "
                             "or sizes tensors from device values")
        memo_for = (lambda *_: {}) if attention_free else backend.capture_memo
        self.release()
        self._upload.zero()
        self._pad(0, self.buckets[-1])
        self._live_rows = [0, 0]  # per upload mirror
        self._tables, self._table_rows = None, 0
        self._choose = choose
        before = self.capturer.memory_reserved()
        memos = {b: memo_for(b, self.max_seq_len, self.device) for b in reversed(self.buckets)}
        if self.logits is None:
            # One eager forward at the largest bucket sizes the logits buffer, outside any graph.
            probe = self._call(model, kv_cache, backend, self.buckets[-1], memos[self.buckets[-1]])
            self.logits = torch.zeros(self.buckets[-1], probe.shape[-1], dtype=probe.dtype, device=self.device)
            del probe
        graphs: dict[int, CapturedGraph] = {}
        for bucket in reversed(self.buckets):
            graphs[bucket] = self.capturer.capture(self._forward(model, kv_cache, backend, bucket, memos[bucket]))
        self._graphs, self._memos = graphs, memos
        self._cache = weakref.ref(kv_cache)
        grown = max(self.capturer.memory_reserved() - before, 0)
        self.stats.captures += 1
        self.stats.capture_bytes.append(grown)
        return grown

    def _call(self, model, kv_cache, backend, rows: int, memo: dict) -> torch.Tensor:
        meta = AttentionMetadata(
            is_prefill=False, slots=self.slots[:rows], block_tables=self.block_tables[:rows],
            seq_lens=self.seq_lens[:rows], max_seq_len=self.max_seq_len, backend=backend, _memo=dict(memo),
        )
        return model(self.input_ids[:rows], self.positions[:rows], kv_cache, meta)

    def _forward(self, model, kv_cache, backend, rows: int, memo: dict) -> Callable[[], None]:
        choose = self._choose

        def forward() -> None:
            self.seq_lens[:rows].copy_(self._seq_lens64[:rows])
            logits = self._call(model, kv_cache, backend, rows, memo)
            self.logits[:rows].copy_(logits)
            if choose is not None:
                tokens, picked = choose(logits)
                self.tokens[:rows].copy_(tokens)
                self.picked[:rows].copy_(picked)

        return forward

    def release(self) -> None:
        """Drops the graphs and what they were captured against; buffers and the capturer's
        pool stay for the next capture."""
        self._graphs = {}
        self._memos = {}
        self._cache = None

    # -- replay -----------------------------------------------------------------------------------
    def run(self, kv_cache: KVCache, inputs: Sequence[Sequence[int]], block_tables: torch.Tensor,
            max_seq_len: int, device_ids: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(logits [n, vocab], greedy ids [n], greedy (id, logprob) pairs [n, 2]) of one decode
        step from its graph, or None when the step must run eagerly (the reason is counted in
        stats.eager and logged once). The greedy outputs are zeros without a `choose`.

        inputs: four host lists of n ints (input ids, positions, slots, sequence lengths after
        this step); block_tables [n, width] on the device, never written in place (a table that
        is the last step's object is not copied again); max_seq_len: the longest sequence after
        this step; device_ids: [n] input ids on the device (the last step's choice, read there:
        one device-to-device copy), in place of inputs[0]. The outputs are views of static buffers
        that the next replay overwrites.
        """
        rows = len(inputs[0])
        reason = self.refusal(kv_cache, rows, max_seq_len)
        if reason is not None:
            return self._eager(reason)
        bucket = next(b for b in self.buckets if b >= rows)
        host = self._upload.host()
        host[:, :rows] = inputs
        # Rows a larger batch left behind in this mirror (the upload's two mirrors take turns, so
        # it is the one before last's): padding (PAD_SLOT is 0).
        live = self._live_rows[self._upload.turn]
        if live > rows:
            host[:, rows:live] = 0
        self._live_rows[self._upload.turn] = rows
        self._upload.push()
        if device_ids is not None:
            self.input_ids[:rows].copy_(device_ids[:rows])
        if self._tables is None or self._tables() is not block_tables:
            # Columns past max_blocks cannot be needed (positions < max_seq_len); narrower tables
            # leave stale columns, zeroed so no row keeps another batch's blocks.
            width = min(block_tables.shape[1], self.max_blocks)
            self.block_tables[:rows, :width].copy_(block_tables[:, :width])
            if width < self.max_blocks:
                self.block_tables[:rows, width:].zero_()
            if self._table_rows > rows:
                self.block_tables[rows:self._table_rows].zero_()
            self._tables, self._table_rows = weakref.ref(block_tables), rows
        self._graphs[bucket].replay()
        self.stats.replays[bucket] += 1
        return self.logits[:rows], self.tokens[:rows], self.picked[:rows]

    def refusal(self, kv_cache: KVCache, rows: int, max_seq_len: int) -> str | None:
        """Why a decode step of `rows` rows up to `max_seq_len` tokens cannot replay a graph (None: it
        can); `run` counts and logs it, a caller that only asks (launch ahead) does not."""
        if not self._graphs:
            return "no graphs captured"
        if self._cache is None or self._cache() is not kv_cache:
            return "the KV cache was replaced after capture"
        if rows > self.buckets[-1]:
            return f"batch larger than the largest graph ({self.buckets[-1]})"
        if max_seq_len > self.max_seq_len:
            return (f"a sequence longer than the {self.max_seq_len} tokens the graphs were captured for "
                    "(max_total_tokens)")
        return None

    def _pad(self, start: int, stop: int) -> None:
        self.inputs[:, start:stop].zero_()  # PAD_SLOT is 0
        self.seq_lens[start:stop].zero_()
        self.block_tables[start:stop].zero_()

    def _eager(self, reason: str) -> None:
        self.stats.eager[reason] += 1
        if reason not in self._logged:
            self._logged.add(reason)
            logger.info("decode step runs eagerly, not from a CUDA graph: {}", reason)
        return None
