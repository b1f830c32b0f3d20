"""The int8 matrix-vector kernel (cpu_native.int8_gemv) at any row count, and the int8 head that runs
every row count on it (Int8Linear.keep_rows_invariant): exact in float32, and a row's bits do not
depend on the rows beside it, the prefetch distance or the thread count, so a sequence's greedy token
does not depend on what decodes beside it. Runs on any x86-64 or aarch64 CPU with a compiler (the
kernel's AVX-512, AVX2 and generic code are one source)."""

from __future__ import annotations

import pytest
import torch
from family_cases import write_family_checkpoint
from helpers import make_weight

from text_generation_server.kernels import cpu, cpu_native
from text_generation_server.kernels.phase import forward_phase

torch.set_num_threads(2)


def int8_case(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, generator=g) * 0.01 + 1e-3
    return w, s


def test_the_kernel_is_exact_in_float32_at_any_row_count(native):
    w, s = int8_case(96, 200, seed=1)  # K = 200: a tail past the 64-, 32- and 16-wide steps
    wb = torch.randn(96, 200).bfloat16()
    for rows in (1, 8, 13):
        x = torch.randn(rows, 200).bfloat16()
        got = cpu_native.int8_gemv(native, x, w, s, torch.float32)
        want = (x.double() @ w.double().t()) * s.double()
        assert got.shape == (rows, 96)
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
        got_b, want_b = native.bf16_gemv(x, wb, 0), x.double() @ wb.double().t()
        assert ((got_b.double() - want_b).abs().max() / want_b.abs().max()).item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_a_rows_bits_do_not_depend_on_its_neighbours_the_prefetch_or_the_threads(native, dtype):
    # bfloat16 x: vdpbf16ps where the CPU has AVX512-BF16; float32 x: float FMAs (K = 336: a tail either way)
    w, s = int8_case(160, 336, seed=2)
    x = torch.randn(29, 336).to(dtype)
    whole = cpu_native.int8_gemv(native, x, w, s, torch.float32)
    for rows in ([0], [3, 4], list(range(8)), [18, 2, 7], list(range(5, 19)), list(range(29))[::-1]):
        assert torch.equal(cpu_native.int8_gemv(native, x[rows], w, s, torch.float32), whole[rows]), rows
    for name, distance in cpu_native.INT8_GEMV_VARIANTS.items():
        assert torch.equal(cpu_native.int8_gemv(native, x, w, s, torch.float32, distance), whole), name
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_native.int8_gemv(native, x, w, s, torch.float32), whole)
    finally:
        torch.set_num_threads(threads)
    # bfloat16 weights: the same kernel, the same rule
    wb = torch.randn(160, 336).bfloat16()
    whole_b = native.bf16_gemv(x, wb, 0)
    for rows in ([11, 3], list(range(9, 29))):
        assert torch.equal(native.bf16_gemv(x[rows], wb, 0), whole_b[rows])


def test_a_row_invariant_layer_runs_every_row_count_and_phase_on_the_kernel(native):
    weight = make_weight(256, 192, 8, 256, True, False, seed=3)
    layer = cpu.CpuInt8Kernel.build(weight, None, torch.bfloat16)
    assert not layer.row_invariant and layer.static_variant(20) == "op" and layer.prompt_variant() == "dequant"
    assert layer.keep_rows_invariant()
    for rows in (1, 9, 20, 40, 70):
        assert layer.variants(rows) == tuple(cpu_native.INT8_GEMV_VARIANTS)
        assert layer.static_variant(rows) == "gemv"
    assert layer.prompt_variant() == "gemv"
    layer.measured.update({1: "op", 8: "gemv-pf0"})  # a stale name is ignored; a prefetch distance is taken
    assert layer.static_variant(40) == "gemv-pf0" and layer.prompt_variant() == "gemv-pf0"
    x = torch.randn(45, 256).bfloat16()
    with torch.inference_mode():
        whole = layer(x)
        for rows in ([7], [0, 44], list(range(9)), list(range(3, 36))):
            assert torch.equal(layer(x[rows]), whole[rows]), rows
        with forward_phase(prefill=True):
            assert torch.equal(layer(x[:13]), whole[:13])
        with forward_phase(prefill=True, decode_rows=[2, 5], total=9):
            assert torch.equal(layer(x[:9]), whole[:9])
        assert layer(x[:0]).shape == (0, 192)


def test_without_the_native_kernels_a_layer_keeps_torchs_op():
    weight = make_weight(128, 64, 8, 128, True, False, seed=4)
    layer = cpu.CpuInt8Kernel.build(weight, None, torch.bfloat16)
    layer.native = None  # no compiler, or TGS_CPU_NATIVE_KERNELS=0
    assert not layer.keep_rows_invariant() and layer.variants(20) == ("op",) and layer.prompt_variant() == "op"


def test_the_int8_head_is_row_invariant_in_a_model(native, tmp_path):
    from text_generation_server.models.loader import get_model

    write_family_checkpoint(tmp_path / "qwen3", "qwen3", seed=5)
    lm = get_model(str(tmp_path / "qwen3"), dtype="bfloat16", quantize_lm_head="int8")
    linear = lm.model.head.projection.linear
    assert getattr(linear, "row_invariant", False), type(linear)
    hidden = torch.randn(37, lm.config.hidden_size).bfloat16()
    with torch.inference_mode():
        whole = lm.model.head(hidden)
        for rows in ([0], [5, 6, 7], list(range(12)), list(range(20, 37))):
            assert torch.equal(lm.model.head(hidden[rows]), whole[rows]), rows
