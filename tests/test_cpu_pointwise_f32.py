"""The native CPU pointwise ops of a float32 layer (kernels/cpu_pointwise.py, `*_f32`) against the
torch code they replace in layers/norm.py, rotary.py and mlp.py (TGS_CPU_NATIVE_POINTWISE=0 runs
that code): rotary and silu * up bit for bit, the RMSNorm within a float32 rounding of its scale."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from text_generation_server.kernels import cpu_native, cpu_pointwise
from text_generation_server.layers.norm import RMSNorm
from text_generation_server.layers.rotary import apply_rotary
from test_cpu_native import Recorder
from test_cpu_pointwise import g, torch_form

pytestmark = pytest.mark.skipif(cpu_native.native() is None,
                                reason=f"native CPU kernels not built here: {cpu_native.unavailable_reason()}")

# silu's exp is torch's own SLEEF routine where the extension is built for AVX-512 or AVX2 (x86-64);
# elsewhere the extension's exp16, a float32 ulp or two apart.
X86 = platform.machine().lower() in ("x86_64", "amd64")


@pytest.fixture
def recorder(monkeypatch):
    """The extension as the float32 layers get it, its calls counted."""
    rec = Recorder(cpu_native.native())
    monkeypatch.setattr(cpu_pointwise.cpu_native, "native", lambda: rec)
    return rec


@pytest.mark.parametrize("rows,n", [(1, 256), (3, 896), (17, 40), (2, 7)])
def test_rms_norm_and_residual_add(monkeypatch, recorder, rows, n):
    norm = RMSNorm(torch.rand(n, generator=g(1)) * 2, 1e-5)
    x = torch.randn(rows, n, generator=g(2)) * 3
    residual = torch.randn(rows, n, generator=g(3))
    got = norm(x)
    normed, summed = norm.add_forward(x, residual)
    assert recorder.calls == {"rms_norm_f32": 2}
    want = torch_form(monkeypatch, lambda: norm(x))
    want_normed, want_summed = torch_form(monkeypatch, lambda: norm.add_forward(x, residual))
    assert torch.equal(summed, want_summed)  # one float32 rounding of the sum, as torch's add
    for a, b in ((got, want), (normed, want_normed)):
        # The mean's sum runs in another order than torch's: the scale a float32 ulp or so apart.
        assert ((a - b).abs() / b.abs().clamp_min(1e-30)).max() < 4e-7


@pytest.mark.parametrize("tokens,heads,dim", [(1, 8, 32), (5, 2, 64), (3, 4, 80)])
def test_rotary_is_torchs_bits(monkeypatch, recorder, tokens, heads, dim):
    x = torch.randn(tokens, heads, dim, generator=g(4))
    angles = torch.rand(tokens, 1, dim // 2, generator=g(5)) * 6
    emb = torch.cat([angles, angles], dim=-1)
    sign = torch.ones(dim)
    sign[: dim // 2] = -1
    cos, sin = emb.cos(), emb.sin() * sign
    got = apply_rotary(x, cos, sin)
    assert recorder.calls == {"rotary_f32": 1}
    assert torch.equal(got, torch_form(monkeypatch, lambda: apply_rotary(x, cos, sin)))
    # A view of q out of a fused qkv output (heads contiguous, rows strided) too.
    qkv = torch.randn(tokens, (heads + 2) * dim, generator=g(6))
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    assert torch.equal(apply_rotary(q, cos, sin), torch_form(monkeypatch, lambda: apply_rotary(q, cos, sin)))
    # Interleaved pairs keep torch's code.
    assert not cpu_pointwise.rotary_f32_fits(x, cos, sin, interleaved=True)


@pytest.mark.parametrize("rows,n", [(1, 768), (4, 40), (2, 23), (1, 100), (1, 48), (3, 4864)])
def test_silu_mul(monkeypatch, recorder, rows, n):
    from text_generation_server.layers.mlp import GatedMLP

    gate_up = torch.randn(rows, 2 * n, generator=g(7)) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's far ends and zero
    mlp = GatedMLP.__new__(GatedMLP)
    torch.nn.Module.__init__(mlp)
    mlp.local, mlp.act = n, F.silu
    mlp.down = torch.nn.Identity()
    mlp.gate_up = torch.nn.Identity()
    got = mlp(gate_up)
    assert recorder.calls == {"silu_mul_f32": 1}
    want = torch_form(monkeypatch, lambda: mlp(gate_up))
    assert got.shape == (rows, n)
    if X86:
        assert torch.equal(got, want)
    else:
        assert ((got - want).abs() / want.abs().clamp_min(1e-30)).max() < 1e-6


def test_float32_layers_keep_torchs_code_when_switched_off(monkeypatch, recorder):
    monkeypatch.setenv(cpu_pointwise.ENV, "0")
    norm = RMSNorm(torch.rand(64), 1e-5)
    x = torch.randn(2, 64)
    assert torch.equal(norm(x), F.rms_norm(x, (64,), norm.weight, 1e-5)) and recorder.calls == {}


def test_bad_input_is_refused_by_name():
    native = cpu_native.native()
    with pytest.raises(RuntimeError, match=r"weight must be contiguous float32 \[8\]"):
        native.rms_norm_f32(torch.zeros(1, 8), torch.zeros(9), 1e-6, None)
    with pytest.raises(RuntimeError, match="residual"):
        native.rms_norm_f32(torch.zeros(1, 8), torch.zeros(8), 1e-6, torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="gate_up must be"):
        native.silu_mul_f32(torch.zeros(1, 10), 4)
    with pytest.raises(RuntimeError, match="cos and sin must be float32"):
        native.rotary_f32(torch.zeros(1, 2, 8), torch.zeros(1, 1, 8, dtype=torch.bfloat16),
                          torch.zeros(1, 1, 8, dtype=torch.bfloat16))
