"""The tiled layout of the int8-activation int4 kernel (cpu_act_int8.tile, cpu_native_q8_src.py "tiled"): the
same bits as the kernel reading torch's layout in place at every row count, rows per pass, prefetch distance
and thread split (one and two rows: several blocks interleaved a thread, any block count), in the generic
loops and in the AVX2 build; the layout round-trips; bad input is refused
by name; a layer tiles at load, lets torch's layout go, and gives the bits it gave before (TGS_CPU_INT4_TILED
off)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest
import torch
from helpers import make_weight
from test_cpu_act_int8 import native, pack  # noqa: F401 (native: the fixture)

from text_generation_server.kernels import cpu, cpu_act_int8, cpu_native
from text_generation_server.kernels.phase import forward_phase

torch.set_num_threads(2)
X86 = platform.machine().lower() in ("x86_64", "amd64")


def case(k: int, n: int, gs: int, block: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    packed = pack(codes, block)
    s, c = torch.rand(k // gs, n, generator=g) / 8, torch.randn(k // gs, n, generator=g)
    return packed, s, c


SHAPES = [  # (K, N, group size): uneven group and block counts, groups of 1, 3, 4 and 8 blocks of 32
    (96, 64, 32), (288, 192, 96), (512, 128, 128), (384, 320, 128), (512, 64, 256), (1536, 256, 128)]


@pytest.mark.parametrize("block", [64, 32])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_tiled_kernel_has_the_bits_of_the_kernel_on_torchs_layout(native, shape, block):
    k, n, gs = shape
    packed, s, c = case(k, n, gs, block, seed=k + n + block)
    tiled = cpu_act_int8.tile(packed, s, c, gs, block)
    assert tiled.shape == (n // block, k // gs, gs * block // 2 + 8 * block) and tiled.dtype == torch.uint8
    back = cpu_act_int8.untile(tiled, gs, block)
    assert all(torch.equal(a, b) for a, b in zip(back, (packed, s, c)))
    x = (torch.randn(9, k, generator=torch.Generator().manual_seed(k)) * 3).bfloat16()
    x[2, 32:64] = 0  # a zero block
    bias = torch.randn(n).bfloat16()
    for rows in range(1, 10):
        for rows_per_pass, prefetch, grain in [(1, 0, 1), (2, 1024, 4), (4, 16384, 2), (2, 64, 1)]:
            want = native.int4_q8_mm(x[:rows], packed, s, c, gs, block, rows_per_pass, prefetch, grain)
            got = native.int4_q8_tiled_mm(x[:rows], tiled, gs, block, rows_per_pass, prefetch, grain, False)
            assert torch.equal(got, want), (rows, rows_per_pass, prefetch, grain)
            want16 = native.int4_q8_linear(x[:rows], packed, s, c, bias, gs, block, rows_per_pass, prefetch, grain)
            got16 = native.int4_q8_tiled_linear(x[:rows], tiled, bias, gs, block, rows_per_pass, prefetch, grain)
            assert torch.equal(got16, want16), (rows, rows_per_pass, prefetch, grain)
        # the generic loops read the tiled bytes to the same bits
        assert torch.equal(native.int4_q8_tiled_mm(x[:rows], tiled, gs, block, 1, 0, 1, True),
                           native.int4_q8_mm(x[:rows], packed, s, c, gs, block, 2, 0, 1))
    # one thread and two give the same bits
    torch.set_num_threads(1)
    try:
        one = native.int4_q8_tiled_mm(x, tiled, gs, block, 2, 1024, 1, False)
    finally:
        torch.set_num_threads(2)
    assert torch.equal(one, native.int4_q8_tiled_mm(x, tiled, gs, block, 2, 1024, 1, False))


@pytest.mark.parametrize("block", [64, 32])
@pytest.mark.parametrize("shape", [(256, 128), (288, 96)], ids=str)
def test_the_streams_keep_the_bits_at_every_block_count_and_thread_count(native, shape, block):
    """One and two rows read several blocks interleaved a thread (q8t_streams: a task's blocks cut into S
    runs, the last pass over fewer runs when the task's block count is not a multiple of S). Each output's
    arithmetic is the one-block kernel's, so a layer of any block count (tasks of fewer than S blocks,
    tails of 1 .. S - 1) gives the bits of the kernel on torch's layout and of the generic loops, at 1-5
    threads, any blocks per task and rows per pass, rows 1, 2 and 3 (3: one block after another)."""
    k, gs = shape
    for blocks in (1, 2, 3, 5, 7, 8, 9, 12, 15, 16, 17, 23, 31):
        n = blocks * block
        packed, s, c = case(k, n, gs, block, seed=blocks + block)
        tiled = cpu_act_int8.tile(packed, s, c, gs, block)
        x = (torch.randn(3, k, generator=torch.Generator().manual_seed(blocks)) * 3).bfloat16()
        bias = torch.randn(n).bfloat16()
        want = {rows: native.int4_q8_mm(x[:rows], packed, s, c, gs, block, 1, 0, 1) for rows in (1, 2, 3)}
        want16 = {rows: native.int4_q8_linear(x[:rows], packed, s, c, bias, gs, block, 1, 0, 1) for rows in (1, 2, 3)}
        for rows in (1, 2, 3):
            assert torch.equal(native.int4_q8_tiled_mm(x[:rows], tiled, gs, block, 1, 0, 1, True), want[rows])
        try:
            for threads in range(1, 6):
                torch.set_num_threads(threads)
                for rows in (1, 2, 3):
                    for rows_per_pass, prefetch, grain in [(2, 1024, 1), (2, 0, 4), (1, 64, 1), (4, 1024, 16)]:
                        got = native.int4_q8_tiled_mm(x[:rows], tiled, gs, block, rows_per_pass, prefetch, grain, False)
                        assert torch.equal(got, want[rows]), (blocks, threads, rows, rows_per_pass, grain)
                    got16 = native.int4_q8_tiled_linear(x[:rows], tiled, bias, gs, block, 2, 1024, 4)
                    assert torch.equal(got16, want16[rows]), (blocks, threads, rows)
        finally:
            torch.set_num_threads(2)


def test_bad_input_is_refused_by_name(native):
    packed, s, c = case(256, 128, 128, 64, seed=1)
    with pytest.raises(ValueError, match="scales and offsets must be"):
        cpu_act_int8.tile(packed, s[:1], c, 128, 64)
    with pytest.raises(ValueError, match="cannot tile"):
        cpu_act_int8.tile(packed, s, c, 48, 64)
    tiled = cpu_act_int8.tile(packed, s, c, 128, 64)
    with pytest.raises(ValueError, match="are not group size"):
        cpu_act_int8.untile(tiled, 64, 64)
    x = torch.randn(1, 256).bfloat16()
    with pytest.raises(RuntimeError, match="tiled must be contiguous uint8"):
        native.int4_q8_tiled_mm(x, tiled, 64, 64, 1, 0, 1, False)
    with pytest.raises(RuntimeError, match="x must be contiguous float32 or bfloat16"):
        native.int4_q8_tiled_mm(torch.randn(1, 128).bfloat16(), tiled, 128, 64, 1, 0, 1, False)
    with pytest.raises(RuntimeError, match="block must be 64 or 32"):
        native.int4_q8_tiled_mm(x, tiled, 128, 16, 1, 0, 1, False)


@pytest.mark.parametrize("case_", [(256, 192, 4, 64, False, False), (256, 128, 4, 128, True, True),
                                   (200, 64, 4, 100, False, True)], ids=str)
def test_a_layer_tiles_at_load_and_keeps_its_bits(native, monkeypatch, case_):
    """The layer lets torch's layout and its float32 scales go, and gives the bits the layer on torch's
    layout gives (TGS_CPU_INT4_TILED=off), prompts and decode, every row count."""
    monkeypatch.setenv(cpu_act_int8.ENV, "on")
    k, n, bits, gs, sym, act = case_
    w = make_weight(k, n, bits, gs, sym, act, seed=k + n)
    bias = torch.randn(n)
    tiled = cpu.CpuInt4PackQ8Kernel.build(w, bias, torch.bfloat16)
    monkeypatch.setenv(cpu_act_int8.TILED_ENV, "off")
    plain = cpu.CpuInt4PackQ8Kernel.build(w, bias, torch.bfloat16)
    assert tiled.tiled is not None and tiled.packed is None and tiled.scales_f32 is None
    assert plain.tiled is None and plain.packed is not None
    assert tiled.preference_scope == plain.preference_scope == cpu_act_int8.SCOPE  # the same names, the same bits
    x = torch.randn(11, k).bfloat16()
    with torch.inference_mode():
        for prefill in (True, False):
            with forward_phase(prefill=prefill):
                assert torch.equal(tiled(x), plain(x))
                for rows in (1, 2, 5, 8):
                    assert torch.equal(tiled(x[:rows]), plain(x[:rows]))
                    for variant in cpu_act_int8.VARIANTS:
                        xp = x[:rows]
                        if tiled.padded:
                            xp = torch.nn.functional.pad(xp, (0, 1))
                        if tiled.perm is not None:
                            xp = xp.index_select(1, tiled.perm)
                        assert torch.equal(tiled.run(xp.contiguous(), variant), plain.run(xp.contiguous(), variant))
                        assert torch.equal(tiled.run(xp.float().contiguous(), variant),
                                           plain.run(xp.float().contiguous(), variant))


# (K, N, group size) the AVX2 build is checked on, 32-output blocks: 6, 8 and 17 blocks (the streams' tails).
AVX2_SHAPES = [(288, 192, 96), (1536, 256, 128), (256, 544, 128)]
CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from test_cpu_act_int8_tiled import AVX2_SHAPES, case
from text_generation_server.kernels import cpu_act_int8, cpu_native
module = cpu_native.native()
out = {"isa": int(module.int4_q8_isa())}
for k, n, gs in AVX2_SHAPES:
    packed, s, c = case(k, n, gs, 32, seed=k)
    tiled = cpu_act_int8.tile(packed, s, c, gs, 32)
    x = (torch.randn(5, k, generator=torch.Generator().manual_seed(n)) * 3).bfloat16()
    got, want = [], []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        for r in (1, 2, 3, 5):
            for rp, pf in ((1, 0), (2, 1024), (4, 1024)):
                got.append(module.int4_q8_tiled_mm(x[:r], tiled, gs, 32, rp, pf, 1, False))
                want.append(module.int4_q8_mm(x[:r], packed, s, c, gs, 32, 2, 0, 1))
    out[f"{k}x{n}"] = {"same": all(torch.equal(a, b) for a, b in zip(got, want)), "y": got[-1].tolist()}
print("RESULT" + json.dumps(out))
"""


@pytest.mark.skipif(not X86, reason="the AVX2 build is an x86-64 build")
def test_the_avx2_build_reads_the_tiled_layout_to_the_native_bits(native, tmp_path):
    from pathlib import Path

    env = {**__import__("os").environ, cpu_native.ISA_ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2",
           "ONEDNN_MAX_CPU_ISA": "AVX2"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(Path(__file__).parent)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert got["isa"] == 1
    for k, n, gs in AVX2_SHAPES:
        assert got[f"{k}x{n}"]["same"]
        packed, s, c = case(k, n, gs, 32, seed=k)
        x = (torch.randn(5, k, generator=torch.Generator().manual_seed(n)) * 3).bfloat16()
        want = native.int4_q8_tiled_mm(x, cpu_act_int8.tile(packed, s, c, gs, 32), gs, 32, 4, 1024, 1, False)
        assert torch.equal(torch.tensor(got[f"{k}x{n}"]["y"]), want)
