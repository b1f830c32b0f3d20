"""Warmup that keeps what it measured (CausalLM.warmup, server/utils/memory.py).

CPU tier (always): the sizing arithmetic (`plan_kv_cache`) on mocked figures; memory readings
on a mocked CUDA device (driver-free memory, the per-process cap, never empty_cache); how the
largest decode batch is chosen; the whole warmup with mocked readings: the largest prefill,
the graph capture and the decode at the largest batch all run before memory is read, nothing
empties the allocator, the block count is the plan's, and a cache too small for
max_total_tokens fails with the flags to change.
CUDA tier (skipped without a GPU): a model whose prefill activations exceed the margin, its KV
cache given nearly all memory under --cuda-memory-fraction, then the largest prefill and a
decode at the largest batch with every KV block taken: no OOM, and memory_allocated stays flat
across decode steps.
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import needs_gpu, write_checkpoint

from text_generation_server.layers.attention import TorchAttention, padded_decode
from text_generation_server.models.loader import get_model
from text_generation_server.engine.batch import Batch
from text_generation_server.engine.warmup import WarmupError, decode_batch_limit, graph_buckets_within
from text_generation_server.engine.cuda_graphs import EagerReplayCapturer
from text_generation_server.engine.types import GenerationRequest
from text_generation_server.engine import memory
from text_generation_server.engine.memory import MemoryReading, plan_kv_cache

torch.set_num_threads(1)

MIB, GIB = 2**20, 2**30
CUDA = torch.cuda.is_available()



# ---------------------------------------------------------------------------------------------
# The arithmetic

def test_margin_is_256_mib_or_two_percent_on_cuda_and_none_on_cpu():
    assert MemoryReading("cuda", 0, 8 * GIB).margin_bytes == 256 * MIB
    assert MemoryReading("cuda", 0, 80 * GIB).margin_bytes == int(0.02 * 80 * GIB)
    assert MemoryReading("cpu", 0, 80 * GIB).margin_bytes == 0


def test_the_per_process_cap_bounds_what_is_available():
    # 45 GiB free on the device, but this process may hold 0.5 x 80 GiB and holds 30 already.
    reading = MemoryReading("cuda", 45 * GIB, 80 * GIB, reserved_bytes=30 * GIB, cap_fraction=0.5)
    assert reading.available_bytes == 10 * GIB
    assert MemoryReading("cuda", 45 * GIB, 80 * GIB, reserved_bytes=30 * GIB).available_bytes == 45 * GIB
    assert MemoryReading("cuda", 1 * GIB, 80 * GIB, reserved_bytes=50 * GIB, cap_fraction=0.5).available_bytes == 0


def test_blocks_are_what_the_fraction_leaves_after_the_margin():
    reading = MemoryReading("cuda", 10 * GIB, 8 * GIB)  # margin 256 MiB
    plan = plan_kv_cache(reading, bytes_per_block=2 * MIB, block_size=16, memory_fraction=0.9)
    assert plan.num_blocks == int(0.9 * (10 * GIB - 256 * MIB)) // (2 * MIB)
    assert plan.margin_bytes == 256 * MIB and plan.transient_bytes == 0
    assert not plan.capped_by_max_batch_total_tokens
    assert plan.usable_tokens(16) == (plan.num_blocks - 1) * 16


def test_the_decode_transient_grows_with_the_cache_and_is_solved_for():
    # torch-sdpa gathers one layer's K and V: 2 x cache / layers. With 4 layers, n blocks need
    # n x bpb x (1 + 0.5 x fraction) <= fraction x (available - margin).
    bpb, layers = 3 * MIB, 4
    reading = MemoryReading("cuda", 20 * GIB, 8 * GIB)
    transient = lambda kv: TorchAttention().decode_transient_bytes(kv, layers)
    plan = plan_kv_cache(reading, bytes_per_block=bpb, block_size=16, memory_fraction=0.8, transient_bytes=transient)
    room = 20 * GIB - 256 * MIB
    n = plan.num_blocks
    assert n * bpb <= 0.8 * (room - transient(n * bpb))
    assert (n + 1) * bpb > 0.8 * (room - transient((n + 1) * bpb))
    assert n == int(0.8 * room / (bpb * (1 + 0.8 * 2 / layers)))
    assert plan.transient_bytes == transient(n * bpb)
    assert plan.budget_bytes == int(0.8 * (room - transient(n * bpb)))


def test_max_batch_total_tokens_caps_the_cache():
    reading = MemoryReading("cuda", 10 * GIB, 8 * GIB)
    plan = plan_kv_cache(reading, bytes_per_block=MIB, block_size=16, memory_fraction=1.0,
                         max_batch_total_tokens=1000)
    assert plan.num_blocks == 63 + 1  # ceil(1000 / 16) and the reserved block 0
    assert plan.capped_by_max_batch_total_tokens


def test_nothing_left_means_no_blocks():
    reading = MemoryReading("cuda", 100 * MIB, 8 * GIB)  # less than the margin
    assert plan_kv_cache(reading, bytes_per_block=MIB, block_size=16, memory_fraction=0.9).num_blocks == 0


@pytest.mark.parametrize("kw,message", [
    (dict(bytes_per_block=0), "bytes_per_block and block_size must be >= 1"),
    (dict(memory_fraction=0.0), "memory fraction must be in"),
    (dict(memory_fraction=1.5), "memory fraction must be in"),
])
def test_bad_plan_inputs(kw, message):
    args = dict(bytes_per_block=MIB, block_size=16, memory_fraction=0.9)
    args.update(kw)
    with pytest.raises(ValueError, match=message):
        plan_kv_cache(MemoryReading("cuda", GIB, GIB), **args)


# ---------------------------------------------------------------------------------------------
# Readings

def test_cuda_readings_use_driver_free_memory_and_never_empty_the_cache(monkeypatch):
    def refuse():
        raise AssertionError("empty_cache would hand back the memory warmup measured")

    monkeypatch.setattr(torch.cuda, "empty_cache", refuse)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (12 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 30 * GIB)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 0.5)
    reading = memory.read_memory(torch.device("cuda", 0))
    assert reading == MemoryReading("cuda", 12 * GIB, 80 * GIB, 30 * GIB, 0.5)
    assert reading.available_bytes == 10 * GIB
    assert memory.available_bytes(torch.device("cuda", 0)) == 10 * GIB


def test_cpu_readings():
    reading = memory.read_memory(torch.device("cpu"))
    assert reading.device_type == "cpu" and 0 < reading.free_bytes <= reading.total_bytes
    assert reading.available_bytes == reading.free_bytes and reading.margin_bytes == 0


# ---------------------------------------------------------------------------------------------
# The largest decode batch

def test_decode_batch_limit_order():
    assert decode_batch_limit(48, [1, 2, 32], 10_000, 16, 512) == (48, "max_batch_size")
    assert decode_batch_limit(None, [1, 2, 32], 10_000, 16, 512) == (32, "the largest CUDA graph")
    # 1000 tokens in blocks of 16 hold 63 blocks; a request needs one (two tokens) at least.
    assert decode_batch_limit(None, [], 1000, 16, 512) == (63, "max_batch_total_tokens at two tokens per request")
    assert decode_batch_limit(None, [], 1000, 1, 512)[0] == 500  # two blocks of one token each
    assert decode_batch_limit(None, [], None, 16, 512) == (512, "max_batch_prefill_tokens, no batch limit known")


def test_buckets_past_the_largest_batch_are_not_captured():
    assert graph_buckets_within([1, 2, 4, 8, 16, 32], 6) == [1, 2, 4, 8]
    assert graph_buckets_within([1, 2, 4, 8], 8) == [1, 2, 4, 8]
    assert graph_buckets_within([1, 2, 4, 8], 100) == [1, 2, 4, 8]
    assert graph_buckets_within([4, 8], 1) == [4]


# ---------------------------------------------------------------------------------------------
# The whole warmup on CPU with mocked readings

class GraphSafePadded(TorchAttention):
    name = "torch-padded"
    graph_safe = True

    def decode(self, q, key_cache, value_cache, meta, scale, window, softcap=None, sinks=None):
        return padded_decode(q, key_cache, value_cache, meta, scale, window, softcap, sinks)

    def capture_memo(self, batch, max_seq_len, device):
        return {}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("warmup") / "llama"
    write_checkpoint(path, "llama", seed=61)
    return str(path)


def warmup_requests(prompt_tokens: int, max_input: int) -> list[GenerationRequest]:
    """The router's warmup batch: prompts of max_input tokens up to max_prefill_tokens in all."""
    rng = random.Random(0)
    out = []
    while prompt_tokens > 0:
        n = min(max_input, prompt_tokens)
        out.append(GenerationRequest(id=0, inputs="", input_ids=[rng.randrange(1, 290) for _ in range(n)],
                                     max_new_tokens=64 - n, prefill_logprobs=True, top_n_tokens=5))
        prompt_tokens -= n
    return out


class Events:
    """Records the order of what warmup does, through the model's own entry points."""

    def __init__(self, lm, monkeypatch, reading: MemoryReading):
        self.log: list[tuple] = []
        for name in ("allocate_kv_cache", "generate_token", "capture_decode_graphs"):
            monkeypatch.setattr(lm, name, self._wrap(name, getattr(lm, name)))
        monkeypatch.setattr(memory, "read_memory", self._read(reading))
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: self.log.append(("empty_cache",)))

    def _wrap(self, name, inner):
        def call(*args, **kw):
            if name == "generate_token":
                batch = args[0]
                self.log.append(("prefill" if batch.prefilling else "decode", len(batch)))
            elif name == "allocate_kv_cache":
                self.log.append(("allocate", args[0]))
            else:
                self.log.append(("capture",))
            return inner(*args, **kw)

        return call

    def _read(self, reading):
        def read(device):
            self.log.append(("read",))
            return reading

        return read


def test_warmup_measures_before_it_sizes_and_keeps_the_allocator_cache(folder, monkeypatch):
    lm = get_model(folder, dtype="float32", block_size=4, cuda_graphs=[1, 2, 4, 8], max_batch_size=6,
                   graph_capturer=EagerReplayCapturer())
    lm.attention = GraphSafePadded(lm.attention.spec)
    bpb = lm.kv_bytes_per_block
    margin = 256 * MIB
    # Padded decode's transient (2 x cache / 2 layers) equals the cache: n x bpb <= 0.5 x (A - n x bpb).
    reading = MemoryReading("cuda", margin + 3 * 1000 * bpb + 7, 8 * GIB)
    events = Events(lm, monkeypatch, reading)
    supported = lm.warmup(warmup_requests(40, 16), 16, 40, 64, 0.5)
    temp = events.log[0]
    assert temp[0] == "allocate"
    assert events.log[1:] == [("prefill", 3), ("capture",), ("decode", 6), ("read",), ("allocate", 1000),
                              ("capture",)]
    # The temporary cache holds the prompts (one new token each) and block 0, nothing more.
    assert temp[1] == 1 + sum(lm.blocks_for(n + 1) for n in (16, 16, 8))
    assert supported == 999 * 4 and lm.kv_cache.num_blocks == 1000
    assert lm.max_prefill_tokens == 40
    assert lm.graphs.buckets == [1, 2, 4, 8] and lm.graphs.stats.replays == {8: 1}


def test_warmup_sizes_around_the_torch_decode_transient(folder, monkeypatch):
    lm = get_model(folder, dtype="float32", block_size=4, max_batch_size=3)
    assert lm.attention.name == "torch-sdpa"
    bpb = lm.kv_bytes_per_block
    layers = lm.config.num_hidden_layers
    assert layers == 2  # the transient (2 x cache / layers) equals the cache: n x bpb <= 0.5 x (A - n x bpb)
    reading = MemoryReading("cuda", 256 * MIB + 3 * 500 * bpb + 5, 8 * GIB)
    events = Events(lm, monkeypatch, reading)
    assert lm.warmup(warmup_requests(20, 20), 20, 20, 64, 0.5) == 499 * 4
    assert [e[0] for e in events.log] == ["allocate", "prefill", "decode", "read", "allocate"]
    assert ("decode", 3) in events.log


def test_warmup_logs_its_figures(folder, monkeypatch):
    from loguru import logger

    lm = get_model(folder, dtype="float32", block_size=4, max_batch_size=2)
    Events(lm, monkeypatch, MemoryReading("cuda", 256 * MIB + 900 * lm.kv_bytes_per_block, 8 * GIB))
    lines = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    try:
        lm.warmup(warmup_requests(12, 12), 12, 12, 32, 1.0, max_batch_total_tokens=400)
    finally:
        logger.remove(sink)
    line = next(x for x in lines if x.startswith("warmup:"))
    assert line.startswith("warmup: prefill of 12 tokens ")
    assert "decode of 2 requests (max_batch_size) " in line and "(eager)" in line
    assert "CUDA graphs off (not on CUDA (cpu))" in line
    assert "KV cache 101 blocks x 4 tokens = 400 tokens" in line
    assert "256.0 MiB margin" in line and "x 1.0, capped by max_batch_total_tokens)" in line


def test_a_cache_too_small_for_max_total_tokens_names_the_flags(folder, monkeypatch):
    lm = get_model(folder, dtype="float32", block_size=4, max_batch_size=2)
    # Room for 10 blocks, half of it for torch's decode transient: 5 blocks, 4 of 4 tokens usable.
    Events(lm, monkeypatch, MemoryReading("cuda", 256 * MIB + 10 * lm.kv_bytes_per_block, 8 * GIB))
    with pytest.raises(WarmupError, match="the KV cache fits 16 tokens .*fewer than max_total_tokens 64; lower "
                                          "--max-total-tokens, --max-batch-prefill-tokens or --max-batch-size"):
        lm.warmup(warmup_requests(12, 12), 12, 12, 64, 1.0)
    assert lm.kv_cache is None


def test_a_decode_that_does_not_fit_names_the_batch_flag(folder, monkeypatch):
    lm = get_model(folder, dtype="float32", block_size=4, max_batch_size=7)
    inner = lm.generate_token

    def step(batch):
        if not batch.prefilling:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return inner(batch)

    monkeypatch.setattr(lm, "generate_token", step)
    with pytest.raises(WarmupError, match="a decode step at the largest batch, 7 requests \\(max_batch_size\\), does "
                                          "not fit in memory .*lower --max-batch-size"):
        lm.warmup(warmup_requests(12, 12), 12, 12, 64, 0.5)
    assert lm.kv_cache is None


# ---------------------------------------------------------------------------------------------
# CUDA: the guarantee at the edge

@needs_gpu
def test_cuda_no_oom_at_the_limits_after_warmup(tmp_path, monkeypatch):
    """Prefill activations (an MLP of 8192 over 32k tokens in fp32: gigabytes) well past the
    margin, so a warmup that gave them back to the KV cache would run out of memory here.

    A first warmup measures what the process holds besides its KV cache; the per-process cap
    (--cuda-memory-fraction) is then set so that a second warmup's KV cache, which takes all
    the memory left, holds fewer tokens than max_batch_size requests of max_total_tokens: the
    test can take every block with requests within the limits."""
    monkeypatch.setenv("TGS_ATTENTION_BACKEND", "triton-paged")
    write_checkpoint(tmp_path / "wide", "llama", seed=3, hidden_size=1024, intermediate_size=8192,
                     num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=20_000)
    # With its index: torch 2.11's set_per_process_memory_fraction refuses a bare "cuda".
    dev = torch.device("cuda", torch.cuda.current_device())
    max_input, max_prefill, max_total, max_batch = 8192, 32_768, 16_384, 32
    total = torch.cuda.get_device_properties(dev).total_memory
    lm = get_model(str(tmp_path / "wide"), dtype="float32", device=dev, cuda_graphs=[1, 2, 4, 8, 16, 32],
                   max_batch_size=max_batch)
    warm = warmup_requests_cuda(max_prefill, max_input, max_total)
    lm.warmup(warm, max_input, max_prefill, max_total, 1.0, max_batch_total_tokens=4 * max_total)
    kv_bytes = lm.kv_cache.num_blocks * lm.kv_bytes_per_block
    held = torch.cuda.memory_reserved(dev)  # weights, kept activations, graphs, this KV cache
    target_kv = 4 * 2**30  # ~262k tokens at 16 KiB a token: fewer than 32 x 16384
    cap = (held + memory.read_memory(dev).margin_bytes + target_kv) / total
    assert cap < 0.9, "this GPU is too small for the test's model"
    torch.cuda.set_per_process_memory_fraction(cap, dev)
    try:
        supported = lm.warmup(warm, max_input, max_prefill, max_total, 1.0)
        reading = memory.read_memory(dev)
        assert reading.available_bytes < 2 * reading.margin_bytes, "the KV cache did not take nearly all memory"
        assert max_total <= supported < max_batch * max_total, (supported, kv_bytes)
        rng = random.Random(1)
        # The largest prefill: four prompts of max_input tokens with prompt logprobs and top-n,
        # holding max_total tokens each; then 28 short requests take every block that is left.
        big = [GenerationRequest(id=i, inputs="", input_ids=[rng.randrange(1, 290) for _ in range(max_input)],
                                 max_new_tokens=max_total - max_input, prefill_logprobs=True, top_n_tokens=5,
                                 ignore_eos_token=True) for i in range(4)]
        left = lm.allocator.free_blocks - 4 * lm.blocks_for(max_total)
        smalls = max_batch - 4
        per_small, extra = divmod(left, smalls)
        assert 2 <= per_small and per_small + 1 <= lm.blocks_for(max_total)
        small = [GenerationRequest(id=100 + i, inputs="", input_ids=[rng.randrange(1, 290) for _ in range(16)],
                                   max_new_tokens=(per_small + (i < extra)) * lm.block_size - 16,
                                   ignore_eos_token=True) for i in range(smalls)]
        first = lm.generate_token(lm.make_batch(0, big))[1]
        second = lm.generate_token(lm.make_batch(1, small))[1]
        batch = Batch.concatenate([first, second])
        assert len(batch) == max_batch
        assert lm.allocator.free_blocks == 0  # every block of the cache is taken
        lm.graphs.stats.replays.clear()  # warmup's own decode steps
        allocated = []
        for _ in range(8):
            batch = lm.generate_token(batch)[1]
            torch.cuda.synchronize()
            allocated.append(torch.cuda.memory_allocated(dev))
        assert len(set(allocated[1:])) == 1, allocated  # nothing accumulates from step to step
        assert lm.graphs.stats.replays[32] == 8
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, dev)
        torch.cuda.empty_cache()


def warmup_requests_cuda(prompt_tokens: int, max_input: int, max_total: int) -> list[GenerationRequest]:
    rng = random.Random(0)
    out = []
    while prompt_tokens > 0:
        n = min(max_input, prompt_tokens)
        out.append(GenerationRequest(id=0, inputs="", input_ids=[rng.randrange(1, 290) for _ in range(n)],
                                     max_new_tokens=max_total - n, prefill_logprobs=True, top_n_tokens=20))
        prompt_tokens -= n
    return out


def test_cuda_reading_takes_a_device_without_an_index(monkeypatch):
    """torch.device("cuda") (what tests and callers may pass) has no index, and torch 2.11's
    get_per_process_memory_fraction refuses it: found on an H100. The reading resolves the
    current device first."""
    from text_generation_server.engine import memory

    def fraction(device):
        if isinstance(device, torch.device) and device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        return 0.5

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (6 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 1 << 30)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", fraction)
    reading = memory.read_memory(torch.device("cuda"))
    assert (reading.free_bytes, reading.total_bytes, reading.reserved_bytes, reading.cap_fraction) == (
        6 << 30, 80 << 30, 1 << 30, 0.5)
