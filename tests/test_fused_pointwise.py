"""The decode step's fused small kernels (kernels/fused_pointwise.py): each equals the torch
arithmetic it replaces (run under TRITON_INTERPRET=1 on the CPU), they switch themselves on only
where they may (CUDA, 16-bit, first-use check passed, not disabled, never first inside a graph
capture), and the layers route RMSNorm, the residual add before the MLP norm, rotary and
SiLU-and-multiply through them: a tiny Llama gives the same greedy tokens and near-equal logits
with them as without."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from text_generation_server.kernels import fused_pointwise as fp

pytest.importorskip("triton")


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many representable values of the 16-bit dtype lie between a and b (same signs here)."""
    view = torch.int16
    return (a.view(view).int() - b.view(view).int()).abs()


def assert_rounds_like(got: torch.Tensor, want: torch.Tensor, steps: int = 1) -> None:
    """float16: at most one rounding step apart, nearly all equal. bfloat16: Triton's interpreter
    truncates casts down to bfloat16 where a GPU rounds to nearest, so bfloat16 is held to its
    precision only (the float16 cases pin the arithmetic)."""
    if got.dtype == torch.float16:
        assert int(ulps_apart(got, want).max()) <= steps
        assert (got == want).float().mean() > 0.97
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2 ** -6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 320), (5, 1000)])
def test_rms_norm_with_and_without_the_residual_add(interpret, dtype, rows, n):
    gen = torch.Generator().manual_seed(rows * n)
    x = (torch.randn(rows, n, generator=gen) * 3).to(dtype)
    r = torch.randn(rows, n, generator=gen).to(dtype)
    w = (torch.rand(n, generator=gen) + 0.5).to(dtype)
    got, none = fp.rms_norm(x, w, 1e-5)
    want, _ = fp.rms_norm_torch(x, w, 1e-5)
    assert none is None and got.dtype == dtype
    assert_rounds_like(got, want)  # the float32 sum of squares is summed in another order
    got, summed = fp.rms_norm(x, w, 1e-5, residual=r)
    want, want_sum = fp.rms_norm_torch(x, w, 1e-5, residual=r)
    if dtype == torch.float16:
        assert torch.equal(summed, want_sum)  # the residual add rounds exactly as torch's
    assert_rounds_like(summed, want_sum)
    assert_rounds_like(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_rotary_on_a_strided_qkv_view(interpret, dtype):
    gen = torch.Generator().manual_seed(1)
    tokens, heads, kv_heads, d = 3, 6, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q, k, _ = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.view(tokens, heads, d), k.view(tokens, kv_heads, d)
    angles = torch.rand(tokens, 1, d // 2, generator=gen) * 6
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = (torch.cat([angles.sin()] * 2, -1) * torch.cat([-torch.ones(d // 2), torch.ones(d // 2)])).to(dtype)
    for x in (q, k):
        got = fp.rotary(x, cos, sin)
        assert got.is_contiguous() and got.shape == x.shape
        assert_rounds_like(got, fp.rotary_torch(x, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,kv_heads,d", [(1, 8, 2, 64), (5, 6, 3, 40)])
def test_rotary_store_rotates_and_writes_the_cache_as_rotary_and_index_copy_do(interpret, dtype, tokens, heads,
                                                                                kv_heads, d):
    gen = torch.Generator().manual_seed(tokens * heads + d)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    q = qkv[:, :heads * d].view(tokens, heads, d)  # strided views, as the qkv split gives
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:].view(tokens, kv_heads, d)
    cos = torch.randn(tokens, 1, d, generator=gen).to(dtype)
    sin = torch.randn(tokens, 1, d, generator=gen).to(dtype)
    blocks, block_size = 6, 4
    key_cache = torch.randn(blocks, block_size, kv_heads, d, generator=gen).to(dtype)
    value_cache = torch.randn(blocks, block_size, kv_heads, d, generator=gen).to(dtype)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    want_keys, want_values = key_cache.clone(), value_cache.clone()
    want_q, want_k = fp.rotary(q, cos, sin), fp.rotary(k, cos, sin)
    want_keys.view(-1, kv_heads, d).index_copy_(0, slots, want_k)
    want_values.view(-1, kv_heads, d).index_copy_(0, slots, v)
    got_q, got_k = fp.rotary_store(q, k, v, cos, sin, key_cache, value_cache, slots)
    # The same arithmetic as the fused rotary kernel, to the bit; every other slot untouched.
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(key_cache, want_keys) and torch.equal(value_cache, want_values)
    assert_rounds_like(got_q, fp.rotary_torch(q, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("inner", [200, 1500])  # one block, and several with a ragged last one
def test_silu_mul(interpret, dtype, inner):
    gen = torch.Generator().manual_seed(inner)
    gate_up = (torch.randn(4, 2 * inner, generator=gen) * 4).to(dtype)
    got, want = fp.silu_mul(gate_up), fp.silu_mul_torch(gate_up)
    assert got.shape == (4, inner)
    # exp differs from torch's by an ulp of float32 at times: one step in silu(g), two in the product
    assert_rounds_like(got, want, steps=2)


# -- when they run ------------------------------------------------------------------------------
def fake_cuda(dtype=torch.float16, index=0):
    return SimpleNamespace(is_cuda=True, dtype=dtype, device=torch.device("cuda", index))


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(fp, "_checked", {})
    monkeypatch.setattr(fp, "_store_checked", {})
    monkeypatch.delenv(fp.DISABLE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    calls = []

    def check(device, verdict=(True, "")):
        calls.append(str(device))
        return verdict

    monkeypatch.setattr(fp, "self_check", check)
    return calls


def test_cpu_tensors_never_use_them_unless_a_test_asks(monkeypatch):
    x = torch.zeros(2, 8, dtype=torch.float16)
    assert not fp.usable(x)
    monkeypatch.setattr(fp, "INTERPRETED_ON_CPU", True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not fp.usable(x), "compiled Triton cannot run CPU tensors"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fp.usable(x) and not fp.usable(x.float())


def test_checked_once_per_device_then_remembered(fresh):
    assert fp.usable(fake_cuda()) and fp.usable(fake_cuda())
    assert not fp.usable(fake_cuda(torch.float32)), "float32 keeps torch's ops"
    assert fp.usable(fake_cuda(index=1))
    assert fresh == ["cuda:0", "cuda:1"]


def test_a_failed_check_turns_them_off_with_a_warning(fresh, monkeypatch):
    from loguru import logger

    monkeypatch.setattr(fp, "self_check", lambda device: (False, "CompilationError: out of resources"))
    lines = []
    sink = logger.add(lines.append, level="WARNING")
    try:
        assert not fp.usable(fake_cuda()) and not fp.usable(fake_cuda())
    finally:
        logger.remove(sink)
    assert len(lines) == 1 and "out of resources" in lines[0] and "torch's ops run" in lines[0]


def test_disabled_by_the_environment(fresh, monkeypatch):
    monkeypatch.setenv(fp.DISABLE_ENV, "1")
    assert not fp.usable(fake_cuda())
    assert fresh == [], "no check runs when they are switched off"


def test_never_checked_inside_a_graph_capture(fresh, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not fp.usable(fake_cuda())
    assert fresh == [] and fp._checked == {}, "the verdict waits for an eager forward"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert fp.usable(fake_cuda())


def test_self_check_runs_the_kernels_and_passes(interpret, monkeypatch):
    ok, why = fp.self_check(torch.device("cpu"))
    assert ok, why


def test_self_check_reports_a_kernel_that_disagrees(interpret, monkeypatch):
    monkeypatch.setattr(fp, "silu_mul", lambda gu: fp.silu_mul_torch(gu) + 1)
    ok, why = fp.self_check(torch.device("cpu"))
    assert not ok and "silu_mul" in why


def test_the_store_kernel_is_checked_on_its_own(interpret, monkeypatch, fresh):
    assert fp.self_check_store(torch.device("cpu")) == (True, "")
    monkeypatch.setattr(fp, "rotary_store", lambda q, k, v, cos, sin, kc, vc, slots: (q, k))  # writes nothing
    ok, why = fp.self_check_store(torch.device("cpu"))
    assert not ok and "rotary_store" in why
    # A failed store check warns once and keeps the other fused kernels on.
    monkeypatch.setattr(fp, "self_check_store", lambda device: (False, "CompilationError: no"))
    from loguru import logger

    lines = []
    sink = logger.add(lines.append, level="WARNING")
    try:
        assert fp.usable(fake_cuda()) and not fp.usable_store(fake_cuda()) and not fp.usable_store(fake_cuda())
    finally:
        logger.remove(sink)
    assert len(lines) == 1 and "rotary + K/V cache write off" in lines[0]


# -- the layers route through them ----------------------------------------------------------------
def test_a_tiny_llama_gives_the_same_tokens_through_the_fused_kernels(interpret, monkeypatch, tmp_path):
    from helpers import write_checkpoint

    from text_generation_server.engine.types import GenerationRequest
    from text_generation_server.models.loader import get_model

    write_checkpoint(tmp_path / "m", "llama", seed=5)
    prompt = [5, 9, 14, 3, 22, 7, 11]

    def run():
        lm = get_model(str(tmp_path / "m"), dtype="float16")
        out = lm.generate([GenerationRequest(id=0, inputs="", input_ids=prompt, max_new_tokens=6,
                                             ignore_eos_token=True, top_n_tokens=3)])[0]
        return out

    plain = run()
    calls = {"rms_norm": 0, "rotary": 0, "rotary_store": 0, "silu_mul": 0}
    for name in calls:
        real = getattr(fp, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(fp, name, counted)
    monkeypatch.setattr(fp, "INTERPRETED_ON_CPU", True)
    fused = run()
    layers = 2  # helpers.hf_config's llama
    steps = 6  # the prefill and five decode steps
    assert calls["silu_mul"] == layers * steps
    assert calls["rotary_store"] == layers * steps  # q and k rotated, k and v written, one launch
    assert calls["rotary"] == 0
    assert calls["rms_norm"] == (2 * layers + 1) * steps  # input and MLP norms, and the final norm
    assert fused.token_ids == plain.token_ids
    fused_lp = [lp for g in fused.steps for lp in g.tokens.logprobs]
    plain_lp = [lp for g in plain.steps for lp in g.tokens.logprobs]
    assert len(fused_lp) == len(plain_lp) == steps
    for a, b in zip(fused_lp, plain_lp):
        assert abs(a - b) < 0.05


# -- on a GPU (gpu_all.sh runs these) -----------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fused_kernels_pass_their_check_and_keep_greedy_tokens(monkeypatch, tmp_path):
    from helpers import write_checkpoint

    from text_generation_server.engine.types import GenerationRequest
    from text_generation_server.models.loader import get_model

    ok, why = fp.self_check(torch.device("cuda", torch.cuda.current_device()))
    assert ok, why
    write_checkpoint(tmp_path / "m", "llama", seed=5)

    def tokens(disabled: bool) -> list[int]:
        monkeypatch.setattr(fp, "_checked", {})
        monkeypatch.setenv(fp.DISABLE_ENV, "1" if disabled else "0")
        lm = get_model(str(tmp_path / "m"), dtype="float16", device=torch.device("cuda", 0))
        return lm.generate([GenerationRequest(id=0, inputs="", input_ids=[5, 9, 14, 3, 22, 7, 11], max_new_tokens=8,
                                              ignore_eos_token=True)])[0].token_ids

    fused = tokens(False)
    assert fp._checked == {"cuda:0": True}
    assert fused == tokens(True)
