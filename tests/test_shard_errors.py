"""Errors that blame the right side: only the caller's mistakes are INVALID_ARGUMENT/NOT_FOUND.

A ValueError or KeyError raised inside the model (a kernel, a layer) during Prefill or Decode is
the server's fault and must reach the client as INTERNAL; the shard keeps serving afterwards.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from helpers import Aborted
from helpers import AbortingContext as Context

from text_generation_server.models.loader import get_model
from text_generation_server.pb.generate.v3 import generate_pb2 as pb
from text_generation_server.shard.service import TextGenerationService

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def lm():
    model = get_model(None)
    model.allocate_kv_cache(64)
    return model


def request(rid: int, prompt: str = "def add(a, b):", max_new: int = 4, **fields) -> pb.Request:
    params = pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0)
    return pb.Request(id=rid, inputs=prompt, parameters=params, add_special_tokens=True,
                      stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=max_new), **fields)


def call(coro):
    try:
        return asyncio.run(coro)
    except Aborted as exc:
        return exc


@pytest.mark.parametrize("error", [ValueError("shape mismatch in a kernel"), KeyError("missing scale")])
@pytest.mark.parametrize("phase", ["prefill", "decode"])
def test_a_model_failure_is_internal_whatever_its_type(lm, error, phase):
    service = TextGenerationService(lm, "/tmp/unused", 1, 0.1)
    service.decode_ahead = False
    ctx = Context()
    free = lm.allocator.free_blocks

    def hook(module, args):
        meta = args[-1].meta  # (hidden, ForwardContext)
        if meta.is_prefill == (phase == "prefill"):
            raise error

    prefill = pb.PrefillRequest(batch=pb.Batch(id=1, requests=[request(1)], size=1))
    handle = lm.model.layers[1].register_forward_pre_hook(hook)
    try:
        if phase == "prefill":
            result = call(service.Prefill(prefill, ctx))
        else:
            handle.remove()
            first = asyncio.run(service.Prefill(prefill, ctx))
            handle = lm.model.layers[1].register_forward_pre_hook(hook)
            result = call(service.Decode(pb.DecodeRequest(batches=[first.batch]), ctx))
    finally:
        handle.remove()
    assert isinstance(result, Aborted) and result.code == grpc.StatusCode.INTERNAL, result
    assert type(error).__name__ in result.details
    assert lm.allocator.free_blocks == free and not service.cache
    # Still serving: the same request now completes.
    again = asyncio.run(service.Prefill(pb.PrefillRequest(batch=pb.Batch(id=2, requests=[request(2)], size=1)), ctx))
    assert len(again.generations) == 1
    asyncio.run(service.ClearCache(pb.ClearCacheRequest(), ctx))
    service._executor.shutdown(wait=True)


def test_the_callers_mistakes_keep_their_codes(lm):
    service = TextGenerationService(lm, "/tmp/unused", 1, 0.1)
    service.decode_ahead = False
    ctx = Context()
    bad_top_n = call(service.Prefill(pb.PrefillRequest(batch=pb.Batch(
        id=1, requests=[request(1, top_n_tokens=10**6)], size=1)), ctx))
    assert bad_top_n.code == grpc.StatusCode.INVALID_ARGUMENT and "top_n_tokens" in bad_top_n.details
    twice = call(service.Prefill(pb.PrefillRequest(batch=pb.Batch(id=1, requests=[request(3), request(3)], size=2)),
                                 ctx))
    assert twice.code == grpc.StatusCode.INVALID_ARGUMENT and "appears twice" in twice.details
    bad_cache = call(service.Prefill(pb.PrefillRequest(batch=pb.Batch(
        id=1, requests=[request(4, cache_len=3)], size=1)), ctx))
    assert bad_cache.code == grpc.StatusCode.INVALID_ARGUMENT and "cache_len" in bad_cache.details
    missing = call(service.Decode(pb.DecodeRequest(batches=[pb.CachedBatch(id=99, request_ids=[1])]), ctx))
    assert missing.code == grpc.StatusCode.NOT_FOUND
    ok = asyncio.run(service.Prefill(pb.PrefillRequest(batch=pb.Batch(id=5, requests=[request(5, max_new=6)], size=1)),
                                     ctx))
    # An unknown request id in FilterBatch is the caller's mistake, and the batch survives it.
    unknown = call(service.FilterBatch(pb.FilterBatchRequest(batch_id=5, request_ids=[5, 77]), ctx))
    assert unknown.code == grpc.StatusCode.INVALID_ARGUMENT and "77" in unknown.details
    step = asyncio.run(service.Decode(pb.DecodeRequest(batches=[ok.batch]), ctx))
    assert [g.request_id for g in step.generations] == [5]
    # A new request whose id is already running in the cached batch it would join.
    clash = call(service.Prefill(pb.PrefillRequest(batch=pb.Batch(id=6, requests=[request(5)], size=1),
                                                   cached_batch=step.batch), ctx))
    assert clash.code == grpc.StatusCode.INVALID_ARGUMENT and "already in batch" in clash.details
    assert 5 in service.cache
    asyncio.run(service.ClearCache(pb.ClearCacheRequest(), ctx))
    service._executor.shutdown(wait=True)
