"""Warmup's kernel timing (kernels/tuning.py, kernels/dispatch.py), on CPU with stand-ins.

Two stand-in kernels that can both run a 4-bit layer are paired the way TIMED_PAIRS pairs
triton-gemm and tinygemm on CUDA; timings are injected per kernel and row bucket (never the
clock). Checked: the dispatch runs the faster kernel per decode bucket and the first kernel for
every prompt, timing happens once per layer shape, the preferences file is written and read back
instead of timing, an override by name wins, a failed or wrong measurement keeps the static order,
and the rival's copy is dropped where no bucket takes it (or where it would not fit).
"""

from __future__ import annotations

import gc
import json
import weakref

import pytest
import torch
import torch.nn.functional as F
from helpers import make_weight, needs_gpu
from loguru import logger

from text_generation_server.kernels import select
from text_generation_server.kernels.base import LinearSpec, QuantizedWeight, QuantKernel, ReferenceKernel, dequantize
from text_generation_server.kernels.dense import DenseKernel
from text_generation_server.kernels.dispatch import KernelDispatch
from text_generation_server.kernels.phase import forward_phase
from text_generation_server.kernels.select import DISABLE_ENV, PREFER_ENV, build_linear, preferences, shape_key
from text_generation_server.kernels.table import TABLES, TIMED_PAIRS
from text_generation_server.kernels.tuning import tune_kernels

RUNS: list[tuple[str, int]] = []  # (kernel, rows) of every stand-in forward, in order


class StandInLinear(torch.nn.Module):
    """A stand-in build: the dequantized weight, a name, and `wrong` to compute something else."""

    def __init__(self, name: str, weight: QuantizedWeight, bias: torch.Tensor | None, act_dtype: torch.dtype):
        super().__init__()
        self.kernel_name = name
        self.weight_form = weight
        self.register_buffer("dense", dequantize(weight, act_dtype))
        self.register_buffer("bias", bias)
        self.wrong = False
        self.raises_at: set[int] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).shape[0]
        RUNS.append((self.kernel_name, rows))
        if rows in self.raises_at:
            raise RuntimeError("no kernel image for this row count")
        y = F.linear(x, self.dense, self.bias)
        return y * 2 if self.wrong else y

    def canonical_weight(self) -> QuantizedWeight:
        return self.weight_form


class First(QuantKernel):
    name = "stand-in-first"

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        return (True, "") if spec.weight_format == "int" else (False, "integer codes only")

    @classmethod
    def build(cls, weight, bias, act_dtype):
        return StandInLinear(cls.name, weight, bias, act_dtype)


class Rival(QuantKernel):
    name = "stand-in-rival"
    built: list[weakref.ref] = []

    @classmethod
    def can_implement(cls, spec: LinearSpec) -> tuple[bool, str]:
        return (True, "") if spec.weight_format == "int" and spec.bits <= 4 else (False, "4-bit codes only")

    @classmethod
    def build(cls, weight, bias, act_dtype):
        module = StandInLinear(cls.name, weight, bias, act_dtype)
        cls.built.append(weakref.ref(module))
        return module


@pytest.fixture(autouse=True)
def paired(monkeypatch, tmp_path):
    """The CPU table ranks the stand-ins first and pairs them; preferences in a fresh folder."""
    for env in (DISABLE_ENV, PREFER_ENV):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv(select.CACHE_ENV, str(tmp_path / "kernel-cache"))
    monkeypatch.setattr(select, "_PREFERENCES", {})
    monkeypatch.setattr(select, "_LOGGED", set())
    monkeypatch.setitem(TABLES, "cpu", (First, Rival, ReferenceKernel, DenseKernel))
    monkeypatch.setitem(TIMED_PAIRS, "cpu", ((First, Rival),))
    RUNS.clear()
    Rival.built = []


class Block(torch.nn.Module):
    def __init__(self, linear: torch.nn.Module):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def model() -> torch.nn.Sequential:
    """Three 4-bit 64x32 layers, one 4-bit 32x64 and one 8-bit 64x32 (the rival cannot run it)."""
    shapes = [(64, 32, 4), (64, 32, 4), (32, 64, 4), (64, 32, 4), (64, 32, 8)]
    return torch.nn.Sequential(*[
        Block(build_linear(make_weight(k, n, bits, 32, False, False, seed=i), torch.randn(n), torch.float32, "cpu",
                           f"layers.{i}"))
        for i, (k, n, bits) in enumerate(shapes)])


SPEC_A = make_weight(64, 32, 4, 32, False, False).spec(torch.float32, "cpu")  # layers 0, 1, 3
SPEC_B = make_weight(32, 64, 4, 32, False, False).spec(torch.float32, "cpu")  # layer 2


def stand_in_timer(seconds: dict[tuple[str, int], float], calls: list | None = None):
    """A select.Timer: runs the candidate once and answers the seconds injected for the kernel and
    row count it ran."""
    def timer(fn) -> float:
        RUNS.clear()
        fn()
        kernel, rows = RUNS[-1]
        if calls is not None:
            calls.append((kernel, rows))
        return seconds[(kernel, rows)]
    return timer


def both(first: float, rival: float, rows: int) -> dict[tuple[str, int], float]:
    return {(First.name, rows): first, (Rival.name, rows): rival}


# The rival is faster at 1 and 2 rows, the first kernel at 4 and 8.
SECONDS = {**both(2.0, 1.0, 1), **both(2.0, 1.5, 2), **both(1.0, 3.0, 4), **both(1.0, 2.0, 8)}


def ran(module: torch.nn.Module, rows: int, prefill: bool | None = None) -> str:
    RUNS.clear()
    x = torch.randn(rows, module.linear_spec.in_features)
    if prefill is None:
        module(x)
    else:
        with forward_phase(prefill=prefill):
            module(x)
    return RUNS[-1][0]


def log_lines() -> tuple[list[str], int]:
    lines: list[str] = []
    return lines, logger.add(lines.append, level="INFO", format="{message}")


# -- the dispatch ---------------------------------------------------------------------------------
def test_the_faster_kernel_runs_each_decode_bucket_and_prompts_take_the_first():
    m = model()
    calls: list = []
    lines, sink = log_lines()
    try:
        chosen = tune_kernels(m, [1, 2, 4, 8], timer=stand_in_timer(SECONDS, calls))
    finally:
        logger.remove(sink)
    per_bucket = {1: Rival.name, 2: Rival.name, 4: First.name, 8: First.name}
    assert chosen[shape_key(SPEC_A)] == per_bucket
    # Timed once per shape (the 64x32 and the 32x64), each kernel at each bucket: not per layer.
    assert sorted(calls) == sorted([(k, r) for r in (1, 2, 4, 8) for k in (First.name, Rival.name)] * 2)
    for i in (0, 1, 2, 3):
        layer = m[i].linear
        assert isinstance(layer, KernelDispatch) and list(layer.builds) == [First.name, Rival.name]
        assert layer.kernel_name == f"{First.name}+{Rival.name}"
        assert ran(layer, 1) == Rival.name and ran(layer, 2) == Rival.name
        assert ran(layer, 3) == First.name and ran(layer, 8) == First.name  # 3 rows: the 4-row bucket
        assert ran(layer, 16) == First.name  # not measured: the static order
        # A prompt takes the first kernel whatever its row count: a chunk and its remainder alike.
        assert {ran(layer, rows, prefill=True) for rows in (1, 2, 5, 40)} == {First.name}
        assert ran(layer, 1, prefill=False) == Rival.name
    assert isinstance(m[4].linear, StandInLinear) and m[4].linear.kernel_name == First.name  # no rival for 8-bit
    x = torch.randn(2, 64)
    assert torch.allclose(m[0](x), F.linear(x, m[0].linear.builds[First.name].dense, m[0].linear.builds[First.name].bias))
    summary = [line for line in lines if line.startswith(f"kernels for {shape_key(SPEC_A)}")]
    assert summary == [f"kernels for {shape_key(SPEC_A)} (3 layers, measured): decode rows<=1 {Rival.name}, "
                       f"rows<=2 {Rival.name}, rows<=4 {First.name}, rows<=8 {First.name}; prompts {First.name}; "
                       f"{Rival.name} copies kept for 3 layers (+0.0 MiB)\n"]


def test_the_choices_are_cached_per_device_and_the_next_start_reads_them():
    tune_kernels(model(), [1, 2, 4, 8], timer=stand_in_timer(SECONDS))
    path = preferences("cpu").path
    data = json.loads(path.read_text())
    assert data["signature"] == select.device_signature("cpu")
    entry = data["choices"][shape_key(SPEC_A)]
    assert entry["kernel rows<=1"] == {"choice": Rival.name, "ms": {First.name: 2000.0, Rival.name: 1000.0}}
    assert {k: v["choice"] for k, v in entry.items()} == {
        "kernel rows<=1": Rival.name, "kernel rows<=2": Rival.name, "kernel rows<=4": First.name,
        "kernel rows<=8": First.name}
    select._PREFERENCES.clear()  # a new process reads the file

    def no_timing(fn):
        raise AssertionError("a cached bucket was timed again")

    again = model()
    lines, sink = log_lines()
    try:
        chosen = tune_kernels(again, [1, 2, 4, 8], timer=no_timing)
    finally:
        logger.remove(sink)
    assert chosen[shape_key(SPEC_A)] == {1: Rival.name, 2: Rival.name, 4: First.name, 8: First.name}
    assert isinstance(again[0].linear, KernelDispatch) and ran(again[0].linear, 1) == Rival.name
    assert any("(3 layers, from this machine's kernel cache)" in line for line in lines)
    # A bucket the cache lacks (16) is the only one timed.
    calls: list = []
    tune_kernels(model(), [1, 16], timer=stand_in_timer(both(1.0, 2.0, 16), calls))
    assert sorted(calls) == sorted([(First.name, 16), (Rival.name, 16)] * 2)


def test_a_variant_choice_and_a_kernel_choice_of_one_shape_are_kept_apart():
    prefs = preferences("cpu")
    prefs.record(SPEC_A, 4, "gemv", {"gemv": 1e-3})
    prefs.record(SPEC_A, 4, Rival.name, {Rival.name: 1e-3}, scope="kernel")
    assert prefs.row_choices(SPEC_A) == {4: "gemv"}
    assert prefs.row_choices(SPEC_A, "kernel") == {4: Rival.name}


# -- the overrides ----------------------------------------------------------------------------------
@pytest.mark.parametrize("prefer", [Rival.name, First.name])
def test_a_kernel_named_by_the_operator_wins_and_nothing_is_timed(prefer, monkeypatch):
    monkeypatch.setenv(PREFER_ENV, prefer)

    def no_timing(fn):
        raise AssertionError("timed despite the override")

    m = model()
    assert tune_kernels(m, [1, 2, 4, 8], timer=no_timing) == {}
    assert {m[i].linear.kernel_name for i in range(4)} == {prefer}
    assert not any(isinstance(m[i].linear, KernelDispatch) for i in range(5))


def test_a_disabled_rival_is_not_timed(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, Rival.name)
    m = model()
    assert tune_kernels(m, [1, 2], timer=stand_in_timer(SECONDS)) == {} and not Rival.built
    assert all(isinstance(m[i].linear, StandInLinear) for i in range(5))


def test_a_whole_layer_measurement_stands():
    preferences("cpu").record(SPEC_A, None, First.name, {First.name: 1e-3})
    chosen = tune_kernels(model(), [1], timer=stand_in_timer(SECONDS))
    assert list(chosen) == [shape_key(SPEC_B)]  # only the other shape was timed


# -- failures keep the static order -------------------------------------------------------------------
def test_a_rival_that_raises_at_a_bucket_leaves_that_bucket_to_the_first_kernel(monkeypatch):
    build = Rival.build.__func__

    def raising_build(cls, weight, bias, act_dtype):
        module = build(cls, weight, bias, act_dtype)
        module.raises_at = {1}
        return module

    monkeypatch.setattr(Rival, "build", classmethod(raising_build))
    m = model()
    chosen = tune_kernels(m, [1, 2, 4, 8], timer=stand_in_timer(SECONDS))
    assert chosen[shape_key(SPEC_A)] == {1: First.name, 2: Rival.name, 4: First.name, 8: First.name}
    assert preferences("cpu").row_choices(SPEC_A, "kernel") == {1: First.name, 2: Rival.name, 4: First.name,
                                                                8: First.name}


def test_a_wrong_rival_is_never_chosen_and_its_copy_is_dropped(monkeypatch):
    build = Rival.build.__func__

    def wrong_build(cls, weight, bias, act_dtype):
        module = build(cls, weight, bias, act_dtype)
        module.wrong = True
        return module

    monkeypatch.setattr(Rival, "build", classmethod(wrong_build))
    m = model()
    lines, sink = log_lines()
    try:
        chosen = tune_kernels(m, [1, 2], timer=stand_in_timer(SECONDS))
    finally:
        logger.remove(sink)
    assert chosen[shape_key(SPEC_A)] == {1: First.name, 2: First.name}
    assert any(f"{Rival.name} left out, its result differs" in line for line in lines)
    assert all(isinstance(m[i].linear, StandInLinear) and m[i].linear.kernel_name == First.name for i in range(5))
    gc.collect()
    assert Rival.built and all(ref() is None for ref in Rival.built)  # the timed copy is gone


def test_a_failing_timer_or_rival_build_keeps_the_static_order(monkeypatch):
    def broken(fn):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    m = model()
    assert set(tune_kernels(m, [1, 2], timer=broken)[shape_key(SPEC_A)].values()) == {First.name}
    assert all(isinstance(m[i].linear, StandInLinear) for i in range(5))

    def refuses(cls, weight, bias, act_dtype):
        raise ValueError("stand-in-rival cannot run this weight")

    monkeypatch.setattr(Rival, "build", classmethod(refuses))
    m = model()
    assert tune_kernels(m, [1], timer=stand_in_timer(SECONDS)) == {}
    assert all(isinstance(m[i].linear, StandInLinear) for i in range(5))


# -- memory ---------------------------------------------------------------------------------------
def test_the_rivals_copy_is_dropped_where_no_bucket_takes_it():
    m = model()
    lines, sink = log_lines()
    try:
        chosen = tune_kernels(m, [4, 8], timer=stand_in_timer(SECONDS))  # the first kernel wins both
    finally:
        logger.remove(sink)
    assert chosen[shape_key(SPEC_A)] == {4: First.name, 8: First.name}
    assert all(isinstance(m[i].linear, StandInLinear) for i in range(5))
    gc.collect()
    assert len(Rival.built) == 2 and all(ref() is None for ref in Rival.built)  # one timed copy per shape, gone
    assert any(f"{Rival.name}'s copy dropped ({First.name} measured faster at every decode batch size)" in line
               for line in lines)
    # A later warmup whose buckets the rival wins turns the layers into dispatches; one whose
    # buckets it loses again (the cache) unwraps them: the rival's copies go.
    tune_kernels(m, [1, 4], timer=stand_in_timer(SECONDS))
    assert isinstance(m[0].linear, KernelDispatch) and ran(m[0].linear, 1) == Rival.name
    copy = weakref.ref(m[0].linear.builds[Rival.name])
    tune_kernels(m, [4, 8], timer=stand_in_timer(SECONDS))
    assert isinstance(m[0].linear, StandInLinear)
    gc.collect()
    assert copy() is None


def test_copies_that_would_not_leave_the_kv_cache_its_memory_are_not_made():
    m = model()
    lines, sink = log_lines()
    try:
        chosen = tune_kernels(m, [1, 2], timer=stand_in_timer(SECONDS), keep_free_bytes=1 << 20,
                              memory=lambda device: (1 << 20, 1 << 30))
    finally:
        logger.remove(sink)
    assert chosen[shape_key(SPEC_A)] == {1: First.name, 2: First.name}
    assert all(isinstance(m[i].linear, StandInLinear) for i in range(5))
    assert any("would leave" in line and f"{First.name} runs every batch" in line for line in lines)
    # With room for them, the copies are made.
    select._PREFERENCES.clear()
    m = model()
    tune_kernels(m, [1, 2], timer=stand_in_timer(SECONDS), keep_free_bytes=1 << 20,
                 memory=lambda device: (1 << 30, 1 << 30))
    assert isinstance(m[0].linear, KernelDispatch)


def test_without_a_pair_nothing_is_timed(monkeypatch):
    monkeypatch.setitem(TIMED_PAIRS, "cpu", ())  # as on CPU today (test_kernel_select pins the pairs)
    m = model()
    assert tune_kernels(m, [1, 2, 4], timer=stand_in_timer(SECONDS)) == {}
    assert not RUNS and all(isinstance(m[i].linear, StandInLinear) for i in range(5))


# -- warmup ---------------------------------------------------------------------------------------------
def test_warmup_times_the_graph_batch_sizes_once_per_shape_before_the_graphs_capture(tmp_path, monkeypatch):
    """An int8 model served with CUDA graphs 1, 2, 4 (the CPU's stand-in capturer) and at most 2
    requests, the stand-ins paired for its layers: warmup times each layer shape at 1 and 2 rows
    (the graphs it captures) before any capture,
    decode steps replay with the rival at 1-2 rows, prompts run the first kernel, and the tokens
    are those of the same model without the pair (the stand-ins compute the same product)."""
    from helpers import ids_request, random_ids, run_to_end, write_checkpoint

    from text_generation_server.engine.cuda_graphs import EagerReplayCapturer
    from text_generation_server.kernels import tuning
    from text_generation_server.layers.attention import TorchAttention, padded_decode
    from text_generation_server.models.loader import get_model

    class GraphSafePadded(TorchAttention):
        name, graph_safe = "torch-padded", True

        def decode(self, q, key_cache, value_cache, meta, scale, window, softcap=None, sinks=None):
            return padded_decode(q, key_cache, value_cache, meta, scale, window, softcap, sinks)

        def capture_memo(self, batch, max_seq_len, device):
            return {}

    monkeypatch.setattr(Rival, "can_implement", classmethod(lambda cls, spec: (spec.weight_format == "int", "")))
    write_checkpoint(tmp_path / "m", "llama", seed=3, hidden_size=64, intermediate_size=128)

    def load(graphs: bool):
        lm = get_model(str(tmp_path / "m"), dtype="float32", quantize="eetq", block_size=4,
                       cuda_graphs=[1, 2, 4] if graphs else [], max_batch_size=2,
                       graph_capturer=EagerReplayCapturer() if graphs else None)
        lm.attention = GraphSafePadded(lm.attention.spec)
        return lm

    order: list[str] = []
    timer = stand_in_timer(SECONDS)
    monkeypatch.setattr(tuning, "wall_timer", lambda fn: (order.append("time"), timer(fn))[1])
    lm = load(graphs=True)
    capture = lm.capture_decode_graphs
    monkeypatch.setattr(lm, "capture_decode_graphs", lambda *a, **kw: (order.append("capture"), capture(*a, **kw))[1])
    firsts = [m for m in lm.model.modules() if getattr(m, "kernel_name", None) == First.name]
    shapes = {shape_key(m.linear_spec) for m in firsts}
    lm.warmup([ids_request(0, random_ids(12, 1), 2)], 24, 24, 48, 0.5, max_batch_total_tokens=400)
    # The graphs warmup captures: 1 and 2 (max_batch_size 2), each shape timed at both, with both kernels.
    assert lm.graphs is not None and lm.graphs.buckets == [1, 2]
    assert order.count("time") == len(shapes) * 2 * 2 and "time" not in order[order.index("capture"):]
    dispatches = [m for m in lm.model.modules() if isinstance(m, KernelDispatch)]
    assert len(dispatches) == len(firsts) and {id(m.builds[First.name]) for m in dispatches} == set(map(id, firsts))
    assert all(m.measured == {1: Rival.name, 2: Rival.name} for m in dispatches)
    RUNS.clear()
    prompts = [random_ids(9, 2), random_ids(5, 3)]
    got = run_to_end(lm, lm.make_batch(1, [ids_request(i, p, 4) for i, p in enumerate(prompts)]))
    assert sum(lm.graphs.stats.replays.values()) > 0
    prefill_rows = sum(len(p) for p in prompts)
    assert (First.name, prefill_rows) in RUNS and (Rival.name, prefill_rows) not in RUNS
    assert {kernel for kernel, rows in RUNS if rows <= 2} == {Rival.name}
    twin = load(graphs=False)
    twin.allocate_kv_cache(64)
    want = run_to_end(twin, twin.make_batch(1, [ids_request(i, p, 4) for i, p in enumerate(prompts)]))
    assert {r: v["ids"] for r, v in got.items()} == {r: v["ids"] for r, v in want.items()}


# -- CUDA (skipped without a GPU) ------------------------------------------------------------------------
@needs_gpu
def test_cuda_triton_gemm_and_tinygemm_timed_with_cuda_events():
    """The real pair on the GPU: cuda_timer's figures, a choice per bucket recorded with both
    kernels' times, every bucket's output against the dequantized weight, and a dispatch captured
    in a CUDA graph replaying what it computes eagerly."""
    from text_generation_server.kernels import tinygemm as tgm
    from text_generation_server.kernels.tuning import cuda_timer

    dev = torch.device("cuda")
    spec = make_weight(1024, 1024, 4, 128, True, False).spec(torch.bfloat16, "cuda")
    if not tgm.TinyGemmKernel.can_implement(spec)[0]:
        pytest.skip(f"no tinygemm here: {tgm.TinyGemmKernel.can_implement(spec)[1]}")
    weights = [make_weight(1024, 1024, 4, 128, True, False, seed=i) for i in range(3)]
    m = torch.nn.Sequential(*[Block(build_linear(QuantizedWeight(w.qweight.to(dev), w.scales.to(dev), None,
                                                                 w.g_idx.to(dev), 4, 128), None, torch.bfloat16,
                                                 "cuda", f"layers.{i}")) for i, w in enumerate(weights)])
    x = torch.randn(16, 1024, device=dev, dtype=torch.bfloat16)
    seconds = cuda_timer(lambda: m[0].linear(x[:1]))
    assert 0 < seconds < 1e-2
    chosen = tune_kernels(m, [1, 2, 16])
    key = shape_key(m[0].linear.linear_spec)
    assert set(chosen) == {key} and set(chosen[key]) == {1, 2, 16}
    entry = json.loads(preferences("cuda").path.read_text())["choices"][key]
    assert set(entry["kernel rows<=1"]["ms"]) == {"triton-gemm", "tinygemm"}
    for i, w in enumerate(weights):
        layer = m[i].linear
        want = x.double() @ dequantize(w, torch.float64).to(dev).t()
        for rows in (1, 2, 16):
            got = layer(x[:rows]).double()
            assert ((got - want[:rows]).norm() / want[:rows].norm()).item() < 1.5e-2
    layer = m[0].linear
    static_x = x[:1].clone()
    eager = layer(static_x).clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(static_x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
