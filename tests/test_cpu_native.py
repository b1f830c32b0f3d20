"""The native CPU kernels (kernels/cpu_native.py): built here, exact against the reference in every
row band (matrix-vector up to 8 rows, torch's op in between, dequantized bf16 GEMM from 32/64
rows), over several dequantization chunks, and torch's ops when they are switched off or cannot
be built.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from helpers import make_weight
from test_kernels import BOUND, rel_err

from text_generation_server.kernels import cpu, cpu_native
from text_generation_server.kernels.base import QuantizedWeight

torch.set_num_threads(2)


@pytest.fixture
def fresh_native():
    """Each test decides availability anew and leaves the process as it found it."""
    cpu_native.reset()
    yield
    cpu_native.reset()


class Recorder:
    """The extension's functions, counted per call."""

    def __init__(self, module):
        self.module = module
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        fn = getattr(self.module, name)

        def counted(*args):
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args)

        return counted


def test_the_extension_builds_on_a_machine_with_a_compiler(fresh_native):
    module = cpu_native.native()
    if shutil.which("c++") or shutil.which("g++"):
        assert module is not None, cpu_native.unavailable_reason()
        assert cpu_native.unavailable_reason() == ""
        assert cpu_native.native() is module  # built (or loaded) once per process
    else:
        assert module is None and "could not be built" in cpu_native.unavailable_reason()


@pytest.fixture
def native():
    module = cpu_native.native()
    if module is None:  # the test above fails on such a machine and says why
        pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")
    return module


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 31, 32, 77])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
def test_int8_rows_in_every_band_match_the_reference(native, rows, sym, monkeypatch):
    monkeypatch.setattr(cpu_native, "DEQUANT_ROWS", 64)  # N=200: four dequantized chunks, the last one short
    k, n = 192, 200
    w = make_weight(k, n, 8, k, sym, False, seed=rows)
    bias = torch.randn(n)
    for dtype in (torch.bfloat16, torch.float32):
        module = cpu.CpuInt8Kernel.build(w, bias, dtype)
        recorder = Recorder(native)
        module.native = recorder
        assert rel_err(w, module, dtype, bias, lead=(rows,)) < BOUND[dtype]
        if rows <= cpu_native.INT8_GEMV_MAX_ROWS:
            assert recorder.calls == {"int8_gemv": 1}
        elif rows < cpu_native.INT8_DEQUANT_MIN_ROWS:
            assert recorder.calls == {}  # torch's _weight_int8pack_mm
        else:
            assert recorder.calls == {"int8_dequant": 4}


def test_int8_gemv_is_exact_in_float32(native):
    """Against a float64 product of the same int8 codes and scales: only float32 accumulation differs."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-128, 128, (96, 320), generator=gen, dtype=torch.int8)
    s = torch.rand(96, generator=gen)
    for rows in range(1, 9):
        x = torch.randn(rows, 320, generator=gen)
        ref = x.double() @ (q.double() * s.double()[:, None]).t()
        got = native.int8_gemv(x, q, s, cpu_native.PREFETCH_BYTES)
        assert ((got.double() - ref).abs().max() / ref.abs().max()).item() < 1e-6


def test_int8_gemv_rejects_what_it_cannot_run(native):
    q = torch.zeros(8, 32, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="at least one row"):
        native.int8_gemv(torch.zeros(0, 32), q, torch.ones(8), 0)
    with pytest.raises(RuntimeError, match="x must be"):
        native.int8_gemv(torch.zeros(1, 16), q, torch.ones(8), 0)


@pytest.mark.parametrize("rows", [1, 63, 64, 130])
@pytest.mark.parametrize("case", [
    (256, 192, 4, 64, False, False),  # three 64-row blocks
    (256, 128, 4, 128, True, True),  # act-order: the input is permuted first
    (384, 64, 4, 32, False, True),
    (256, 80, 4, 128, False, False),  # N not a multiple of 64: torch's op at every size
], ids=str)
def test_int4_prompt_rows_match_the_reference(native, rows, case, monkeypatch):
    monkeypatch.setattr(cpu_native, "DEQUANT_ROWS", 64)  # one 64-row block per chunk
    k, n, bits, gs, sym, act = case
    w = make_weight(k, n, bits, gs, sym, act, seed=rows + n)
    module = cpu.CpuInt4PackKernel.build(w, None, torch.bfloat16)
    recorder = Recorder(native)
    module.native = recorder
    assert rel_err(w, module, torch.bfloat16, None, lead=(rows,)) < BOUND[torch.bfloat16]
    # (without a layout the native kernels read, torch's int4 layout at this CPU capability: torch's op)
    expected = n // 64 if rows >= cpu_native.INT4_DEQUANT_MIN_ROWS and cpu_native.int4_dequant_fits(n) and n % 64 == 0 else 0
    assert recorder.calls.get("int4pack_dequant_t", 0) == expected


def test_int4_dequantized_gemm_agrees_with_torchs_op(native):
    """The same packed weight through both paths: they differ by bf16 rounding only."""
    w = make_weight(512, 256, 4, 128, False, False, seed=5)
    module = cpu.CpuInt4PackKernel.build(w, None, torch.bfloat16)
    x = torch.randn(96, 512).to(torch.bfloat16)
    ours = module(x).double()
    module.native = None
    theirs = module(x).double()
    assert ((ours - theirs).norm() / theirs.norm()).item() < 5e-3


def test_switched_off_every_layer_uses_torchs_ops(fresh_native, monkeypatch):
    monkeypatch.setenv(cpu_native.ENV, "0")
    assert cpu_native.native() is None
    assert cpu_native.unavailable_reason() == f"disabled by {cpu_native.ENV}=0"
    w = make_weight(128, 64, 8, 128, False, False, seed=1)
    module = cpu.CpuInt8Kernel.build(w, None, torch.bfloat16)
    assert module.native is None
    for rows in (1, 40):
        assert rel_err(w, module, torch.bfloat16, None, lead=(rows,)) < BOUND[torch.bfloat16]


def test_a_failed_build_falls_back_and_says_why(fresh_native, monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension\nc++: command not found")

    monkeypatch.delenv(cpu_native.ENV, raising=False)
    monkeypatch.setattr(cpp_extension, "load_inline", no_compiler)
    assert cpu_native.native() is None
    assert cpu_native.unavailable_reason() == "could not be built: RuntimeError: c++: command not found"
    q = torch.randint(0, 16, (64, 32), dtype=torch.uint8)
    w = QuantizedWeight(q, torch.rand(1, 32), None, torch.zeros(64, dtype=torch.int32), 4, 64)
    module = cpu.CpuInt4PackKernel.build(w, None, torch.bfloat16)
    assert module.native is None
    assert rel_err(w, module, torch.bfloat16, None, lead=(70,)) < BOUND[torch.bfloat16]


HOLD_FLOCK = """
import fcntl, os, sys, time
handle = open(os.path.join(sys.argv[1], sys.argv[2]), "a")
fcntl.flock(handle, fcntl.LOCK_EX)
open(os.path.join(sys.argv[1], sys.argv[3]), "w").close()  # torch's baton, as a build in progress has it
print("held", flush=True)
time.sleep(600)
"""


def hold_build_lock(build_dir) -> subprocess.Popen:
    """A process that holds the build lock and torch's baton, as a build in progress does."""
    child = subprocess.Popen([sys.executable, "-c", HOLD_FLOCK, str(build_dir), cpu_native.FLOCK, cpu_native.BATON],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_killed_build_leaves_no_lock_behind(tmp_path):
    """torch's baton outlives a killed build; ours does not, so the next build goes on."""
    child = hold_build_lock(tmp_path)
    child.kill()
    child.wait()
    assert (tmp_path / cpu_native.BATON).exists()
    with cpu_native.build_lock(str(tmp_path)):
        assert not (tmp_path / cpu_native.BATON).exists()


def test_a_baton_held_open_by_a_build_without_our_lock_stays(tmp_path):
    """A build by code without the fcntl lock (an older version sharing the cache) holds torch's baton
    open: it is that build's, not a dead one's, and stays."""
    baton = tmp_path / cpu_native.BATON
    with open(baton, "w"):
        assert cpu_native.baton_in_use(str(baton))
        with cpu_native.build_lock(str(tmp_path)):
            assert baton.exists()
    assert not cpu_native.baton_in_use(str(baton))


def test_a_live_build_is_waited_for(tmp_path):
    child = hold_build_lock(tmp_path)
    entered = threading.Event()

    def build():
        with cpu_native.build_lock(str(tmp_path)):
            entered.set()

    thread = threading.Thread(target=build)
    thread.start()
    try:
        assert not entered.wait(1.0), "entered while another process held the lock"
        assert (tmp_path / cpu_native.BATON).exists()  # a live builder's baton stays
    finally:
        child.kill()
        child.wait()
    assert entered.wait(30.0)
    thread.join()


def test_the_extension_loads_past_a_dead_builds_lock(native):
    """A killed build's baton in the real build directory: a new process loads the extension anyway
    (torch's lock alone waits for it forever)."""
    baton = os.path.join(cpu_native.build_directory(cpu_native.build_name()), cpu_native.BATON)
    assert not os.path.exists(baton)
    open(baton, "w").close()
    try:
        done = subprocess.run([sys.executable, "-c", "from text_generation_server.kernels import cpu_native\n"
                               "assert cpu_native.native() is not None, cpu_native.unavailable_reason()"],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert "left by a build whose process is gone" in done.stderr
        assert not os.path.exists(baton)
    finally:
        if os.path.exists(baton):
            os.remove(baton)


def test_build_name_depends_on_the_cpu(monkeypatch):
    first = cpu_native.build_name()
    monkeypatch.setattr(cpu_native, "cpu_signature", lambda: "model name: another CPU\nflags: sse2\n")
    assert cpu_native.build_name() != first and cpu_native.build_name().startswith("tgs_cpu_native_")


def test_copies_of_a_layer_share_the_extension(native):
    import copy

    module = cpu.CpuInt8Kernel.build(make_weight(64, 32, 8, 64, True, False), None, torch.bfloat16)
    clone = copy.deepcopy(module)
    assert clone.native is module.native and clone.weight.data_ptr() != module.weight.data_ptr()
    x = torch.randn(2, 64).to(torch.bfloat16)
    assert torch.equal(clone(x), module(x))


def test_int8_rows_past_the_inner_size_limit_stay_on_torchs_op(native, monkeypatch):
    monkeypatch.setattr(cpu_native, "INT8_GEMV_MAX_K", 128)  # K=192 is past it
    w = make_weight(192, 64, 8, 192, True, False, seed=2)
    module = cpu.CpuInt8Kernel.build(w, None, torch.bfloat16)
    recorder = Recorder(native)
    module.native = recorder
    for rows in (1, 8, 40):
        assert rel_err(w, module, torch.bfloat16, None, lead=(rows,)) < BOUND[torch.bfloat16]
    assert recorder.calls == {"int8_dequant": 1}  # 40 rows: dequantized; 1 and 8 rows: torch's op


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("k,n", [(192, 200), (100, 37), (1536, 64)], ids=str)  # tails of K and of N
def test_bf16_matrix_vector_product_matches_float_arithmetic(native, rows, k, n):
    g = torch.Generator().manual_seed(rows + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    got = native.bf16_gemv(x.float(), w, cpu_native.PREFETCH_BYTES)
    want = x.double() @ w.double().t()
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5  # float32 sums of exact products


@pytest.mark.parametrize("k,n", [(200, 37), (1536, 50)], ids=str)  # tails of K; N past each tile's outputs
def test_bf16_product_rows_bits_do_not_depend_on_the_batch(native, k, n):
    # bfloat16 x: vdpbf16ps with AVX512-BF16, in tiles of 1-8 rows x 2-4 outputs by the row count
    g = torch.Generator().manual_seed(k + n)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(8, k, generator=g).bfloat16()
    alone = torch.cat([native.bf16_gemv(x[m:m + 1], w, cpu_native.PREFETCH_BYTES) for m in range(8)])
    for rows in range(2, 9):
        assert torch.equal(native.bf16_gemv(x[:rows], w, cpu_native.PREFETCH_BYTES), alone[:rows]), rows
    want = x.double() @ w.double().t()
    assert ((alone.double() - want).abs().max() / want.abs().max()).item() < 1e-5


def test_bf16_dense_layers_and_the_head_take_decode_rows_natively(native):
    from text_generation_server.kernels.dense import DenseLinear
    from text_generation_server.layers.tensor_parallel import TensorParallelHead
    from text_generation_server.quantizers.dist import single_process_group

    g = torch.Generator().manual_seed(7)
    w, b = torch.randn(96, 64, generator=g).bfloat16(), torch.randn(96, generator=g).bfloat16()
    for layer, bias in ((DenseLinear(w, b), b), (TensorParallelHead(w, 96, single_process_group(), b), b),
                        (DenseLinear(w, None), None)):
        assert layer.native is native
        recorder = Recorder(native)
        layer.native = recorder
        for lead in ((1,), (2,), (1, 2), (3,), (8,), (9,), (40,)):
            x = torch.randn(*lead, 64, generator=g).bfloat16()
            want = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float())
            got = layer(x)
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            assert ((got.float() - want).abs().max() / want.abs().max()).item() < BOUND[torch.bfloat16]
        # 1, 2 and 1x2 rows natively; with AVX512-BF16 also 3 and 8 (vdpbf16ps, the weights read once
        # per 8 rows). Past the bound (9 and 40 rows; 3 and 8 without AVX512-BF16): torch's GEMM, or on a
        # build without AVX512-BF16 (an AVX2 machine, TGS_CPU_ISA=avx2) the native one (bf16_gemm_fits)
        bf16_dot = bool(native.bf16_gemm_has_bf16_dot())
        assert cpu_native.dense_gemv_max_rows(native, w) == (8 if bf16_dot else 2)
        gemm = {"bf16_gemm": 2 if bf16_dot else 4} if cpu_native.bf16_gemm_fits(native, w) else {}
        assert recorder.calls == {"bf16_gemv": 5 if bf16_dot else 3, **gemm}
    # float32 weights: the float32 matrix-vector product (tests/test_cpu_dense_gemv.py)
    layer = DenseLinear(w, None).to(torch.float32)
    assert layer.native is native and layer(torch.randn(1, 64)).dtype == torch.float32


def test_bf16_layers_keep_torchs_gemm_when_native_kernels_are_off(fresh_native, monkeypatch):
    from text_generation_server.kernels.dense import DenseLinear

    monkeypatch.setenv(cpu_native.ENV, "0")
    w = torch.randn(32, 16).bfloat16()
    layer = DenseLinear(w, None)
    x = torch.randn(1, 16).bfloat16()
    assert layer.native is None and torch.equal(layer(x), torch.nn.functional.linear(x, w))


def test_layers_take_no_rows(native):
    """A head asked for no logits (a prompt chunk that does not end its prompt) gets zero rows: every
    CPU layer returns an empty result in both phases (the int8 matrix-vector kernel refuses 0 rows)."""
    from text_generation_server.kernels.phase import forward_phase

    for w in (make_weight(128, 64, 8, 128, True, False, seed=3), make_weight(128, 64, 4, 64, False, False, seed=3)):
        kernel = cpu.CpuInt8Kernel if w.bits == 8 else cpu.CpuInt4PackKernel
        module = kernel.build(w, None, torch.bfloat16)
        for prefill in (False, True):
            with forward_phase(prefill):
                y = module(torch.zeros(0, 128, dtype=torch.bfloat16))
            assert y.shape == (0, 64) and y.dtype == torch.bfloat16
