"""The group-scale int8 CPU kernel (kernels/cpu_group_int8.py) against the reference dequantization.

5- to 8-bit codes with 16- or 32-wide groups, symmetric or with zero points, in float32 and
bfloat16; a prompt's rows come out bit for bit the same whole or in chunks (kernels/phase.py);
the table picks it for ggml's groups only. The native variant (cpu-int8-group-native) gives the torch
kernel's prompt bits exactly, its decode rows agree to float32 rounding, and a decode row's bits do not
depend on its batch neighbours or the thread count.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
from helpers import make_weight

from text_generation_server.kernels.base import dequantize
from text_generation_server.kernels import cpu_native
from text_generation_server.kernels.cpu_group_int8 import (
    BLOCK_BYTES,
    NATIVE_GEMV_MAX_ROWS,
    CpuGroupInt8Kernel,
    CpuGroupInt8NativeKernel,
)
from text_generation_server.kernels.phase import forward_phase
from text_generation_server.kernels.select import build_linear, choose_kernel

torch.set_num_threads(1)

CASES = [(8, 32, True), (6, 16, True), (5, 32, True), (5, 32, False), (8, 16, False)]


@pytest.mark.parametrize("bits,group,sym", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_the_reference(bits, group, sym, dtype):
    w = make_weight(512, 96, bits, group, sym, False, seed=bits + group)
    bias = torch.randn(96)
    layer = CpuGroupInt8Kernel.build(w, bias, dtype)
    x = torch.randn(5, 512)
    want = x @ dequantize(w).t() + bias
    got = layer(x.to(dtype)).float()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got - want).abs().max() <= tol * want.abs().max()


def test_many_row_blocks_cover_every_output(monkeypatch):
    """N larger than one dequantized block: every block's rows land in their own columns."""
    w = make_weight(2048, 2600, 8, 32, False, False, seed=3)
    layer = CpuGroupInt8Kernel.build(w, None, torch.float32)
    assert layer.block < 2600 and BLOCK_BYTES // (2048 * 4) == layer.block
    x = torch.randn(3, 2048)
    torch.testing.assert_close(layer(x), x @ dequantize(w).t(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_prompt_gives_the_same_bits_whole_or_in_chunks(dtype):
    layer = CpuGroupInt8Kernel.build(make_weight(512, 320, 6, 16, True, False, seed=1), None, dtype)
    x = torch.randn(45, 512).to(dtype)
    with forward_phase(prefill=True):
        whole = layer(x)
        for cuts in ((40,), (1, 40), (8, 16, 30)):
            bounds = [0, *cuts, 45]
            assert torch.equal(torch.cat([layer(x[a:b]) for a, b in zip(bounds, bounds[1:])]), whole), cuts


def native_runs() -> bool:
    module = cpu_native.native()
    return module is not None and bool(module.group_int8_native_isa())


def test_the_table_takes_it_for_ggml_groups_only():
    first = "cpu-int8-group-native" if native_runs() else "cpu-int8-group"
    for bits, group in ((8, 32), (6, 16), (5, 32)):
        assert build_linear(make_weight(256, 64, bits, group, True, False), None, torch.float32,
                            "cpu").kernel_name == first
    spec = make_weight(256, 64, 8, 128, True, False).spec(torch.float32, "cpu")
    kernel, why = choose_kernel(spec)
    assert kernel.name == "reference"
    assert ("cpu-int8-group", "group size 128 not in (16, 32) (ggml's block groups)") in why
    assert ("cpu-int8-group-native", "group size 128 not in (16, 32) (ggml's block groups)") in why
    ok, reason = CpuGroupInt8Kernel.can_implement(make_weight(256, 64, 8, 32, True, True).spec(torch.float32, "cpu"))
    assert not ok and "act-order" in reason


def test_without_the_native_extension_the_torch_kernel_serves(monkeypatch):
    monkeypatch.setenv(cpu_native.ENV, "0")
    cpu_native.reset()
    try:
        spec = make_weight(256, 64, 8, 32, True, False).spec(torch.float32, "cpu")
        kernel, why = choose_kernel(spec)
        assert kernel is CpuGroupInt8Kernel
        assert why[-1] == ("cpu-int8-group-native", f"native kernels unavailable (disabled by {cpu_native.ENV}=0)")
    finally:
        monkeypatch.delenv(cpu_native.ENV)
        cpu_native.reset()


needs_native = pytest.mark.skipif(not native_runs(), reason="the native extension has no AVX-512 code here: "
                                  "cpu-int8-group-native refuses (test_the_table_takes_it_for_ggml_groups_only)")


def both(bits, group, sym, dtype, k=544, n=200, bias=True, seed=0):
    """The torch kernel and the native one on the same random weight (N not a multiple of the tiles)."""
    w = make_weight(k, n, bits, group, sym, False, seed=seed)
    b = torch.randn(n) if bias else None
    return CpuGroupInt8Kernel.build(w, b, dtype), CpuGroupInt8NativeKernel.build(w, b, dtype)


@needs_native
@pytest.mark.parametrize("bits,group,sym", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_native_prompts_have_the_torch_kernels_bits(bits, group, sym, dtype):
    torch_layer, native_layer = both(bits, group, sym, dtype, seed=bits * group)
    x = torch.randn(37, 544).to(dtype)
    with forward_phase(prefill=True):
        assert torch.equal(native_layer(x), torch_layer(x))
        assert torch.equal(native_layer(x[:3]), torch_layer(x[:3]))
    # more decode rows than the matrix-vector kernel takes: the same dequantized blocks and matmul
    rows = x[:NATIVE_GEMV_MAX_ROWS + 4]
    assert torch.equal(native_layer(rows), torch_layer(rows))


@needs_native
@pytest.mark.parametrize("bits,group,sym", CASES, ids=str)
def test_native_decode_rows_match_the_torch_kernel(bits, group, sym):
    torch_layer, native_layer = both(bits, group, sym, torch.float32, seed=bits + 7 * group)
    x = torch.randn(NATIVE_GEMV_MAX_ROWS, 544)
    for m in range(1, NATIVE_GEMV_MAX_ROWS + 1):
        want = torch_layer(x[:m])
        torch.testing.assert_close(native_layer(x[:m]), want, atol=2e-5 * float(want.abs().max()), rtol=0)


@needs_native
@pytest.mark.parametrize("bits,group,sym", [(8, 32, True), (6, 16, True), (5, 32, False)], ids=str)
def test_a_native_decode_row_does_not_depend_on_its_neighbours(bits, group, sym):
    _, layer = both(bits, group, sym, torch.bfloat16, k=1536, n=333, seed=5)
    x = torch.randn(NATIVE_GEMV_MAX_ROWS, 1536).to(torch.bfloat16)
    alone = [layer(x[i:i + 1]) for i in range(NATIVE_GEMV_MAX_ROWS)]
    for m in range(1, NATIVE_GEMV_MAX_ROWS + 1):
        batch = layer(x[:m])
        shuffled = layer(x[:m].flip(0)).flip(0)
        for i in range(m):
            assert torch.equal(batch[i:i + 1], alone[i]), (m, i)
            assert torch.equal(shuffled[i:i + 1], alone[i]), (m, i)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(layer(x), torch.cat(alone))
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_native_kernel_refuses_bad_inputs_by_name():
    _, layer = both(8, 32, True, torch.float32, bias=False)
    codes, scales, offsets = layer._flat()
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        layer.native.group_int8_gemv(torch.randn(9, 544), codes, scales, offsets, 0)
    with pytest.raises(RuntimeError, match="x must be contiguous float32"):
        layer.native.group_int8_gemv(torch.randn(2, 512), codes, scales, offsets, 0)
    with pytest.raises(RuntimeError, match="offsets must be empty"):
        layer.native.group_int8_gemv(torch.randn(2, 544), codes, scales, torch.zeros(3), 0)


FALLBACK_CHILD = r"""
import json, sys, torch
from text_generation_server.kernels import cpu_native
sys.path.insert(0, "tests")
from test_cpu_group_int8 import fallback_case
module = cpu_native.native()
out = {"built": module is not None, "reason": cpu_native.unavailable_reason()}
if module is not None:
    x, q, s, c = fallback_case()
    out["isa"] = int(module.group_int8_native_isa())
    out["gemv"] = [module.group_int8_gemv(x[:m].contiguous(), q, s, c, 0).tolist() for m in (1, 3, 8)]
    f32, b16 = torch.empty(q.shape), torch.empty(q.shape, dtype=torch.bfloat16)
    module.group_int8_dequant(q, s, c, 0, q.shape[0], f32)
    module.group_int8_dequant(q, s, c, 0, q.shape[0], b16)
    out["f32"], out["b16"] = f32.tolist(), b16.float().tolist()
print("RESULT" + json.dumps(out))
"""


def fallback_case():
    """A 16-column-group weight with offsets, the same in every process."""
    g = torch.Generator().manual_seed(0)
    n, k, gs = 37, 96, 16
    q = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, k // gs, generator=g) * 0.01
    c = torch.randn(n, k // gs, generator=g) * 0.01
    return torch.randn(8, k, generator=g), q, s, c


@needs_native
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the AVX2 build is x86-64's")
def test_the_portable_fallback_computes_what_the_avx512_code_does():
    """Built without AVX-512 (TGS_CPU_ISA=avx2, as on an AVX2-only CPU), the scalar loops give the same
    dequantized weights bit for bit and the same products to rounding, and say they are the fallback."""
    module = cpu_native.native()
    x, q, s, c = fallback_case()
    env = {**os.environ, cpu_native.ISA_ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", FALLBACK_CHILD], env=env, capture_output=True, text=True,
                          timeout=900)
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")]
    assert done.returncode == 0 and line, done.stderr[-3000:]
    got = json.loads(line[0].removeprefix("RESULT"))
    assert got["built"], got["reason"]
    assert got["isa"] == 0
    f32, b16 = torch.empty(q.shape), torch.empty(q.shape, dtype=torch.bfloat16)
    module.group_int8_dequant(q, s, c, 0, q.shape[0], f32)
    module.group_int8_dequant(q, s, c, 0, q.shape[0], b16)
    assert torch.equal(torch.tensor(got["f32"]), f32)
    assert torch.equal(torch.tensor(got["b16"]), b16.float())
    for m, rows in zip((1, 3, 8), got["gemv"]):
        want = module.group_int8_gemv(x[:m].contiguous(), q, s, c, 0)
        torch.testing.assert_close(torch.tensor(rows), want, rtol=1e-5, atol=1e-5)
