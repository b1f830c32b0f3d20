"""The native CPU decode attention over the paged cache (kernels/cpu_native_decode_src.py) against
torch's SDPA form (`padded_decode`), the path it replaces on the CPU (issue #32)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from text_generation_server.kernels import cpu_native
from text_generation_server.layers.attention import (
    NATIVE_DECODE_ENV,
    AttentionMetadata,
    TorchAttention,
    native_decode_module,
    padded_decode,
)

pytestmark = pytest.mark.skipif(cpu_native.native() is None,
                                reason=f"native CPU kernels not built here: {cpu_native.unavailable_reason()}")


def paged(lengths: list[int], kv_heads: int, dim: int, dtype: torch.dtype, block_size: int = 16, seed: int = 0):
    """Random caches with each sequence's blocks scattered (a shuffled pool), and its metadata."""
    g = torch.Generator().manual_seed(seed)
    per_row = [(n + block_size - 1) // block_size for n in lengths]
    total = sum(per_row) + 3  # spare blocks nobody reads
    key_cache = torch.randn(total, block_size, kv_heads, dim, generator=g).to(dtype)
    value_cache = torch.randn(total, block_size, kv_heads, dim, generator=g).to(dtype)
    order = torch.randperm(total, generator=g)
    tables = torch.zeros(len(lengths), max(per_row), dtype=torch.long)
    used = 0
    for row, count in enumerate(per_row):
        tables[row, :count] = order[used:used + count]
        used += count
    meta = AttentionMetadata(is_prefill=False, slots=torch.zeros(len(lengths), dtype=torch.long), block_tables=tables,
                             seq_lens=torch.tensor(lengths, dtype=torch.long), max_seq_len=max(lengths))
    return key_cache, value_cache, meta


def native_decode(q, key_cache, value_cache, meta, scale, window):
    return cpu_native.native().paged_decode_attention(q.contiguous(), key_cache, value_cache, meta.block_tables,
                                                      meta.seq_lens, scale, window or 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,dim", [(12, 2, 128), (4, 4, 64), (6, 1, 80), (8, 2, 24)])
@pytest.mark.parametrize("window", [None, 7])
def test_matches_torch_sdpa(dtype, heads, kv_heads, dim, window):
    lengths = [1, 17, 160, 33]
    key_cache, value_cache, meta = paged(lengths, kv_heads, dim, dtype)
    q = torch.randn(len(lengths), heads, dim, generator=torch.Generator().manual_seed(5)).to(dtype)
    scale = dim ** -0.5
    want = padded_decode(q, key_cache, value_cache, meta, scale, window).float()
    got = native_decode(q, key_cache, value_cache, meta, scale, window)
    assert got.dtype == dtype and got.shape == q.shape
    # float32: summation order only; bfloat16: both round the probabilities and the output to
    # bfloat16, so they differ by an output rounding step (2^-8 relative) and its knock-ons.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)
    # Against a float64 reference of the same attention, the native kernel is as close as torch's.
    ref = reference(q, key_cache, value_cache, meta, scale, window)
    err_native = (got.double() - ref).abs().max().item()
    err_torch = (want.double() - ref).abs().max().item()
    assert err_native <= 1.5 * err_torch + 1e-6


def reference(q, key_cache, value_cache, meta, scale, window) -> torch.Tensor:
    """float64 attention of each row over its own positions."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    bs, kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = q.shape[1] // kv_heads
    for row, length in enumerate(meta.seq_lens.tolist()):
        blocks = meta.block_tables[row, : (length + bs - 1) // bs]
        k = key_cache[blocks].reshape(-1, kv_heads, q.shape[2])[:length].double()
        v = value_cache[blocks].reshape(-1, kv_heads, q.shape[2])[:length].double()
        start = max(0, length - window) if window else 0
        k, v = k[start:], v[start:]
        for h in range(q.shape[1]):
            scores = (k[:, h // group] @ q[row, h].double()) * scale
            out[row, h] = torch.softmax(scores, 0) @ v[:, h // group]
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_does_not_depend_on_batch_or_threads(dtype):
    lengths = [40, 9, 130]
    key_cache, value_cache, meta = paged(lengths, 2, 64, dtype, seed=3)
    q = torch.randn(3, 8, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    whole = native_decode(q, key_cache, value_cache, meta, 0.125, None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = native_decode(q, key_cache, value_cache, meta, 0.125, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, one_thread)
    for row in range(3):
        alone = AttentionMetadata(is_prefill=False, slots=meta.slots[row:row + 1],
                                  block_tables=meta.block_tables[row:row + 1].to(torch.int32),
                                  seq_lens=meta.seq_lens[row:row + 1], max_seq_len=lengths[row])
        assert torch.equal(native_decode(q[row:row + 1], key_cache, value_cache, alone, 0.125, None), whole[row:row + 1])


def test_backend_takes_it_on_cpu_and_the_switch_turns_it_off(monkeypatch):
    key_cache, value_cache, meta = paged([5, 20], 2, 32, torch.bfloat16, seed=7)
    q = torch.randn(2, 4, 32).to(torch.bfloat16)
    backend = TorchAttention()
    assert native_decode_module(q, key_cache, value_cache) is not None
    got = backend.decode(q, key_cache, value_cache, meta, 0.2, None)
    assert torch.equal(got, native_decode(q, key_cache, value_cache, meta, 0.2, None))
    monkeypatch.setenv(NATIVE_DECODE_ENV, "0")
    assert native_decode_module(q, key_cache, value_cache) is None
    assert torch.equal(backend.decode(q, key_cache, value_cache, meta, 0.2, None),
                       padded_decode(q, key_cache, value_cache, meta, 0.2, None))
    monkeypatch.delenv(NATIVE_DECODE_ENV)
    # Soft-capping keeps the torch form (the kernel has no cap).
    assert torch.equal(backend.decode(q, key_cache, value_cache, meta, 0.2, None, softcap=5.0),
                       padded_decode(q, key_cache, value_cache, meta, 0.2, None, softcap=5.0))
    # A cache in another dtype than q is not the kernel's; float32 keeps SDPA (the exactness reference).
    assert native_decode_module(q, key_cache.float(), value_cache.float()) is None
    assert native_decode_module(q.float(), key_cache.float(), value_cache.float()) is None


def test_bad_input_is_refused_by_name():
    key_cache, value_cache, meta = paged([5], 2, 32, torch.float32)
    q = torch.randn(1, 3, 32)  # 3 query heads over 2 KV heads
    with pytest.raises(RuntimeError, match="multiple of the cache's KV heads"):
        native_decode(q, key_cache, value_cache, meta, 0.2, None)
    q = torch.randn(1, 4, 32)
    meta.seq_lens[0] = 17  # past the row's one block
    with pytest.raises(RuntimeError, match="past its 1 blocks"):
        native_decode(q, key_cache, value_cache, meta, 0.2, None)


def eager_block(module, qkv, cos, sin, key_cache, value_cache, meta, heads, kv_heads, scale, window):
    """The eager calls the fused decode step replaces: rotary on q and k, the K/V store, the attention."""
    tokens, dim = qkv.shape[0], key_cache.shape[3]
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    q, k = module.rotary_bf16(q, cos, sin), module.rotary_bf16(k, cos, sin)
    key_cache.view(-1, kv_heads, dim).index_copy_(0, meta.slots, k)
    value_cache.view(-1, kv_heads, dim).index_copy_(0, meta.slots, v)
    out = module.paged_decode_attention(q.contiguous(), key_cache, value_cache, meta.block_tables, meta.seq_lens,
                                        scale, window or 0)
    return out.reshape(tokens, heads * dim)


@pytest.mark.parametrize("heads,kv_heads,dim", [(12, 2, 128), (4, 4, 64), (8, 2, 32), (6, 1, 80)])
@pytest.mark.parametrize("window", [None, 9])
def test_fused_decode_block_is_the_eager_calls_bit_for_bit(heads, kv_heads, dim, window):
    """`decode_attention_bf16` (one call a layer on the CPU) against rotary, store and attention
    called one after another: the same output and the same cache, to the bit."""
    module = cpu_native.native()
    lengths = [1, 17, 160, 33]
    key_cache, value_cache, meta = paged(lengths, kv_heads, dim, torch.bfloat16, seed=heads + dim)
    bs = key_cache.shape[1]
    # Each row's new token sits at its last position (length - 1), in its own block.
    meta.slots = torch.tensor([int(meta.block_tables[r, (n - 1) // bs]) * bs + (n - 1) % bs
                               for r, n in enumerate(lengths)], dtype=torch.long)
    g = torch.Generator().manual_seed(dim)
    qkv = torch.randn(len(lengths), (heads + 2 * kv_heads) * dim, generator=g).to(torch.bfloat16)
    angles = torch.randn(len(lengths), 1, dim // 2, generator=g).repeat(1, 1, 2) * 3
    cos, sin = angles.cos().to(torch.bfloat16), (angles.sin() * torch.cat(
        [-torch.ones(dim // 2), torch.ones(dim // 2)])).to(torch.bfloat16)
    scale = dim ** -0.5
    kc2, vc2 = key_cache.clone(), value_cache.clone()
    want = eager_block(module, qkv, cos, sin, key_cache, value_cache, meta, heads, kv_heads, scale, window)
    got = module.decode_attention_bf16(qkv, cos, sin, kc2, vc2, meta.slots, meta.block_tables, meta.seq_lens, heads,
                                       kv_heads, scale, window or 0)
    assert got.shape == (len(lengths), heads * dim) and torch.equal(got, want)
    assert torch.equal(kc2, key_cache) and torch.equal(vc2, value_cache)


@pytest.mark.parametrize("heads,kv_heads,dim", [(12, 2, 128), (8, 4, 32), (6, 1, 80)])
def test_float32_rotary_and_store_are_the_eager_calls_bit_for_bit(heads, kv_heads, dim):
    """`rotary_store_f32` against rotary_f32 on q and k and the two index_copy_ calls."""
    module = cpu_native.native()
    lengths = [3, 40, 17]
    key_cache, value_cache, meta = paged(lengths, kv_heads, dim, torch.float32, seed=dim)
    bs = key_cache.shape[1]
    slots = torch.tensor([int(meta.block_tables[r, (n - 1) // bs]) * bs + (n - 1) % bs
                          for r, n in enumerate(lengths)], dtype=torch.long)
    g = torch.Generator().manual_seed(heads)
    qkv = torch.randn(len(lengths), (heads + 2 * kv_heads) * dim, generator=g)
    angles = torch.randn(len(lengths), 1, dim // 2, generator=g).repeat(1, 1, 2) * 3
    cos, sin = angles.cos(), angles.sin() * torch.cat([-torch.ones(dim // 2), torch.ones(dim // 2)])
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    rows = len(lengths)
    want_q = module.rotary_f32(q.view(rows, heads, dim), cos, sin)
    kc, vc = key_cache.clone(), value_cache.clone()
    kc.view(-1, kv_heads, dim).index_copy_(0, slots, module.rotary_f32(k.view(rows, kv_heads, dim), cos, sin))
    vc.view(-1, kv_heads, dim).index_copy_(0, slots, v.reshape(rows, kv_heads, dim))
    got_q = module.rotary_store_f32(qkv, cos, sin, key_cache, value_cache, slots, heads, kv_heads)
    assert torch.equal(got_q, want_q) and torch.equal(key_cache, kc) and torch.equal(value_cache, vc)
    with pytest.raises(RuntimeError, match="outside the cache's"):
        module.rotary_store_f32(qkv, cos, sin, key_cache, value_cache, slots - 10_000, heads, kv_heads)


def test_fused_decode_block_refuses_bad_input_by_name():
    module = cpu_native.native()
    key_cache, value_cache, meta = paged([5], 2, 32, torch.bfloat16)
    qkv = torch.randn(1, (4 + 4) * 32).to(torch.bfloat16)
    cos = sin = torch.ones(1, 1, 32, dtype=torch.bfloat16)
    capacity = key_cache.shape[0] * key_cache.shape[1]
    with pytest.raises(RuntimeError, match=f"slot {capacity} outside the cache's {capacity}"):
        module.decode_attention_bf16(qkv, cos, sin, key_cache, value_cache, torch.tensor([capacity]),
                                     meta.block_tables, meta.seq_lens, 4, 2, 0.2, 0)
    with pytest.raises(RuntimeError, match="columns, expected"):
        module.decode_attention_bf16(qkv[:, :-32], cos, sin, key_cache, value_cache, torch.tensor([3]),
                                     meta.block_tables, meta.seq_lens, 4, 2, 0.2, 0)
    with pytest.raises(RuntimeError, match="cos and sin must be bfloat16"):
        module.decode_attention_bf16(qkv, cos.float(), sin.float(), key_cache, value_cache, torch.tensor([3]),
                                     meta.block_tables, meta.seq_lens, 4, 2, 0.2, 0)


@pytest.mark.parametrize("dtype,switch", [("bfloat16", NATIVE_DECODE_ENV), ("float32", "TGS_CPU_NATIVE_POINTWISE")])
def test_the_model_decodes_through_the_fused_calls_with_the_eager_bits(monkeypatch, dtype, switch):
    """The embedded model on the CPU: every decode layer takes the fused calls (bfloat16: the one-call
    block; float32: rotary and the store in one call, then SDPA), and tokens, logprobs and the KV
    cache equal the eager path's. The native attention's switch (bfloat16) or the native pointwise
    ops' (float32) turns them off. The layers run one by one here (TGS_CPU_DECODE_STEP=0: the plan of
    layers/cpu_decode_step.py calls the same native functions without `_cpu_decode`; its own test is
    tests/test_cpu_decode_step.py)."""
    from helpers import decode_three_requests

    from text_generation_server import about
    from text_generation_server.layers import self_attention
    from text_generation_server.models.loader import get_model

    lm = get_model(str(Path(about.__file__).parent / "assets" / about.EMBEDDED_MODEL_ID), dtype=dtype)
    taken = []
    fused = self_attention.SelfAttention._cpu_decode

    def counting(self, hidden, ctx):
        out = fused(self, hidden, ctx)
        taken.append(out is not None)
        return out

    monkeypatch.setenv("TGS_CPU_DECODE_STEP", "0")
    monkeypatch.setattr(self_attention.SelfAttention, "_cpu_decode", counting)
    got, got_cache = decode_three_requests(lm)
    assert taken and all(taken)  # 4 layers x 11 decode steps
    monkeypatch.setattr(self_attention.SelfAttention, "_cpu_decode", lambda self, hidden, ctx: None)
    want, want_cache = decode_three_requests(lm)
    assert got == want
    assert all(torch.equal(a, b) for a, b in zip(got_cache, want_cache))
    monkeypatch.setattr(self_attention.SelfAttention, "_cpu_decode", counting)
    monkeypatch.setenv(switch, "0")
    taken.clear()
    decode_three_requests(lm)
    assert taken and not any(taken)


AVX2_CHILD = r"""
import json, sys
import torch
sys.path.insert(0, "tests")
from text_generation_server.kernels import cpu_native
from test_cpu_decode_attention import paged
module = cpu_native.native()
out = {"built": module is not None, "reason": cpu_native.unavailable_reason()}
if module is not None:
    kc, vc, meta = paged([3, 40, 130], 2, 80, torch.bfloat16, seed=11)
    q = torch.randn(3, 6, 80, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    out["attn"] = module.paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, 0.1, 0).float().tolist()
    gu = torch.randn(2, 2 * 100, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    out["silu"] = module.silu_mul_bf16(gu, 100).float().tolist()
    scores = torch.randn(3, 1000, generator=torch.Generator().manual_seed(14)).round()  # ties
    scores[1, 500] = float("nan")
    out["argmax"] = module.argmax_f32(scores).tolist()
print("RESULT" + json.dumps(out))
"""


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="the AVX2 build is x86-64's")
def test_the_avx2_build_computes_what_this_one_does():
    """The kernels' generic vector code compiled without AVX-512 (`--cpu-isa avx2`): the same
    arithmetic, so the same results within float32 rounding."""
    env = dict(os.environ) | {cpu_native.ISA_ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", AVX2_CHILD], env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parent.parent)
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")]
    assert done.returncode == 0 and line, done.stderr[-3000:]
    got = json.loads(line[0].removeprefix("RESULT"))
    assert got["built"], got["reason"]
    kc, vc, meta = paged([3, 40, 130], 2, 80, torch.bfloat16, seed=11)
    q = torch.randn(3, 6, 80, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    want = native_decode(q, kc, vc, meta, 0.1, None).float()
    torch.testing.assert_close(torch.tensor(got["attn"]), want, atol=1e-2, rtol=1e-2)
    gu = torch.randn(2, 2 * 100, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    torch.testing.assert_close(torch.tensor(got["silu"]), cpu_native.native().silu_mul_bf16(gu, 100).float(),
                               atol=1e-2, rtol=1e-2)
    scores = torch.randn(3, 1000, generator=torch.Generator().manual_seed(14)).round()
    scores[1, 500] = float("nan")
    assert got["argmax"] == scores.argmax(dim=-1).tolist()  # the greedy argmax: torch's index there too
