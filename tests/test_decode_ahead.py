"""Decode ahead in the shard: the next step computed on a fork must change nothing a caller sees.

A small router-like driver runs the shard service's RPC handlers directly (no sockets:
integration-tests cover the wire) through arrivals, finishes, stop sequences, seeded
sampling and a cancellation, once with decode ahead and once without; every token,
every finish and the KV pool must come out the same, and the ahead path must really
have served steps.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from text_generation_server.models.loader import get_model
from text_generation_server.pb.generate.v3 import generate_pb2 as pb
from text_generation_server.shard.service import TextGenerationService

torch.set_num_threads(1)

PROMPTS = ["def fibonacci(n):", "import os\nimport", "class Node:\n    def __init__(self", "for i in range(",
           "with open(path) as f:", "return sorted(", "try:\n    import", "def main():\n    args ="]


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self.code = code


class Context:
    async def abort(self, code, details):
        raise Aborted(code, details)


@pytest.fixture(scope="module")
def lm():
    model = get_model(None)
    model.allocate_kv_cache(256)
    return model


def request(rid: int, prompt: str, max_new: int, sample: bool = False, stop: list[str] | None = None) -> pb.Request:
    params = pb.NextTokenChooserParameters(temperature=0.8 if sample else 1.0, top_k=20 if sample else 0,
                                           do_sample=sample, seed=1000 + rid, repetition_penalty=1.0)
    return pb.Request(id=rid, inputs=prompt, parameters=params, add_special_tokens=True,
                      stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=max_new,
                                                                        stop_sequences=stop or []))


class Driver:
    """Continuous batching as a router does it: prefill arrivals, decode everything, filter finished."""

    def __init__(self, service: TextGenerationService, merge_in_prefill: bool = False):
        self.service = service
        self.merge_in_prefill = merge_in_prefill  # Prefill(batch, cached_batch): steps ahead are thrown away
        self.ctx = Context()
        self.tokens: dict[int, list[int]] = {}
        self.finished: dict[int, tuple[str, int]] = {}
        self.cancelled: set[int] = set()
        self.next_batch_id = 1

    def _take(self, resp) -> pb.CachedBatch | None:
        for gen in resp.generations:
            self.tokens.setdefault(gen.request_id, []).extend(gen.tokens.ids)
            if gen.HasField("generated_text"):
                self.finished[gen.request_id] = (gen.generated_text.text, gen.generated_text.finish_reason)
        return resp.batch if resp.HasField("batch") else None

    async def _filter(self, batch: pb.CachedBatch) -> pb.CachedBatch | None:
        keep = [i for i in batch.request_ids if i not in self.finished and i not in self.cancelled]
        if len(keep) == len(batch.request_ids):
            return batch
        if not keep:
            await self.service.ClearCache(pb.ClearCacheRequest(id=batch.id), self.ctx)
            return None
        resp = await self.service.FilterBatch(pb.FilterBatchRequest(batch_id=batch.id, request_ids=keep), self.ctx)
        return resp.batch

    async def run(self, arrivals: dict[int, list[pb.Request]], cancel_at: dict[int, int]) -> None:
        cached: pb.CachedBatch | None = None
        step = 0
        while cached is not None or any(s >= step for s in arrivals):
            batches = [cached] if cached is not None else []
            if step in arrivals:
                bid, self.next_batch_id = self.next_batch_id, self.next_batch_id + 1
                reqs = arrivals[step]
                prefill = pb.PrefillRequest(batch=pb.Batch(id=bid, requests=reqs, size=len(reqs)))
                if self.merge_in_prefill and batches:
                    prefill.cached_batch.CopyFrom(batches.pop())
                new = self._take(await self.service.Prefill(prefill, self.ctx))
                if new is not None:
                    new = await self._filter(new)
                if new is not None:
                    batches.append(new)
            if cancel_at.get(step) is not None:
                self.cancelled.add(cancel_at[step])
            if batches:
                cached = self._take(await self.service.Decode(pb.DecodeRequest(batches=batches), self.ctx))
                if cached is not None:
                    cached = await self._filter(cached)
            step += 1


def scenario() -> tuple[dict[int, list[pb.Request]], dict[int, int]]:
    arrivals = {
        0: [request(1, PROMPTS[0], 12), request(2, PROMPTS[1], 5, sample=True)],
        2: [request(3, PROMPTS[2], 9, stop=[")"])],
        3: [request(4, PROMPTS[3], 14, sample=True), request(5, PROMPTS[4], 1)],
        7: [request(6, PROMPTS[5], 6)],
        8: [request(7, PROMPTS[6], 10, sample=True)],
    }
    return arrivals, {6: 4}  # request 4 is cancelled before step 6's decode


def drive(lm, ahead: bool, merge_in_prefill: bool = False) -> tuple[Driver, TextGenerationService]:
    service = TextGenerationService(lm, "/tmp/unused", 1, 0.1)
    service.decode_ahead = ahead
    free = lm.allocator.free_blocks
    driver = Driver(service, merge_in_prefill)
    arrivals, cancel_at = scenario()
    asyncio.run(driver.run(arrivals, cancel_at))
    assert not service.cache and not service._ahead
    assert lm.allocator.free_blocks == free, "KV blocks leaked"
    service._executor.shutdown(wait=True)
    return driver, service


def test_decode_ahead_changes_no_token(lm):
    plain, plain_service = drive(lm, ahead=False)
    fast, fast_service = drive(lm, ahead=True)
    assert plain_service.ahead_hits == 0
    assert fast_service.ahead_hits > 5, (fast_service.ahead_hits, fast_service.ahead_misses)
    assert fast.finished == plain.finished
    # The cancelled request may see one token fewer before its cancellation lands: a batch
    # that joins while a step is ready ahead gets its first decoded token one step later.
    cut, late = plain.tokens.pop(4), fast.tokens.pop(4)
    assert late == cut[:len(late)] and len(cut) - len(late) <= 1, (cut, late)
    assert fast.tokens == plain.tokens
    assert set(plain.finished) == {1, 2, 3, 5, 6, 7}  # 4 was cancelled
    assert len(plain.tokens[1]) == 12 and len(plain.tokens[5]) == 1


def test_steps_ahead_thrown_away_leave_no_trace(lm):
    """Prefill with a cached batch merges it: its step ahead is dropped, and the random streams,
    stop counters and detokenizers it advanced on the fork must be untouched in the batch."""
    plain, _ = drive(lm, ahead=False, merge_in_prefill=True)
    fast, fast_service = drive(lm, ahead=True, merge_in_prefill=True)
    assert fast_service.ahead_hits > 3
    assert fast.finished == plain.finished
    assert fast.tokens == plain.tokens


def test_a_failing_step_ahead_fails_the_decode_that_commits_it(lm):
    service = TextGenerationService(lm, "/tmp/unused", 1, 0.1)
    ctx = Context()
    free = lm.allocator.free_blocks
    decode_forwards = []

    def hook(module, args):
        hidden, ctx = args
        meta = ctx.meta
        if meta.is_prefill:
            return None
        decode_forwards.append(hidden.shape[0])
        if len(decode_forwards) == 2:  # the step computed ahead of the second Decode
            return (hidden[..., :-1], ctx)
        return None

    async def go():
        reqs = [request(1, PROMPTS[0], 8), request(2, PROMPTS[1], 8)]
        resp = await service.Prefill(pb.PrefillRequest(batch=pb.Batch(id=1, requests=reqs, size=2)), ctx)
        first = await service.Decode(pb.DecodeRequest(batches=[resp.batch]), ctx)  # a plain step
        assert len(first.generations) == 2
        await service.Decode(pb.DecodeRequest(batches=[first.batch]), ctx)

    assert_failed_step_is_clean(lm, service, hook, go, free)
    assert decode_forwards == [2, 2]


def assert_failed_step_is_clean(lm, service, hook, go, free: int) -> None:
    """Runs `go` with `hook` before the first layer: the call must fail as INTERNAL, and leave no
    cached batch, no step ahead and every KV block free (then the service's model thread stops)."""
    handle = lm.model.layers[0].register_forward_pre_hook(hook)
    try:
        with pytest.raises(Aborted) as err:
            asyncio.run(go())
    finally:
        handle.remove()
    assert err.value.code == grpc.StatusCode.INTERNAL
    assert not service.cache and not service._ahead
    assert lm.allocator.free_blocks == free, "the failed batch kept its KV blocks"
    service._executor.shutdown(wait=True)
