"""The CPU KV cache's lazily zeroed memory (kernels/lazy_zeros.py) and how much of it is resident
(engine/resident.touched_bytes, from /proc/self/pagemap): zeros to every reader, no page resident until written."""

from __future__ import annotations

import sys

import pytest
import torch

from text_generation_server.engine.resident import touched_bytes
from text_generation_server.kernels import lazy_zeros
from text_generation_server.layers.attention import KVCache

MIB = 2**20
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page residency is read from /proc/self/pagemap")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_a_large_tensor_reads_as_zeros_and_takes_writes(dtype):
    shape = (512, 16, 4, 64)
    t = lazy_zeros.zeros(shape, dtype, "cpu")
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.numel() * t.element_size() >= lazy_zeros.MIN_BYTES
    assert not t.float().any()
    t[3, 2] = 1.0
    assert t.float().sum().item() == 4 * 64
    view = t[3:4]
    del t  # a view keeps the mapping alive
    assert view.float().sum().item() == 4 * 64


def test_small_tensors_and_the_switch_keep_torch_zeros(monkeypatch):
    small = lazy_zeros.zeros((4, 4), torch.float32, "cpu")
    assert small.untyped_storage().nbytes() == 64 and not small.any()
    monkeypatch.setenv(lazy_zeros.ENV, "0")
    plain = lazy_zeros.zeros((1024, 1024), torch.float32, "cpu")
    assert not plain.any() and plain.shape == (1024, 1024)


@linux_only
def test_a_kv_cache_is_resident_only_where_blocks_were_written():
    # 4 layers x K and V x 2048 blocks x 16 tokens x 4 heads x 64 x 4 bytes = 256 MiB allocated.
    cache = KVCache(4, 2048, 16, 4, 64, torch.float32, torch.device("cpu"))
    tensors = [*cache.keys, *cache.values]
    allocated = sum(t.numel() * t.element_size() for t in tensors)
    assert allocated == 256 * MIB
    before = touched_bytes(tensors)
    assert before is not None and before < 8 * MIB  # nothing written: at most stray pages of the edges
    slots = torch.arange(0, 160)  # ten blocks of each layer
    for layer in range(4):
        cache.store(layer, slots, torch.ones(160, 4, 64), torch.ones(160, 4, 64))
    after = touched_bytes(tensors)
    # Ten blocks of 16 KiB per pool: a few pages each (2 MiB each where huge pages are on).
    assert after > before and after <= before + 8 * 2 * MIB + 8 * 160 * 4 * 64 * 4
    assert cache.keys[0][:10].sum().item() == 160 * 4 * 64 and not cache.keys[0][10:].any()


@linux_only
def test_touched_bytes_counts_a_written_tensor_once_and_unknown_without_pagemap(tmp_path):
    t = torch.ones(4 * MIB // 4)
    counted = touched_bytes([t])
    assert counted is not None and 4 * MIB <= counted <= 4 * MIB + 2 * 2**21  # edges: a page, or a huge page
    assert touched_bytes([t, t[: MIB // 4]]) == counted  # pages two tensors share count once
    assert touched_bytes([t], pagemap=tmp_path / "absent") is None
