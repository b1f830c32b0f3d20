"""The native CPU pointwise ops of a bfloat16 layer (kernels/cpu_pointwise.py) against the torch code
they replace in layers/norm.py, rotary.py and mlp.py (TGS_CPU_NATIVE_POINTWISE=0 runs that code)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from text_generation_server.kernels import cpu_native, cpu_pointwise
from text_generation_server.layers.norm import RMSNorm
from text_generation_server.layers.rotary import apply_rotary

pytestmark = pytest.mark.skipif(cpu_native.native() is None,
                                reason=f"native CPU kernels not built here: {cpu_native.unavailable_reason()}")


def torch_form(monkeypatch, fn):
    """fn() with the native ops switched off: the layers' torch code."""
    monkeypatch.setenv(cpu_pointwise.ENV, "0")
    try:
        return fn()
    finally:
        monkeypatch.delenv(cpu_pointwise.ENV)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bfloat16 units in the last place between a and b (same signs here)."""
    ia = a.view(torch.int16).to(torch.int32)
    ib = b.view(torch.int16).to(torch.int32)
    return (ia - ib).abs()


def g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows,n", [(1, 1536), (3, 896), (17, 40)])
def test_rms_norm_and_residual_add(monkeypatch, rows, n):
    norm = RMSNorm((torch.rand(n, generator=g(1)) * 2).to(torch.bfloat16), 1e-6)
    x = (torch.randn(rows, n, generator=g(2)) * 3).to(torch.bfloat16)
    residual = torch.randn(rows, n, generator=g(3)).to(torch.bfloat16)
    assert cpu_pointwise.module_for(x) is not None and cpu_pointwise.norm_fits(x, norm.weight, residual)
    got = norm(x)
    want = torch_form(monkeypatch, lambda: norm(x))
    normed, summed = norm.add_forward(x, residual)
    want_normed, want_summed = torch_form(monkeypatch, lambda: norm.add_forward(x, residual))
    assert torch.equal(summed, want_summed)  # one bfloat16 rounding of the float32 sum, as torch's add
    for a, b in ((got, want), (normed, want_normed)):
        # The scale's sum of squares runs in another order than torch's: a float32 ulp apart at most,
        # which moves a bfloat16 product by one unit now and then.
        assert ulps_apart(a, b).max() <= 1
        assert (a != b).float().mean() < 0.01


def test_rms_norm_leaves_other_forms_to_torch(monkeypatch):
    x = torch.randn(2, 64)  # float32: not the bfloat16 op (its own float32 form: test_cpu_pointwise_f32.py)
    assert cpu_pointwise.module_for(x) is None
    gemma = RMSNorm(torch.rand(64).to(torch.bfloat16), 1e-6, offset=1.0)  # 1 + w in float32: torch's code
    xb = x.to(torch.bfloat16)
    assert torch.equal(gemma(xb), torch_form(monkeypatch, lambda: gemma(xb)))


@pytest.mark.parametrize("tokens,heads,dim", [(1, 12, 128), (5, 2, 64), (3, 4, 80)])
def test_rotary_is_torchs_bits(monkeypatch, tokens, heads, dim):
    x = torch.randn(tokens, heads, dim, generator=g(4)).to(torch.bfloat16)
    angles = torch.rand(tokens, 1, dim // 2, generator=g(5)) * 6
    emb = torch.cat([angles, angles], dim=-1)
    sign = torch.ones(dim)
    sign[: dim // 2] = -1
    cos, sin = emb.cos().to(torch.bfloat16), (emb.sin() * sign).to(torch.bfloat16)
    got = apply_rotary(x, cos, sin)
    want = torch_form(monkeypatch, lambda: apply_rotary(x, cos, sin))
    assert torch.equal(got, want)
    # A view of q out of a fused qkv output (heads contiguous, rows strided) too.
    qkv = torch.randn(tokens, (heads + 2) * dim, generator=g(6)).to(torch.bfloat16)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    assert torch.equal(apply_rotary(q, cos, sin), torch_form(monkeypatch, lambda: apply_rotary(q, cos, sin)))
    # Interleaved pairs and partial rotation keep torch's code.
    assert not cpu_pointwise.rotary_fits(x, cos, sin, interleaved=True)


@pytest.mark.parametrize("rows,n", [(1, 8960), (4, 40), (2, 23)])
def test_silu_mul(monkeypatch, rows, n):
    from text_generation_server.layers.mlp import GatedMLP

    gate_up = (torch.randn(rows, 2 * n, generator=g(7)) * 4).to(torch.bfloat16)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps and zero
    mlp = GatedMLP.__new__(GatedMLP)
    torch.nn.Module.__init__(mlp)
    mlp.local, mlp.act = n, F.silu
    mlp.down = torch.nn.Identity()
    mlp.gate_up = torch.nn.Identity()
    got = mlp(gate_up)
    want = torch_form(monkeypatch, lambda: mlp(gate_up))
    assert got.shape == (rows, n)
    assert ulps_apart(got, want).max() <= 1  # exp in the last float32 bits: a bfloat16 unit at most, rarely
    assert (got != want).float().mean() < 0.01


def test_bad_input_is_refused_by_name():
    native = cpu_native.native()
    with pytest.raises(RuntimeError, match="weight must be contiguous bfloat16"):
        native.rms_norm_bf16(torch.zeros(1, 8, dtype=torch.bfloat16), torch.zeros(9, dtype=torch.bfloat16), 1e-6,
                             None)
    with pytest.raises(RuntimeError, match="gate_up must be"):
        native.silu_mul_bf16(torch.zeros(1, 10, dtype=torch.bfloat16), 4)
