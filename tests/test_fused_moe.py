"""The fused mixture-of-experts op (kernels/fused_moe.py).

Tier 1 (CPU, always): moe_align's invariants, the Triton kernel under TRITON_INTERPRET=1 for
every activation, with and without biases, in float32/float16/bfloat16, for dense, packed
integer (act-order, asymmetric, 4- and 8-bit) and e4m3 weights (per-channel, per-tensor,
block grid) against `moe_reference` on the dequantized weights; experts nobody picks are never
read (their weights or scales are NaN and the output stays finite); scratch sizing and use.
Tier 2 (CUDA, skipped without a GPU): the compiled kernels against the reference, moe_align
without host syncs, and the op captured in a CUDA graph.

Bounds are relative to the output norm: float32 runs exactly up to summation order; float16
and bfloat16 round the input, the intermediate activation and each slot's output (~2^-11 and
~2^-8 per element). A wrong expert, slot, weight or bias gives errors of order one.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_weight, needs_gpu
from text_generation_server.kernels import fused_moe as fm
from text_generation_server.kernels.base import dequantize
from text_generation_server.kernels.fp8 import FP8_DTYPE, Fp8Weight
from text_generation_server.kernels.scratch import ScratchSpace

torch.set_num_threads(1)

triton = pytest.importorskip("triton")  # tier 1 runs the kernel in Triton's interpreter
BOUND = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# The kernel's sigmoids are 1 / (1 + exp(-x)): exp overflows to inf for very negative x, giving
# the right 0. The interpreter computes it in numpy, which warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert y.shape == ref.shape and y.dtype == ref.dtype
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def routing(t: int, k: int, e: int, seed: int, experts: list[int] | None = None,
            device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """k distinct experts per token (from `experts` when given) and positive weights."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts if experts is not None else list(range(e)))
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen) + 0.1
    return weights.to(device), ids.to(torch.int32).to(device)


def dense_problem(t: int, k: int, e: int, h: int, i: int, dtype: torch.dtype, seed: int, bias: bool,
                  device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype).to(device)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h**0.5).to(dtype).to(device)
    w2 = (torch.randn(e, h, i, generator=gen) / i**0.5).to(dtype).to(device)
    b13 = torch.randn(e, 2 * i, generator=gen).to(device) if bias else None
    b2 = torch.randn(e, h, generator=gen).to(device) if bias else None
    return x, w13, w2, b13, b2


# ---------------------------------------------------------------------------------------------
# Alignment (torch only)

@pytest.mark.parametrize("t,k,e,bm", [(1, 1, 4, 16), (1, 8, 128, 16), (5, 2, 8, 16), (37, 2, 3, 32),
                                      (64, 4, 8, 64), (3, 2, 64, 16)])
def test_moe_align_invariants(t, k, e, bm):
    _, ids = routing(t, k, e, seed=t * 31 + e)
    sorted_ids, block_experts, total = fm.moe_align(ids, e, bm)
    rows = t * k
    cap = fm.max_padded_rows(t, k, e, bm)
    assert sorted_ids.dtype == block_experts.dtype == total.dtype == torch.int32
    assert sorted_ids.shape == (cap,) and block_experts.shape == (cap // bm,) and total.shape == (1,)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=e)
    padded = (counts + bm - 1) // bm * bm
    assert int(total) == int(padded.sum()) <= cap and int(total) % bm == 0
    real = sorted_ids[sorted_ids < rows]
    assert sorted(real.tolist()) == list(range(rows))  # every (token, slot) exactly once
    assert int((sorted_ids == rows).sum()) == cap - rows  # the rest is the sentinel
    assert int((sorted_ids > rows).sum()) == 0
    flat_e = ids.reshape(-1).long()
    used = int(total) // bm
    for b in range(cap // bm):
        block = sorted_ids[b * bm:(b + 1) * bm]
        if b >= used:
            assert int(block_experts[b]) == -1 and bool((block == rows).all())
            continue
        expert = int(block_experts[b])
        members = block[block < rows].long()
        assert len(members) > 0  # padding never fills a whole block
        assert bool((flat_e[members] == expert).all())
        assert members.tolist() == sorted(members.tolist())  # token order within an expert
        # real rows first, sentinels after: a run's padding is at its end
        assert bool((block[:len(members)] < rows).all())
    # experts nobody picked own no block; each picked one owns ceil(count / bm) blocks
    owned = torch.bincount(block_experts[:used].long(), minlength=e)
    assert torch.equal(owned, padded // bm)


def test_moe_align_fills_given_buffers_and_block_sizes():
    _, ids = routing(3, 2, 8, seed=1)
    cap = fm.max_padded_rows(3, 2, 8, 16)
    bufs = (torch.full((cap + 16,), 7, dtype=torch.int32), torch.full((cap // 16 + 3,), 7, dtype=torch.int32))
    sorted_ids, block_experts, _ = fm.moe_align(ids, 8, 16, out=bufs)
    assert sorted_ids.data_ptr() == bufs[0].data_ptr() and block_experts.data_ptr() == bufs[1].data_ptr()
    assert torch.equal(sorted_ids, fm.moe_align(ids, 8, 16)[0])
    # decode: a block per active expert, not per expert
    assert fm.max_padded_rows(1, 8, 128, 16) == 8 * 16
    assert fm.max_padded_rows(4, 2, 2, 16) == 8 + 2 * 15 - (8 + 2 * 15) % 16
    # blocks of twice an average expert's rows: E=128, k=8 averages t/16 rows per expert
    assert [fm.block_m_for(t, 8, 128) for t in (1, 128, 129, 256, 257, 4096)] == [16, 16, 32, 32, 64, 64]


# ---------------------------------------------------------------------------------------------
# The reference itself, against a per-token loop written from the formula

def test_reference_matches_per_token_formula():
    x, w13, w2, b13, b2 = dense_problem(4, 2, 5, 16, 12, torch.float32, seed=0, bias=True)
    weights, ids = routing(4, 2, 5, seed=0)
    y = fm.moe_reference(x, w13, w2, weights, ids, b13, b2, "swiglu_oai", alpha=1.5, limit=0.5)
    for t in range(4):
        acc = torch.zeros(16)
        for j in range(2):
            e = int(ids[t, j])
            g, u = (w13[e] @ x[t] + b13[e]).split(12)
            g, u = g.clamp(max=0.5), u.clamp(-0.5, 0.5)
            acc += weights[t, j] * (w2[e] @ ((u + 1) * g * torch.sigmoid(1.5 * g)) + b2[e])
        assert torch.allclose(y[t], acc, atol=1e-5), t
    gate, up = torch.randn(2, 50)
    assert torch.allclose(fm.moe_activation(gate, up, "gelu_tanh"),
                          0.5 * gate * (1 + torch.tanh(0.7978845608 * (gate + 0.044715 * gate**3))) * up, atol=1e-6)
    with pytest.raises(ValueError, match="activation must be one of"):
        fm.moe_activation(gate, up, "relu")


# ---------------------------------------------------------------------------------------------
# Dense weights (interpreter)

@pytest.mark.parametrize("activation", fm.ACTIVATIONS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_dense_matches_reference(activation, bias, dtype, interpret):
    # I = 48 and H = 40: neither a multiple of the 64-column tile nor of the K tile.
    t, k, e, h, i = 3, 2, 5, 40, 48
    x, w13, w2, b13, b2 = dense_problem(t, k, e, h, i, dtype, seed=len(activation), bias=bias)
    if activation == "swiglu_oai":
        x = x * 8  # reach the clamps
    weights, ids = routing(t, k, e, seed=2)
    y = fm.fused_moe(x, w13, w2, weights, ids, b13, b2, activation, alpha=1.702, limit=7.0)
    ref = fm.moe_reference(x, w13, w2, weights, ids, b13, b2, activation)
    assert rel_err(y, ref) < BOUND[dtype]


@pytest.mark.parametrize("t,k,e,block_m", [(1, 1, 4, None), (1, 2, 8, None), (6, 2, 4, 16), (20, 1, 2, 16),
                                           (9, 2, 3, 32)])
def test_dense_token_counts_and_topk(t, k, e, block_m, interpret):
    # (20, 1, 2, 16): an expert spanning several blocks; (1, ...): decode.
    x, w13, w2, b13, b2 = dense_problem(t, k, e, 32, 16, torch.float32, seed=t, bias=True)
    weights, ids = routing(t, k, e, seed=t + k)
    y = fm.fused_moe(x, w13, w2, weights, ids, b13, b2, block_m=block_m)
    assert rel_err(y, fm.moe_reference(x, w13, w2, weights, ids, b13, b2)) < BOUND[torch.float32]


def test_unpicked_experts_are_never_read(interpret):
    t, k, e, h, i = 4, 2, 8, 32, 24
    x, w13, w2, b13, b2 = dense_problem(t, k, e, h, i, torch.float16, seed=5, bias=True)
    picked = [1, 4, 6]
    weights, ids = routing(t, k, e, seed=5, experts=picked)
    idle = [x_ for x_ in range(e) if x_ not in picked]
    for w in (w13, w2, b13, b2):
        w[idle] = float("nan")
    y = fm.fused_moe(x, w13, w2, weights, ids, b13, b2)
    assert bool(torch.isfinite(y).all())
    assert rel_err(y, fm.moe_reference(x, w13, w2, weights, ids, b13, b2)) < BOUND[torch.float16]


def test_no_load_touches_an_unpicked_expert(interpret, monkeypatch):
    """Every load the kernel issues, counted in the interpreter (benchmarks/moe_triton_bytes.py's
    counter): none falls in an unpicked expert's weights, codes, scales or permutation, padding
    blocks included (the NaN tests only see reads that reach a stored output)."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import moe_triton_bytes

    t, k, e, h, i = 2, 2, 6, 128, 64
    x, d13, d2, _, _ = dense_problem(t, k, e, h, i, torch.float16, seed=0, bias=False)
    weights, ids = routing(t, k, e, seed=0, experts=[1, 4, 5])
    picked = set(ids.reshape(-1).tolist())
    forms = {
        "dense": (d13, d2),
        "int4": (fm.MoeGemmWeight.from_quantized([(make_weight(h, i, 4, 32, False, True, seed=x_),
                                                   make_weight(h, i, 4, 32, False, True, seed=9 + x_))
                                                  for x_ in range(e)], torch.float16),
                 fm.MoeGemmWeight.from_quantized([make_weight(i, h, 4, 32, False, True, seed=x_) for x_ in range(e)],
                                                 torch.float16)),
        "fp8": (fm.MoeFp8Weight.from_tensors(fp8_codes((e, 2 * i, h), 1), torch.rand(e, 2 * i) / 64),
                fm.MoeFp8Weight.from_tensors(fp8_codes((e, h, i), 2), torch.rand(e, h) / 64)),
    }
    for name, (w13, w2) in forms.items():
        touched, stored = moe_triton_bytes.count_touched(fm, x, w13, w2, weights, ids)
        assert all(touched[x_] == 0 for x_ in range(e) if x_ not in picked), name
        if name == "int4":  # N pads to 128 per part; the padding columns past I = 64 are never loaded
            assert all(0 < touched[x_] < stored[x_] for x_ in picked)
        else:
            assert all(touched[x_] == stored[x_] for x_ in picked), name  # an active expert is read whole


def test_zero_tokens_and_launcher_checks(interpret):
    x, w13, w2, _, _ = dense_problem(2, 2, 4, 16, 8, torch.float32, seed=0, bias=False)
    weights, ids = routing(2, 2, 4, seed=0)
    assert fm.fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, 16)
    with pytest.raises(ValueError, match="topk_weights must be float32"):
        fm.fused_moe(x, w13, w2, weights.half(), ids)
    with pytest.raises(ValueError, match=r"w13 must be \[E, 2I, 16\]"):
        fm.fused_moe(x, w13[:, :, :8], w2, weights, ids)
    with pytest.raises(ValueError, match="dense w2 must be torch.float32"):
        fm.fused_moe(x, w13, w2.half(), weights, ids)
    with pytest.raises(ValueError, match="activation must be one of"):
        fm.fused_moe(x, w13, w2, weights, ids, activation="relu")
    with pytest.raises(ValueError, match=r"b2 must be \[4, 16\]"):
        fm.fused_moe(x, w13, w2, weights, ids, b2=torch.zeros(4, 8))
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        fm.fused_moe(x, w13, w2, weights, ids, block_m=24)


# ---------------------------------------------------------------------------------------------
# Packed integer weights (interpreter)

def int_experts(e: int, h: int, i: int, bits: int, gs: int, sym: bool, act: bool, seed: int):
    """Per expert: gate and up quantized apart ([h, i] each, own g_idx) and down [i, h]."""
    gate_up = [(make_weight(h, i, bits, gs, sym, act, seed=seed + 3 * x),
                make_weight(h, i, bits, gs, sym, act, seed=seed + 3 * x + 1)) for x in range(e)]
    down = [make_weight(i, h, bits, gs, sym, act, seed=seed + 3 * x + 2) for x in range(e)]
    dense13 = torch.stack([torch.cat([dequantize(g), dequantize(u)]) for g, u in gate_up])  # [E, 2I, H]
    dense2 = torch.stack([dequantize(d) for d in down])  # [E, H, I]
    return gate_up, down, dense13, dense2


INT_CASES = [
    # (bits, group size, symmetric, act-order, dtype)
    (4, 32, False, True, torch.float16),  # GPTQ act-order, asymmetric: gate and up with their own g_idx
    (4, 64, True, False, torch.float32),
    (8, 32, False, False, torch.bfloat16),
    (4, 16, True, False, torch.float32),  # group smaller than a field block: scales per row
]


@pytest.mark.parametrize("bits,gs,sym,act,dtype", INT_CASES, ids=lambda v: str(v).removeprefix("torch."))
def test_packed_int_matches_dequantized_reference(bits, gs, sym, act, dtype, interpret):
    t, k, e, h, i = 3, 2, 4, 160, 72  # K off the 128-row chunk, N off the tile
    gate_up, down, dense13, dense2 = int_experts(e, h, i, bits, gs, sym, act, seed=bits + gs)
    w13 = fm.MoeGemmWeight.from_quantized(gate_up, dtype)
    w2 = fm.MoeGemmWeight.from_quantized(down, dtype)
    assert (w13.parts, w13.out_features, w13.in_features, w2.parts) == (2, i, h, 1)
    assert (w13.zeros is None) == sym and (w13.perm is not None or not act)  # repack may pad a short group too
    assert torch.allclose(w13.dequantize(), dense13.to(dtype).float(), rtol=1e-2 if dtype != torch.float32 else 1e-6)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(t, h, generator=gen).to(dtype)
    b13, b2 = torch.randn(e, 2 * i, generator=gen), torch.randn(e, h, generator=gen)
    weights, ids = routing(t, k, e, seed=3)
    y = fm.fused_moe(x, w13, w2, weights, ids, b13, b2, "silu")
    ref = fm.moe_reference(x, dense13.to(dtype), dense2.to(dtype), weights, ids, b13, b2, "silu")
    assert rel_err(y, ref) < BOUND[dtype]


def test_packed_int_fused_gate_up_and_unpicked_experts(interpret):
    """One fused [H, 2I] weight per expert split in two; unpicked experts' scales are NaN."""
    t, k, e, h, i = 2, 2, 6, 128, 32
    fused = [make_weight(h, 2 * i, 4, 32, False, False, seed=x) for x in range(e)]
    down = [make_weight(i, h, 4, 32, False, False, seed=10 + x) for x in range(e)]
    w13 = fm.MoeGemmWeight.from_quantized(fused, torch.float16, split=2)
    w2 = fm.MoeGemmWeight.from_quantized(down, torch.float16)
    dense13 = torch.stack([dequantize(w) for w in fused]).half()
    dense2 = torch.stack([dequantize(w) for w in down]).half()
    weights, ids = routing(t, k, e, seed=4, experts=[0, 3, 5])
    for w in (w13, w2):
        w.scales[[1, 2, 4]] = float("nan")
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(1)).half()
    y = fm.fused_moe(x, w13, w2, weights, ids, activation="gelu")
    assert bool(torch.isfinite(y).all())
    assert rel_err(y, fm.moe_reference(x, dense13, dense2, weights, ids, activation="gelu")) < BOUND[torch.float16]


def test_packed_int_refuses_mixed_layouts():
    a = make_weight(128, 32, 4, 32, False, False, seed=0)
    b = make_weight(128, 32, 4, 64, False, False, seed=1)
    with pytest.raises(ValueError, match="reads one layout for every expert"):
        fm.MoeGemmWeight.from_quantized([a, b], torch.float16)
    with pytest.raises(ValueError, match="cannot split 32 output columns into 3"):
        fm.MoeGemmWeight.from_quantized([a], torch.float16, split=3)


# ---------------------------------------------------------------------------------------------
# e4m3 weights (interpreter)

def fp8_codes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random finite e4m3 values, subnormals and both signs included."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    codes = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)  # 0x7F / 0xFF are NaN
    return codes.to(torch.uint8).view(FP8_DTYPE)


@pytest.mark.parametrize("scales", ["channel", "tensor", "both", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_channel_scales_match_reference(scales, dtype, interpret):
    t, k, e, h, i = 3, 2, 4, 80, 40
    gen = torch.Generator().manual_seed(7)
    ch13 = torch.rand(e, 2 * i, generator=gen) / 64 if scales in ("channel", "both") else None
    ch2 = torch.rand(e, h, generator=gen) / 64 if scales in ("channel", "both") else None
    ts = torch.rand(e, generator=gen) / 16 + 0.01 if scales in ("tensor", "both") else None
    w13 = fm.MoeFp8Weight.from_tensors(fp8_codes((e, 2 * i, h), 1), ch13, ts)
    w2 = fm.MoeFp8Weight.from_tensors(fp8_codes((e, h, i), 2), ch2, ts)
    assert not w13.grid
    x = torch.randn(t, h, generator=gen).to(dtype)
    b13, b2 = torch.randn(e, 2 * i, generator=gen), torch.randn(e, h, generator=gen)
    weights, ids = routing(t, k, e, seed=8)
    y = fm.fused_moe(x, w13, w2, weights, ids, b13, b2, "gelu_tanh")
    ref = fm.moe_reference(x, w13.dequantize().to(dtype), w2.dequantize().to(dtype), weights, ids, b13, b2,
                           "gelu_tanh")
    assert rel_err(y, ref) < BOUND[dtype]


def test_fp8_block_grid_and_parts_match_reference(interpret):
    """Canonical Fp8Weights: gate/up as parts with per-tensor scales (w13), 16x16 blocks (w2)."""
    t, k, e, h, i = 4, 2, 3, 64, 32
    gen = torch.Generator().manual_seed(3)

    def per_tensor(n, kk, seed):
        return Fp8Weight(fp8_codes((n, kk), seed), torch.rand(1, 1, generator=gen) / 32,
                         torch.zeros(n, dtype=torch.int32), torch.zeros(kk, dtype=torch.int32))

    def blocked(n, kk, seed, bn=16, bk=16):
        grid = torch.rand(-(-n // bn), -(-kk // bk), generator=gen) / 32
        return Fp8Weight(fp8_codes((n, kk), seed), grid, (torch.arange(n) // bn).int(), (torch.arange(kk) // bk).int())

    w13 = fm.MoeFp8Weight.from_fp8_weights([(per_tensor(i, h, 3 * x), per_tensor(i, h, 3 * x + 1))
                                            for x in range(e)])
    w2 = fm.MoeFp8Weight.from_fp8_weights([blocked(h, i, 3 * x + 2) for x in range(e)])
    assert w13.scale.shape == (e, 2, 1) and not w13.grid and w2.grid
    x = torch.randn(t, h, generator=gen).half()
    weights, ids = routing(t, k, e, seed=9, experts=[0, 2])
    for w in (w13, w2):
        w.scale[1] = float("nan")  # expert 1 is never picked
    y = fm.fused_moe(x, w13, w2, weights, ids, activation="swiglu_oai", alpha=1.702, limit=7.0)
    assert bool(torch.isfinite(y).all())
    ref = fm.moe_reference(x, w13.dequantize().half(), w2.dequantize().half(), weights, ids, activation="swiglu_oai")
    assert rel_err(y, ref) < BOUND[torch.float16]
    with pytest.raises(ValueError, match="another fp8 scale layout"):
        fm.MoeFp8Weight.from_fp8_weights([blocked(h, i, 0), blocked(h, i, 1, bn=32)])


# ---------------------------------------------------------------------------------------------
# Scratch

def test_scratch_bytes():
    needs = fm.fused_moe_scratch_bytes(4, 2, 8, 16, hidden=64, intermediate=32, dtype=torch.float16)
    cap = fm.max_padded_rows(4, 2, 8, 16)
    assert needs == {"moe_sorted_ids": cap * 4, "moe_block_experts": cap // 16 * 4,
                     "moe_intermediate": 8 * 32 * 2, "moe_expert_out": 8 * 64 * 2}


def test_scratch_needs_cover_every_token_count():
    moe = fm.FusedMoe(128, 8, 64, 32, torch.bfloat16, "cpu", scratch=ScratchSpace())
    for max_tokens in (1, 7, 300, 1000):
        needs = moe.scratch_needs(max_tokens, max_tokens)
        for t in range(1, max_tokens + 1, max(1, max_tokens // 97)):
            each = fm.fused_moe_scratch_bytes(t, 8, 128, fm.block_m_for(t, 8, 128), 64, 32, torch.bfloat16)
            assert all(each[name] <= needs[name] for name in each), (max_tokens, t)


def test_forward_uses_warmup_scratch_without_allocating(interpret):
    scratch = ScratchSpace()
    t_max, k, e, h, i = 6, 2, 4, 32, 16
    moe = fm.FusedMoe(e, k, h, i, torch.float32, "cpu", activation="gelu", scratch=scratch)
    assert moe.prepare_scratch(t_max, t_max) > 0
    before = scratch.stats()
    assert before.reserved_bytes == sum(moe.scratch_needs(t_max, t_max).values())
    for t in (1, 3, t_max):
        x, w13, w2, b13, b2 = dense_problem(t, k, e, h, i, torch.float32, seed=t, bias=True)
        weights, ids = routing(t, k, e, seed=t)
        y = moe(x, w13, w2, weights, ids, b13, b2)
        assert rel_err(y, fm.moe_reference(x, w13, w2, weights, ids, b13, b2, "gelu")) < BOUND[torch.float32]
    assert scratch.stats() == before  # same bytes and allocations: nothing grew after warmup


def test_machine_reason(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fm.machine_reason() == "no CUDA device"
    monkeypatch.setattr(fm.tg, "triton", None)
    assert fm.machine_reason() == "triton is not installed"
    monkeypatch.setattr(fm.tg, "triton", triton)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    monkeypatch.setattr(torch.version, "hip", None)
    assert fm.machine_reason() == "needs compute capability 8.0+, got 7.5"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert fm.machine_reason() == ""


# ---------------------------------------------------------------------------------------------
# The kernel compiles for real GPUs (no GPU needed: Triton compiles for a named target); the
# interpreter forgives type mismatches between branches that the compiler does not.

COMPILE_CASES = [
    # (capability, activation dtype, FMT, gated, BITS, GS, GATHER, GRID, BM)
    (90, "fp16", 1, True, 4, 128, True, False, 16),  # int4 act-order gate_up
    (80, "bf16", 1, False, 8, 16, False, False, 64),  # int8, scales per row, down
    (80, "bf16", 2, True, 4, 128, False, True, 32),  # e4m3 block grid gate_up
    (90, "fp32", 2, False, 4, 128, False, False, 16),  # e4m3 per-channel down, float32
    (80, "fp16", 0, True, 4, 128, False, False, 64),  # dense gate_up
]


@pytest.mark.parametrize("cap,dtype,fmt,gated,bits,gs,gather,grid,bm", COMPILE_CASES, ids=range(len(COMPILE_CASES)))
def test_kernel_compiles_for_sm80_and_sm90(cap, dtype, fmt, gated, bits, gs, gather, grid, bm, monkeypatch):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    d = "*" + dtype
    sig = {"a_ptr": d, "ids_ptr": "*i32", "blk_e_ptr": "*i32", "total_ptr": "*i32", "route_ptr": "*fp32",
           "w_ptr": {0: d, 1: "*i32", 2: "*u8"}[fmt], "s_ptr": "*fp32" if fmt == 2 else d, "z_ptr": d,
           "p_ptr": "*i32", "rb_ptr": "*i32", "cb_ptr": "*i32", "bias_ptr": "*fp32", "out_ptr": d,
           **{a: "i32" for a in ("num_rows", "N", "K", "up_off", "chunks")}, "alpha": "fp32", "limit": "fp32",
           **{a: "i32" for a in ("stride_am", "stride_om", "stride_we", "stride_wn", "stride_wk", "stride_se",
                                 "stride_sr", "stride_pe", "stride_pp", "stride_be")}}
    const = {"A_DIV": 2 if gated else 1, "GATED": gated, "ACT": 3 if gated else 0, "HAS_BIAS": True,
             "ROUTE": not gated, "FMT": fmt, "BITS": bits, "GS": gs, "SYM_ZERO": 8, "HAS_ZEROS": fmt == 1,
             "GATHER": gather, "GRID": grid, "DOT_F32": dtype == "fp32", "BM": bm, "BN": fm.BLOCK_N,
             "BK": 128 if fmt == 1 else 64 if dtype != "fp32" else 32}
    sig.update({c: "constexpr" for c in const})
    compiled = triton.compile(ASTSource(fn=fm._kernels().moe_gemm, signature=sig, constexprs=const),
                              target=GPUTarget("cuda", cap, 32), options={"num_warps": 4})
    assert compiled.asm["cubin"] and "atom." not in compiled.asm["ptx"]  # atomic-free
    assert compiled.metadata.shared <= 99 * 1024


# ---------------------------------------------------------------------------------------------
# CUDA (compiled kernels)

@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("t", [1, 7, 300])
def test_cuda_formats_match_reference(dtype, t):
    k, e, h, i = 4, 16, 256, 192
    x, w13, w2, b13, b2 = dense_problem(t, k, e, h, i, dtype, seed=t, bias=True, device="cuda")
    weights, ids = routing(t, k, e, seed=t, device="cuda")
    for act in fm.ACTIVATIONS:
        ref = fm.moe_reference(x, w13, w2, weights, ids, b13, b2, act)
        assert rel_err(fm.fused_moe(x, w13, w2, weights, ids, b13, b2, act), ref) < BOUND[dtype], act
    gate_up, down, dense13, dense2 = int_experts(e, h, i, 4, 128, False, True, seed=1)
    q13 = fm.MoeGemmWeight.from_quantized([(_to_cuda(g), _to_cuda(u)) for g, u in gate_up], dtype)
    q2 = fm.MoeGemmWeight.from_quantized([_to_cuda(d) for d in down], dtype)
    ref = fm.moe_reference(x, dense13.to(dtype).cuda(), dense2.to(dtype).cuda(), weights, ids, b13, b2)
    assert rel_err(fm.fused_moe(x, q13, q2, weights, ids, b13, b2), ref) < BOUND[dtype]
    f13 = fm.MoeFp8Weight.from_tensors(fp8_codes((e, 2 * i, h), 1).cuda(), torch.rand(e, 2 * i, device="cuda") / 64)
    f2 = fm.MoeFp8Weight.from_tensors(fp8_codes((e, h, i), 2).cuda(), torch.rand(e, h, device="cuda") / 64)
    ref = fm.moe_reference(x, f13.dequantize().to(dtype), f2.dequantize().to(dtype), weights, ids, b13, b2)
    assert rel_err(fm.fused_moe(x, f13, f2, weights, ids, b13, b2), ref) < BOUND[dtype]


def _to_cuda(w):
    from text_generation_server.kernels.base import QuantizedWeight

    return QuantizedWeight(w.qweight.cuda(), w.scales.cuda(), None if w.zeros is None else w.zeros.cuda(),
                           w.g_idx.cuda(), w.bits, w.group_size)


@needs_gpu
def test_cuda_align_has_no_host_sync_and_op_captures_in_a_graph():
    k, e, h, i, t = 8, 32, 128, 64, 4
    x, w13, w2, b13, b2 = dense_problem(t, k, e, h, i, torch.float16, seed=0, bias=True, device="cuda")
    weights, ids = routing(t, k, e, seed=0, device="cuda")
    scratch = ScratchSpace()
    moe = fm.FusedMoe(e, k, h, i, torch.float16, "cuda", scratch=scratch)
    moe.prepare_scratch(t, t)
    moe(x, w13, w2, weights, ids, b13, b2)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fm.moe_align(ids, e, 16)
        moe(x, w13, w2, weights, ids, b13, b2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = moe(x, w13, w2, weights, ids, b13, b2)
    new_w, new_ids = routing(t, k, e, seed=1, device="cuda")
    weights.copy_(new_w)
    ids.copy_(new_ids)
    graph.replay()
    ref = fm.moe_reference(x, w13, w2, weights, ids, b13, b2)
    assert rel_err(y, ref) < BOUND[torch.float16]
