"""The step connections: our router's calls to a rank over one connection, answered as the unary calls are.

A real gRPC server (the shard service on a unix socket), the rank's step socket where a test
serves it, and the router's ShardClient: the same requests give the same tokens over the step
socket, the gRPC Steps stream and the unary calls; a failed call raises the unary call's status
and leaves the connection serving; a broken connection fails its waiter and the next call opens a
new one; bytes that are not frames drop their connection alone; and the unary calls stay where the
connections are switched off or not served.
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
from text_generation_server.utils.step_frames import HEADER_BYTES, MAX_FRAME_BYTES, FrameError, FrameProtocol, frame


def request(rid: int, prompt: str = "def add(a, b):", max_new: int = 5, ids: list[int] | None = None) -> pb.Request:
    """`ids`: the prompt's token ids as our router sends them (input_ids), else text the shard tokenizes."""
    params = pb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0)
    return pb.Request(id=rid, inputs=prompt, input_ids=ids or [], parameters=params, add_special_tokens=True,
                      stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=max_new),
                      blocks=[rid * 2 + 1, rid * 2 + 2], slots=list(range((rid * 2 + 1) * 16, (rid * 2 + 3) * 16)))


class NoStepsService(TextGenerationService):
    """A shard that does not say it serves Steps (as a TGI shard): its Info has no tgs-steps."""

    async def Info(self, request, context):
        response = await super().Info(request, context)
        context.set_trailing_metadata(())
        return response


async def served(lm, tmp_path: Path, service_cls=TextGenerationService, step_socket: bool = False,
                 inline: bool | None = None):
    """The service on a gRPC socket (as serve_shard starts it), and its step socket when asked
    (`inline`: answers written by the model thread, or by its sender thread as on a GPU)."""
    service = service_cls(lm, str(tmp_path / "unused"), 1, 0.1)
    server = grpc.aio.server()
    pb_grpc.add_TextGenerationServiceServicer_to_server(service, server)
    url = f"unix://{tmp_path}/shard.sock"
    server.add_insecure_port(url)
    await server.start()
    if step_socket:
        service.serve_step_socket(f"{tmp_path}/shard.sock.steps", inline)
    return service, server, ShardClient([url])


async def stop(service, server, client) -> None:
    await client.close()
    await server.stop(None)
    service._executor.shutdown(wait=True)


async def run_to_end(client: ShardClient, rid: int, ids: list[int] | None = None) -> list[int]:
    """Prefill one request, then Decode (filtering nothing) until it finishes; its token ids."""
    resp = await client.prefill(pb.Batch(id=rid, requests=[request(rid, ids=ids)], size=1))
    tokens = [t for g in resp.generations for t in g.tokens.ids]
    batch = resp.batch if resp.HasField("batch") else None
    while batch is not None:
        resp = await client.decode([batch])
        tokens += [t for g in resp.generations for t in g.tokens.ids]
        batch = resp.batch if resp.HasField("batch") else None
    return tokens


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


@pytest.mark.parametrize("mode", ["socket, answers inline", "socket, answers by the sender", "grpc stream"])
def test_the_step_connections_answer_as_the_unary_calls(lm, tmp_path, monkeypatch, mode):
    monkeypatch.setenv(STEP_STREAM_ENV, "grpc" if mode == "grpc stream" else "1")

    async def main():
        service, server, client = await served(lm, tmp_path, step_socket=True, inline="inline" in mode)
        try:
            unary = await run_to_end(client, 1)
            assert await client.open_steps() and client.streaming
            assert client.step_transport == ("one Steps stream per rank" if mode == "grpc stream" else
                                             "one step socket per rank")
            assert oct(Path(service.step_socket).stat().st_mode & 0o777) == "0o600"
            streamed = await run_to_end(client, 2)  # (text prompts: tokenized off the model thread)
            assert streamed == unary and len(streamed) == 5
            ids = lm.tokenizer.encode("def add(a, b):", add_special_tokens=True).ids
            assert await run_to_end(client, 6, ids) == unary  # token ids: converted on the model thread
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await client.decode([pb.CachedBatch(id=99, request_ids=[1])])
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND and "99" in missing.value.details()
            for ids_or_text in (None, ids):
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    await client.prefill(pb.Batch(id=3, requests=[request(3, ids=ids_or_text)] * 2, size=2))
                assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "twice" in bad.value.details()
            for ids_or_text in (None, ids):  # a request the shard refuses is answered alone, beside the others
                broken = request(7, ids=ids_or_text)
                broken.parameters.watermark = True
                resp = await client.prefill(pb.Batch(id=7, requests=[broken, request(8, ids=ids_or_text)], size=2))
                errors = {g.request_id: g.error for g in resp.generations if g.error}
                assert list(errors) == [7] and "watermark" in errors[7]
                assert resp.batch.request_ids == [8]
                await client.clear_cache(7)
            assert await run_to_end(client, 4) == unary
            stream = client._streams[0]
            answer = await stream.call(10**6, pb.StepCall(seq=10**6))
            assert answer.WhichOneof("answer") == "error" and "no call" in answer.error.message
            # A connection that ends fails its waiters; the next call opens a new one.
            if mode == "grpc stream":
                stream._call.cancel()
                await asyncio.sleep(0.05)
            else:
                waiting = asyncio.ensure_future(stream.call(10**6 + 1, pb.StepCall(
                    seq=10**6 + 1, clear_cache=pb.ClearCacheRequest())))
                stream._protocol.transport.abort()
                with pytest.raises(grpc.aio.AioRpcError) as gone:
                    await waiting
                assert gone.value.code() == grpc.StatusCode.UNAVAILABLE and "step socket" in gone.value.details()
            assert stream.broken is not None
            assert await run_to_end(client, 5) == unary
            assert client._streams[0] is not stream
            await client.clear_cache()
            assert not service.cache
        finally:
            await stop(service, server, client)

    asyncio.run(main())


def test_bytes_that_are_not_frames_drop_their_connection_alone(lm, tmp_path, monkeypatch):
    monkeypatch.delenv(STEP_STREAM_ENV, raising=False)

    async def main():
        service, server, client = await served(lm, tmp_path, step_socket=True)
        try:
            assert await client.open_steps() and client.step_transport == "one step socket per rank"
            for junk in (b"\xff\xff\xff\x7f" + b"x" * 8, frame(b"\x0a\xff\xff")):  # too long; not a StepCall
                reader, writer = await asyncio.open_unix_connection(service.step_socket)
                writer.write(junk)
                await writer.drain()
                assert await asyncio.wait_for(reader.read(), 5) == b""  # the rank hung up, answering nothing
                writer.close()
            assert len(await run_to_end(client, 1)) == 5  # the router's own connection serves on
        finally:
            await stop(service, server, client)

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["socket", "grpc stream", "unary"])
def test_decode_now_answers_as_decode_on_the_step_socket_alone(lm, tmp_path, monkeypatch, mode):
    """ShardClient.decode_now (the scheduler's Decode sent ahead): on the step socket, a future made
    with the call already written, resolving to what decode returns (the same tokens) or failing as it
    raises; on the gRPC stream, the unary calls or a connection to reopen, None (decode runs instead)."""
    monkeypatch.setenv(STEP_STREAM_ENV, {"socket": "1", "grpc stream": "grpc", "unary": "0"}[mode])

    async def main():
        service, server, client = await served(lm, tmp_path, step_socket=True)
        try:
            unary = await run_to_end(client, 1)
            await client.open_steps()
            resp = await client.prefill(pb.Batch(id=2, requests=[request(2)], size=1))
            if mode != "socket":
                assert client.decode_now([resp.batch]) is None
                return
            tokens = [t for g in resp.generations for t in g.tokens.ids]
            while resp.HasField("batch"):
                call = client.decode_now([resp.batch])
                assert isinstance(call, asyncio.Future) and not call.done()
                resp = await call
                assert isinstance(resp, pb.DecodeResponse)
                tokens += [t for g in resp.generations for t in g.tokens.ids]
            assert tokens == unary
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await client.decode_now([pb.CachedBatch(id=99, request_ids=[1])])
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND and "99" in missing.value.details()
            stream = client._streams[0]
            waiting = client.decode_now([pb.CachedBatch(id=98, request_ids=[1])])
            stream._protocol.transport.abort()
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await waiting
            assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
            assert client.decode_now([pb.CachedBatch(id=98, request_ids=[1])]) is None  # to reopen: decode does
            assert await run_to_end(client, 3) == unary
        finally:
            await stop(service, server, client)

    asyncio.run(main())


@pytest.mark.parametrize("mode, transport", [
    ("switched off", "unary calls"), ("not served", "unary calls"),
    ("grpc", "one Steps stream per rank"), ("unreachable", "one Steps stream per rank")])
def test_the_fallbacks_of_the_step_socket(lm, tmp_path, monkeypatch, mode, transport):
    """TGS_STEP_STREAM=0 or a shard without Steps (a TGI shard): the unary calls; TGS_STEP_STREAM=grpc
    or a socket the router cannot open: the gRPC Steps stream. The same tokens every way."""
    monkeypatch.setenv(STEP_STREAM_ENV, {"switched off": "0", "grpc": "grpc"}.get(mode, "1"))

    async def main():
        service, server, client = await served(lm, tmp_path, NoStepsService if mode == "not served" else
                                               TextGenerationService, step_socket=mode != "not served")
        try:
            if mode == "unreachable":
                Path(service.step_socket).unlink()  # a rank whose socket the router cannot open
            assert await client.open_steps() == (transport != "unary calls")
            assert client.step_transport == transport
            assert len(await run_to_end(client, 1)) == 5
        finally:
            await stop(service, server, client)

    asyncio.run(main())


def test_a_bad_step_transport_setting_is_refused_by_name(lm, tmp_path, monkeypatch):
    monkeypatch.setenv(STEP_STREAM_ENV, "sometimes")

    async def main():
        service, server, client = await served(lm, tmp_path, step_socket=True)
        try:
            with pytest.raises(ValueError, match="TGS_STEP_STREAM='sometimes'"):
                await client.open_steps()
        finally:
            await stop(service, server, client)

    asyncio.run(main())


class _Transport:
    def __init__(self):
        self.aborted = False

    def abort(self):
        self.aborted = True


@pytest.mark.parametrize("cut", [1, 2, 3, 5, 7, 1000])
def test_frames_are_cut_out_of_any_split_of_the_byte_stream(cut):
    payloads = [b"", b"a", b"hello" * 300, bytes(range(256)) * 3]
    wire = b"".join(frame(p) for p in payloads)
    got, lost = [], []
    protocol = FrameProtocol(got.append, lost.append)
    protocol.connection_made(_Transport())
    for start in range(0, len(wire), cut):
        protocol.data_received(wire[start:start + cut])
    assert got == payloads and not lost
    protocol.data_received(frame(b"xyz")[:HEADER_BYTES + 1])  # a frame cut short by the peer's close
    protocol.connection_lost(None)
    assert len(lost) == 1 and isinstance(lost[0], ConnectionError) and "middle" in str(lost[0])


def test_a_frame_over_the_limit_is_refused_on_both_sides():
    with pytest.raises(FrameError, match="over the"):
        frame(b"x" * (MAX_FRAME_BYTES + 1))
    got, lost = [], []
    protocol = FrameProtocol(got.append, lost.append)
    transport = _Transport()
    protocol.connection_made(transport)
    protocol.data_received((MAX_FRAME_BYTES + 1).to_bytes(4, "little") + b"abc")
    assert transport.aborted and not got
    assert len(lost) == 1 and isinstance(lost[0], FrameError) and "announces" in str(lost[0])
    protocol.connection_lost(None)
    assert len(lost) == 1  # reported once
