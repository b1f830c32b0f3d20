"""The int8 table layout (cpu_native.int8_table_pack, `int8_table_gemv`): codes rearranged at load so the
matrix-vector kernel converts them to bfloat16 with fewer instructions. It must give int8_gemv's bits on
the plain codes at every row count, prefetch distance and thread count (the int8 head's row invariance
rests on them), in every build (elsewhere than AVX512-BF16 + VBMI the codes are unpacked), and a layer
takes it only where it pays and the codes fit (no -128)."""

from __future__ import annotations

import pytest
import torch

from text_generation_server.kernels import cpu, cpu_native
from text_generation_server.kernels.phase import forward_phase

torch.set_num_threads(2)


def codes(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
            torch.rand(n, generator=g) * 0.01 + 1e-3)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_the_layout_is_sign_magnitude_in_the_unpack_order():
    w = torch.arange(-127, 128, 2, dtype=torch.int8)[:64].repeat(2, 2)  # K = 64 + 64
    w = torch.cat([w, torch.tensor([[-5, 7, -1]] * 2, dtype=torch.int8)], dim=1)  # a 3-code tail
    packed = cpu_native.int8_table_pack(w)
    for p, source in enumerate(cpu_native.TABLE_ORDER):
        for chunk in (0, 64):
            v = int(w[1, chunk + source])
            assert int(packed[1, chunk + p]) & 0xFF == (0x80 | -v if v < 0 else v), (p, chunk)
    assert packed[:, 128:].tolist() == [[-5, 7, -1]] * 2  # the tail as it is
    assert sorted(cpu_native.TABLE_ORDER) == list(range(64))


def test_the_native_pack_gives_the_torch_forms_bytes(native):
    for n, k in ((3, 64), (70, 200), (129, 1536)):
        w, _ = codes(n, k, seed=n)
        want = cpu_native.int8_table_pack(w, rows_per_piece=50)  # the torch form, in pieces
        assert torch.equal(cpu_native.int8_table_pack(w, module=native), want), (n, k)


def test_codes_of_minus_128_are_refused():
    with pytest.raises(ValueError, match="-128"):
        cpu_native.int8_table_pack(torch.full((2, 64), -128, dtype=torch.int8))
    with pytest.raises(ValueError, match="int8 codes"):
        cpu_native.int8_table_pack(torch.zeros(64, dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("k", [64, 96, 200, 1536], ids=lambda k: f"K{k}")
def test_the_table_kernel_gives_int8_gemvs_bits(native, dtype, k):
    w, s = codes(67, k, seed=k)  # 67 outputs: the 4- and 2-output tiles and their remainders
    packed = cpu_native.int8_table_pack(w)
    x = (torch.randn(19, k) * 3).to(dtype)
    for rows in (1, 2, 3, 4, 5, 8, 9, 19):
        for distance in (0, 16384):
            want = native.int8_gemv(x[:rows].contiguous(), w, s, distance)
            assert same_bits(native.int8_table_gemv(x[:rows].contiguous(), packed, s, distance), want), (rows, distance)
    whole = native.int8_table_gemv(x, packed, s, 0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert same_bits(native.int8_table_gemv(x, packed, s, 0), whole)
    finally:
        torch.set_num_threads(threads)
    for rows in ([3], [18, 2, 7], list(range(5, 19))):
        assert same_bits(native.int8_table_gemv(x[rows].contiguous(), packed, s, 0), whole[rows]), rows


def test_the_int8_head_takes_the_layout_where_it_pays_with_the_same_bits(native, monkeypatch):
    w, s = codes(192, 320, seed=7)
    x = torch.randn(45, 320).bfloat16()

    def head() -> cpu.Int8Linear:
        layer = cpu.Int8Linear(w.clone(), s.bfloat16(), None, None, torch.bfloat16, scales_f32=s.clone())
        assert layer.keep_rows_invariant()
        return layer

    monkeypatch.setenv(cpu_native.TABLE_ENV, "off")
    plain = head()
    assert not plain.table_layout and torch.equal(plain.weight, w)
    monkeypatch.delenv(cpu_native.TABLE_ENV)
    table = head()
    assert table.table_layout == cpu_native.int8_table_enabled(native)
    assert table.table_layout == bool(native.int8_table_isa())
    with torch.inference_mode():
        whole = plain(x)
        assert torch.equal(table(x), whole)
        for rows in ([7], [0, 44], list(range(9)), list(range(3, 36))):
            assert torch.equal(table(x[rows]), whole[rows]), rows
        with forward_phase(prefill=True):
            assert torch.equal(table(x[:13]), whole[:13])
        assert table(x[:0]).shape == (0, 192)
    if table.table_layout:
        with pytest.raises(ValueError, match="no 'op' variant"):
            table.run(x, "op")
    # codes of -128 (an asymmetric 8-bit grid) keep the plain layout
    w_min = w.clone()
    w_min[0, 0] = -128
    layer = cpu.Int8Linear(w_min, s.bfloat16(), None, None, torch.bfloat16, scales_f32=s.clone())
    assert layer.keep_rows_invariant() and not layer.table_layout


def test_an_int8_layer_in_the_table_layout_keeps_every_variants_bits(native, monkeypatch):
    # The plain layer's variants (gemv at 1-8 rows, the dequantized GEMM for prompts) against the same
    # variants on the table layout; at 9-31 rows the table layer runs the matrix-vector kernel in chunks.
    w, s = codes(160, 1600, seed=9)  # K = 1600: a 32-code chunk and no 16-code tail past the 64-wide ones
    x = torch.randn(40, 1600).bfloat16()
    monkeypatch.setenv(cpu_native.TABLE_ENV, "off")
    plain = cpu.Int8Linear(w.clone(), s.bfloat16(), None, None, torch.bfloat16, scales_f32=s.clone())
    assert not plain.use_table_layout()
    monkeypatch.delenv(cpu_native.TABLE_ENV)
    table = cpu.Int8Linear(w.clone(), s.bfloat16(), None, None, torch.bfloat16, scales_f32=s.clone())
    packed = cpu_native.int8_table_pack(w)  # every build reads the layout (elsewhere by unpacking it)
    for n0, n1 in ((0, 160), (5, 77)):
        assert torch.equal(native.int8_table_dequant(packed, s, n0, n1), native.int8_dequant(w, s, n0, n1))
    if not table.use_table_layout():  # where it does not pay, no layer takes it
        assert not native.int8_table_isa()
        return
    assert table.variants(20) == (*cpu_native.INT8_GEMV_VARIANTS, "dequant") and "op" not in table.variants(4)
    assert table.static_variant(20) == "gemv" and table.static_variant(40) == "dequant"
    assert table.prompt_variant() == "dequant"
    with torch.inference_mode():
        for rows in (1, 3, 8):
            for variant in cpu_native.INT8_GEMV_VARIANTS:
                assert torch.equal(table.run(x[:rows], variant), plain.run(x[:rows], variant)), (rows, variant)
        assert torch.equal(table.run(x, "dequant"), plain.run(x, "dequant"))
        assert torch.equal(table.run(x[:20], "gemv"), plain.run(x[:20], "gemv"))


def test_the_int8_kernel_builds_table_layers_and_the_int8_activation_one_does_not(native, monkeypatch):
    from helpers import make_weight

    weight = make_weight(256, 192, 8, 256, True, False, seed=3)  # codes 0-255: q - 128 reaches -128
    assert not cpu.CpuInt8Kernel.build(weight, None, torch.bfloat16).table_layout
    weight.qweight.clamp_(min=1)  # EETQ's symmetric grid: -127 .. 127
    layer = cpu.CpuInt8Kernel.build(weight, None, torch.bfloat16)
    assert layer.table_layout == bool(native.int8_table_isa())
    monkeypatch.setenv("TGS_CPU_INT8_ACTIVATIONS", "on")
    q8 = cpu.CpuInt8Q8Kernel.build(weight, None, torch.bfloat16)
    assert q8.int8_activations and not q8.table_layout
