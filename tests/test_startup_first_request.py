"""What the first request after SERVING would otherwise do once, done by warmup instead (issue #33).

The CPU KV cache is lazily zeroed memory in huge pages (kernels/lazy_zeros.py) and the router hands
blocks out from block 1 upwards (router/block_pool.py): the first request would fault in and zero
the first huge page of every layer's keys and values inside its prefill. Warmup writes those first
blocks (engine/resident.py prefault_first_blocks), and only those: the rest of the cache stays
unresident until used. No timing is asserted (targets live in benchmarks/startup.py); what is held
is that the path runs, writes nothing a reader could see, and keeps the cache lazy past it.
"""

from __future__ import annotations

import sys

import pytest
import torch

from text_generation_server.engine.resident import HUGE_PAGE, prefault_first_blocks, touched_bytes
from text_generation_server.layers.attention import KVCache

MIB = 2**20
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/pagemap is Linux's")


def _block_bytes(tensor: torch.Tensor) -> int:
    return tensor[0].numel() * tensor.element_size()


@linux_only
def test_the_first_blocks_become_resident_and_stay_zero_the_rest_stays_lazy():
    # 2 layers x K and V x 4096 blocks x 16 tokens x 2 heads x 64 x 2 bytes = 64 MiB, 16 MiB a tensor.
    cache = KVCache(2, 4096, 16, 2, 64, torch.bfloat16, torch.device("cpu"))
    tensors = [*cache.keys, *cache.values]
    block = _block_bytes(tensors[0])
    first = [t[1:1 + HUGE_PAGE // block] for t in tensors]
    assert touched_bytes(first) < len(tensors) * HUGE_PAGE  # nothing written yet (edges aside)

    written = prefault_first_blocks(tensors)

    assert written == len(tensors) * HUGE_PAGE
    assert touched_bytes(first) == len(tensors) * HUGE_PAGE  # every page of blocks 1.. is resident
    # Past the first two huge pages of each tensor nothing was touched: the cache stays lazy.
    past = [t[1 + 2 * HUGE_PAGE // block:] for t in tensors]
    assert touched_bytes(past) == 0
    assert not any(t.any() for t in tensors)  # zeros over zeros


def test_a_cache_smaller_than_a_huge_page_is_written_whole_and_block_0_is_left_alone():
    tensors = [torch.zeros(8, 16, 2, 64)]
    tensors[0][0] = 7  # block 0 is the one the router never hands out: untouched
    assert prefault_first_blocks(tensors) == 7 * _block_bytes(tensors[0])
    assert (tensors[0][0] == 7).all() and not tensors[0][1:].any()
    assert prefault_first_blocks([torch.zeros(1, 16, 2, 64)]) == 0  # no block past block 0


@linux_only
@torch.inference_mode()
def test_warmup_leaves_the_blocks_the_router_hands_out_first_resident():
    from text_generation_server.engine.types import GenerationRequest
    from text_generation_server.models.loader import get_model

    lm = get_model(None, max_batch_size=8)
    requests = [GenerationRequest(id=0, inputs="_test " * 64, truncate=64, max_new_tokens=1)]
    lm.warmup(requests, 64, 128, 256, 0.01)
    tensors = [t for t in (*lm.kv_cache.keys, *lm.kv_cache.values) if t is not None]
    block = _block_bytes(tensors[0])
    first = [t[1:1 + min(HUGE_PAGE // block, t.shape[0] - 1)] for t in tensors]
    assert touched_bytes(first) >= sum(f.numel() * f.element_size() for f in first)
    # ... and only those: the cache as a whole is far from resident.
    allocated = sum(t.numel() * t.element_size() for t in tensors)
    assert touched_bytes(tensors) <= len(tensors) * 3 * HUGE_PAGE < allocated
