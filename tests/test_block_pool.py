"""The router's block pool: allocation, reference counts and the prefix cache.

Invariants checked after every operation: every block is exactly one of free, cached-and-
unreferenced (evictable) or referenced; a referenced block is never handed out again; an
evicted block is forgotten by the cache before it is reused.
"""

from __future__ import annotations

import random

import pytest

from text_generation_server.router.block_pool import BlockPool

BS = 4


def check(pool: BlockPool, held: list) -> None:
    refs = {}
    for allocation in held:
        for b in allocation.blocks:
            refs[b] = refs.get(b, 0) + 1
    for b in range(1, pool.num_blocks):
        assert pool.reference_count(b) == refs.get(b, 0), f"block {b}"
    assert pool.used == len(refs)
    assert pool.free == pool.num_blocks - 1 - len(refs)
    assert 0 not in refs, "block 0 is reserved"


def test_plain_allocation_without_prefix_caching():
    pool = BlockPool(9, BS)
    a = pool.allocate(10, [1] * 10)
    assert len(a.blocks) == 3 and a.cache_len == 0 and a.slots == [a.blocks[p // BS] * BS + p % BS for p in range(10)]
    assert pool.register(a, [1] * 10, 10) == 0 and pool.cached == 0
    b = pool.allocate(20)
    assert len(b.blocks) == 5
    assert pool.allocate(1) is None  # 8 usable blocks, all held
    check(pool, [a, b])
    pool.release(a)
    pool.release(b)
    assert pool.free == 8


def test_a_shared_prefix_is_reused_and_never_written():
    pool = BlockPool(32, BS, prefix_caching=True)
    prompt = list(range(1, 15))  # 14 tokens: 3 whole blocks
    a = pool.allocate(len(prompt) + 6, prompt)
    assert a.cache_len == 0
    assert pool.register(a, prompt, len(prompt)) == 3
    follow = prompt[:12] + [99, 98, 97]
    b = pool.allocate(len(follow) + 4, follow)
    assert b.cache_len == 12 and b.blocks[:3] == a.blocks[:3] and b.blocks[3] not in a.blocks
    check(pool, [a, b])
    # The whole prompt cached: the last token is still computed, in a block of its own.
    same = pool.allocate(len(prompt[:12]) + 2, prompt[:12])
    assert same.cache_len == 8 and same.blocks[:2] == a.blocks[:2]
    check(pool, [a, b, same])
    for x in (a, b, same):
        pool.release(x)
    check(pool, [])
    assert pool.cached == 3 and pool.free == 31


def test_unreferenced_cached_blocks_are_evicted_tail_first_and_forgotten():
    pool = BlockPool(7, BS, prefix_caching=True)  # 6 usable blocks
    prompt = list(range(1, 17))  # 4 whole blocks
    a = pool.allocate(17, prompt)  # 5 blocks: 4 whole prompt blocks and the start of the answer
    pool.register(a, prompt + [50], 16)
    prefix = list(a.blocks[:4])
    pool.release(a)
    assert pool.cached == 4 and pool.free == 6
    other = pool.allocate(12, [7] * 12)  # 3 blocks: the 2 free ones, then the cache's tail
    assert pool.evictions == 1 and not pool.is_cached(prefix[3]) and pool.is_cached(prefix[2])
    # 3 cached blocks match, but 2 fresh ones do not fit while `other` holds the rest.
    assert pool.allocate(17, prompt) is None
    check(pool, [other])
    pool.release(other)
    again = pool.allocate(17, prompt)
    assert again.cache_len == 12 and again.blocks[:3] == prefix[:3]
    assert prefix[3] not in again.blocks[:3]
    check(pool, [again])


def test_generated_tokens_enter_the_cache_for_the_next_turn():
    pool = BlockPool(32, BS, prefix_caching=True)
    prompt = list(range(1, 10))  # 9 tokens
    answer = [40, 41, 42, 43, 44, 45, 46]
    a = pool.allocate(len(prompt) + 8, prompt)
    pool.register(a, prompt, len(prompt))
    # Finished after 7 tokens: the last one was never fed back, so 15 tokens have K/V.
    pool.register(a, prompt + answer, len(prompt) + len(answer) - 1)
    pool.release(a)
    turn2 = prompt + answer + [60, 61, 62]
    b = pool.allocate(len(turn2) + 4, turn2)
    assert b.cache_len == 12  # 3 whole blocks of 15 computed tokens


def test_duplicate_content_stays_private_and_later_blocks_still_chain():
    pool = BlockPool(32, BS, prefix_caching=True)
    prompt = list(range(1, 13))
    a = pool.allocate(13, prompt)
    b = pool.allocate(13, prompt)  # admitted before a's prompt was registered: computed twice
    assert b.cache_len == 0
    pool.register(a, prompt[:8], 8)
    pool.register(b, prompt, 12)  # blocks 0-1 duplicate a's; block 2 is new and chains from them
    pool.release(b)
    assert pool.cached == 3
    c = pool.allocate(14, prompt + [5])
    assert c.cache_len == 12 and c.blocks[:2] == a.blocks[:2] and c.blocks[2] in b_blocks(pool)
    check(pool, [a, c])


def b_blocks(pool: BlockPool) -> set[int]:
    return set(pool._hash_of)


def test_a_full_pool_refuses_without_taking_anything():
    pool = BlockPool(5, BS, prefix_caching=True)
    prompt = list(range(1, 9))
    a = pool.allocate(9, prompt)
    pool.register(a, prompt, 8)
    before = (pool.free, pool.used, pool.cached)
    assert pool.allocate(9 + 8, prompt) is None  # needs 2 cached + 3 fresh; only 1 free
    assert (pool.free, pool.used, pool.cached) == before
    check(pool, [a])


def test_random_workload_keeps_every_invariant():
    rng = random.Random(0)
    pool = BlockPool(40, BS, prefix_caching=True)
    bases = [[rng.randrange(1, 50) for _ in range(rng.randrange(4, 30))] for _ in range(5)]
    held = []
    for step in range(600):
        if held and (rng.random() < 0.45 or pool.free < 8):
            allocation, tokens = held.pop(rng.randrange(len(held)))
            pool.register(allocation, tokens, len(tokens) - 1)
            pool.release(allocation)
        else:
            prompt = list(rng.choice(bases)) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))]
            allocation = pool.allocate(len(prompt) + 4, prompt)
            if allocation is None:
                continue
            assert allocation.cache_len < len(prompt) and allocation.cache_len % BS == 0
            for i in range(allocation.cache_len // BS):  # what was reused holds exactly these tokens
                assert pool._tokens_of[allocation.blocks[i]] == tuple(prompt[i * BS:(i + 1) * BS])
            pool.register(allocation, prompt, len(prompt))
            held.append((allocation, prompt + [7]))
        check(pool, [a for a, _ in held])
    assert pool.evictions > 0


def test_releasing_twice_is_an_error():
    pool = BlockPool(5, BS)
    a = pool.allocate(4)
    blocks = list(a.blocks)
    pool.release(a)
    a.blocks = blocks
    with pytest.raises(RuntimeError, match="released more often"):
        pool.release(a)
