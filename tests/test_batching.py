"""Continuous batching: a request's tokens must not depend on what it is batched with.

The reference for every request is the same request run alone. Batches are driven
by hand the way the router drives a shard (prefill, decode, concatenate, filter),
and the KV block allocator is checked after every change, because a leaked block
is lost for the life of the server.
"""

from __future__ import annotations

import math
import shutil

import pytest
import torch
from helpers import write_checkpoint

from text_generation_server.generation.sampling import SamplingParams
from text_generation_server.models.loader import get_model
from text_generation_server.engine.batch import Batch, OutOfBlocksError
from text_generation_server.engine.types import GenerationRequest

torch.set_num_threads(1)

BLOCK_SIZE = 4  # small blocks: every request spans many, so block tables are exercised
NUM_BLOCKS = 64
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)",  # 26 tokens
    "a",  # 1 token
    "import os\nimport sys\n\nclass Stack:\n",  # 21 tokens
    "bb",
    "Ünïcödé: 日本語 テキスト 😀",  # 36 tokens
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("batching")
    out = {}
    for seed, name in enumerate(("llama", "mistral_window")):
        write_checkpoint(root / name, name, seed=seed + 21)
        out[name] = str(root / name)
    return out


def load(folder: str, blocks: int = NUM_BLOCKS):
    lm = get_model(folder, dtype="float32", block_size=BLOCK_SIZE)
    lm.allocate_kv_cache(blocks)
    return lm


def greedy(rid: int, prompt: str, new: int, **kw) -> GenerationRequest:
    return GenerationRequest(id=rid, inputs=prompt, max_new_tokens=new, ignore_eos_token=True, **kw)


def sampled(rid: int, prompt: str, new: int, seed: int, **kw) -> GenerationRequest:
    params = SamplingParams(do_sample=True, seed=seed, temperature=0.8, top_k=40, top_p=0.95,
                            repetition_penalty=1.1)
    return GenerationRequest(id=rid, inputs=prompt, max_new_tokens=new, ignore_eos_token=True,
                             sampling=params, **kw)


def alone(lm, request: GenerationRequest) -> list[int]:
    free = lm.allocator.free_blocks
    tokens = lm.generate([request])[0].token_ids
    assert lm.allocator.free_blocks == free
    return tokens


def drive(lm, batch: Batch | None, steps: int, tokens: dict[int, list[int]]) -> Batch | None:
    """Up to `steps` generate_token calls, filtering finished requests out as a router does."""
    for _ in range(steps):
        if batch is None:
            break
        generations, batch, _ = lm.generate_token(batch)
        finished = set()
        for gen in generations:
            tokens.setdefault(gen.request_id, []).extend(gen.tokens.ids)
            if gen.generated_text is not None:
                finished.add(gen.request_id)
        if batch is not None and finished:
            batch = lm.filter(batch, [r for r in batch.request_ids if r not in finished])
    return batch


@pytest.mark.parametrize("arch", ["llama", "mistral_window"])
def test_batch_of_mixed_lengths_matches_each_alone(folders, arch):
    lm = load(folders[arch])
    requests = [greedy(i, p, 6 + 2 * i, prefill_logprobs=True) for i, p in enumerate(PROMPTS)]
    completions = lm.generate(requests)
    assert lm.allocator.free_blocks == NUM_BLOCKS - 1
    for i, (prompt, done) in enumerate(zip(PROMPTS, completions)):
        single = lm.generate([greedy(i, prompt, 6 + 2 * i, prefill_logprobs=True)])[0]
        assert done.token_ids == single.token_ids, f"prompt {i}"
        assert len(done.token_ids) == 6 + 2 * i
        batched_lp = torch.tensor(done.steps[0].prefill_tokens.logprobs)
        single_lp = torch.tensor(single.steps[0].prefill_tokens.logprobs)
        torch.testing.assert_close(batched_lp, single_lp, atol=1e-5, rtol=0, equal_nan=True)
        torch.testing.assert_close(
            torch.tensor([lp for s in done.steps for lp in s.tokens.logprobs]),
            torch.tensor([lp for s in single.steps for lp in s.tokens.logprobs]),
            atol=1e-5, rtol=0,
        )


@pytest.mark.parametrize("order", ["old_first", "new_first"])
@pytest.mark.parametrize("arch", ["llama", "mistral_window"])
def test_concatenate_and_filter_mid_decode_change_no_tokens(folders, arch, order):
    lm = load(folders[arch])
    first = lambda: [greedy(1, PROMPTS[0], 10), greedy(2, PROMPTS[1], 12), sampled(3, PROMPTS[2], 9, seed=3)]
    second = lambda: [greedy(4, PROMPTS[3], 6), sampled(5, PROMPTS[4], 11, seed=5)]
    expected = {r.id: alone(lm, r) for r in first() + second()}

    tokens: dict[int, list[int]] = {}
    batch_a = lm.make_batch(0, first())
    batch_a = drive(lm, batch_a, 3, tokens)  # prefill + 2 decode steps
    free = lm.allocator.free_blocks
    batch_b = lm.make_batch(1, second())
    used_b = sum(len(s.blocks) for s in batch_b.states)
    # A request's last token is never fed back: it needs slots for prompt + max_new_tokens - 1.
    assert used_b == lm.blocks_for(2 + 6 - 1) + lm.blocks_for(36 + 11 - 1)
    assert lm.allocator.free_blocks == free - used_b
    batch_b = drive(lm, batch_b, 1, tokens)  # prefill of the newcomers
    parts = [batch_a, batch_b] if order == "old_first" else [batch_b, batch_a]
    batch = Batch.concatenate(parts)
    assert sorted(batch.request_ids) == [1, 2, 3, 4, 5]
    batch = drive(lm, batch, 2, tokens)

    # Cancel request 2 mid-generation: its blocks go back at once.
    free = lm.allocator.free_blocks
    batch = lm.filter(batch, [r for r in batch.request_ids if r != 2])
    assert lm.allocator.free_blocks == free + lm.blocks_for(1 + 12 - 1)
    assert 2 not in batch.request_ids
    batch = drive(lm, batch, 100, tokens)
    assert batch is None

    for rid, want in expected.items():
        if rid == 2:
            assert 0 < len(tokens[2]) < len(want) and tokens[2] == want[: len(tokens[2])]
        else:
            assert tokens[rid] == want, f"request {rid}"
    assert lm.allocator.free_blocks == NUM_BLOCKS - 1


def test_seeded_sampling_reproduces_alone_and_in_a_mixed_batch(folders):
    lm = load(folders["llama"])
    reference = alone(lm, sampled(7, PROMPTS[0], 20, seed=42))
    assert alone(lm, sampled(7, PROMPTS[0], 20, seed=42)) == reference
    assert alone(lm, sampled(7, PROMPTS[0], 20, seed=43)) != reference  # the seed matters

    mixed = [
        greedy(1, PROMPTS[2], 5),
        sampled(2, PROMPTS[4], 25, seed=1),
        sampled(7, PROMPTS[0], 20, seed=42),
        greedy(3, PROMPTS[1], 30, top_n_tokens=4),
    ]
    completions = {c.request_id: c for c in lm.generate(mixed)}
    assert completions[7].token_ids == reference
    assert completions[7].seed == 42
    assert completions[1].seed is None


def test_top_n_tokens_through_the_engine(folders):
    lm = load(folders["llama"])
    done = lm.generate([greedy(1, PROMPTS[0], 5, top_n_tokens=3), greedy(2, PROMPTS[2], 5)])
    for step in done[0].steps:
        (top,) = step.top_tokens
        assert len(top.ids) == 3 and len(top.texts) == 3
        assert top.logprobs == sorted(top.logprobs, reverse=True)
        assert top.ids[0] == step.tokens.ids[0]  # greedy picks the most likely token
        assert math.isclose(top.logprobs[0], step.tokens.logprobs[0], abs_tol=1e-6)
        assert all(lp <= 0 for lp in top.logprobs)
    assert all(step.top_tokens == [] for step in done[1].steps)


def test_stop_sequence_ends_generation(folders):
    lm = load(folders["llama"])
    full = lm.generate([greedy(1, PROMPTS[0], 16)])[0]
    texts = [step.tokens.texts[0] for step in full.steps]
    # Pick a stop string whose first occurrence ends with step k's text.
    for k in range(2, 16):
        so_far = "".join(texts[: k + 1])
        stop = so_far[-3:]
        if texts[k] and len(stop) == 3 and stop not in so_far[:-1]:
            break
    else:
        pytest.fail("no usable stop string in the greedy text")
    done = lm.generate([greedy(1, PROMPTS[0], 16, stop_sequences=["never-there", stop])])[0]
    assert done.finish_reason.name == "STOP_SEQUENCE"
    assert done.token_ids == full.token_ids[: k + 1]
    assert done.text.endswith(stop)


def test_max_new_tokens_and_eos(folders, tmp_path):
    lm = load(folders["llama"])
    full = lm.generate([greedy(1, PROMPTS[2], 12)])[0].token_ids
    for n in (1, 3):
        done = lm.generate([greedy(1, PROMPTS[2], n)])[0]
        assert done.finish_reason.name == "LENGTH" and done.token_ids == full[:n]
    assert lm.allocator.free_blocks == NUM_BLOCKS - 1

    # Make the token greedy decoding emits at step k the checkpoint's EOS.
    k = next(i for i in range(2, 12) if full[i] not in full[:i])
    folder = tmp_path / "eos"
    shutil.copytree(folders["llama"], folder)
    (folder / "generation_config.json").write_text(f'{{"eos_token_id": [{full[k]}]}}')
    eos_lm = load(str(folder))
    done = eos_lm.generate([GenerationRequest(id=1, inputs=PROMPTS[2], max_new_tokens=12)])[0]
    assert done.finish_reason.name == "EOS_TOKEN"
    assert done.token_ids == full[: k + 1]
    assert done.steps[-1].generated_text.generated_tokens == k + 1
    ignored = eos_lm.generate([greedy(1, PROMPTS[2], 12)])[0]
    assert ignored.finish_reason.name == "LENGTH" and ignored.token_ids == full


def test_kv_blocks_return_to_allocator(folders):
    lm = load(folders["llama"])
    total = NUM_BLOCKS - 1
    assert lm.allocator.free_blocks == total
    batch = lm.make_batch(0, [greedy(1, PROMPTS[0], 4), greedy(2, PROMPTS[2], 8)])
    need_1, need_2 = lm.blocks_for(26 + 4 - 1), lm.blocks_for(21 + 8 - 1)
    assert lm.allocator.free_blocks == total - need_1 - need_2
    tokens: dict[int, list[int]] = {}
    batch = drive(lm, batch, 2, tokens)
    batch = lm.filter(batch, [2])
    assert lm.allocator.free_blocks == total - need_2
    assert lm.filter(batch, []) is None  # ClearCache of the whole batch
    assert lm.allocator.free_blocks == total

    # A batch whose every request finishes at prefill gives its blocks back by itself.
    batch = lm.make_batch(1, [greedy(3, PROMPTS[1], 1), greedy(4, PROMPTS[3], 1)])
    generations, next_batch, _ = lm.generate_token(batch)
    assert next_batch is None and all(g.generated_text is not None for g in generations)
    assert lm.allocator.free_blocks == total


def router_kv(blocks: list[int], total: int) -> dict:
    slots = [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(total)]
    return {"blocks": blocks, "slots": slots}


def test_router_provided_blocks_and_slots(folders):
    lm = load(folders["mistral_window"])
    expected = {1: alone(lm, greedy(1, PROMPTS[0], 10)), 2: alone(lm, sampled(2, PROMPTS[4], 7, seed=9)),
                3: alone(lm, greedy(3, PROMPTS[2], 8))}
    free = lm.allocator.free_blocks
    # Scattered, unordered blocks from the top of the pool (the allocator hands out low ids).
    blocks_1 = [60, 41, 55, 47, 63, 44, 52, 50, 58, 62]  # 26 + 10 tokens = 9 blocks needed
    blocks_2 = [40, 61, 43, 57, 46, 39, 54, 49, 53, 38, 59, 42]  # 36 + 7 = 11 blocks needed
    requests = [
        greedy(1, PROMPTS[0], 10, **router_kv(blocks_1, 36)),
        sampled(2, PROMPTS[4], 7, seed=9, blocks=blocks_2),  # blocks without slots: slots derived
        greedy(3, PROMPTS[2], 8),  # self-assigned, in the same batch
    ]
    batch = lm.make_batch(0, requests)
    assert lm.allocator.free_blocks == free - lm.blocks_for(21 + 8 - 1)
    tokens: dict[int, list[int]] = {}
    assert drive(lm, batch, 100, tokens) is None
    assert tokens == expected
    # Router-owned blocks are never handed to the shard's own allocator.
    assert lm.allocator.free_blocks == free


def _bad_cases() -> dict[str, tuple[GenerationRequest, str]]:
    ok_blocks = list(range(40, 48))  # 8 blocks = 32 tokens for PROMPTS[1] + 5 = 6 tokens
    return {
        "max_new_tokens 0": (greedy(2, PROMPTS[1], 0), "max_new_tokens must be >= 1"),
        "too long": (greedy(2, PROMPTS[0], 240), r"max_new_tokens \(240\) \+ 26 input tokens exceeds the model's"),
        "duplicate id": (greedy(1, PROMPTS[1], 5), "request id 1 appears twice"),
        "slots too few": (greedy(2, PROMPTS[1], 5, blocks=ok_blocks, slots=router_kv(ok_blocks, 6)["slots"][:4]),
                          "4 slots given, 5 needed"),
        "block past the end": (greedy(2, PROMPTS[1], 5, blocks=[40, NUM_BLOCKS]),
                               rf"blocks \[{NUM_BLOCKS}\] are outside the KV cache of {NUM_BLOCKS} blocks"),
        "negative block": (greedy(2, PROMPTS[1], 5, blocks=[-1, 40]), r"blocks \[-1\] are outside"),
        "blocks too few": (greedy(2, PROMPTS[0], 10, blocks=[40, 41]), "2 blocks of 4 cannot hold 35 tokens"),
        "slots off the blocks": (greedy(2, PROMPTS[1], 5, blocks=[40, 41], slots=[160, 161, 162, 163, 4, 165]),
                                 "slot 4 for position 4 does not match its blocks"),
        "slots without blocks": (greedy(2, PROMPTS[1], 5, slots=list(range(160, 166))), "without the blocks"),
        "top_n negative": (greedy(2, PROMPTS[1], 5, top_n_tokens=-1), "top_n_tokens"),
        "temperature 0": (GenerationRequest(id=2, inputs="a", sampling=SamplingParams(temperature=0.0)),
                          "temperature"),
        "empty stop": (greedy(2, PROMPTS[1], 5, stop_sequences=[""]), "stop_sequences must not contain an empty"),
        "empty prompt": (greedy(2, "", 5), "zero tokens"),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_requests_raise_and_leave_the_allocator_unchanged(folders, case):
    lm = load(folders["llama"])
    bad, message = _bad_cases()[case]
    free = lm.allocator.free_blocks
    # A valid self-assigned request first: its blocks must not leak when the second fails.
    with pytest.raises(ValueError, match=message):
        lm.make_batch(0, [greedy(1, PROMPTS[2], 5), bad])
    assert lm.allocator.free_blocks == free
    assert len(lm.generate([greedy(1, PROMPTS[2], 3)])[0].token_ids) == 3
    assert lm.allocator.free_blocks == free


def test_out_of_blocks_leaves_the_allocator_unchanged(folders):
    lm = load(folders["llama"], blocks=12)  # 11 usable blocks of 4 tokens
    with pytest.raises(OutOfBlocksError, match="free blocks"):
        lm.make_batch(0, [greedy(1, PROMPTS[1], 8), greedy(2, PROMPTS[0], 20)])  # 3 + 12 blocks
    assert lm.allocator.free_blocks == 11
