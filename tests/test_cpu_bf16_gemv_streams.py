"""The bfloat16 matrix-vector product at 1-2 rows on a build without AVX512-BF16 (cpu_native_src.py,
`gemv_impl_streams`): each thread's chunk of outputs is read as several concurrent weight streams (a tile's
outputs a run apart, not adjacent). Its rows must keep the bits of the 3-8 row tiles, of any thread count
and chunking of the pool and of at::parallel_for, over tails of K (not a multiple of 64 or 16) and of N
(not a multiple of the streams, chunks cut unevenly), and stay float32 sums of exact products.
"""

from __future__ import annotations

import pytest
import torch

from text_generation_server.kernels import cpu_native

pytestmark = pytest.mark.skipif(cpu_native.native() is None,
                                reason=f"native CPU kernels not built here: {cpu_native.unavailable_reason()}")

# K: a multiple of 64, one with a 16-step tail and a scalar tail, one shorter than a step; N: below one
# tile of streams, one chunk with a remainder, several uneven chunks over any thread count.
SHAPES = [(1536, 1001), (200, 37), (1000, 4099), (7, 65), (1536 + 16 + 5, 257)]


@pytest.fixture
def module(native_pool):
    """The extension, with torch's thread count and the pool's settings put back afterwards (conftest)."""
    return native_pool


def _inputs(k: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(k * 7 + n)
    return torch.randn(8, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()


@pytest.mark.parametrize("k,n", SHAPES, ids=str)
def test_one_and_two_rows_keep_the_bits_of_every_batch(module, k, n):
    torch.set_num_threads(2)
    x, w = _inputs(k, n)
    alone = torch.cat([module.bf16_gemv(x[m:m + 1], w, cpu_native.PREFETCH_BYTES) for m in range(8)])
    for start in range(0, 8, 2):  # pairs: the 2-row streams
        assert torch.equal(module.bf16_gemv(x[start:start + 2], w, cpu_native.PREFETCH_BYTES), alone[start:start + 2])
    for rows in range(3, 9):  # the row tiles of 3-8 rows (adjacent outputs)
        assert torch.equal(module.bf16_gemv(x[:rows], w, cpu_native.PREFETCH_BYTES), alone[:rows]), rows
    # the prefetch distance moves no bit
    assert torch.equal(module.bf16_gemv(x[:1], w, 0), alone[:1])
    assert torch.equal(module.bf16_gemv(x[:2], w, 65536), alone[:2])
    want = x.double() @ w.double().t()
    assert ((alone.double() - want).abs().max() / want.abs().max()).item() < 1e-5  # float32 sums of exact products


@pytest.mark.parametrize("k,n", [(1536, 1001), (1000, 4099), (200, 37)], ids=str)
def test_one_and_two_rows_do_not_depend_on_the_split(module, k, n):
    x, w = _inputs(k, n)
    torch.set_num_threads(1)
    want = [module.bf16_gemv(x[:rows], w, cpu_native.PREFETCH_BYTES) for rows in (1, 2)]
    for threads in (2, 3, 5):
        torch.set_num_threads(threads)
        for per_thread in (1, 3, 8):
            cpu_native.set_parallel_mode(module, True, chunks_per_thread=per_thread)
            for rows, expected in zip((1, 2), want):
                got = module.bf16_gemv(x[:rows], w, cpu_native.PREFETCH_BYTES)
                assert torch.equal(got, expected), (threads, per_thread, rows)
        cpu_native.set_parallel_mode(module, False)
        for rows, expected in zip((1, 2), want):
            assert torch.equal(module.bf16_gemv(x[:rows], w, cpu_native.PREFETCH_BYTES), expected), (threads, rows)
        cpu_native.set_parallel_mode(module, True)


def test_float32_and_bfloat16_x_give_the_same_bits(module):
    # x in bfloat16 is widened to float32 exactly on a build without AVX512-BF16 (with it, vdpbf16ps
    # sums pairs: another order, so the comparison holds only here)
    if module.bf16_gemm_has_bf16_dot():
        pytest.skip("AVX512-BF16 build: bfloat16 x takes vdpbf16ps")
    x, w = _inputs(1000, 4099)
    for rows in (1, 2):
        assert torch.equal(module.bf16_gemv(x[:rows], w, 16384), module.bf16_gemv(x[:rows].float(), w, 16384))


class _Stand:
    """A stand-in extension that records the prefetch distance its bfloat16 product was given."""

    def __init__(self):
        self.distances: list[int] = []

    def bf16_gemv(self, x, w, prefetch):
        self.distances.append(prefetch)
        return x.float() @ w.float().t()


@pytest.mark.parametrize("bf16_dot", [False, True])
def test_the_streams_prefetch_distance_on_builds_without_the_bf16_dot(monkeypatch, bf16_dot):
    from text_generation_server.kernels.dense import DenseLinear

    monkeypatch.setitem(cpu_native._state, "bf16_dot", bf16_dot)
    want = cpu_native.PREFETCH_BYTES if bf16_dot else cpu_native.BF16_STREAMS_PREFETCH_BYTES
    assert cpu_native.bf16_gemv_prefetch(_Stand()) == want
    stand = _Stand()
    w = torch.randn(24, 32).bfloat16()
    cpu_native.bf16_gemv(stand, torch.randn(1, 32).bfloat16(), w, None)  # the head's path (dense_gemv)
    layer = DenseLinear(w, None)
    layer.native = stand
    call = layer.decode_call(1, torch.bfloat16)  # a dense layer's resolved decode call
    assert call is not None
    call(torch.randn(1, 32).bfloat16())
    assert stand.distances == [want, want]
