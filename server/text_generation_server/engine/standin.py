"""A benchmark-only stand-in for the model's forward: canned logits after a wait of X µs.

`benchmarks/host_overhead.py` measures the host side of a decode step (batching, KV
bookkeeping, sampling, stopping, detokenization, the shard service, the router, gRPC) on a
machine without an accelerator. It needs a forward whose cost it sets: `StandinForward` wraps
the loaded model and answers each forward with logits it makes up, after a wait that releases
the GIL (time.sleep), so the host path around it runs as it would beside a device busy for X
µs. Everything but the decoder's arithmetic stays real: the engine still builds batches, assigns
KV blocks and slots, samples from the logits (log_softmax and all), checks stopping, streams text.
What it skips: embedding, layers, attention and the K/V writes into the paged cache (nothing reads
them back: the logits do not depend on them), and the head's matmul.

The logits: float32 (what the real head returns), of the model's full vocabulary, on its device.
The row of an input token at position p peaks at `cycle[p % len(cycle)]`, a fixed list of
ordinary tokens (no special token, no EOS), so greedy decoding walks the cycle forever and a
request's tokens are known in advance: a test can tell the stand-in's output from the model's.

The switch, and why it cannot be thrown by accident. A server with canned logits answers
plausibly-shaped nonsense, so turning it on takes two environment variables of the rank process
(inherited from `serve`; no flag, no ServeArgs field, no config file reaches them):

- `TGS_BENCHMARK_STANDIN_FORWARD_US=<X>`: the nominal wait in µs (an integer, 0 to 10^7);
- `TGS_BENCHMARK_STANDIN_ACK=canned-logits-not-the-model`: that exact text. Without it, or with
  anything else, a rank with the first variable refuses to start (ValueError: `serve` exits
  with the message), so a stray or half-copied environment fails loudly instead of serving.

When on, every rank logs a warning block at load. How the wait relates to the host,
`TGS_BENCHMARK_STANDIN_DEVICE` (rank environment, like the switch):

- `blocking` (the default): the forward itself sleeps X, as a CPU's forward occupies the
  thread that calls it. CUDA graphs are off (`graph_blocker`: a replayed graph would skip the
  wait), and so is launch ahead. On CUDA the sleep is a device that blocks the host.
- `stream`: a GPU's timing, on a machine without one. The forward returns at once and queues X
  µs of work on an emulated device queue (`engine/readback.EmulatedStream`); the step's one sync
  (its readback) sleeps until the queue is empty. Decode steps replay emulated graphs
  (`DirectReplayCapturer`: the recorded forward, checked at capture as CUDA graphs require) and
  launch ahead as on CUDA, so the host's work for step N runs while the "device" computes step
  N+1, and what the host still adds to a step is the exposed time issue #31 bounds. The host
  work of making the canned logits and the greedy choice in the graph stays host work (it
  runs on this machine's cores), outside X.

Measuring X instead of assuming it: `TGS_BENCHMARK_STANDIN_STATS=<file>` (optional) names a
small file of int64 slots (`STAT_SLOTS`) that every rank maps and rank 0 updates per forward:
calls, wall ns and the calling thread's CPU ns of decode steps, and of prefill-shaped ones, apart.
Its first slot, when >= 0, overrides X at run time on every rank, so one server serves several X
(the benchmark writes it between rounds). `StandinStats.create` makes such a file; `StandinStats.open` maps one.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path
from typing import Iterable, Mapping

import torch
from loguru import logger
from tokenizers import Tokenizer

from text_generation_server.engine.readback import EmulatedStream

FORWARD_US_ENV = "TGS_BENCHMARK_STANDIN_FORWARD_US"
ACK_ENV = "TGS_BENCHMARK_STANDIN_ACK"
ACK_VALUE = "canned-logits-not-the-model"
STATS_ENV = "TGS_BENCHMARK_STANDIN_STATS"
DEVICE_ENV = "TGS_BENCHMARK_STANDIN_DEVICE"
DEVICE_MODES = ("blocking", "stream")
MAX_WAIT_US = 10_000_000  # 10 s: anything above is a typo, not a forward
CYCLE_LENGTH = 16
PEAK_LOGIT = 20.0  # the cycle's token against 0 everywhere else: p ~ 1 - vocab * e^-20

# int64 slots of the stats file, in order. wait_us < 0: the environment's X.
STAT_SLOTS = ("wait_us", "decode_calls", "decode_wall_ns", "decode_cpu_ns", "prefill_calls", "prefill_wall_ns",
              "prefill_cpu_ns")


def standin_wait_us(environ: Mapping[str, str] = os.environ) -> int | None:
    """The stand-in's nominal X in µs when the switch is thrown, None when it is not.

    ValueError (the rank refuses to start) when FORWARD_US_ENV is set without ACK_ENV holding
    exactly ACK_VALUE, or when X is not an integer in [0, MAX_WAIT_US]."""
    raw = environ.get(FORWARD_US_ENV)
    if raw is None:
        return None
    if environ.get(ACK_ENV) != ACK_VALUE:
        raise ValueError(
            f"{FORWARD_US_ENV} is set, which replaces the model's forward by canned logits (a benchmark "
            f"stand-in, benchmarks/host_overhead.py); refusing to start without {ACK_ENV}={ACK_VALUE}. "
            f"Unset {FORWARD_US_ENV} to serve the model."
        )
    try:
        wait_us = int(raw)
    except ValueError:
        raise ValueError(f"{FORWARD_US_ENV} must be an integer number of microseconds, got {raw!r}") from None
    if not 0 <= wait_us <= MAX_WAIT_US:
        raise ValueError(f"{FORWARD_US_ENV} must be in [0, {MAX_WAIT_US}] µs, got {wait_us}")
    return wait_us


def standin_device_mode(environ: Mapping[str, str] = os.environ) -> str:
    """`blocking` or `stream` (module docstring); ValueError naming the variable for anything else."""
    mode = environ.get(DEVICE_ENV, "blocking").strip().lower() or "blocking"
    if mode not in DEVICE_MODES:
        raise ValueError(f"{DEVICE_ENV} must be one of {', '.join(DEVICE_MODES)}, got {environ.get(DEVICE_ENV)!r}")
    return mode


class StandinStats:
    """The stats file's int64 slots (STAT_SLOTS), memory-mapped: counted by rank 0's stand-in, its
    wait_us read by every rank's; read (and its wait_us written) by the benchmark."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 8 * len(STAT_SLOTS))
        self.slots = memoryview(self._map).cast("q")

    @classmethod
    def create(cls, path: str | Path, wait_us: int = -1) -> StandinStats:
        """A new zeroed stats file at `path`, with its wait override."""
        Path(path).write_bytes(bytes(8 * len(STAT_SLOTS)))
        stats = cls(path)
        stats.slots[0] = wait_us
        return stats

    @classmethod
    def open(cls, path: str | Path) -> StandinStats:
        """Maps an existing stats file (the rank's side)."""
        return cls(path)

    def close(self) -> None:
        self.slots.release()
        self._map.close()

    def read(self) -> dict[str, int]:
        return dict(zip(STAT_SLOTS, self.slots.tolist()))

    def set_wait_us(self, wait_us: int) -> None:
        self.slots[0] = wait_us

    def add(self, prefill: bool, wall_ns: int, cpu_ns: int) -> None:
        base = 4 if prefill else 1
        self.slots[base] += 1
        self.slots[base + 1] += wall_ns
        self.slots[base + 2] += cpu_ns


def canned_cycle(vocab_size: int, text_vocab: int, excluded: Iterable[int], length: int = CYCLE_LENGTH) -> list[int]:
    """`length` token ids the canned logits walk through: ordinary ids from the middle of the
    vocabulary up (past byte-level and special tokens at its start), none of `excluded`."""
    excluded = set(excluded)
    top = min(vocab_size, text_vocab)
    cycle = [t for t in range(top // 2, top) if t not in excluded][:length]
    if len(cycle) < length:
        raise ValueError(f"a vocabulary of {top} ids has no {length} ordinary tokens for the stand-in's cycle")
    return cycle


class StandinForward(torch.nn.Module):
    """The model with its forward replaced (see the module docstring); every other attribute
    (config, kv_layout, heads, the weights in state_dict) is the wrapped model's."""

    # Neither mode reads the KV cache: graphs need no graph-safe attention backend (CausalLM asks).
    attention_free = True

    def __init__(self, inner: torch.nn.Module, wait_us: int, cycle: list[int], device: torch.device,
                 stats: StandinStats | None = None, record: bool = True, mode: str = "blocking"):
        """stats: the file whose wait_us overrides `wait_us`; record: whether this one counts its
        forwards there (rank 0 only, so a step is counted once); mode: `blocking` or `stream`
        (module docstring)."""
        super().__init__()
        if mode not in DEVICE_MODES:
            raise ValueError(f"stand-in device mode must be one of {DEVICE_MODES}, got {mode!r}")
        self.inner = inner
        self.wait_us = wait_us
        self.stats = stats
        self.record = record
        self.mode = mode
        # The emulated device queue of "stream" mode; CausalLM's readback and clock use it.
        self.stream = EmulatedStream(self._completed) if mode == "stream" else None
        self._unrecorded_cpu = [0]  # stream mode: CPU ns of launches a sync has not completed yet
        self.graph_blocker = None if mode == "stream" else \
            f"the benchmark stand-in forward ({FORWARD_US_ENV}) blocks the host: a graph would skip its wait"
        self.vocab_size = inner.config.vocab_size
        self.cycle = list(cycle)
        # Row i: the logits that choose cycle[i]; a step's logits are rows of it, one copy.
        self._table = torch.zeros(len(cycle), self.vocab_size, dtype=torch.float32, device=device)
        self._table[torch.arange(len(cycle), device=device), torch.tensor(cycle, device=device)] = PEAK_LOGIT

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)

    def current_wait_us(self) -> int:
        if self.stats is not None and self.stats.slots[0] >= 0:
            return self.stats.slots[0]
        return self.wait_us

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache, meta, logits_indices=None,
                head: bool = True, seq_lens=None) -> torch.Tensor:
        # As DecoderModel.forward. head=False returns, in place of hidden states, the rows'
        # positions [rows, 1]: all `logits` needs to make their canned logits.
        start, cpu_start = time.perf_counter_ns(), time.thread_time_ns()
        if self.stream is not None:
            # Queued first, as a graph launch is: what making the logits costs this machine's
            # host runs while the emulated device computes, as a real device's forward would.
            self.stream.launch(self.current_wait_us() * 1000, bool(getattr(meta, "is_prefill", False)))
        rows = positions if logits_indices is None else positions.index_select(0, logits_indices)
        out = self.logits(rows[:, None]) if head else rows[:, None]
        cpu_ns = time.thread_time_ns() - cpu_start
        if self.stream is not None:
            self._unrecorded_cpu[0] += cpu_ns
            return out
        remaining_ns = self.current_wait_us() * 1000 - (time.perf_counter_ns() - start)
        if remaining_ns > 0:
            time.sleep(remaining_ns / 1e9)  # releases the GIL, as a device wait does
        if self.stats is not None and self.record:
            self.stats.add(bool(getattr(meta, "is_prefill", False)), time.perf_counter_ns() - start, cpu_ns)
        return out

    def _completed(self, prefill: bool, device_ns: int) -> None:
        """Stream mode: a launch's device time, once a sync completed it, into the stats."""
        if self.stats is not None and self.record:
            self.stats.add(prefill, device_ns, self._unrecorded_cpu[0])
        self._unrecorded_cpu[0] = 0

    def graph_capturer(self):
        """What records decode graphs on a CPU in stream mode (engine/cuda_graphs.py)."""
        from text_generation_server.engine.cuda_graphs import DirectReplayCapturer

        return DirectReplayCapturer()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [rows, 1] positions (from forward) -> [rows, vocab] float32
        return self._table.index_select(0, hidden[:, 0] % len(self.cycle))


def from_environment(net: torch.nn.Module, tokenizer: Tokenizer, eos_token_ids: Iterable[int], device: torch.device,
                     rank: int = 0, environ: Mapping[str, str] = os.environ) -> torch.nn.Module:
    """`net` itself, or `net` behind a StandinForward when the switch is thrown (ValueError when it
    is thrown wrongly). Called by models.loader.get_model, once per loaded model."""
    wait_us = standin_wait_us(environ)
    if wait_us is None:
        return net
    mode = standin_device_mode(environ)
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    cycle = canned_cycle(net.config.vocab_size, tokenizer.get_vocab_size(with_added_tokens=True),
                         special | set(eos_token_ids))
    stats_path = environ.get(STATS_ENV)
    try:
        stats = StandinStats.open(stats_path) if stats_path else None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{STATS_ENV}={stats_path} is not a stand-in stats file: {exc}") from exc
    banner = "!" * 100
    logger.warning(banner)
    logger.warning("BENCHMARK STAND-IN FORWARD ON ({}={}): this server does NOT run the model. Every forward returns "
                   "canned logits (tokens {}...) after a {} µs wait ({} device).", FORWARD_US_ENV, wait_us, cycle[:4],
                   wait_us, mode)
    logger.warning("Only benchmarks/host_overhead.py sets it; unset {} to serve the model.", FORWARD_US_ENV)
    logger.warning(banner)
    return StandinForward(net, wait_us, cycle, device, stats, record=rank == 0, mode=mode)
