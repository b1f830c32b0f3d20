"""A client that goes away cancels its request, however gRPC lets go of the handler.

When a client cancels a stream while the server is writing to it, gRPC's asyncio server drops the
handler's async generator without closing it; a `finally` inside runs only when the garbage
collector reaches it, which in a busy server can be after the request decoded to its end (seen
in CI as a cancelled stream counted as a success). The router cancels from the call's done
callback instead. These tests hold the abandoned generator alive, so only that callback can do it.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from helpers import Context
from test_scheduler_prefix import LIMITS, SYSTEM, generate_request, make

from text_generation_server.models.loader import get_model
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.router.service import TextGenerationService as RouterService

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def lm():
    return get_model(None)


def value(metrics, name: str, **labels) -> float:
    """The sum over the series that carry `labels` (others, e.g. the adapter, are summed over)."""
    wanted = set(labels.items())
    return sum(s.value for family in metrics.registry.collect() for s in family.samples
               if s.name == name and wanted <= set(s.labels.items()))


async def until(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the router never reached the expected state"
        await asyncio.sleep(0.01)


def test_a_stream_dropped_mid_write_is_cancelled_by_the_calls_end(lm):
    scheduler, _, metrics, service = make(lm, 200, True, 64)
    router = RouterService(scheduler, lm.tokenizer, LIMITS, cpb.InfoResponse(), metrics)

    async def go():
        scheduler.start()
        try:
            ctx = Context()
            stream = router.GenerateStream(generate_request(SYSTEM + "def cancel_me(", 200), ctx)
            first = [await stream.__anext__(), await stream.__anext__()]
            assert scheduler.pool.used > 0 and len(scheduler.running) == 1
            ctx.end()  # the call is over; `stream` stays referenced and unclosed, as gRPC leaves it
            await until(lambda: scheduler.pool.used == 0 and not scheduler.running)
            assert value(metrics, "tgs_request_cancelled_total") == 1
            assert value(metrics, "tgi_request_failure_total", err="dropped") == 1
            assert value(metrics, "tgi_request_success_total", finish_reason="length") == 0
            assert all(not m.HasField("generated_text") for m in first)

            # A stream read to its end, and a unary call, are not cancelled when their calls end.
            ctx = Context()
            done = [m async for m in router.GenerateStream(generate_request(SYSTEM + "def keep(", 6), ctx)]
            ctx.end()
            ctx = Context()
            unary = await router.Generate(generate_request(SYSTEM + "def keep_too(", 6), ctx)
            ctx.end()
            await until(lambda: scheduler.pool.used == 0)
            assert len(done) == 6 and done[-1].generated_text and unary.generated_text
            assert value(metrics, "tgs_request_cancelled_total") == 1
            await stream.aclose()
        finally:
            await scheduler.stop()
            service._executor.shutdown(wait=True)

    asyncio.run(go())
