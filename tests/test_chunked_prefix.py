"""Prefix caching and chunked prefill in the engine: computing a prompt in pieces, or over K/V a
router says are already cached, must give the tokens (and logprobs) of computing it whole.

Requests are driven by hand the way a router drives a shard; the router's part (which blocks
hold which prefix) is played by the test with the allocator's blocks.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import collect_generations, ids_request, random_ids, run_to_end, write_checkpoint

from text_generation_server.layers.attention import (
    AttentionMetadata,
    TorchAttention,
    blockwise_decode,
    padded_decode,
    sequence_attention,
)
from text_generation_server.models.loader import get_model
from text_generation_server.engine.batch import Batch
from text_generation_server.engine.types import RequestError

torch.set_num_threads(1)

BLOCK_SIZE = 4
NUM_BLOCKS = 96


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("chunked")
    out = {}
    for seed, name in enumerate(("llama", "mistral_window")):
        write_checkpoint(root / name, name, seed=seed + 31)
        out[name] = str(root / name)
    return out


def load(folder: str):
    lm = get_model(folder, dtype="float32", block_size=BLOCK_SIZE)
    lm.allocate_kv_cache(NUM_BLOCKS)
    return lm


def assert_same(got: dict, want: dict) -> None:
    assert got["ids"] == want["ids"]
    torch.testing.assert_close(torch.tensor(got["lps"]), torch.tensor(want["lps"]), atol=1e-5, rtol=0)
    if want["prompt"] is not None:
        torch.testing.assert_close(torch.tensor(got["prompt"]), torch.tensor(want["prompt"]), atol=1e-5, rtol=0,
                                   equal_nan=True)


@pytest.mark.parametrize("arch", ["llama", "mistral_window"])
def test_chunked_prefill_gives_the_tokens_of_a_whole_prefill(folders, arch):
    lm = load(folders[arch])
    prompts = [random_ids(23, 1), random_ids(9, 2), random_ids(31, 3)]
    make = lambda i, **kw: ids_request(i, prompts[i], 7, seed=(i if i == 2 else None), prefill_logprobs=True, **kw)
    whole = run_to_end(lm, lm.make_batch(0, [make(i) for i in range(3)]))
    free = lm.allocator.free_blocks
    lm.max_prefill_tokens = 6  # later chunks: within 6 tokens a step, after the decoding rows
    batch = lm.make_batch(1, [make(0, chunk_len=5), make(1, chunk_len=2), make(2, chunk_len=4)])
    assert batch.info().current_tokens == 11
    steps = 0
    chunked: dict[int, dict] = {}
    while batch is not None:
        generations, batch, _ = lm.generate_token(batch)
        steps += 1
        done = collect_generations(chunked, generations)
        if batch is not None:
            assert batch.info().current_tokens <= max(6, len(batch))
            if done:
                batch = lm.filter(batch, [r for r in batch.request_ids if r not in done])
    assert steps > 7 + 1, "the prompts were not split"
    assert lm.allocator.free_blocks == free
    for rid in range(3):
        assert_same(chunked[rid], whole[rid])
        assert len(chunked[rid]["prompt"]) == len(prompts[rid])


@pytest.mark.parametrize("arch", ["llama", "mistral_window"])
def test_prefix_from_the_cache_gives_the_tokens_of_a_recompute(folders, arch):
    lm = load(folders[arch])
    shared = random_ids(13, 7)
    first, second = shared + random_ids(6, 8), shared + random_ids(9, 9)
    # The router's part: blocks it owns, handed in with every request.
    blocks_a = lm.allocator.allocate(lm.blocks_for(len(first) + 5))
    run_to_end(lm, lm.make_batch(0, [ids_request(1, first, 5, blocks=blocks_a)]))
    fresh = lm.allocator.allocate(lm.blocks_for(len(second) + 6))
    want = run_to_end(lm, lm.make_batch(1, [ids_request(2, second, 6, seed=4, blocks=fresh)]))[2]
    for cached_blocks in (1, 3):  # whole blocks of the shared 13 tokens
        tail = lm.allocator.allocate(lm.blocks_for(len(second) + 6) - cached_blocks)
        req = ids_request(2, second, 6, seed=4, blocks=blocks_a[:cached_blocks] + tail,
                          cache_len=cached_blocks * BLOCK_SIZE)
        before_a = [lm.kv_cache.keys[0][b].clone() for b in blocks_a[:cached_blocks]]
        assert_same(run_to_end(lm, lm.make_batch(2, [req]))[2], want)
        for b, k in zip(blocks_a[:cached_blocks], before_a):
            assert torch.equal(lm.kv_cache.keys[0][b], k), "a cached block was written"
        lm.allocator.free(tail)
    # TGI's router, when a whole prompt is cached, recomputes only the last token.
    again = lm.allocator.allocate(1)
    whole_hit = ids_request(3, first, 4, blocks=blocks_a[: lm.blocks_for(len(first))] + again,
                            cache_len=len(first) - 1)
    redo = ids_request(3, first, 4, blocks=lm.allocator.allocate(lm.blocks_for(len(first) + 4)))
    hit_ids = run_to_end(lm, lm.make_batch(3, [whole_hit]))[3]["ids"]
    assert hit_ids == run_to_end(lm, lm.make_batch(4, [redo]))[3]["ids"]


def test_prompt_logprobs_of_a_cached_prefix_are_unknown(folders):
    lm = load(folders["llama"])
    prompt = random_ids(12, 5)
    blocks = lm.allocator.allocate(lm.blocks_for(len(prompt) + 2))
    whole = run_to_end(lm, lm.make_batch(0, [ids_request(1, prompt, 2, blocks=blocks, prefill_logprobs=True)]))[1]
    hit = run_to_end(lm, lm.make_batch(1, [ids_request(1, prompt, 2, blocks=blocks, prefill_logprobs=True,
                                                       cache_len=8)]))[1]
    assert hit["ids"] == whole["ids"]
    assert all(math.isnan(x) for x in hit["prompt"][:9])
    torch.testing.assert_close(torch.tensor(hit["prompt"][9:]), torch.tensor(whole["prompt"][9:]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "mistral_window"])
def test_a_long_prompt_prefills_in_chunks_while_others_decode(folders, arch):
    lm = load(folders[arch])
    decoding = [ids_request(1, random_ids(7, 11), 12), ids_request(2, random_ids(3, 12), 12, seed=9)]
    long = ids_request(3, random_ids(40, 13), 5, seed=3)
    want = {**run_to_end(lm, lm.make_batch(0, [decoding[0], decoding[1]])), **run_to_end(lm, lm.make_batch(1, [long]))}
    decoding = [ids_request(1, random_ids(7, 11), 12), ids_request(2, random_ids(3, 12), 12, seed=9)]
    long = ids_request(3, random_ids(40, 13), 5, seed=3, chunk_len=6)
    lm.max_prefill_tokens = 8
    got: dict[int, dict] = {}
    running = lm.make_batch(0, decoding)
    for _ in range(2):  # two tokens each before the long prompt arrives
        generations, running, _ = lm.generate_token(running)
        collect_generations(got, generations)
    batch = Batch.concatenate([running, lm.make_batch(1, [long])])
    sizes = []
    while batch is not None:
        sizes.append(batch.info().current_tokens)
        generations, batch, _ = lm.generate_token(batch)
        emitted = {g.request_id for g in generations}
        if batch is not None and any(s.prefilling for s in batch.states):
            assert {1, 2} <= emitted, "decoding requests stalled behind the long prompt"
        done = collect_generations(got, generations)
        if batch is not None and done:
            batch = lm.filter(batch, [r for r in batch.request_ids if r not in done])
    assert max(sizes) <= 8 and sizes[0] == 2 + 6
    for rid in (1, 2, 3):
        assert_same(got[rid], want[rid])


def test_bad_cache_and_chunk_fields_are_the_callers_error(folders):
    lm = load(folders["llama"])
    free = lm.allocator.free_blocks
    prompt = random_ids(10, 1)
    blocks = [1, 2, 3, 4]
    for req, needle in (
        (ids_request(1, prompt, 2, cache_len=4), "needs the blocks"),
        (ids_request(1, prompt, 2, blocks=blocks, cache_len=10), "cache_len 10 must be less than"),
        (ids_request(1, prompt, 2, chunk_len=0), "chunk_len must be >= 1"),
    ):
        with pytest.raises(RequestError, match=needle):
            lm.make_batch(0, [req])
    assert lm.allocator.free_blocks == free


# -- the torch backend's own paths agree with each other ------------------------------------------------
def _random_cache(blocks: int, kv_heads: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (blocks, BLOCK_SIZE, kv_heads, dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@pytest.mark.parametrize("window", [None, 3, 9, 100])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_blockwise_decode_matches_padded_decode(window, heads, kv_heads):
    keys, values = _random_cache(40, kv_heads, 16, seed=heads + kv_heads)
    lengths = [1, 4, 5, 17, 23]
    perm = torch.randperm(39, generator=torch.Generator().manual_seed(1)) + 1
    tables = torch.zeros(len(lengths), 6, dtype=torch.long)
    used = 0
    for row, n in enumerate(lengths):
        count = (n + BLOCK_SIZE - 1) // BLOCK_SIZE
        tables[row, :count] = perm[used:used + count]
        used += count
    meta = AttentionMetadata(is_prefill=False, slots=torch.zeros(len(lengths), dtype=torch.long),
                             block_tables=tables, seq_lens=torch.tensor(lengths), max_seq_len=max(lengths))
    q = torch.randn(len(lengths), heads, 16, generator=torch.Generator().manual_seed(2))
    want = padded_decode(q, keys, values, meta, 0.25, window)
    got = blockwise_decode(q, keys, values, meta, 0.25, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 4, 7])
@pytest.mark.parametrize("cache_len", [0, 5, 12])
def test_windowed_prefill_tiles_match_a_dense_mask(window, cache_len):
    g = torch.Generator().manual_seed(cache_len)
    n, heads, kv_heads, dim = 19, 6, 2, 8
    q = torch.randn(n, heads, dim, generator=g)
    k = torch.randn(cache_len + n, kv_heads, dim, generator=g)
    v = torch.randn(cache_len + n, kv_heads, dim, generator=g)
    got = sequence_attention(q, k, v, cache_len, 0.3, window)
    pos_q = torch.arange(cache_len, cache_len + n)
    pos_k = torch.arange(cache_len + n)
    diff = pos_q[:, None] - pos_k[None, :]
    mask = (diff >= 0) & ((diff < window) if window is not None else True)
    kk = k.repeat_interleave(heads // kv_heads, dim=1)
    vv = v.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk.double()) * 0.3
    scores = scores.masked_fill(~mask, -math.inf)
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv.double()).float()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_torch_backend_reads_a_cached_prefix_through_the_block_table():
    keys, values = _random_cache(20, 2, 8, seed=5)
    g = torch.Generator().manual_seed(6)
    backend = TorchAttention()
    tables = torch.tensor([[7, 3, 12, 5], [9, 2, 0, 0]])
    cache_lens, q_lens = [9, 2], [4, 3]
    q = torch.randn(sum(q_lens), 4, 8, generator=g)
    meta = AttentionMetadata(is_prefill=True, slots=torch.zeros(7, dtype=torch.long), prefill_lens=q_lens,
                             cache_lens=cache_lens, block_tables=tables)
    out = backend.prefill(q, None, None, keys, values, meta, 0.5, None)
    start = 0
    for row, (c, n) in enumerate(zip(cache_lens, q_lens)):
        flat_k = keys[tables[row]].reshape(-1, 2, 8)[: c + n]
        flat_v = values[tables[row]].reshape(-1, 2, 8)[: c + n]
        want = sequence_attention(q[start:start + n], flat_k, flat_v, c, 0.5, None)
        torch.testing.assert_close(out[start:start + n], want)
        start += n


def test_prompt_logprobs_computed_a_few_rows_at_a_time_are_the_same(folders, monkeypatch):
    lm = load(folders["llama"])
    prompt = random_ids(17, 21)
    whole = run_to_end(lm, lm.make_batch(0, [ids_request(1, prompt, 2, prefill_logprobs=True)]))[1]
    monkeypatch.setattr(type(lm), "PROMPT_LOGIT_ELEMENTS", 3 * lm.config.vocab_size)  # 3 rows per piece
    pieces = run_to_end(lm, lm.make_batch(1, [ids_request(1, prompt, 2, prefill_logprobs=True)]))[1]
    assert_same(pieces, whole)
