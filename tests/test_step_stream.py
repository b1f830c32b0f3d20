"""The Steps stream: our router's calls to a rank over one stream, answered as the unary calls are.

A real gRPC server (the shard service on a unix socket) and the router's ShardClient: the same
requests give the same tokens over the stream and over the unary calls, a failed call raises the
unary call's status and leaves the stream serving, a broken stream fails its waiter and the next
call opens a new one, and the unary calls stay where the stream is switched off or not served.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
import torch
from test_shard_errors import lm  # noqa: F401: the embedded model, one KV cache, 1 torch thread

from text_generation_server.pb.generate.v3 import generate_pb2 as pb
from text_generation_server.pb.generate.v3 import generate_pb2_grpc as pb_grpc
from text_generation_server.router.client import STEP_STREAM_ENV, ShardClient
from text_generation_server.shard.service import TextGenerationService


def request(rid: int, prompt: str = "def add(a, b):", max_new: int = 5) -> pb.Request:
    params = pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0)
    return pb.Request(id=rid, inputs=prompt, parameters=params, add_special_tokens=True,
                      stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=max_new),
                      blocks=[rid * 2 + 1, rid * 2 + 2], slots=list(range((rid * 2 + 1) * 16, (rid * 2 + 3) * 16)))


class NoStepsService(TextGenerationService):
    """A shard that does not say it serves Steps (as a TGI shard): its Info has no tgs-steps."""

    async def Info(self, request, context):
        response = await super().Info(request, context)
        context.set_trailing_metadata(())
        return response


async def served(lm, tmp_path: Path, service_cls=TextGenerationService):
    service = service_cls(lm, str(tmp_path / "unused"), 1, 0.1)
    server = grpc.aio.server()
    pb_grpc.add_TextGenerationServiceServicer_to_server(service, server)
    url = f"unix://{tmp_path}/shard.sock"
    server.add_insecure_port(url)
    await server.start()
    return service, server, ShardClient([url])


async def run_to_end(client: ShardClient, rid: int) -> list[int]:
    """Prefill one request, then Decode (filtering nothing) until it finishes; its token ids."""
    resp = await client.prefill(pb.Batch(id=rid, requests=[request(rid)], size=1))
    tokens = [t for g in resp.generations for t in g.tokens.ids]
    batch = resp.batch if resp.HasField("batch") else None
    while batch is not None:
        resp = await client.decode([batch])
        tokens += [t for g in resp.generations for t in g.tokens.ids]
        batch = resp.batch if resp.HasField("batch") else None
    return tokens


def test_the_stream_answers_as_the_unary_calls(lm, tmp_path, monkeypatch):
    monkeypatch.delenv(STEP_STREAM_ENV, raising=False)

    async def main():
        service, server, client = await served(lm, tmp_path)
        try:
            unary = await run_to_end(client, 1)
            assert await client.open_steps() and client.streaming
            streamed = await run_to_end(client, 2)
            assert streamed == unary and len(streamed) == 5
            # A failed call raises the unary call's status, and the stream keeps serving.
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await client.decode([pb.CachedBatch(id=99, request_ids=[1])])
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND and "99" in missing.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await client.prefill(pb.Batch(id=3, requests=[request(3), request(3)], size=2))
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "twice" in bad.value.details()
            assert await run_to_end(client, 4) == unary
            # A call the shard cannot read (no call set) is refused by name, and the stream goes on.
            stream = client._streams[0]
            answer = await stream.call(10**6, pb.StepCall(seq=10**6))
            assert answer.WhichOneof("answer") == "error"
            assert answer.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "no call" in answer.error.message
            # A broken stream fails its waiters; the next call opens a new stream.
            stream._call.cancel()
            await asyncio.sleep(0.05)
            assert stream.broken is not None
            assert await run_to_end(client, 5) == unary
            assert client._streams[0] is not stream
            await client.clear_cache()
            assert not service.cache
        finally:
            await client.close()
            await server.stop(None)
            service._executor.shutdown(wait=True)

    asyncio.run(main())


@pytest.mark.parametrize("why", ["switched off", "not served"])
def test_the_unary_calls_stay_where_the_stream_is_off(lm, tmp_path, monkeypatch, why):
    if why == "switched off":
        monkeypatch.setenv(STEP_STREAM_ENV, "0")
    else:
        monkeypatch.delenv(STEP_STREAM_ENV, raising=False)

    async def main():
        service, server, client = await served(lm, tmp_path, TextGenerationService if why == "switched off"
                                               else NoStepsService)
        try:
            assert not await client.open_steps() and not client.streaming
            assert len(await run_to_end(client, 1)) == 5
        finally:
            await client.close()
            await server.stop(None)
            service._executor.shutdown(wait=True)

    asyncio.run(main())


def test_the_device_clock_times_the_forward_on_a_cpu():
    """On a CPU the device is the host: the forward's wall time, stopped before the readback."""
    import time

    from text_generation_server.engine.readback import DeviceClock

    clock = DeviceClock(torch.device("cpu"))
    clock.start()
    time.sleep(0.002)
    clock.stop()
    time.sleep(0.005)  # after stop(): not the forward's
    assert 2_000_000 <= clock.elapsed_ns() < 5_000_000
