"""The native float32 matrix-vector product (kernels/cpu_native.py `f32_gemv`) and the dense layers
that run float32 decode rows on it (kernels/dense.py): close to torch's F.linear (float32 sums in
another order), a row's bits independent of the rows beside it and of the thread split, every tail
of K and N, bias, the layers' choice of path by row count and phase, and torch's GEMM when the
extension is off.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from text_generation_server.kernels import cpu_native
from text_generation_server.kernels.dense import DenseLinear
from text_generation_server.kernels.phase import forward_phase
from test_cpu_native import Recorder, fresh_native  # noqa: F401 (a fixture)

torch.set_num_threads(2)

# Both sides sum float32 products, in different orders: each result is within a few float32 roundings
# of the exact sum, relative to the sum of the products' magnitudes.
TOLERANCE = 1e-5


def close_to_exact(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> float:
    """The largest error of `got` against the float64 product, relative to the sum of |products|."""
    want = x.double() @ w.double().t()
    scale = x.double().abs() @ w.double().abs().t()
    if bias is not None:
        want, scale = want + bias.double(), scale + bias.double().abs()
    return ((got.double() - want).abs() / scale.clamp_min(1e-30)).max().item()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 17])
@pytest.mark.parametrize("k,n", [(256, 768), (100, 37), (15, 9), (1, 3), (768, 256), (80, 4099)], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_float32_product_matches_torch_within_float32_rounding(native, rows, k, n, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    got = cpu_native.f32_gemv(native, x, w, bias)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert close_to_exact(got, x, w, bias) < TOLERANCE
    assert close_to_exact(F.linear(x, w, bias), x, w, bias) < TOLERANCE  # the same bound holds for torch's


@pytest.mark.parametrize("k,n", [(256, 1536), (72, 33)], ids=str)
def test_a_rows_bits_do_not_depend_on_the_batch_or_the_thread_split(native, k, n, monkeypatch):
    g = torch.Generator().manual_seed(k)
    w, x, bias = torch.randn(n, k, generator=g), torch.randn(19, k, generator=g), torch.randn(n, generator=g)
    whole = cpu_native.f32_gemv(native, x, w, bias)
    for m in range(1, 19):
        assert torch.equal(cpu_native.f32_gemv(native, x[:m], w, bias), whole[:m])
        assert torch.equal(cpu_native.f32_gemv(native, x[m:m + 1], w, bias), whole[m:m + 1])
    for parallel_min in (0, 1 << 40):  # always both threads, never
        monkeypatch.setattr(cpu_native, "F32_PARALLEL_MIN_BYTES", parallel_min)
        assert torch.equal(cpu_native.f32_gemv(native, x, w, bias), whole)
    for prefetch in (0, 65536):
        assert torch.equal(cpu_native.f32_gemv(native, x, w, bias, prefetch=prefetch), whole)


def test_bad_inputs_are_refused_with_the_reason(native):
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match=r"x must be contiguous float32 \[M, 16\]"):
        native.f32_gemv(torch.randn(2, 15), w, None, 0, 0)
    with pytest.raises(RuntimeError, match="at least one row"):
        native.f32_gemv(torch.randn(0, 16), w, None, 0, 0)
    with pytest.raises(RuntimeError, match=r"bias must be contiguous float32 \[8\]"):
        native.f32_gemv(torch.randn(2, 16), w, torch.randn(7), 0, 0)
    with pytest.raises(RuntimeError, match="w must be contiguous float32"):
        native.f32_gemv(torch.randn(2, 16), w.t().contiguous().t(), None, 0, 0)
    with pytest.raises(ValueError, match="takes float32 inputs"):
        cpu_native.f32_gemv(native, torch.randn(2, 16).bfloat16(), w, None)


def test_float32_dense_layers_and_the_head_take_decode_rows_natively(native):
    from text_generation_server.layers.tensor_parallel import TensorParallelHead
    from text_generation_server.quantizers.dist import single_process_group

    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    for layer, bias in ((DenseLinear(w, b), b), (TensorParallelHead(w, 96, single_process_group(), b), b),
                        (DenseLinear(w, None), None)):
        assert layer.native is native
        recorder = Recorder(native)
        layer.native = recorder
        for lead in ((1,), (2,), (1, 2), (8,), (9,), (40,)):
            x = torch.randn(*lead, 64, generator=g)
            got = layer(x)
            assert got.dtype == torch.float32 and got.shape == (*lead, 96)
            assert close_to_exact(got.reshape(-1, 96), x.reshape(-1, 64), w, bias) < TOLERANCE
        # 1, 2, 1x2 and 8 rows; 9 and 40 rows (past F32_GEMV_MAX_ROWS): torch's GEMM
        assert recorder.calls == {"f32_gemv": 4}
        with forward_phase(prefill=True):  # prompts keep their one path (kernels/phase.py): torch's GEMM
            layer(torch.randn(1, 64, generator=g))
        assert recorder.calls == {"f32_gemv": 4}


def test_a_bfloat16_layer_moved_to_float32_follows_with_the_float32_kernel(native):
    layer = DenseLinear(torch.randn(32, 16).bfloat16(), None).to(torch.float32)
    recorder = Recorder(native)
    layer.native = recorder  # what _apply set: the extension, for the float32 weight now
    x = torch.randn(1, 16)
    assert close_to_exact(layer(x), x, layer.weight, None) < TOLERANCE and recorder.calls == {"f32_gemv": 1}
    assert DenseLinear(torch.randn(4, 4, dtype=torch.float64), None).native is None  # float64: torch only


def test_float32_layers_keep_torchs_gemm_when_native_kernels_are_off(fresh_native, monkeypatch):
    monkeypatch.setenv(cpu_native.ENV, "0")
    w = torch.randn(32, 16)
    layer = DenseLinear(w, None)
    x = torch.randn(1, 16)
    assert layer.native is None and torch.equal(layer(x), F.linear(x, w))


def test_a_float32_layer_looks_the_extension_up_on_its_first_decode_call(fresh_native):
    """A float32 model that never decodes (quantize's calibration) neither builds nor logs the extension."""
    w = torch.randn(32, 16)
    layer = DenseLinear(w, None)
    assert layer.native is None and not cpu_native.loaded()[0]
    with forward_phase(prefill=True):
        layer(torch.randn(3, 16))
    assert layer.native is None and not cpu_native.loaded()[0]
    x = torch.randn(1, 16)
    got = layer(x)
    decided, module = cpu_native.loaded()
    assert decided and layer.native is module
    if module is not None:
        assert close_to_exact(got, x, w, None) < TOLERANCE
