"""The int8 x int8-activation matrix-vector product at 1-2 rows (cpu_native_q8_src.py, `i8q8_streams`):
each thread's task of outputs is read as several concurrent weight streams (a tile's outputs a run apart,
not adjacent). Its rows must keep the bits of the adjacent 4-output tiles that 3-8 rows (and the other
rows-per-pass names) take, of the generic loops, of any thread count and chunking of the pool and of
at::parallel_for, over tails of K (a multiple of 32, not of 64) and of N (not a multiple of the streams,
tasks cut unevenly), and stay within `error_bound_int8` of the float64 arithmetic.
"""

from __future__ import annotations

import pytest
import torch

from text_generation_server.kernels import cpu_act_int8, cpu_native

pytestmark = pytest.mark.skipif(cpu_native.native() is None,
                                reason=f"native CPU kernels not built here: {cpu_native.unavailable_reason()}")

# K: a multiple of 64, one with a 32 tail, one shorter than a 64-wide step; N: below one tile of
# streams, one task with a remainder, several uneven tasks over any thread count.
SHAPES = [(1536, 1001), (96, 37), (1056, 4099), (32, 65), (1536 + 32, 257), (64, 3)]
PF = cpu_native.PREFETCH_BYTES


@pytest.fixture
def module(native_pool):
    """The extension, with torch's thread count and the pool's settings put back afterwards (conftest)."""
    return native_pool


def _inputs(k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k * 7 + n)
    x = torch.randn(8, k, generator=g)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    return x, w, torch.rand(n, generator=g) + 0.01


@pytest.mark.parametrize("k,n", SHAPES, ids=str)
def test_one_and_two_rows_keep_the_bits_of_every_batch_and_the_generic_loops(module, k, n):
    torch.set_num_threads(2)
    x, w, s = _inputs(k, n)
    alone = torch.cat([module.int8_q8_gemv(x[m:m + 1], w, s, PF, 2, False) for m in range(8)])
    for start in range(0, 8, 2):  # pairs: the 2-row streams, and the adjacent tiles of 1 and 4 rows a pass
        for rows_per_pass in (2, 1, 4):
            got = module.int8_q8_gemv(x[start:start + 2], w, s, PF, rows_per_pass, False)
            assert torch.equal(got, alone[start:start + 2]), (start, rows_per_pass)
    for rows in range(3, 9):  # the adjacent tiles of 3-8 rows
        assert torch.equal(module.int8_q8_gemv(x[:rows], w, s, PF, 2, False), alone[:rows]), rows
    assert torch.equal(module.int8_q8_gemv(x, w, s, 0, 2, True), alone)  # the generic loops
    for pf in (0, 65536):  # the prefetch distance moves no bit
        assert torch.equal(module.int8_q8_gemv(x[:1], w, s, pf, 2, False), alone[:1])
        assert torch.equal(module.int8_q8_gemv(x[:2], w, s, pf, 2, False), alone[:2])
    want = cpu_act_int8.reference_int8(x, w, s)
    assert ((alone.double() - want).abs() <= cpu_act_int8.error_bound_int8(x, w, s)).all()


@pytest.mark.parametrize("k,n", [(1536, 1001), (1056, 4099), (96, 37)], ids=str)
def test_one_and_two_rows_do_not_depend_on_the_split(module, k, n):
    x, w, s = _inputs(k, n)
    torch.set_num_threads(1)
    want = [module.int8_q8_gemv(x[:rows], w, s, PF, 2, False) for rows in (1, 2)]
    for threads in (2, 3, 5):
        torch.set_num_threads(threads)
        for per_thread in (1, 3, 8):
            cpu_native.set_parallel_mode(module, True, chunks_per_thread=per_thread)
            for rows, expected in zip((1, 2), want):
                got = module.int8_q8_gemv(x[:rows], w, s, PF, 2, False)
                assert torch.equal(got, expected), (threads, per_thread, rows)
        cpu_native.set_parallel_mode(module, False)
        for rows, expected in zip((1, 2), want):
            assert torch.equal(module.int8_q8_gemv(x[:rows], w, s, PF, 2, False), expected), (threads, rows)
        cpu_native.set_parallel_mode(module, True)


def test_the_variants_give_one_rows_bits(module):
    x, w, s = _inputs(1536, 1001)
    for rows in (1, 2):
        got = {name: cpu_act_int8.int8_q8_gemv(module, x[:rows], w, s, name) for name in cpu_act_int8.INT8_VARIANTS}
        first = next(iter(got.values()))
        assert all(torch.equal(v, first) for v in got.values()), rows
