"""The native kernels' thread split (tgs::parallel_for, kernels/cpu_native_src.py): every output
range run exactly once whatever the threads and chunks, the kernels' bits equal to one thread's
(and to at::parallel_for's) for uneven chunk counts and more threads than cores, errors in any
thread reaching the caller, and the same bits while other processes busy-loop on every core
(the case the pool exists for: a thread the scheduler does not run must not hold a call up)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from text_generation_server.kernels import cpu_native

pytestmark = pytest.mark.skipif(cpu_native.native() is None,
                                reason=f"native CPU kernels not built here: {cpu_native.unavailable_reason()}")


@pytest.fixture
def module(native_pool):
    """The extension, with torch's thread count and the pool's settings put back afterwards (conftest)."""
    return native_pool


@pytest.mark.parametrize("threads", [2, 3, 5, 8])
@pytest.mark.parametrize("n,grain", [(1, 1), (7, 3), (1001, 1), (1001, 7), (4099, 64), (33, 33), (34, 33)])
@pytest.mark.parametrize("per_thread", [1, 3, 8])
def test_every_index_once(module, threads, n, grain, per_thread):
    torch.set_num_threads(threads)
    cpu_native.set_parallel_mode(module, True, chunks_per_thread=per_thread)
    for _ in range(3):
        out = module.parallel_probe(n, grain, 200, -1)
        assert torch.equal(out[:, 0], torch.arange(n)), "an index skipped or run twice"


def test_workers_take_chunks_and_one_thread_takes_none(module):
    torch.set_num_threads(2)
    ran_by_worker = sum(int(module.parallel_probe(4096, 1, 2000, -1)[:, 1].sum()) for _ in range(20))
    assert ran_by_worker > 0, "no chunk ran on the pool's worker in 20 calls"
    torch.set_num_threads(1)
    assert int(module.parallel_probe(4096, 1, 200, -1)[:, 1].sum()) == 0


@pytest.mark.parametrize("fail_at", [0, 517, 4095])
def test_an_error_in_any_chunk_reaches_the_caller(module, fail_at):
    torch.set_num_threads(4)
    with pytest.raises(RuntimeError, match=f"index {fail_at} fails"):
        module.parallel_probe(4096, 1, 500, fail_at)
    assert torch.equal(module.parallel_probe(4096, 1, 10, -1)[:, 0], torch.arange(4096))  # still works


def _kernel_calls(m) -> dict:
    """Each pooled kernel once, on shapes whose output ranges cut into uneven chunk counts."""
    g = torch.Generator().manual_seed(3)
    calls = {}
    n, k = 1216, 512  # 19 blocks of 64: uneven over any thread count but 1 and 19
    x = torch.randn(3, k, generator=g)
    xb = x.bfloat16()
    w8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s8 = torch.rand(n, generator=g) / 64
    wb = torch.randn(n, k, generator=g).bfloat16()
    wf = torch.randn(n + 3, k + 5, generator=g)
    calls["int8_gemv"] = lambda: m.int8_gemv(x, w8, s8, 16384)
    calls["int8_gemv bf16 x"] = lambda: m.int8_gemv(xb[:1].contiguous(), w8, s8, 16384)
    calls["bf16_gemv"] = lambda: m.bf16_gemv(xb, wb, 16384)
    xf, bias_f = torch.randn(2, k + 5, generator=g), torch.randn(n + 3, generator=g)
    calls["f32_gemv"] = lambda: m.f32_gemv(xf, wf, bias_f, 16384, 0)
    calls["int8_dequant"] = lambda: m.int8_dequant(w8, s8, 5, n - 3)
    calls["int8_q8_gemv"] = lambda: m.int8_q8_gemv(x, w8, s8, 1024, 2, False)
    gs8, gc8 = torch.rand(n, 4, generator=g) / 64, torch.randn(n, 4, generator=g)
    calls["group_int8_gemv"] = lambda: m.group_int8_gemv(x, w8, gs8, gc8, 4096)
    block = cpu_native.int4_block()
    if block is not None:
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
        packed = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
        scales = torch.rand(k // 64, n, generator=g) / 16
        offsets = torch.randn(k // 64, n, generator=g) / 8
        calls["int4pack_dequant_t"] = lambda: m.int4pack_dequant_t(packed, scales, offsets, 64, block, 1, n // block - 1)
        if cpu_native.int4_native_ok(m):
            calls["int4pack_mm"] = lambda: m.int4pack_mm(x, packed, scales, offsets, 64, block, 2, 16384, 1)
        calls["int4_q8_mm"] = lambda: m.int4_q8_mm(x, packed, scales, offsets, 64, block, 2, 1024, 1)
        bias = torch.randn(n, generator=g).bfloat16()
        calls["int4_q8_linear"] = lambda: m.int4_q8_linear(xb[:1].contiguous(), packed, scales, offsets, bias, 64, block,
                                                           1, 1024, 1)
    rows = torch.randn(37, 1536, generator=g).bfloat16()
    norm_w = torch.randn(1536, generator=g)
    calls["rms_norm_bf16"] = lambda: m.rms_norm_bf16(rows, norm_w.bfloat16(), 1e-6, rows)[0]
    calls["silu_mul_bf16"] = lambda: m.silu_mul_bf16(rows, 768)
    calls["silu_mul_f32"] = lambda: m.silu_mul_f32(rows.float(), 768)
    calls["rms_norm_f32"] = lambda: m.rms_norm_f32(rows.float(), norm_w, 1e-6, None)[0]
    trig = torch.randn(37, 1, 128, generator=g)
    calls["rotary_f32"] = lambda: m.rotary_f32(rows.float().reshape(37, 12, 128), trig, trig.flip(-1).contiguous())
    calls["rotary_bf16"] = lambda: m.rotary_bf16(rows.reshape(37, 12, 128), trig.bfloat16(),
                                                 trig.flip(-1).contiguous().bfloat16())
    kc = torch.randn(12, 16, 3, 64, generator=g)
    vc = torch.randn(12, 16, 3, 64, generator=g)
    tables = torch.randperm(12, generator=g)[:10].reshape(5, 2)
    lens = torch.tensor([1, 17, 32, 9, 20])
    q = torch.randn(5, 6, 64, generator=g)
    calls["paged_decode_attention"] = lambda: m.paged_decode_attention(q, kc, vc, tables, lens, 0.125, 0)
    return calls


def _results(m) -> dict[str, torch.Tensor]:
    return {name: fn() for name, fn in _kernel_calls(m).items()}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], how: str) -> None:
    assert got.keys() == want.keys()
    differ = [name for name in want if not torch.equal(got[name], want[name])]
    assert not differ, f"{how}: bits differ from one thread's in {differ}"


def test_kernels_bits_do_not_depend_on_the_split(module):
    torch.set_num_threads(1)
    want = _results(module)
    for threads in (2, 3, 5, 8):
        torch.set_num_threads(threads)
        for per_thread in (1, 3, 8):
            cpu_native.set_parallel_mode(module, True, chunks_per_thread=per_thread)
            _same(_results(module), want, f"pool, {threads} threads, {per_thread} chunks a thread")
        cpu_native.set_parallel_mode(module, False)
        _same(_results(module), want, f"at::parallel_for, {threads} threads")
        cpu_native.set_parallel_mode(module, True)


def test_same_bits_while_every_core_is_busy(module):
    torch.set_num_threads(1)
    want_one = _results(module)
    torch.set_num_threads(2)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        time.sleep(0.2)  # the loops are running
        start = time.perf_counter()
        for _ in range(5):
            _same(_results(module), want_one, "pool, 2 threads, every core busy")
        # Not a speed test (a loaded CI machine may be slower), only a guard against a call that
        # waits on a worker the scheduler never runs: 5 rounds of small calls take milliseconds.
        assert time.perf_counter() - start < 60
    finally:
        for process in busy:
            process.kill()
        for process in busy:
            process.wait()


def test_switched_off_the_kernels_split_with_at_parallel_for(monkeypatch):
    monkeypatch.setenv(cpu_native.POOL_ENV, "off")
    cpu_native.reset()
    try:
        m = cpu_native.native()
        assert m is not None
        # the previous mode, as the switch left it: 0, at::parallel_for
        assert cpu_native.set_parallel_mode(m, True) is False
        assert cpu_native.set_parallel_mode(m, True) is True
    finally:
        monkeypatch.delenv(cpu_native.POOL_ENV)
        cpu_native.reset()
        cpu_native.native()


def test_a_forked_child_starts_its_own_pool(module):
    """The parent's workers do not exist in a child (os.fork, multiprocessing's default on Linux):
    the child's first call starts a new pool instead of waiting on threads that are gone."""
    torch.set_num_threads(2)
    assert int(module.parallel_probe(4096, 1, 500, -1)[:, 1].sum()) >= 0  # the parent's pool is running
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when every index ran once, on more than one thread
        code = 1
        try:
            torch.set_num_threads(2)
            runs = [module.parallel_probe(4096, 1, 2000, -1) for _ in range(20)]
            once = all(torch.equal(out[:, 0], torch.arange(4096)) for out in runs)
            code = 0 if once and sum(int(out[:, 1].sum()) for out in runs) > 0 else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's kernel call did not return in 60 s")
        time.sleep(0.05)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
