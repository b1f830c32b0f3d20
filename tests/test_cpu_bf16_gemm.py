"""The native bfloat16 GEMM through float32 FMAs (kernels/cpu_native_gemm_src.py, `cpu_native.bf16_gemm`) and
the dense layers that run prompts and larger decode batches on it where torch's bfloat16 GEMM has no fast
path (kernels/dense.py "native-gemm"): close to the float64 product, a row's bits independent of the rows
beside it, of the row count (so of a prompt's chunking, d05298c), of the thread split and the prefetch
distance, every tail of M, N and K, bias, bfloat16 output rounded once, and the layers' choice of path.
The bits themselves are checked against the header's summation order written out in float32 torch ops, at
row counts on both sides of the AVX-512 build's switch from 256-bit to 512-bit tiles (BGZ_MIN_ROWS), and
against the AVX2 build's.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from text_generation_server.kernels import cpu_native
from text_generation_server.kernels.dense import DenseLinear
from text_generation_server.kernels.phase import forward_phase

torch.set_num_threads(2)

# float32 sums of exact products (bfloat16 inputs widen exactly): within a few float32 roundings of the
# exact sum times log-ish growth over K, relative to the sum of the products' magnitudes.
TOLERANCE = 2e-6


def relative_error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> float:
    want = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    if bias is not None:
        want, scale = want + bias.double(), scale + bias.double().abs()
    return ((got.double() - want).abs() / scale.clamp_min(1e-30)).max().item()


def case(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g).bfloat16(), (torch.randn(n, k, generator=g) * 0.05).bfloat16(),
            torch.randn(n, generator=g))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 64, 131])
@pytest.mark.parametrize("k,n", [(256, 768), (100, 37), (15, 9), (7, 3), (1544, 20)], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_product_matches_the_float64_one_within_float32_rounding(native, rows, k, n, with_bias):
    x, w, bias = case(rows, k, n, rows * 1000 + k + n)
    b = bias if with_bias else None
    got = native.bf16_gemm(x, w, torch.empty(0) if b is None else b, False, 0)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert relative_error(got, x, w, b) < TOLERANCE
    # float32 rows give the same (bfloat16 rows widen exactly); bfloat16 output is that sum rounded once
    assert torch.equal(native.bf16_gemm(x.float(), w, torch.empty(0) if b is None else b, False, 0), got)
    assert torch.equal(native.bf16_gemm(x, w, torch.empty(0) if b is None else b, True, 0), got.bfloat16())


def test_a_rows_bits_do_not_depend_on_its_neighbours_the_split_or_the_prefetch(native):
    # 300 rows: three passes over the weights (128 rows each), N = 70: four 16-output blocks and a short one
    x, w, bias = case(300, 264, 70, 7)
    whole = cpu_native.bf16_gemm(native, x, w, bias)
    for start, stop in [(0, 1), (5, 6), (0, 3), (2, 40), (100, 260), (127, 129), (299, 300), (0, 128)]:
        assert torch.equal(cpu_native.bf16_gemm(native, x[start:stop], w, bias), whole[start:stop])
    assert torch.equal(native.bf16_gemm(x, w, bias, True, 65536), whole)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_native.bf16_gemm(native, x, w, bias), whole)
    finally:
        torch.set_num_threads(threads)
    was_pool = cpu_native.set_parallel_mode(native, False)
    try:
        assert torch.equal(cpu_native.bf16_gemm(native, x, w, bias), whole)
    finally:
        cpu_native.set_parallel_mode(native, was_pool)


def in_summation_order(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out_bf16: bool) -> torch.Tensor:
    """The header's bits by float32 torch ops, no float64: lane l of output n sums x[m, k] * w[n, k] for
    k = l, l + 8, ... in increasing k; each FMA is one float32 add of the product, which is exact in float32
    for bfloat16 x and w (8-bit significands: 16-bit products, no underflow at these magnitudes); then the
    fixed tree over the 8 lanes, the K % 8 tail in k order, the bias, one rounding to bfloat16 (nearest even)."""
    m, k = x.shape
    k8 = k - k % 8
    xf, wf = x.float(), w.float()
    lanes = torch.zeros(m, w.shape[0], 8)
    for k0 in range(0, k8, 8):
        lanes = lanes + xf[:, None, k0:k0 + 8] * wf[None, :, k0:k0 + 8]
    l0, l1, l2, l3, l4, l5, l6, l7 = lanes.unbind(-1)
    t = ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
    for kk in range(k8, k):
        t = t + xf[:, None, kk] * wf[None, :, kk]
    if bias is not None:
        t = t + bias
    return t.bfloat16() if out_bf16 else t


# Rows on both sides of the 512-bit tiles' bound (16 rows a pass on AVX-512 builds), their 6-row groups' and
# the 256-bit tiles' tails (7 = 4 + 3, 8 = 4 + 4), one pass (128) and a second one of 1 or 2 rows (129, 130).
GEMM_ROWS = [1, 2, 3, 5, 7, 8, 13, 15, 16, 17, 21, 23, 64, 127, 128, 129, 130]


@pytest.mark.parametrize("k,n", [(264, 37), (100, 18), (7, 5), (1544, 17)], ids=str)
def test_the_bits_are_the_summation_order_of_the_header(native_pool, k, n):
    # N = 37 / 17 / 5: 16-output blocks with an odd tail (the 512-bit tiles' output pairs with one missing);
    # K: two k-passes plus 8, a K % 8 tail, no 8-block at all, six passes plus 8
    x, w, bias = case(max(GEMM_ROWS), k, n, k * 7 + n)
    for rows in GEMM_ROWS:
        want = in_summation_order(x[:rows], w, bias, False)
        assert torch.equal(native_pool.bf16_gemm(x[:rows], w, bias, False, cpu_native.PREFETCH_BYTES), want), rows
        assert torch.equal(native_pool.bf16_gemm(x[:rows], w, torch.empty(0), True, 0),
                           in_summation_order(x[:rows], w, None, True)), rows
    for threads in (1, 2):  # the thread split changes no bit
        torch.set_num_threads(threads)
        assert torch.equal(native_pool.bf16_gemm(x[:130], w, bias, False, 4096), in_summation_order(x[:130], w, bias,
                                                                                                    False))


GEMM_CHILD = r"""
import json, sys, torch
from text_generation_server.kernels import cpu_native
sys.path.insert(0, "tests")
from test_cpu_bf16_gemm import case
module = cpu_native.native()
out = {"built": module is not None, "reason": cpu_native.unavailable_reason(), "bits": []}
if module is not None:
    for rows, k, n in ((130, 264, 37), (20, 100, 18), (5, 264, 37)):
        x, w, bias = case(rows, k, n, rows + k + n)
        out["bits"].append(cpu_native.bf16_gemm(module, x, w, bias).view(torch.int16).tolist())
print("RESULT" + json.dumps(out))
"""
AVX2_ENV = {cpu_native.ISA_ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the AVX2 build is x86-64's")
def test_the_avx2_build_gives_this_builds_bits_at_every_row_count(native):
    # An AVX-512 build runs 512-bit tiles from 16 rows (5 rows: the 256-bit tiles both builds share)
    done = subprocess.run([sys.executable, "-c", GEMM_CHILD], env=dict(os.environ) | AVX2_ENV, capture_output=True,
                          text=True, timeout=600)
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")]
    assert done.returncode == 0 and line, done.stderr[-3000:]
    got = json.loads(line[0].removeprefix("RESULT"))
    assert got["built"], got["reason"]
    for bits, (rows, k, n) in zip(got["bits"], ((130, 264, 37), (20, 100, 18), (5, 264, 37)), strict=True):
        x, w, bias = case(rows, k, n, rows + k + n)
        assert bits == cpu_native.bf16_gemm(native, x, w, bias).view(torch.int16).tolist(), rows


def test_bad_inputs_are_refused_with_the_reason(native):
    w = torch.randn(8, 16).bfloat16()
    with pytest.raises(RuntimeError, match=r"x must be float32 or bfloat16 \[M, 16\]"):
        native.bf16_gemm(torch.randn(2, 15), w, torch.empty(0), False, 0)
    with pytest.raises(RuntimeError, match=r"bias must be contiguous float32 \[8\] or empty"):
        native.bf16_gemm(torch.randn(2, 16), w, torch.randn(7), False, 0)
    with pytest.raises(RuntimeError, match="w must be contiguous bfloat16"):
        native.bf16_gemm(torch.randn(2, 16), w.float(), torch.empty(0), False, 0)
    with pytest.raises(RuntimeError, match="prefetch must be >= 0"):
        native.bf16_gemm(torch.randn(2, 16), w, torch.empty(0), False, -1)
    assert native.bf16_gemm(torch.randn(0, 16), w, torch.empty(0), True, 0).shape == (0, 8)


def test_dense_layers_choose_it_by_the_switch_and_keep_one_prompt_path(native, monkeypatch):
    x, w, bias = case(40, 96, 48, 3)
    monkeypatch.setenv(cpu_native.BF16_GEMM_ENV, "on")
    layer = DenseLinear(w, bias.bfloat16())
    assert layer.prompt_variant() == "native-gemm"
    gemv_rows = cpu_native.dense_gemv_max_rows(native, w)  # 8 with AVX512-BF16, else 2
    assert [layer.static_variant(r) for r in (1, 2, 3, 8, 9, 64)] == [
        "gemv" if r <= gemv_rows else "native-gemm" for r in (1, 2, 3, 8, 9, 64)]
    with torch.inference_mode():
        with forward_phase(prefill=True):
            whole = layer(x)
            chunks = torch.cat([layer(x[:32]), layer(x[32:39]), layer(x[39:])])
        assert torch.equal(chunks, whole)  # a prompt's chunking changes no bit
        assert torch.equal(whole, cpu_native.bf16_gemm(native, x, w, layer.bias))
        with forward_phase(prefill=False):
            assert torch.equal(layer(x[:gemv_rows + 1]), whole[:gemv_rows + 1])  # batches past it: the same kernel
    monkeypatch.setenv(cpu_native.BF16_GEMM_ENV, "off")
    layer = DenseLinear(w, None)
    assert layer.prompt_variant() == "padded-gemm" and "native-gemm" not in layer.variants(8)
    monkeypatch.setenv(cpu_native.BF16_GEMM_ENV, "auto")
    layer = DenseLinear(w, None)
    # auto: the native GEMM where this build has no AVX512-BF16 (torch's GEMM is fast where it has)
    assert (layer.prompt_variant() == "native-gemm") == (not native.bf16_gemm_has_bf16_dot())
    assert DenseLinear(w.float(), None).prompt_variant() == "padded-gemm"  # float32 weights: torch's GEMM
