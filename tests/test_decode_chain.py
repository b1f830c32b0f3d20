"""Chains of steps ahead (shard/service.py): when the router is slower than a step, the model
thread goes on stepping, and the Decode that arrives takes every step computed, one Generation
per request per step. What a caller sees must be what it would see calling Decode once per step:
the same tokens, finishes and freed blocks; only how many steps one answer carries changes.

The driver of test_decode_ahead.py runs the scenario; `settle` lets the model thread finish its
chain before each call (a no-op queued straight on its executor is not a call, so it does not
stop the chain), which makes every answer carry exactly min(chain, steps left) steps.
"""

from __future__ import annotations

import asyncio

import pytest

from text_generation_server.pb.generate.v3 import generate_pb2 as pb
from text_generation_server.shard import service as service_mod
from text_generation_server.shard.service import TextGenerationService, ahead_steps_setting

from text_generation_server.models.loader import get_model
from text_generation_server.router.scheduler import steps_in

from test_decode_ahead import PROMPTS, Context, Driver, assert_failed_step_is_clean, request, scenario

CHAIN = 3


@pytest.fixture(scope="module")
def lm():
    model = get_model(None)
    model.allocate_kv_cache(256)
    return model


class ChainDriver(Driver):
    """Driver whose Prefill and Decode go the Steps stream's way (with a chain), after the model
    thread has finished the chain it was computing."""

    def __init__(self, service: TextGenerationService, chain: int, merge_in_prefill: bool = False):
        super().__init__(service, merge_in_prefill)
        self.chain = chain
        self.steps_per_answer: list[int] = []
        real = (service.Prefill, service.Decode)
        service.Prefill = self._chained(service._prefill)
        service.Decode = self._chained(service._decode, count=True)
        self._real = real

    async def settle(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self.service._executor, lambda: None)

    def _chained(self, handler, count: bool = False):
        async def call(message, ctx):
            await self.settle()
            resp = await self.service._unary(ctx, handler(message, chain=self.chain))
            if count and resp.generations:
                ids = [g.request_id for g in resp.generations]
                self.steps_per_answer.append(max(ids.count(i) for i in set(ids)))
            return resp
        return call


def chained_scenario(chain: int):
    """scenario()'s arrivals at the plain driver's steps that are multiples of `chain`, moved to
    the chained driver's call that comes after the same number of decode steps."""
    arrivals, cancel_at = scenario()
    plain = {0: arrivals[0] + arrivals[2], 3: arrivals[3], 9: arrivals[7] + arrivals[8]}
    return plain, {6: 4}, {s // chain: r for s, r in plain.items()}, {6 // chain: 4}


def run(lm, driver: Driver, arrivals, cancel_at) -> None:
    free = lm.allocator.free_blocks
    asyncio.run(driver.run(arrivals, cancel_at))
    assert not driver.service.cache and not driver.service._ahead
    assert lm.allocator.free_blocks == free, "KV blocks leaked"
    driver.service._executor.shutdown(wait=True)


@pytest.mark.parametrize("merge_in_prefill", [False, True])
def test_a_chain_gives_the_tokens_of_steps_one_by_one(lm, merge_in_prefill):
    plain_arrivals, plain_cancel, arrivals, cancel_at = chained_scenario(CHAIN)
    plain_service = TextGenerationService(lm, "/tmp/unused", 1, 0.1)
    plain_service.decode_ahead = False
    plain = Driver(plain_service, merge_in_prefill)
    run(lm, plain, plain_arrivals, plain_cancel)

    service = TextGenerationService(lm, "/tmp/unused", 1, 0.1)
    chained = ChainDriver(service, CHAIN, merge_in_prefill)
    run(lm, chained, arrivals, cancel_at)

    assert service.chained_steps > 5 and max(chained.steps_per_answer) == CHAIN, chained.steps_per_answer
    assert sum(chained.steps_per_answer) > 2 * len(chained.steps_per_answer), chained.steps_per_answer
    assert chained.finished == plain.finished
    # The cancelled request runs on until its cancellation lands: at most a chain's steps more.
    cut, late = plain.tokens.pop(4), chained.tokens.pop(4)
    assert late[:len(cut)] == cut[:len(late)] and abs(len(late) - len(cut)) <= CHAIN, (cut, late)
    assert chained.tokens == plain.tokens
    assert set(plain.finished) == {1, 2, 3, 5, 6, 7}
    # Rows that finished inside a chain (1 token after a prefill, 9, 14, 12...): answered once, in order.
    assert len(plain.tokens[1]) == 12 and len(plain.tokens[5]) == 1


def test_a_waiting_call_ends_the_chain(lm):
    """A Decode sent while the chain runs takes what is done after one more step at most, not the
    chain's full length: a router's FilterBatch or a newcomer never waits for a long chain."""
    service = TextGenerationService(lm, "/tmp/unused", 1, 0.1)
    ctx = Context()
    free = lm.allocator.free_blocks

    async def go():
        prefill = pb.PrefillRequest(batch=pb.Batch(id=1, requests=[request(1, PROMPTS[0], 300)], size=1))
        resp = await service._unary(ctx, service._prefill(prefill, chain=250))
        answer = await service._unary(ctx, service._decode(pb.DecodeRequest(batches=[resp.batch]), chain=250))
        await service._unary(ctx, service._clear_cache(pb.ClearCacheRequest(id=1)))
        return answer

    answer = asyncio.run(go())
    steps = len(answer.generations)
    assert 1 <= steps < 250 and [g.request_id for g in answer.generations] == [1] * steps
    assert not service.cache and not service._ahead
    assert lm.allocator.free_blocks == free
    service._executor.shutdown(wait=True)


def test_a_failing_chain_step_fails_the_decode_that_commits_it(lm):
    service = TextGenerationService(lm, "/tmp/unused", 1, 0.1)
    ChainDriver(service, 4)  # Prefill and Decode as over the Steps stream, with chains of 4
    ctx = Context()
    free = lm.allocator.free_blocks
    decode_forwards = []

    def hook(module, args):
        hidden, fctx = args
        if fctx.meta.is_prefill:
            return None
        decode_forwards.append(hidden.shape[0])
        if len(decode_forwards) == 3:  # the third step of the first chain
            return (hidden[..., :-1], fctx)
        return None

    async def go():
        reqs = [request(1, PROMPTS[0], 8), request(2, PROMPTS[1], 8)]
        resp = await service.Prefill(pb.PrefillRequest(batch=pb.Batch(id=1, requests=reqs, size=2)), ctx)
        await service.Decode(pb.DecodeRequest(batches=[resp.batch]), ctx)

    assert_failed_step_is_clean(lm, service, hook, go, free)
    assert decode_forwards == [2, 2, 2]


def test_the_steps_stream_chains_and_the_unary_decode_does_not(lm):
    service = TextGenerationService(lm, "/tmp/unused", 1, 0.1)
    service.ahead_steps = 4
    ctx = Context()
    driver = ChainDriver(service, 1)  # only for settle()

    async def over_steps(calls):
        async def stream():
            for call in calls:
                await driver.settle()
                yield call
        return [a async for a in service.Steps(stream(), ctx)]

    async def go():
        reqs = [request(1, PROMPTS[0], 20)]
        first = await over_steps([pb.StepCall(seq=1, prefill=pb.PrefillRequest(batch=pb.Batch(id=1, requests=reqs,
                                                                                                size=1)))])
        batch = first[0].prefill.batch
        second = await over_steps([pb.StepCall(seq=2, decode=pb.DecodeRequest(batches=[batch]))])
        await driver.settle()
        unary = await driver._real[1](pb.DecodeRequest(batches=[second[0].decode.batch]), ctx)
        await driver.settle()
        again = await driver._real[1](pb.DecodeRequest(batches=[unary.batch]), ctx)
        return second[0].decode, unary, again

    chained, unary, again = asyncio.run(go())
    assert [g.request_id for g in chained.generations] == [1] * 4  # Steps: a chain of 4
    assert len(unary.generations) == 4  # the chain the Steps call started
    assert len(again.generations) == 1  # after a unary Decode, one step ahead only, as on TGI's wire
    service._executor.shutdown(wait=True)


def test_the_setting(monkeypatch):
    monkeypatch.delenv(service_mod.AHEAD_STEPS_ENV, raising=False)
    assert ahead_steps_setting(1) == service_mod.DEFAULT_AHEAD_STEPS
    assert ahead_steps_setting(2) == 1  # ranks would have to agree on each chain's length
    monkeypatch.setenv(service_mod.AHEAD_STEPS_ENV, "3")
    assert ahead_steps_setting(1) == 3 and ahead_steps_setting(4) == 1
    for bad in ("0", "-2", "many", "1.5"):
        monkeypatch.setenv(service_mod.AHEAD_STEPS_ENV, bad)
        with pytest.raises(ValueError, match=service_mod.AHEAD_STEPS_ENV):
            ahead_steps_setting(1)


def test_the_router_counts_an_answers_steps():
    gen = lambda rid: pb.Generation(request_id=rid, tokens=pb.Tokens(ids=[7, 8]))  # speculation: one step
    assert steps_in([]) == 1 and steps_in([gen(1)]) == 1 and steps_in([gen(1), gen(2)]) == 1
    assert steps_in([gen(1), gen(2), gen(1), gen(2), gen(1)]) == 3
