"""The router's scheduler with prefix caching and chunked prefill, against a real shard in process.

The scheduler drives the shard service's handlers through an in-process client (the wire is
covered by integration-tests). Every workload runs with caching and chunking off and on; the
tokens each request gets must be identical: shared prefixes, partial-block prefixes, follow-up
turns that contain the previous answer, evictions under memory pressure (a KV cache of a few
blocks), cancellations, seeded sampling and stop sequences.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from helpers import InProcessClient

from text_generation_server.router.metrics import Metrics
from text_generation_server.models.loader import get_model
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.router.block_pool import BlockPool
from text_generation_server.router.scheduler import Scheduler, SchedulerLimits, StepFailed
from text_generation_server.router.validation import Limits, validate
from text_generation_server.shard.service import TextGenerationService

torch.set_num_threads(1)

SYSTEM = "# A helper module for parsing configuration files.\nimport os\nimport sys\nimport json\n\n"
QUESTIONS = ["def load(path):", "class Config:\n    def __init__(self", "def main():\n    args =",
             "def parse_args(argv):", "def merge(a, b):"]


@pytest.fixture(scope="module")
def lm():
    return get_model(None)


LIMITS = Limits(max_input_tokens=700, max_total_tokens=1000, max_stop_sequences=4, max_stop_sequence_length=64,
                max_top_n_tokens=5, max_input_chars=100_000)


def make(lm, num_blocks: int, caching: bool, max_prefill: int, block_size: int = 16):
    lm.block_size = block_size
    lm.allocate_kv_cache(num_blocks)
    lm.max_prefill_tokens = max_prefill
    service = TextGenerationService(lm, "/tmp/unused", 1, 0.1, prefix_caching=caching)
    client = InProcessClient(service)
    metrics = Metrics(model_name="test")
    pool = BlockPool(num_blocks, block_size, prefix_caching=caching)
    scheduler = Scheduler(client, pool, SchedulerLimits(max_prefill, None, 64), metrics, support_chunking=True)
    return scheduler, client, metrics, service


def generate_request(prompt: str, new: int, seed: int | None = None, stop: list[str] | None = None,
                     details: bool = False):
    params = cpb.GenerateParameters(max_new_tokens=new, stop=stop or [])
    if seed is not None:
        params.do_sample = True
        params.seed = seed
        params.temperature = 0.9
        params.top_k = 30
    if details:
        params.details = True
        params.decoder_input_details = True
    return cpb.GenerateRequest(inputs=prompt, parameters=params)


async def collect(scheduler: Scheduler, entry, cancel_after: int | None = None) -> tuple[list[int], str | None]:
    ids: list[int] = []
    while True:
        event = await entry.events.get()
        if isinstance(event, StepFailed):
            raise event
        ids += list(event.tokens.ids)
        if event.HasField("generated_text"):
            return ids, event.generated_text.text
        if cancel_after is not None and len(ids) >= cancel_after:
            scheduler.cancel(entry)
            return ids, None


async def workload(lm, caching: bool, max_prefill: int, num_blocks: int = 200):
    """A shared system prompt, a multi-turn conversation, partial-block and sampled requests,
    a cancellation and a stop sequence; some arrive while others run."""
    scheduler, client, metrics, _ = make(lm, num_blocks, caching, max_prefill)
    scheduler.start()
    try:
        results: dict[str, tuple[list[int], str | None]] = {}

        async def one(name, req, cancel_after=None, delay=0.0):
            await asyncio.sleep(delay)
            entry = scheduler.submit(validate(req, lm.tokenizer, LIMITS))
            results[name] = await collect(scheduler, entry, cancel_after)

        # Turn 1 of a conversation, then requests sharing the system prompt (some while it runs).
        await one("turn1", generate_request(SYSTEM + QUESTIONS[0], 12))
        await asyncio.gather(*(
            one(f"shared{i}", generate_request(SYSTEM + q, 10, seed=(7 + i if i % 2 else None),
                                               stop=["\n\n"] if i == 3 else None), delay=0.002 * i)
            for i, q in enumerate(QUESTIONS[1:])
        ), one("cancelled", generate_request(SYSTEM + "def cancel_me(", 30), cancel_after=3))
        # Turn 2 contains turn 1's prompt and answer.
        turn2 = SYSTEM + QUESTIONS[0] + results["turn1"][1] + "\n\ndef save(path, data):"
        await one("turn2", generate_request(turn2, 12))
        # A prefix that ends mid-block, and prompt logprobs (never served from the cache).
        await one("partial", generate_request(SYSTEM[:40], 6))
        await one("details", generate_request(SYSTEM + QUESTIONS[1], 5, details=True))
        await asyncio.sleep(0.05)
        assert scheduler.pool.used == 0, "blocks held after every request ended"
        return results, metrics, client, scheduler
    finally:
        await scheduler.stop()


def counter(metrics: Metrics, name: str) -> float:
    return metrics.registry.get_sample_value(name + "_total", {"model_name": "test"}) or \
        metrics.registry.get_sample_value(name + "_total") or 0.0


def run(coro):
    return asyncio.run(coro)


def test_prefix_caching_and_chunking_change_no_token(lm):
    plain, _, plain_client, _ = run(workload(lm, caching=False, max_prefill=2048))
    assert "prefill+cached" in plain_client.calls, "admissions must join the running batch in one call"
    cached, metrics, _, scheduler = run(workload(lm, caching=True, max_prefill=2048))
    chunked, chunk_metrics, _, _ = run(workload(lm, caching=True, max_prefill=24))
    for name, (ids, text) in plain.items():
        if name == "cancelled":
            assert cached[name][0] == ids[: len(cached[name][0])] and chunked[name][0] == ids[: len(chunked[name][0])]
            continue
        assert cached[name] == (ids, text), f"{name} differs with prefix caching"
        assert chunked[name] == (ids, text), f"{name} differs with chunked prefill"
    assert counter(metrics, "tgs_prefix_cache_hits") >= 4
    assert counter(metrics, "tgs_prefix_cache_hit_tokens") >= 4 * 16
    assert counter(chunk_metrics, "tgs_chunked_prefills") >= 5
    assert counter(chunk_metrics, "tgs_prefill_chunks") > counter(chunk_metrics, "tgs_chunked_prefills")
    assert scheduler.pool.cached > 0


def test_follow_up_turn_reuses_the_conversation(lm):
    async def go():
        scheduler, client, metrics, _ = make(lm, 200, True, 2048)
        scheduler.start()
        try:
            first = scheduler.submit(validate(generate_request(SYSTEM + QUESTIONS[0], 20), lm.tokenizer, LIMITS))
            _, answer = await collect(scheduler, first)
            follow = SYSTEM + QUESTIONS[0] + answer + "\n"
            valid = validate(generate_request(follow, 4), lm.tokenizer, LIMITS)
            entry = scheduler.submit(valid)
            await collect(scheduler, entry)
            return entry.allocation, valid
        finally:
            await scheduler.stop()

    allocation, valid = run(go())
    # Everything but the last block or so of the conversation came from the cache.
    assert allocation.cache_len >= valid.input_length - 2 * 16, (allocation.cache_len, valid.input_length)


def test_eviction_under_memory_pressure_changes_no_token(lm):
    # 14 blocks of 16 tokens; each prompt takes ~6 blocks, so every new prompt evicts cached
    # blocks, and prompts seen before come back partly cached or not at all.
    prompts = [SYSTEM + q * 8 for q in QUESTIONS] + [SYSTEM + QUESTIONS[4] * 8, SYSTEM + QUESTIONS[3] * 8]

    async def go(caching: bool):
        scheduler, _, metrics, _ = make(lm, 14, caching, 48)
        scheduler.start()
        try:
            out = []
            for i in range(0, len(prompts), 2):
                entries = [scheduler.submit(validate(generate_request(p, 8), lm.tokenizer, LIMITS))
                           for p in prompts[i:i + 2]]
                out += [await collect(scheduler, e) for e in entries]
            await asyncio.sleep(0.02)
            assert scheduler.pool.used == 0
            return out, metrics
        finally:
            await scheduler.stop()

    plain, _ = run(go(False))
    cached, metrics = run(go(True))
    assert cached == plain
    assert counter(metrics, "tgs_prefix_cache_evictions") > 0
    assert counter(metrics, "tgs_prefix_cache_hits") > 0


def test_a_long_prompt_does_not_stall_running_streams(lm):
    async def tokens_while_prefilling(max_prefill: int) -> int:
        """Tokens the slowest running stream got while a ~600-token prompt was prefilled."""
        scheduler, _, _, _ = make(lm, 200, True, max_prefill)
        scheduler.start()
        try:
            streams = [scheduler.submit(validate(generate_request(q, 60), lm.tokenizer, LIMITS)) for q in QUESTIONS]
            for s in streams:
                await s.events.get()  # every stream is running
            long = scheduler.submit(validate(generate_request(SYSTEM * 25, 3), lm.tokenizer, LIMITS))
            await long.events.get()  # its first token: the whole prompt is computed
            counts = []
            for s in streams:
                n = 0
                while not s.events.empty():
                    s.events.get_nowait()
                    n += 1
                counts.append(n)
            return min(counts)
        finally:
            await scheduler.stop()

    # ~600 prompt tokens in chunks of <= 64 - 5: every stream gets a token with every chunk.
    assert run(tokens_while_prefilling(64)) >= 8
    # Chunking off (a budget that fits the prompt): the streams wait for one long forward.
    assert run(tokens_while_prefilling(2048)) <= 2


def test_a_request_whose_admission_raises_fails_alone(lm, monkeypatch):
    """A fault while admitting one request (here the block pool raising for it) fails that
    request with INTERNAL; the queue behind it is served, and the scheduler does not spin on it
    (it used to retry the same admission forever)."""

    async def scenario():
        scheduler, _, metrics, _ = make(lm, 200, caching=True, max_prefill=2048)
        real = scheduler.pool.allocate
        bad_tokens: list[int] = []

        def allocate(tokens, lookup=None, salt=None):
            if lookup is not None and list(lookup) == bad_tokens:
                raise RuntimeError("pool bookkeeping broke")
            return real(tokens, lookup, salt)

        monkeypatch.setattr(scheduler.pool, "allocate", allocate)
        scheduler.start()
        try:
            good = [validate(generate_request(SYSTEM + q, 6), lm.tokenizer, LIMITS) for q in QUESTIONS[:3]]
            bad = validate(generate_request("def broken(", 6), lm.tokenizer, LIMITS)
            bad_tokens.extend(bad.input_ids)
            entries = [scheduler.submit(good[0]), scheduler.submit(bad), scheduler.submit(good[1]),
                       scheduler.submit(good[2])]
            outcomes = []
            for entry in entries:
                try:
                    outcomes.append(await asyncio.wait_for(collect(scheduler, entry), 20))
                except StepFailed as failed:
                    outcomes.append(failed)
            await asyncio.sleep(0.05)
            return outcomes, scheduler.pool.used, metrics
        finally:
            await scheduler.stop()

    outcomes, used, metrics = run(scenario())
    failed = outcomes[1]
    assert isinstance(failed, StepFailed) and "pool bookkeeping broke" in str(failed)
    assert failed.code == grpc.StatusCode.INTERNAL
    for ok in (outcomes[0], outcomes[2], outcomes[3]):
        ids, text = ok
        assert len(ids) == 6 and text is not None
    assert used == 0
    assert metrics.registry.get_sample_value("tgi_request_failure_total", {"err": "internal", "adapter": ""}) == 1
