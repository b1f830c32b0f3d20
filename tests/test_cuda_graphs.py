"""Decode steps from CUDA graphs (server/models/cuda_graphs.py, CausalLM's decode path).

CPU tier (always): the graph path runs through `EagerReplayCapturer`, which replays by running
the recorded forward again against the same static buffers, and fails a replay that issues
other operators than its capture or reads a device value on the host. The tokens (greedy and
seeded) and logprobs of the graph path must equal a twin model's eager path: across bucket
padding, batches that shrink and grow across buckets, batches above the largest bucket (eager),
sequences longer than the graphs were captured for (eager, with the reason), a replaced KV
cache (eager). Static buffers are allocated once. The attention is torch's padded decode
marked graph-safe (it is: its shapes follow max_seq_len, which a graph fixes), so these run
at full speed; triton-paged runs the same path under TRITON_INTERPRET=1.
CUDA tier (skipped without a GPU): real torch.cuda.CUDAGraph capture with triton-paged, tokens
equal to eager.
"""

from __future__ import annotations

import random

import pytest
import torch
from family_cases import write_family_checkpoint
from helpers import needs_gpu, write_checkpoint

from text_generation_server.generation.sampling import SamplingParams
from text_generation_server.layers.attention import TorchAttention, padded_decode
from text_generation_server.models.loader import get_model
from text_generation_server.engine.batch import Batch
from text_generation_server.engine.cuda_graphs import (
    CudaGraphCapturer,
    DecodeGraphs,
    EagerReplayCapturer,
    GraphReplayMismatch,
    HostSyncError,
)
from text_generation_server.engine.types import GenerationRequest

torch.set_num_threads(1)

BLOCK_SIZE = 4
NUM_BLOCKS = 160
MAX_TOTAL = 48  # what the graphs are captured for
# Families whose decode differs in what a graph must capture: two rotaries and soft caps (Gemma),
# learned positions (GPT-2), a replicated KV head's row pick (Falcon-7B), dynamic NTK frequencies
# from the device's lengths, longrope's one-off recompute.
FAMILY_CASES = ("gemma2", "gemma3_text", "gpt2", "falcon_mqa", "llama_dynamic", "phi3_longrope")
CUDA = torch.cuda.is_available()



class GraphSafePadded(TorchAttention):
    """torch's padded decode everywhere: its shapes come from max_seq_len (fixed in a graph)
    and the batch size alone, and it never reads a device value on the host."""

    name = "torch-padded"
    graph_safe = True

    def decode(self, q, key_cache, value_cache, meta, scale, window, softcap=None, sinks=None):
        return padded_decode(q, key_cache, value_cache, meta, scale, window, softcap, sinks)

    def capture_memo(self, batch: int, max_seq_len: int, device: torch.device) -> dict:
        return {}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("graphs")
    out = {}
    for seed, name in enumerate(("llama", "mistral_window")):
        write_checkpoint(root / name, name, seed=seed + 41)
        out[name] = str(root / name)
    for seed, name in enumerate(FAMILY_CASES):
        write_family_checkpoint(root / name, name, seed=seed + 51)
        out[name] = str(root / name)
    return out


def load(folder: str, buckets=(), capturer=None, backend=GraphSafePadded, capture: bool = True, **kw):
    lm = get_model(folder, dtype="float32", block_size=BLOCK_SIZE, cuda_graphs=buckets, graph_capturer=capturer, **kw)
    if backend is not None:
        lm.attention = backend(lm.attention.spec)
    lm.allocate_kv_cache(NUM_BLOCKS)
    if buckets and capture:
        lm.capture_decode_graphs(MAX_TOTAL)
    return lm


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 290) for _ in range(n)]


def request(rid: int, prompt_len: int, new: int, seed: int | None = None) -> GenerationRequest:
    sampling = SamplingParams()
    if seed is not None:
        sampling = SamplingParams(do_sample=True, seed=seed, temperature=0.9, top_k=20, repetition_penalty=1.1)
    return GenerationRequest(id=rid, inputs="", input_ids=ids(prompt_len, rid + 100), max_new_tokens=new,
                             ignore_eos_token=True, sampling=sampling)


class Recorder:
    def __init__(self, lm):
        self.lm = lm
        self.out: dict[int, list[tuple[int, float]]] = {}

    def step(self, batch: Batch) -> Batch | None:
        generations, batch, _ = self.lm.generate_token(batch)
        for gen in generations:
            self.out.setdefault(gen.request_id, []).extend(zip(gen.tokens.ids, gen.tokens.logprobs))
        return batch

    def steps(self, batch: Batch, n: int) -> Batch | None:
        for _ in range(n):
            batch = self.step(batch)
        return batch


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for rid in want:
        assert [t for t, _ in got[rid]] == [t for t, _ in want[rid]], rid
        torch.testing.assert_close(torch.tensor([lp for _, lp in got[rid]]), torch.tensor([lp for _, lp in want[rid]]),
                                   atol=1e-5, rtol=0)


def padding_scenario(lm) -> dict:
    """Three requests (two greedy, one seeded) in a bucket of four, then two, then one."""
    rec = Recorder(lm)
    batch = lm.make_batch(0, [request(0, 9, 12), request(1, 5, 12, seed=7), request(2, 14, 12)])
    batch = rec.steps(batch, 4)
    batch = rec.steps(lm.filter(batch, [2, 1]), 3)
    rec.steps(lm.filter(batch, [1]), 2)
    return rec.out


@pytest.mark.parametrize("name", ["llama", "mistral_window", *FAMILY_CASES, "mistral_window@transformers"])
def test_graph_tokens_equal_eager_across_padding(folders, name):
    name, _, impl = name.partition("@")  # @transformers: through transformers' modeling code
    kw = {"model_impl": impl} if impl else {}
    eager = padding_scenario(load(folders[name], **kw))
    lm = load(folders[name], buckets=[1, 2, 4], capturer=EagerReplayCapturer(), **kw)
    assert lm.model_impl == (impl or "native")
    assert_same(padding_scenario(lm), eager)
    if name == "phi3_longrope":
        # Each sequence crossing the longrope switch (16) recomputes itself once, eagerly.
        assert sum(lm.graphs.stats.replays.values()) < 8
    else:
        assert lm.graphs.stats.replays == {4: 3, 2: 3, 1: 2}  # the prefill step is eager, decodes are not
    assert not lm.graphs.stats.eager


def test_batches_grow_and_shrink_across_buckets(folders):
    def scenario(lm):
        rec = Recorder(lm)
        batch = lm.make_batch(0, [request(i, 4 + 2 * i, 20, seed=i if i % 2 else None) for i in range(5)])
        batch = rec.steps(batch, 3)  # 5 rows: bucket 8
        batch = rec.steps(lm.filter(batch, [0, 3, 4]), 2)  # bucket 4
        newcomers = rec.step(lm.make_batch(1, [request(10, 7, 20), request(11, 3, 20, seed=5)]))
        batch = rec.steps(Batch.concatenate([batch, newcomers]), 3)  # 5 again: bucket 8
        rec.steps(lm.filter(batch, [11]), 2)  # bucket 1
        return rec.out

    eager = scenario(load(folders["llama"]))
    lm = load(folders["llama"], buckets=[1, 2, 4, 8], capturer=EagerReplayCapturer())
    assert_same(scenario(lm), eager)
    assert lm.graphs.stats.replays == {8: 2 + 3, 4: 2, 1: 2}
    assert not lm.graphs.stats.eager


def test_batches_above_the_largest_bucket_run_eagerly(folders):
    def scenario(lm):
        rec = Recorder(lm)
        batch = lm.make_batch(0, [request(i, 5 + i, 6, seed=3 if i == 1 else None) for i in range(3)])
        batch = rec.steps(batch, 3)
        rec.steps(lm.filter(batch, [0, 2]), 2)
        return rec.out

    eager = scenario(load(folders["llama"]))
    lm = load(folders["llama"], buckets=[1, 2], capturer=EagerReplayCapturer())
    assert_same(scenario(lm), eager)
    assert lm.graphs.stats.eager == {"batch larger than the largest graph (2)": 2}
    assert lm.graphs.stats.replays == {2: 2}


def test_sequences_longer_than_captured_fall_back_clearly(folders):
    def scenario(lm):
        rec = Recorder(lm)
        # 40 prompt tokens + 12 new passes MAX_TOTAL (48) at the 9th step: those steps run eagerly.
        batch = lm.make_batch(0, [request(0, 40, 12), request(1, 6, 12, seed=1)])
        rec.steps(batch, 12)
        return rec.out

    eager = scenario(load(folders["llama"]))
    lm = load(folders["llama"], buckets=[1, 2], capturer=EagerReplayCapturer())
    assert_same(scenario(lm), eager)
    reason = "a sequence longer than the 48 tokens the graphs were captured for (max_total_tokens)"
    assert lm.graphs.stats.eager == {reason: 3}  # lengths 49, 50, 51 after steps 9-11
    assert lm.graphs.stats.replays == {2: 8}


def test_wider_block_tables_use_the_graph_when_no_sequence_needs_the_extra_columns(folders):
    def scenario(lm):
        rec = Recorder(lm)
        batch = rec.step(lm.make_batch(0, [request(0, 6, 4), request(1, 3, 4, seed=4)]))
        # A router may hand out more blocks than a request needs: columns past the graphs' max_blocks.
        extra = -(-MAX_TOTAL // BLOCK_SIZE) + 3 - batch.block_tables.shape[1]
        batch.block_tables = torch.nn.functional.pad(batch.block_tables, (0, extra))
        rec.steps(batch, 3)
        return rec.out

    eager = scenario(load(folders["llama"]))
    lm = load(folders["llama"], buckets=[2], capturer=EagerReplayCapturer())
    assert_same(scenario(lm), eager)
    assert lm.graphs.stats.replays == {2: 3}


def test_a_replaced_kv_cache_is_never_replayed(folders):
    lm = load(folders["llama"], buckets=[1, 2], capturer=EagerReplayCapturer())
    lm.allocate_kv_cache(NUM_BLOCKS)  # graphs pointed into the old cache
    assert not lm.graphs.captured
    rec = Recorder(lm)
    rec.steps(lm.make_batch(0, [request(0, 5, 3)]), 3)
    assert lm.graphs.stats.eager == {"no graphs captured": 2}
    graphs = DecodeGraphs([1], MAX_TOTAL, BLOCK_SIZE, torch.device("cpu"), EagerReplayCapturer())
    graphs.capture(lm.model, lm.kv_cache, lm.attention)
    other = load(folders["llama"])
    batch = other.make_batch(0, [request(0, 5, 3)])
    inputs = (batch.history[:, 0].tolist(), [4], batch.slot_table[:, 4].tolist(), [5])
    assert graphs.run(other.kv_cache, inputs, batch.block_tables, 5) is None
    assert graphs.stats.eager == {"the KV cache was replaced after capture": 1}


def test_replay_allocates_no_static_buffers(folders):
    capturer = EagerReplayCapturer()
    lm = load(folders["llama"], buckets=[1, 2, 4, 8], capturer=capturer)
    graphs = lm.graphs
    before = {name: (t.data_ptr(), t.shape) for name, t in graphs.static_buffers().items()}
    assert set(before) == {"inputs", "input_ids", "positions", "slots", "block_tables", "seq_lens", "logits",
                           "tokens", "picked"}
    assert before["block_tables"][1] == (8, -(-MAX_TOTAL // BLOCK_SIZE))
    assert capturer.captures == 4
    padding_scenario(lm)
    # Re-capturing against a new cache keeps the same buffers.
    lm.allocate_kv_cache(NUM_BLOCKS)
    lm.capture_decode_graphs(MAX_TOTAL)
    assert lm.graphs is graphs
    padding_scenario(lm)
    after = {name: (t.data_ptr(), t.shape) for name, t in graphs.static_buffers().items()}
    assert after == before
    assert capturer.captures == 8 and capturer.replays == 2 * 8


def test_padding_rows_are_reset_when_a_batch_shrinks_within_a_bucket(folders):
    lm = load(folders["llama"], buckets=[4], capturer=EagerReplayCapturer())
    batch = lm.make_batch(0, [request(i, 5, 6) for i in range(4)])
    batch = lm.generate_token(batch)[1]
    batch = lm.generate_token(batch)[1]
    batch = lm.generate_token(batch)[1]  # both of the upload's mirrors have held 4 rows
    batch = lm.filter(batch, [1])
    graphs = lm.graphs
    for length in (8, 9):  # each mirror in turn, shrunk to one row
        batch = lm.generate_token(batch)[1]
        assert graphs.seq_lens[1:].tolist() == [0, 0, 0]
        assert graphs.slots[1:].tolist() == [0, 0, 0]
        assert graphs.block_tables[1:].abs().sum().item() == 0
        assert graphs.seq_lens[0].item() == length


def test_the_emulator_refuses_host_syncs_and_data_dependent_replays(folders):
    class Syncing(GraphSafePadded):
        def decode(self, q, key_cache, value_cache, meta, scale, window, softcap=None, sinks=None):
            meta.seq_lens.tolist()
            return super().decode(q, key_cache, value_cache, meta, scale, window, softcap)

    with pytest.raises(HostSyncError, match="Tensor.tolist inside a captured decode forward"):
        load(folders["llama"], buckets=[2], capturer=EagerReplayCapturer(), backend=Syncing)

    class Drifting(GraphSafePadded):
        calls = 0

        def decode(self, q, key_cache, value_cache, meta, scale, window, softcap=None, sinks=None):
            Drifting.calls += 1
            out = super().decode(q, key_cache, value_cache, meta, scale, window, softcap)
            return out * 1.0 if Drifting.calls > 2 * 2 else out  # 2 layers: probe + capture, then replays

    lm = load(folders["llama"], buckets=[2], capturer=EagerReplayCapturer(), backend=Drifting)
    batch = lm.make_batch(0, [request(0, 5, 4), request(1, 4, 4)])
    batch = lm.generate_token(batch)[1]
    with pytest.raises(GraphReplayMismatch, match="replay op"):
        lm.generate_token(batch)


def test_rotary_is_bounded_by_the_context_and_needs_no_host_sync(folders):
    """cos/sin come from the positions alone (nothing sized by the context, nothing read back
    from the device), and a position past the model's context is refused by the host bound."""
    lm = load(folders["llama"])
    rotary = lm.model.layers[0].self_attn.rotary
    assert all(layer.self_attn.rotary is rotary for layer in lm.model.layers)  # one per model
    assert rotary.max_positions == lm.config.max_context == 256
    assert not [b for b in rotary.buffers()] and rotary.inv_freq.numel() == lm.config.head_dim // 2
    with pytest.raises(ValueError, match="position 256 is past the 256 positions this model supports"):
        rotary.cos_sin(torch.tensor([3]), torch.float32, max_position=256)
    cos, sin = rotary.cos_sin(torch.tensor([0, 5]), torch.float16, max_position=5)
    assert cos.shape == (2, 1, lm.config.head_dim) and cos.dtype == torch.float16 and torch.all(cos[0] == 1)


def test_graphs_need_a_graph_safe_backend(folders):
    lm = load(folders["llama"], buckets=[1, 2], capturer=EagerReplayCapturer(), backend=None, capture=False)
    assert lm.attention.name == "torch-sdpa"
    assert "attention backend torch-sdpa is not graph-safe" in lm.graphs_off_reason()
    with pytest.raises(ValueError, match="CUDA graphs cannot be captured: attention backend torch-sdpa"):
        lm.capture_decode_graphs(MAX_TOTAL)


def test_cpu_ignores_graph_sizes_without_a_capturer(folders):
    from loguru import logger

    lines = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="DEBUG")
    try:
        lm = get_model(folders["llama"], dtype="float32", cuda_graphs=[1, 2, 4])
    finally:
        logger.remove(sink)
    assert lm.graph_buckets == []
    assert "CUDA graphs [1, 2, 4] ignored on cpu" in lines
    assert lm.graphs_off_reason() == "not on CUDA (cpu)"


def test_warmup_captures_twice_and_decodes_through_a_graph(folders):
    capturer = EagerReplayCapturer()
    lm = load(folders["llama"], buckets=[1, 2, 4], capturer=capturer, capture=False, max_batch_size=3)
    warm = [GenerationRequest(id=0, inputs="", input_ids=ids(20, 1), max_new_tokens=5)]
    supported = lm.warmup(warm, 24, 24, MAX_TOTAL, 0.5, max_batch_total_tokens=400)
    assert supported == 400
    assert lm.graphs.stats.captures == 2  # against the temporary cache, then the real one
    assert lm.graphs.stats.replays == {4: 1}  # the decode step at max_batch_size 3
    assert capturer.captures == 2 * 3
    eager = padding_scenario(load(folders["llama"]))
    lm.graphs.stats.replays.clear()
    assert_same(padding_scenario(lm), eager)
    assert lm.graphs.stats.replays == {4: 3, 2: 3, 1: 2}


# ---------------------------------------------------------------------------------------------
# triton-paged under Triton's interpreter (slow: few tokens)

def test_triton_paged_graph_path_under_the_interpreter(folders, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TGS_ATTENTION_BACKEND", "triton-paged")
    from text_generation_server.kernels import paged_attention

    # Splits of 8 positions, so short test contexts take the flash-decoding path (a graph fixes
    # 6 splits for 48 positions; eager steps choose theirs from the step's longest sequence).
    monkeypatch.setattr(paged_attention, "MIN_SPLIT_TOKENS", 8)

    def scenario(lm):
        rec = Recorder(lm)
        batch = lm.make_batch(0, [request(0, 6, 3), request(1, 3, 3, seed=2), request(2, 17, 3)])
        rec.steps(batch, 3)
        return rec.out

    eager = scenario(load(folders["mistral_window"], backend=None))
    lm = load(folders["mistral_window"], buckets=[4], capturer=EagerReplayCapturer(), backend=None)
    assert lm.attention.name == "triton-paged"
    assert_same(scenario(lm), eager)
    assert lm.graphs.stats.replays == {4: 2}
    memo = lm.graphs._memos[4]
    assert memo["num_splits"] == lm.attention.splits_for(4, MAX_TOTAL) == 6
    workspace = memo["decode_workspace"]
    assert workspace is not None and workspace[0].numel() >= 4 * lm.attention.spec.heads * 6


# ---------------------------------------------------------------------------------------------
# CudaGraphCapturer's pool lifetime, against a stand-in for torch.cuda with torch 2.11's rule

class _PoolLatch:
    """torch's graph-pool bookkeeping: a pool id's use count goes up per capture and down per
    destroyed graph; an id whose count went back to 0 can never be captured into again (the
    internal assert an H100 hit at warmup's second capture with torch 2.11)."""

    def __init__(self):
        self.use_count: dict[tuple[int, int], int] = {}

    def begin(self, pool_id: tuple[int, int]) -> None:
        if self.use_count.get(pool_id, 1) <= 0:
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED")
        self.use_count[pool_id] = self.use_count.get(pool_id, 0) + 1

    def release(self, pool_id: tuple[int, int]) -> None:
        self.use_count[pool_id] -= 1


def _fake_cuda(monkeypatch, latch: _PoolLatch) -> None:
    import contextlib

    class Stream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, other):
            pass

        def synchronize(self):
            pass

    class MemPool:
        def __init__(self):
            self.id = (1, 0)

    class CUDAGraph:
        def __init__(self):
            self.pool = None

        def capture_begin(self, pool=None):
            latch.begin(pool)
            self.pool = pool

        def capture_end(self):
            pass

        def __del__(self):
            if self.pool is not None:
                latch.release(self.pool)

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "MemPool", MemPool)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)


def test_capturer_keeps_its_pool_alive_when_every_graph_was_dropped(monkeypatch):
    """Warmup's pattern: capture the buckets, drop them all (the temporary KV cache goes), capture
    again into the same pool. The second round must find the pool alive."""
    import gc

    latch = _PoolLatch()
    _fake_cuda(monkeypatch, latch)
    capturer = CudaGraphCapturer(torch.device("cuda", 0))
    runs = []
    first = [capturer.capture(lambda: runs.append(1)) for _ in range(3)]
    del first
    gc.collect()
    second = [capturer.capture(lambda: runs.append(2)) for _ in range(3)]
    assert len(second) == 3 and runs == [1] * 6 + [2] * 6  # one eager run and one captured run each
    assert latch.use_count[(1, 0)] >= 3
    del capturer, second
    gc.collect()
    assert latch.use_count[(1, 0)] == 0  # nothing outlives the capturer


# ---------------------------------------------------------------------------------------------
# CUDA: real graphs

@needs_gpu
def test_cuda_graph_tokens_equal_eager(folders, monkeypatch):
    """float32 (IEEE dots in triton-paged): a bucket's padded GEMMs may sum in another order
    than the eager batch's, far below what could change a token; in half precision that
    difference is an ulp of the logits, which can flip a near tie, so tokens are compared here."""
    dtype = "float32"
    monkeypatch.setenv("TGS_ATTENTION_BACKEND", "triton-paged")
    dev = torch.device("cuda")

    def build(buckets):
        lm = get_model(folders["llama"], dtype=dtype, device=dev, block_size=16, cuda_graphs=buckets, max_batch_size=5)
        assert lm.attention.name == "triton-paged"
        warm = [GenerationRequest(id=0, inputs="", input_ids=ids(40, 1), max_new_tokens=5)]
        lm.warmup(warm, 64, 64, 128, 0.05, max_batch_total_tokens=4096)
        return lm

    def scenario(lm):
        rec = Recorder(lm)
        batch = lm.make_batch(0, [request(i, 5 + 7 * i, 24, seed=i if i % 2 else None) for i in range(5)])
        batch = rec.steps(batch, 8)
        batch = rec.steps(lm.filter(batch, [0, 2, 3]), 8)
        rec.steps(lm.filter(batch, [3]), 8)
        return rec.out

    eager_lm = build([])
    assert eager_lm.graphs is None
    lm = build([1, 2, 4, 8])
    assert lm.graphs.buckets == [1, 2, 4, 8]
    assert lm.graphs.stats.replays == {8: 1}  # warmup's decode step at max_batch_size
    lm.graphs.stats.replays.clear()
    assert lm.launch_ahead  # on by default on CUDA (engine/causal_lm.py): first the steps one by one
    lm.launch_ahead = False
    got, want = scenario(lm), scenario(eager_lm)
    for rid in want:
        assert [t for t, _ in got[rid]] == [t for t, _ in want[rid]], rid
    assert lm.graphs.stats.replays == {8: 7, 4: 8, 1: 8}
    assert not lm.graphs.stats.eager
    # Launch ahead: each decode step's successor enqueued before its host work, taken by the next
    # step, through both filters too (the launched step ran rows the filtered batch skips).
    one_by_one = sum(lm.graphs.stats.replays.values())
    lm.graphs.stats.replays.clear()
    lm.launch_ahead = True
    got = scenario(lm)
    for rid in want:
        assert [t for t, _ in got[rid]] == [t for t, _ in want[rid]], rid
    assert lm.launched_taken >= 18, (lm.launched_taken, lm.launched_dropped)
    assert sum(lm.graphs.stats.replays.values()) <= one_by_one + 1  # no step ran twice
    assert not lm.graphs.stats.eager
    # The second capture reused the pool the first one measured.
    first, second = lm.graphs.stats.capture_bytes
    assert second <= first // 4 + 2 * 2**20, lm.graphs.stats.capture_bytes
