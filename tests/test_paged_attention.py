"""Paged-attention Triton kernels (kernels/paged_attention.py).

Tier 1 (CPU, always): decode (one split and several) and varlen prefill under
TRITON_INTERPRET=1 against a float64 reference that rebuilds each sequence's K/V from its block
table position by position, with and without logit soft-capping (and softcap=None bit for bit
the uncapped path); launcher argument checks; availability reasons with a mocked GPU; the split
heuristic; the kernels compiled for sm80/sm90 without a GPU.
Tier 2 (CUDA, skipped without a GPU): the compiled kernels against the same reference.

Caches are poisoned: block 0 (never handed out, where padding table entries point), spare
blocks and every slot past a sequence's length hold NaN, so a kernel that reads one position it
should not (or lets a masked load reach a dot) returns NaN, not a slightly wrong number.

Bounds are on the largest absolute error (outputs are convex combinations of unit-normal
values): fp32 runs exactly up to summation order; fp16 and bf16 round the probabilities to the
value dtype before the P@V dot (~2^-11 and ~2^-8 relative). A wrong mask, position or block
gives errors of order one.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch
from helpers import needs_gpu

from text_generation_server.kernels import paged_attention as pa

torch.set_num_threads(1)

triton = pytest.importorskip("triton")  # the CPU tier runs the kernels in Triton's interpreter
CUDA = torch.cuda.is_available()

BOUND = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


# ---------------------------------------------------------------------------------------------
# A paged cache and the reference

class Paged:
    """Random K/V for sequences of `seq_lens` positions in shuffled, non-contiguous blocks."""

    def __init__(self, seq_lens: list[int], kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 seed: int = 0, device: str = "cpu", extra_cols: int = 2):
        gen = torch.Generator().manual_seed(seed)
        need = [-(-n // block_size) for n in seq_lens]
        num_blocks = 1 + sum(need) + 3  # block 0 and 3 spare blocks stay NaN
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.key_cache = torch.full(shape, float("nan"), dtype=dtype)
        self.value_cache = torch.full(shape, float("nan"), dtype=dtype)
        free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        table = torch.zeros(len(seq_lens), max(need, default=0) + extra_cols, dtype=torch.int32)
        for b, (n, count) in enumerate(zip(seq_lens, need)):
            blocks, free = free[:count], free[count:]
            table[b, :count] = torch.tensor(blocks, dtype=torch.int32)
            pos = torch.arange(n)
            ids = table[b, pos // block_size].long()
            self.key_cache[ids, pos % block_size] = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
            self.value_cache[ids, pos % block_size] = torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)
        self.block_tables = table
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
        self.block_size = block_size
        if device != "cpu":
            for name in ("key_cache", "value_cache", "block_tables", "seq_lens"):
                setattr(self, name, getattr(self, name).to(device))

    def reference(self, b: int, q: torch.Tensor, positions: torch.Tensor, scale: float,
                  window: int | None, softcap: float | None = None) -> torch.Tensor:
        """float64 attention of q [n, H, D] at `positions` [n] over sequence b's cached keys;
        softcap as in transformers' Gemma 2 (after the scale, before the mask and the softmax)."""
        seq_len = int(self.seq_lens[b])
        pos = torch.arange(seq_len)
        ids = self.block_tables[b].cpu()[pos // self.block_size].long()
        k = self.key_cache.cpu()[ids, pos % self.block_size].double()  # [seq_len, KVH, D]
        v = self.value_cache.cpu()[ids, pos % self.block_size].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,khd->nhk", q.cpu().double(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        visible = pos[None, :] <= positions[:, None]
        if window is not None:
            visible &= positions[:, None] - pos[None, :] < window
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        return torch.einsum("nhk,khd->nhd", scores.softmax(-1), v)


def decode_reference(paged: Paged, q: torch.Tensor, scale: float, window: int | None,
                     softcap: float | None = None) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(paged.seq_lens.tolist()):
        if n:
            out[b] = paged.reference(b, q[b:b + 1], torch.tensor([n - 1]), scale, window, softcap)[0]
    return out


def prefill_batch(q_lens: list[int], cache_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                  block_size: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu"):
    paged = Paged([c + n for c, n in zip(cache_lens, q_lens)], kv_heads, head_dim, block_size, dtype, seed, device)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return paged, q.to(device), cu.to(device)


def prefill_reference(paged: Paged, q: torch.Tensor, q_lens: list[int], cache_lens: list[int], scale: float,
                      window: int | None, softcap: float | None = None) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float64)
    start = 0
    for b, (n, c) in enumerate(zip(q_lens, cache_lens)):
        if n:
            out[start:start + n] = paged.reference(b, q[start:start + n], c + torch.arange(n), scale, window,
                                                   softcap)
        start += n
    return out


def max_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(y).any(), "NaN in the output: a poisoned (unowned) cache slot was read"
    return (y.cpu().double() - ref).abs().max().item() if y.numel() else 0.0


# ---------------------------------------------------------------------------------------------
# decode

DECODE_CASES = [
    # (dtype, heads, kv_heads, head_dim, block_size, seq_lens, window, splits)
    (torch.float32, 4, 4, 32, 16, [1, 16, 33], None, 1),  # H = KVH; lengths 1, block-aligned, not
    (torch.float16, 8, 2, 64, 8, [40, 0, 9, 24], None, 1),  # a padding row between real ones
    (torch.bfloat16, 8, 1, 128, 32, [50, 3], 7, 1),  # H = 8 KVH, window inside the context
    (torch.float16, 4, 1, 80, 1, [21, 5], 30, 2),  # block_size 1, head_dim 80, window beyond it
    (torch.float32, 8, 2, 64, 16, [32, 48, 17], 16, 3),  # window of a whole block, 3 splits
    (torch.float32, 8, 8, 128, 8, [1, 26], 1, 1),  # window 1: only the new token itself
    (torch.bfloat16, 8, 2, 32, 16, [70, 12], None, 5),  # splits with a short row (some splits empty)
]


def _decode_id(c: tuple) -> str:
    dtype, h, kvh, d, bs, lens, window, splits = c
    return f"{SHORT[dtype]}-H{h}KV{kvh}-D{d}-bs{bs}-len{'_'.join(map(str, lens))}-w{window}-s{splits}"


@pytest.mark.parametrize("case", DECODE_CASES, ids=_decode_id)
def test_decode_matches_reference(case, interpret):
    dtype, heads, kv_heads, dim, bs, lens, window, splits = case
    paged = Paged(lens, kv_heads, dim, bs, dtype, seed=dim + bs)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = dim ** -0.5
    out = pa.paged_decode(q, paged.key_cache, paged.value_cache, paged.block_tables, paged.seq_lens, scale,
                          window, num_splits=splits)
    assert out.dtype == dtype and out.shape == q.shape
    assert max_err(out, decode_reference(paged, q, scale, window)) < BOUND[dtype]


@pytest.mark.parametrize("window", [None, 100])
def test_decode_split_counts_agree_on_a_long_context(window, interpret):
    lens = [300, 129, 0, 2]
    paged = Paged(lens, 2, 64, 16, torch.float32, seed=7)
    q = torch.randn(len(lens), 8, 64, generator=torch.Generator().manual_seed(2))
    args = (q, paged.key_cache, paged.value_cache, paged.block_tables, paged.seq_lens, 0.125, window)
    outs = {s: pa.paged_decode(*args, num_splits=s) for s in (1, 4, 7)}
    ref = decode_reference(paged, q, 0.125, window)
    for s, out in outs.items():
        assert max_err(out, ref) < BOUND[torch.float32], s
        assert torch.allclose(out, outs[1], rtol=0, atol=1e-6), s
    assert torch.equal(outs[4][2], torch.zeros(8, 64))  # the padding row


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_padding_rows_write_zeros(splits, interpret):
    paged = Paged([0, 0], 2, 32, 16, torch.float16)
    q = torch.randn(2, 4, 32).half()
    out = torch.full_like(q, float("nan"))  # stale contents of a CUDA-graph buffer
    got = pa.paged_decode(q, paged.key_cache, paged.value_cache, paged.block_tables, paged.seq_lens, 0.2,
                          num_splits=splits, out=out)
    assert got is out and torch.equal(out, torch.zeros_like(q))


def test_decode_uses_the_given_out_and_workspace(interpret):
    lens = [45, 7, 0]
    paged = Paged(lens, 2, 64, 8, torch.float16, seed=3)
    q = torch.randn(3, 8, 64).half()
    # One workspace for a larger batch and more splits serves this call (the caller keeps one).
    ws = pa.decode_workspace(8, 8, 64, 6, q.device)
    assert [tuple(t.shape) for t in ws] == [(8, 8, 6), (8, 8, 6), (8, 8, 6, 64)]
    assert all(t.dtype == torch.float32 for t in ws)
    for t in ws:
        t.fill_(float("nan"))
    out = torch.empty(3, 8, 64, dtype=torch.float16)
    got = pa.paged_decode(q, paged.key_cache, paged.value_cache, paged.block_tables, paged.seq_lens, 0.125,
                          num_splits=3, out=out, workspace=ws)
    assert got is out
    assert max_err(out, decode_reference(paged, q, 0.125, None)) < BOUND[torch.float16]
    # The partials landed in the first 3 * 8 * 3 rows of the workspace, row (b, h, split).
    m = ws[0].view(-1)[:72].view(3, 8, 3)
    assert torch.isfinite(m[0]).all() and torch.isneginf(m[2]).all()  # row 2 is padding: every split empty


def test_decode_strided_q_and_out(interpret):
    """q as a view of a fused qkv projection output, out as a view of a wider buffer."""
    paged = Paged([19, 33], 2, 32, 8, torch.float32, seed=5)
    qkv = torch.randn(2, 8 * 32 + 2 * 2 * 32)
    q = qkv[:, :256].view(2, 8, 32)
    wide = torch.zeros(2, 10, 32)
    out = wide[:, 1:9]
    pa.paged_decode(q, paged.key_cache, paged.value_cache, paged.block_tables, paged.seq_lens, 0.17, out=out)
    assert max_err(out, decode_reference(paged, q, 0.17, None)) < BOUND[torch.float32]
    assert torch.equal(wide[:, 0], torch.zeros(2, 32)) and torch.equal(wide[:, 9], torch.zeros(2, 32))


@pytest.mark.parametrize("block_size", [8, 128])
def test_decode_gpu_tile_under_interpreter(block_size, interpret, monkeypatch):
    """The 64-key tile the GPU uses, with blocks smaller and larger than it."""
    monkeypatch.setattr(pa, "_decode_config", lambda dim, dtype: (64, 4, 2))
    lens = [150, 64, 1]
    paged = Paged(lens, 1, 64, block_size, torch.float16, seed=block_size)
    q = torch.randn(3, 4, 64).half()
    for splits, window in ((1, None), (2, 90)):
        out = pa.paged_decode(q, paged.key_cache, paged.value_cache, paged.block_tables, paged.seq_lens, 0.125,
                              window, num_splits=splits)
        assert max_err(out, decode_reference(paged, q, 0.125, window)) < BOUND[torch.float16], (splits, window)


# ---------------------------------------------------------------------------------------------
# prefill

PREFILL_CASES = [
    # (dtype, heads, kv_heads, head_dim, block_size, q_lens, cache_lens, window)
    (torch.float32, 2, 2, 32, 16, [5, 12], [0, 0], None),  # no cached prefix
    (torch.float16, 8, 2, 64, 8, [3, 8, 1], [5, 16, 20], None),  # prefixes: partial block, whole blocks
    (torch.bfloat16, 8, 1, 128, 32, [1, 30, 1, 17], [9, 0, 40, 3], None),  # decode rows among long rows
    (torch.float32, 4, 2, 80, 1, [6, 20], [11, 2], 4),  # block_size 1, window inside the context
    (torch.float16, 4, 4, 64, 16, [18, 1], [7, 33], 100),  # window beyond every context
    (torch.float32, 6, 2, 32, 8, [9, 0, 4], [0, 5, 13], 8),  # group of 3 (not a power of two), q_len 0
    (torch.float16, 16, 2, 32, 16, [3], [29], 1),  # group 8 over one 16-row tile; window 1
]


def _prefill_id(c: tuple) -> str:
    dtype, h, kvh, d, bs, q_lens, cache_lens, window = c
    return (f"{SHORT[dtype]}-H{h}KV{kvh}-D{d}-bs{bs}-q{'_'.join(map(str, q_lens))}-"
            f"c{'_'.join(map(str, cache_lens))}-w{window}")


@pytest.mark.parametrize("case", PREFILL_CASES, ids=_prefill_id)
def test_prefill_matches_reference(case, interpret):
    dtype, heads, kv_heads, dim, bs, q_lens, cache_lens, window = case
    paged, q, cu = prefill_batch(q_lens, cache_lens, heads, kv_heads, dim, bs, dtype, seed=dim + bs)
    scale = dim ** -0.5
    out = pa.paged_prefill(q, paged.key_cache, paged.value_cache, cu, paged.seq_lens, paged.block_tables, scale,
                           window, max_q_len=max(q_lens))
    assert out.dtype == dtype and out.shape == q.shape
    assert max_err(out, prefill_reference(paged, q, q_lens, cache_lens, scale, window)) < BOUND[dtype]


def test_prefill_gpu_tiles_under_interpreter(interpret, monkeypatch):
    """64x32 tiles (grid rows packing 16 tokens of a 4-head group) over 16-position blocks."""
    monkeypatch.setattr(pa, "_prefill_config", lambda rows, dim, dtype: (64, 32, 4, 2))
    q_lens, cache_lens = [40, 1, 23], [0, 50, 20]
    paged, q, cu = prefill_batch(q_lens, cache_lens, 8, 2, 64, 16, torch.float16, seed=4)
    for window in (None, 24):
        out = pa.paged_prefill(q, paged.key_cache, paged.value_cache, cu, paged.seq_lens, paged.block_tables,
                               0.125, window, max_q_len=40)
        assert max_err(out, prefill_reference(paged, q, q_lens, cache_lens, 0.125, window)) < BOUND[torch.float16]


def test_prefill_single_token_rows_equal_decode(interpret):
    """A q_len-1 row of a prefill step is a decode step: both kernels give the same numbers."""
    q_lens, cache_lens = [1, 1, 1], [0, 30, 47]
    paged, q, cu = prefill_batch(q_lens, cache_lens, 8, 2, 32, 8, torch.float32, seed=6)
    pre = pa.paged_prefill(q, paged.key_cache, paged.value_cache, cu, paged.seq_lens, paged.block_tables, 0.3, 20,
                           max_q_len=1)
    dec = pa.paged_decode(q, paged.key_cache, paged.value_cache, paged.block_tables, paged.seq_lens, 0.3, 20)
    assert torch.allclose(pre, dec, rtol=0, atol=1e-6)


def test_prefill_out_buffer_and_larger_max_q_len(interpret):
    """max_q_len only bounds the grid: a loose bound changes nothing; rows outside q stay untouched."""
    q_lens, cache_lens = [7, 2], [3, 0]
    paged, q, cu = prefill_batch(q_lens, cache_lens, 4, 2, 32, 4, torch.float16, seed=8)
    out = torch.full_like(q, float("nan"))
    got = pa.paged_prefill(q, paged.key_cache, paged.value_cache, cu, paged.seq_lens, paged.block_tables, 0.2,
                           max_q_len=40, out=out)
    assert got is out
    assert max_err(out, prefill_reference(paged, q, q_lens, cache_lens, 0.2, None)) < BOUND[torch.float16]


# ---------------------------------------------------------------------------------------------
# Logit soft-capping (Gemma 2): softcap * tanh(scores / softcap) after the scale, before the masks

SOFTCAP_DECODE_CASES = [
    # (dtype, heads, kv_heads, head_dim, block_size, seq_lens, window, splits, softcap)
    (torch.float32, 8, 2, 64, 16, [40, 0, 17], None, 1, 50.0),  # Gemma 2's cap: tanh's polynomial range
    (torch.float32, 4, 4, 256, 8, [33, 9], 12, 3, 5.0),  # head_dim 256, window, 3 splits
    (torch.bfloat16, 8, 1, 256, 16, [50, 3], None, 2, 1.0),  # H = 8 KVH, splits with an empty one
    (torch.float16, 8, 2, 128, 32, [70, 12], 30, 4, 0.5),  # tanh saturated for most scores
]


@pytest.mark.parametrize("case", SOFTCAP_DECODE_CASES, ids=lambda c: f"{_decode_id(c[:8])}-cap{c[8]:g}")
def test_decode_softcap_matches_reference(case, interpret):
    dtype, heads, kv_heads, dim, bs, lens, window, splits, softcap = case
    paged = Paged(lens, kv_heads, dim, bs, dtype, seed=dim + bs)
    q = torch.randn(len(lens), heads, dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    scale = dim ** -0.5
    out = pa.paged_decode(q, paged.key_cache, paged.value_cache, paged.block_tables, paged.seq_lens, scale,
                          window, num_splits=splits, softcap=softcap)
    assert out.dtype == dtype and out.shape == q.shape
    assert max_err(out, decode_reference(paged, q, scale, window, softcap)) < BOUND[dtype]
    # The cap matters here: a kernel that ignored it would miss the reference by far more.
    assert max_err(out, decode_reference(paged, q, scale, window)) > 10 * BOUND[dtype]


SOFTCAP_PREFILL_CASES = [
    # (dtype, heads, kv_heads, head_dim, block_size, q_lens, cache_lens, window, softcap)
    (torch.float32, 8, 2, 64, 8, [3, 8, 1], [5, 16, 20], None, 50.0),  # cached prefixes, GQA, Gemma 2's cap
    (torch.float32, 4, 1, 256, 4, [6, 9], [5, 0], 5, 2.0),  # head_dim 256, group 4, window
    (torch.bfloat16, 8, 2, 256, 16, [1, 12], [9, 3], None, 1.0),  # bf16, head_dim 256, a decode row
    (torch.float16, 6, 2, 32, 8, [9, 0, 4], [0, 5, 13], 4, 0.5),  # group of 3, q_len 0, window, saturated
]


@pytest.mark.parametrize("case", SOFTCAP_PREFILL_CASES, ids=lambda c: f"{_prefill_id(c[:8])}-cap{c[8]:g}")
def test_prefill_softcap_matches_reference(case, interpret):
    dtype, heads, kv_heads, dim, bs, q_lens, cache_lens, window, softcap = case
    paged, q, cu = prefill_batch(q_lens, cache_lens, heads, kv_heads, dim, bs, dtype, seed=dim + bs)
    scale = dim ** -0.5
    out = pa.paged_prefill(q, paged.key_cache, paged.value_cache, cu, paged.seq_lens, paged.block_tables, scale,
                           window, max_q_len=max(q_lens), softcap=softcap)
    assert out.dtype == dtype and out.shape == q.shape
    assert max_err(out, prefill_reference(paged, q, q_lens, cache_lens, scale, window, softcap)) < BOUND[dtype]
    assert max_err(out, prefill_reference(paged, q, q_lens, cache_lens, scale, window)) > 10 * BOUND[dtype]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # numpy's exp2 -> inf: the point
def test_softcap_extreme_scores_stay_finite(interpret):
    """Scores of +-1e4 x the cap: tanh saturates to +-1 (exp2 overflowing to inf or reaching 0), no NaN;
    split partials included."""
    lens = [37, 20]
    paged = Paged(lens, 2, 32, 8, torch.float32, seed=9)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(3)) * 100.0
    for splits in (1, 3):
        out = pa.paged_decode(q, paged.key_cache, paged.value_cache, paged.block_tables, paged.seq_lens, 1.0,
                              num_splits=splits, softcap=0.05)
        assert max_err(out, decode_reference(paged, q, 1.0, None, 0.05)) < BOUND[torch.float32], splits
    q_lens, cache_lens = [5, 7], [4, 0]
    paged, q, cu = prefill_batch(q_lens, cache_lens, 4, 2, 32, 8, torch.float32, seed=10)
    q = q * 100.0
    out = pa.paged_prefill(q, paged.key_cache, paged.value_cache, cu, paged.seq_lens, paged.block_tables, 1.0, 3,
                           max_q_len=7, softcap=0.05)
    assert max_err(out, prefill_reference(paged, q, q_lens, cache_lens, 1.0, 3, 0.05)) < BOUND[torch.float32]


def test_softcap_prefill_single_token_rows_equal_decode(interpret):
    q_lens, cache_lens = [1, 1, 1], [0, 30, 47]
    paged, q, cu = prefill_batch(q_lens, cache_lens, 8, 2, 32, 8, torch.float32, seed=6)
    pre = pa.paged_prefill(q, paged.key_cache, paged.value_cache, cu, paged.seq_lens, paged.block_tables, 0.3, 20,
                           max_q_len=1, softcap=3.0)
    dec = pa.paged_decode(q, paged.key_cache, paged.value_cache, paged.block_tables, paged.seq_lens, 0.3, 20,
                          softcap=3.0)
    assert torch.allclose(pre, dec, rtol=0, atol=1e-6)


def test_softcap_none_is_bit_identical_to_no_softcap(interpret):
    """softcap=None takes the kernels' uncapped path (SOFTCAP a compile-time False, so the same
    operations as before the feature): bit for bit what a call without the argument gives, for
    decode with one split and several, and prefill with a cached prefix and a window. (That the
    uncapped kernels compile without a single extra operation is checked in
    test_kernels_compile_for_sm80_and_sm90.)"""
    lens = [45, 7, 0, 20]
    paged = Paged(lens, 2, 64, 8, torch.bfloat16, seed=3)
    q = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    args = (q, paged.key_cache, paged.value_cache, paged.block_tables, paged.seq_lens, 0.125)
    for splits, window in ((1, None), (3, 16)):
        plain = pa.paged_decode(*args, window, num_splits=splits)
        assert torch.equal(pa.paged_decode(*args, window, num_splits=splits, softcap=None), plain)
        assert not torch.equal(pa.paged_decode(*args, window, num_splits=splits, softcap=30.0), plain)
    q_lens, cache_lens = [3, 8, 1], [5, 16, 20]
    paged, q, cu = prefill_batch(q_lens, cache_lens, 8, 2, 64, 8, torch.float16, seed=2)
    args = (q, paged.key_cache, paged.value_cache, cu, paged.seq_lens, paged.block_tables, 0.125)
    for window in (None, 6):
        plain = pa.paged_prefill(*args, window, max_q_len=8)
        assert torch.equal(pa.paged_prefill(*args, window, max_q_len=8, softcap=None), plain)
        assert max_err(plain, prefill_reference(paged, q, q_lens, cache_lens, 0.125, window)) < BOUND[torch.float16]


# ---------------------------------------------------------------------------------------------
# Launcher checks

def _decode_args(**change):
    paged = Paged([5, 9], 2, 32, 8, torch.float16)
    args = dict(q=torch.randn(2, 4, 32).half(), key_cache=paged.key_cache, value_cache=paged.value_cache,
                block_tables=paged.block_tables, seq_lens=paged.seq_lens, scale=0.1)
    args.update(change)
    return args


def _prefill_args(**change):
    paged, q, cu = prefill_batch([3, 2], [1, 0], 4, 2, 32, 8, torch.float16)
    args = dict(q=q, key_cache=paged.key_cache, value_cache=paged.value_cache, cu_seqlens_q=cu,
                seq_lens=paged.seq_lens, block_tables=paged.block_tables, scale=0.1, max_q_len=3)
    args.update(change)
    return args


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


BAD_DECODE = [
    (dict(q=torch.randn(2, 128).half()), r"q must be 3-D"),
    (dict(q=torch.randn(2, 4, 32, dtype=torch.float64)), r"q dtype torch.float64 not in float16/bfloat16/float32"),
    (dict(q=torch.randn(2, 4, 32)), r"cache dtypes torch.float16/torch.float16 must match q's torch.float32"),
    (dict(q=torch.randn(2, 3, 32).half()), r"3 query heads are not a multiple of 2 KV heads"),
    (dict(q=torch.randn(2, 4, 64).half()), r"q head_dim 64 does not match the cache's 32"),
    (dict(q=torch.randn(2, 32, 4).half().transpose(1, 2)), r"q needs unit stride along head_dim"),
    (dict(key_cache=torch.zeros(4, 8, 2, 32).half()), r"key_cache and value_cache must both be"),
    (dict(block_tables=torch.zeros(2, 4, dtype=torch.int64)), r"block_tables must be int32 \[batch, max_blocks\]"),
    (dict(seq_lens=torch.tensor([5, 9])), r"seq_lens must be contiguous int32 \[2\], got torch.int64"),
    (dict(seq_lens=torch.tensor([5], dtype=torch.int32)), r"seq_lens must be contiguous int32 \[2\]"),
    (dict(seq_lens=torch.tensor([5, 40], dtype=torch.int32)), r"seq_lens must lie in 0..32"),
    (dict(window=0), r"window must be None or a positive int, got 0"),
    (dict(num_splits=0), r"num_splits must be an int in 1..64, got 0"),
    (dict(num_splits=65), r"num_splits must be an int in 1..64, got 65"),
    (dict(num_splits=2, workspace=pa.decode_workspace(2, 4, 32, 1, torch.device("cpu"))),
     r"workspace\[0\] must be contiguous float32 on cpu with at least 16 elements"),
    (dict(num_splits=2, workspace=pa.decode_workspace(2, 4, 32, 2, torch.device("cpu"))[:2]),
     r"workspace must be the 3 tensors decode_workspace returns"),
    (dict(out=torch.empty(2, 4, 32)), r"out must be torch.float16 \[2, 4, 32\]"),
    (dict(softcap=0.0), r"softcap must be None or a positive finite number, got 0.0"),
    (dict(softcap=-50.0), r"softcap must be None or a positive finite number, got -50.0"),
    (dict(softcap=float("inf")), r"softcap must be None or a positive finite number, got inf"),
    (dict(softcap=float("nan")), r"softcap must be None or a positive finite number, got nan"),
    (dict(softcap=True), r"softcap must be None or a positive finite number, got True"),
    (dict(softcap="50"), r"softcap must be None or a positive finite number, got '50'"),
]


@pytest.mark.parametrize("change,message", BAD_DECODE, ids=range(len(BAD_DECODE)))
def test_decode_rejects_bad_arguments(change, message, interpret):
    with pytest.raises(ValueError, match=message):
        pa.paged_decode(**_decode_args(**change))


def test_decode_rejects_mixed_devices(interpret):
    args = _decode_args()
    args["seq_lens"] = _meta(args["seq_lens"])
    with pytest.raises(ValueError, match=r"tensors on different devices: .*seq_lens meta"):
        pa.paged_decode(**args)


BAD_PREFILL = [
    (dict(cu_seqlens_q=torch.tensor([0, 3, 5])), r"cu_seqlens_q must be contiguous int32 \[3\], got torch.int64"),
    (dict(cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32)), r"cu_seqlens_q must be contiguous int32 \[3\]"),
    (dict(cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32)), r"must rise from 0 to 5"),
    (dict(max_q_len=2), r"by steps of at most max_q_len=2"),
    (dict(max_q_len=None), r"max_q_len must be a non-negative int, got None"),
    (dict(seq_lens=torch.tensor([2, 2], dtype=torch.int32)), r"more new tokens than positions in cache"),
    (dict(window=-3), r"window must be None or a positive int, got -3"),
    (dict(block_tables=torch.zeros(65536, 1, dtype=torch.int32), seq_lens=torch.ones(65536, dtype=torch.int32),
          cu_seqlens_q=torch.arange(65537, dtype=torch.int32), q=torch.zeros(65536, 4, 32).half(), max_q_len=1),
     r"65536 sequences in one launch, at most 65535"),
    (dict(out=torch.empty(5, 4, 32, dtype=torch.bfloat16)), r"out must be torch.float16 \[5, 4, 32\]"),
    (dict(softcap=0), r"softcap must be None or a positive finite number, got 0"),
    (dict(softcap=-1e-3), r"softcap must be None or a positive finite number, got -0.001"),
]


@pytest.mark.parametrize("change,message", BAD_PREFILL, ids=range(len(BAD_PREFILL)))
def test_prefill_rejects_bad_arguments(change, message, interpret):
    with pytest.raises(ValueError, match=message):
        pa.paged_prefill(**_prefill_args(**change))


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pa.paged_attention_available(torch.device("cpu")) == (
        False, "CPU tensors run only under TRITON_INTERPRET=1 (Triton's interpreter)")
    with pytest.raises(ValueError, match="paged_decode cannot run on cpu: CPU tensors run only under"):
        pa.paged_decode(**_decode_args())
    with pytest.raises(ValueError, match="paged_prefill cannot run on cpu: CPU tensors run only under"):
        pa.paged_prefill(**_prefill_args())


def test_empty_batches_return_at_once(interpret):
    paged = Paged([], 2, 32, 8, torch.float16)
    q = torch.zeros(0, 4, 32).half()
    assert pa.paged_decode(q, paged.key_cache, paged.value_cache, paged.block_tables.view(0, 2), paged.seq_lens,
                           0.1).shape == (0, 4, 32)
    out = pa.paged_prefill(q, paged.key_cache, paged.value_cache, torch.zeros(1, dtype=torch.int32),
                           paged.seq_lens, paged.block_tables.view(0, 2), 0.1, max_q_len=0)
    assert out.shape == (0, 4, 32)


# ---------------------------------------------------------------------------------------------
# Availability and the split heuristic

@pytest.fixture
def gpu(monkeypatch):
    """A mocked GPU whose capability the test sets through the returned setter."""
    state = {"cap": (9, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: state["cap"])
    monkeypatch.setattr(torch.version, "hip", None)
    return lambda cap: state.update(cap=cap)


def test_available_reasons(gpu, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda = torch.device("cuda", 0)
    assert pa.paged_attention_available(cuda) == (True, "")
    gpu((8, 0))
    assert pa.paged_attention_available(cuda) == (True, "")
    gpu((7, 5))
    assert pa.paged_attention_available(cuda) == (False, "needs compute capability 8.0+, got 7.5")
    gpu((9, 0))
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert pa.paged_attention_available(cuda) == (False, "ROCm devices are not validated for these kernels")
    monkeypatch.setattr(torch.version, "hip", None)
    assert pa.paged_attention_available(torch.device("meta")) == (
        False, "device type meta is not supported (CUDA, or CPU under TRITON_INTERPRET=1)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pa.paged_attention_available(torch.device("cpu")) == (True, "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pa.paged_attention_available(cuda) == (False, "no CUDA device")
    monkeypatch.setattr(pa, "triton", None)
    assert pa.paged_attention_available(torch.device("cpu")) == (False, "triton is not installed")


def test_decode_splits():
    # Llama-3-8B (8 KV heads) on 132 SMs: 264 programs wanted.
    assert pa.decode_splits(32768, 16, 1, 8) == 33  # batch 1, 32k: the whole GPU
    assert pa.decode_splits(32768, 16, 1, 8, num_sms=108) == 27  # an A100
    assert pa.decode_splits(8192, 16, 32, 8) == 2  # 256 programs: one more wave's worth
    assert pa.decode_splits(32768, 16, 64, 8) == 1  # 512 programs fill it already
    assert pa.decode_splits(300, 16, 1, 8) == 1  # short context: never split
    assert pa.decode_splits(1024, 16, 1, 8) == 4  # at least MIN_SPLIT_TOKENS per split
    assert pa.decode_splits(1 << 20, 16, 1, 1) == pa.MAX_SPLITS
    assert pa.decode_splits(4096, 1024, 1, 8) == 4  # a split reads at least one whole block
    assert pa.decode_splits(0, 16, 0, 8) == 1
    previous = pa.MAX_SPLITS
    for batch in (1, 2, 4, 8, 16, 32, 64):  # more sequences never ask for more splits
        s = pa.decode_splits(16384, 16, batch, 8)
        assert 1 <= s <= previous
        previous = s
    for bad in (dict(max_seq_len=-1), dict(block_size=0), dict(kv_heads=0), dict(num_sms=0)):
        with pytest.raises(ValueError, match="decode_splits"):
            pa.decode_splits(**{**dict(max_seq_len=64, block_size=16, batch=1, kv_heads=8), **bad})


def test_tile_configs_on_gpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pa._decode_config(128, torch.float16) == (64, 4, 2)
    assert pa._decode_config(256, torch.bfloat16) == (32, 4, 2)
    assert pa._decode_config(128, torch.float32) == (32, 4, 2)
    assert pa._prefill_config(4096, 128, torch.float16) == (128, 64, 8, 2)
    assert pa._prefill_config(4096, 80, torch.bfloat16) == (128, 64, 8, 2)
    assert pa._prefill_config(4096, 256, torch.float16) == (64, 32, 8, 2)
    assert pa._prefill_config(4096, 64, torch.float32) == (64, 32, 8, 2)
    assert pa._prefill_config(4096, 256, torch.float32) == (32, 16, 8, 2)
    assert pa._prefill_config(4096, 32, torch.float16) == (128, 64, 4, 2)
    assert pa._prefill_config(12, 128, torch.float16) == (16, 64, 4, 2)  # short rows: a small M tile


def test_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
        "import torch\n"
        "from text_generation_server.kernels import paged_attention as pa\n"
        "print(pa.paged_attention_available(torch.device('cpu')))\n"
        "print(pa.decode_splits(32768, 16, 1, 8))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["(False, 'triton is not installed')", "33"]


# ---------------------------------------------------------------------------------------------
# The kernels compile for real GPUs (no GPU needed: Triton compiles for a named target)

def _compile(kernel, cap: int, sig: dict, const: dict, aligned: list[str], **options):
    """Compile with 16-divisibility hints on `aligned` args, as Triton's launcher specializes them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    sig = dict(sig, **{c: "constexpr" for c in const})
    return triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", cap, 32), options=options)


def _wide_loads(ptx: str) -> bool:
    """K/V arrive in 16-byte accesses: cp.async of 16 bytes or ld.global.v4 (128-bit)."""
    return ("cp.async.cg.shared.global" in ptx and ", 0x10," in ptx) or "ld.global.v4" in ptx


def _exp2_and_softcap_reads(ttir: str) -> tuple[int, int]:
    """(math.exp2 ops, uses of the softcap argument beyond its declaration) in a kernel's TTIR."""
    return ttir.count("math.exp2"), len(re.findall(r"%softcap\b", ttir)) - 1


@pytest.mark.parametrize("cap,dtype,dim,softcap,fp8", [
    (90, torch.float16, 128, False, 0), (80, torch.bfloat16, 80, False, 0), (80, torch.float32, 256, False, 0),
    (90, torch.bfloat16, 256, True, 0), (80, torch.float16, 128, True, 0),
    (80, torch.bfloat16, 128, False, 1), (90, torch.float16, 128, True, 2), (90, torch.bfloat16, 64, False, 1)])
def test_kernels_compile_for_sm80_and_sm90(cap, dtype, dim, softcap, fp8, monkeypatch):
    """Also: without a cap (SOFTCAP False) the kernels never read the softcap argument and hold just
    the online softmax's two exp2 ops, as before soft-capping existed; with one, a third (tanh).
    An fp8 cache (FP8 1: e4m3fn, 2: e5m2) compiles on sm80 too (its bytes are widened with integer
    ops, no fp8 conversion instruction) and still arrives in 16-byte loads."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernels = pa._kernels()
    d = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32"}[dtype]
    c = "*u8" if fp8 else d
    dp = pa._pow2(dim)
    strides = ["stride_qb", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb", "stride_vt",
               "stride_vh", "stride_bt", "stride_ob", "stride_oh"]
    ptrs = {"q_ptr": d, "k_ptr": c, "v_ptr": c, "bt_ptr": "*i32", "lens_ptr": "*i32", "out_ptr": d,
            "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
    sig = {**ptrs, "qk_scale": "fp32", "softcap": "fp32",
           **{a: "i32" for a in ["window", "num_splits", "max_blocks"] + strides}}
    block_n, warps, stages = pa._decode_config(dim, dtype)
    const = dict(GROUP=4, GP=16, D=dim, DP=dp, BS=16, BLOCK_N=block_n, SPLIT=True, DOT_F32=dtype == torch.float32,
                 SOFTCAP=softcap, FP8=fp8)
    compiled = _compile(kernels.decode, cap, sig, const, list(ptrs) + strides, num_warps=warps, num_stages=stages)
    assert _wide_loads(compiled.asm["ptx"])
    exp2, reads = _exp2_and_softcap_reads(compiled.asm["ttir"])
    assert (exp2, reads > 0) == ((3, True) if softcap else (2, False))
    assert compiled.metadata.shared <= 99 * 1024

    sig = {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": d, "num_splits": "i32",
           "stride_ob": "i32", "stride_oh": "i32"}
    assert _compile(kernels.combine, cap, sig, dict(D=dim, DP=dp, SP=64), ["m_ptr", "l_ptr", "acc_ptr", "out_ptr"],
                    num_warps=2).asm["cubin"]

    strides = ["stride_qt", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_vb", "stride_vt",
               "stride_vh", "stride_bt", "stride_ot", "stride_oh"]
    ptrs = {"q_ptr": d, "k_ptr": c, "v_ptr": c, "bt_ptr": "*i32", "cu_ptr": "*i32", "lens_ptr": "*i32",
            "out_ptr": d, "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
    sig = {**ptrs, "qk_scale": "fp32", "softcap": "fp32", **{a: "i32" for a in ["window", "max_blocks"] + strides}}
    block_m, block_n, warps, stages = pa._prefill_config(8192, dim, dtype)
    const = dict(GROUP=4, D=dim, DP=dp, BS=16, BLOCK_M=block_m, BLOCK_N=block_n, HAS_WINDOW=cap == 80,
                 DOT_F32=dtype == torch.float32, SOFTCAP=softcap, FP8=fp8)
    compiled = _compile(kernels.prefill, cap, sig, const, list(ptrs) + strides, num_warps=warps, num_stages=stages)
    exp2, reads = _exp2_and_softcap_reads(compiled.asm["ttir"])
    assert (exp2, reads > 0) == ((3, True) if softcap else (2, False))
    ptx = compiled.asm["ptx"]
    assert _wide_loads(ptx)
    assert compiled.metadata.shared <= 99 * 1024  # fits sm86/sm89, the smallest sm80+ shared memory
    if dtype != torch.float32:
        assert ("wgmma" if cap >= 90 else "mma.sync") in ptx  # tensor cores


# ---------------------------------------------------------------------------------------------
# CUDA (compiled kernels; skipped without a GPU)

@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_decode_and_prefill_match_reference(dtype):
    dev = "cuda"
    lens = [1, 300, 0, 4097, 64]
    paged = Paged(lens, 8, 128, 16, dtype, seed=1, device=dev)
    q = torch.randn(len(lens), 32, 128, device=dev).to(dtype)
    for window in (None, 1000):
        ref = decode_reference(paged, q, 128 ** -0.5, window)
        for splits in (1, pa.decode_splits(max(lens), 16, len(lens), 8)):
            out = pa.paged_decode(q, paged.key_cache, paged.value_cache, paged.block_tables, paged.seq_lens,
                                  128 ** -0.5, window, num_splits=splits)
            assert max_err(out, ref) < BOUND[dtype], (window, splits)
    q_lens, cache_lens = [1, 700, 33, 1], [500, 0, 260, 0]
    paged, q, cu = prefill_batch(q_lens, cache_lens, 32, 8, 128, 16, dtype, seed=2, device=dev)
    for window in (None, 256):
        out = pa.paged_prefill(q, paged.key_cache, paged.value_cache, cu, paged.seq_lens, paged.block_tables,
                               128 ** -0.5, window, max_q_len=700)
        assert max_err(out, prefill_reference(paged, q, q_lens, cache_lens, 128 ** -0.5, window)) < BOUND[dtype]


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_softcap_matches_reference(dtype):
    """Gemma 2's shapes: head_dim 256, 2 query heads per KV head, cap 50, window 4096."""
    dev, scale, cap = "cuda", 256 ** -0.5, 50.0
    lens = [1, 300, 0, 5000]
    paged = Paged(lens, 4, 256, 16, dtype, seed=3, device=dev)
    q = torch.randn(len(lens), 8, 256, device=dev).to(dtype)
    for window in (None, 4096):
        ref = decode_reference(paged, q, scale, window, cap)
        for splits in (1, pa.decode_splits(max(lens), 16, len(lens), 4)):
            out = pa.paged_decode(q, paged.key_cache, paged.value_cache, paged.block_tables, paged.seq_lens, scale,
                                  window, num_splits=splits, softcap=cap)
            assert max_err(out, ref) < BOUND[dtype], (window, splits)
    q_lens, cache_lens = [1, 600, 40], [300, 0, 4100]
    paged, q, cu = prefill_batch(q_lens, cache_lens, 8, 4, 256, 16, dtype, seed=4, device=dev)
    for window in (None, 4096):
        out = pa.paged_prefill(q, paged.key_cache, paged.value_cache, cu, paged.seq_lens, paged.block_tables, scale,
                               window, max_q_len=600, softcap=cap)
        assert max_err(out, prefill_reference(paged, q, q_lens, cache_lens, scale, window, cap)) < BOUND[dtype]


@needs_gpu
def test_cuda_decode_captures_in_a_graph():
    dev = "cuda"
    lens = [40, 3000]
    paged = Paged(lens, 8, 128, 16, torch.float16, device=dev)
    q = torch.randn(2, 32, 128, device=dev).half()
    splits = pa.decode_splits(4096, 16, 2, 8)
    ws = pa.decode_workspace(2, 32, 128, splits, q.device)
    out = torch.empty_like(q)
    args = (q, paged.key_cache, paged.value_cache, paged.block_tables, paged.seq_lens, 128 ** -0.5)
    pa.paged_decode(*args, num_splits=splits, out=out, workspace=ws)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pa.paged_decode(*args, num_splits=splits, out=out, workspace=ws)
    paged.seq_lens.copy_(torch.tensor([39, 2999], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    assert math.isfinite(max_err(out, decode_reference(paged, q, 128 ** -0.5, None)))
    assert max_err(out, decode_reference(paged, q, 128 ** -0.5, None)) < BOUND[torch.float16]
