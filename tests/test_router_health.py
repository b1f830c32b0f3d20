"""The router's grpc.health.v1 (Check, Watch, List), reflection v1 and v1alpha, and the shard
health monitor against fake shards: real gRPC servers on unix sockets whose Health answers,
fails or hangs on demand.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import pytest
import reflection_v1_client as v1
from grpc_health.v1 import health_pb2, health_pb2_grpc
from loguru import logger

from text_generation_server.router.metrics import Metrics
from text_generation_server.pb.generate.v3 import generate_pb2 as spb
from text_generation_server.pb.generate.v3 import generate_pb2_grpc as spb_grpc
from text_generation_server.router.main import SERVICE_NAME
from text_generation_server.router.client import ShardClient
from text_generation_server.router.health import (
    HEALTH_SERVICE_NAME, NOT_SERVING, SERVING, RouterHealth, ShardHealthMonitor,
)
from text_generation_server.router.reflection import enable_reflection
from text_generation_server.router.service import MalformedRequestInterceptor


# -- fake shards ----------------------------------------------------------------------------------------
class FakeShard(spb_grpc.TextGenerationServiceServicer):
    """generate.v3 Health and Info only; `mode` says how Health behaves."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] = ()):
        self.mode = "ok"  # "ok" | "hang" | "fail"
        self.metadata = metadata
        self.calls = 0

    async def Health(self, request, context):
        self.calls += 1
        if self.mode == "hang":
            await asyncio.sleep(3600)  # a rank stuck in a collective never answers
        if self.mode == "fail":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "model call running for 400 s")
        return spb.HealthResponse()

    async def Info(self, request, context):
        if self.metadata:
            context.set_trailing_metadata(self.metadata)
        return spb.InfoResponse(dtype="float32", device_type="cpu", block_size=16, support_chunking=True)


async def start_shards(tmp_path: Path, shards: list[FakeShard]) -> tuple[list[grpc.aio.Server], list[str]]:
    servers, urls = [], []
    for rank, shard in enumerate(shards):
        server = grpc.aio.server()
        spb_grpc.add_TextGenerationServiceServicer_to_server(shard, server)
        url = f"unix://{tmp_path}/shard-{rank}"
        assert server.add_insecure_port(url)
        await server.start()
        servers.append(server)
        urls.append(url)
    return servers, urls


class LogLines:
    def __init__(self):
        self.lines: list[str] = []
        self._id = logger.add(lambda m: self.lines.append(str(m)), level="INFO", format="{level} {message}")

    def close(self):
        logger.remove(self._id)


# -- the monitor -----------------------------------------------------------------------------------------
def test_a_hung_rank_turns_health_not_serving_and_back(tmp_path):
    async def main():
        shards = [FakeShard(), FakeShard()]
        servers, urls = await start_shards(tmp_path, shards)
        client, metrics, health = ShardClient(urls), Metrics(), RouterHealth(["", SERVICE_NAME])
        monitor = ShardHealthMonitor(client, health, metrics, interval_s=0.05, timeout_s=0.3)
        logs = LogLines()
        try:
            await health.update(started=True)
            assert await monitor.check_once() == {}
            assert health.status("") == health.status(SERVICE_NAME) == SERVING
            assert metrics.shards_healthy._value.get() == 1

            shards[1].mode = "hang"
            failing = await monitor.check_once()
            assert list(failing) == [1] and "no Health answer within 0.3 s" in failing[1]
            assert health.status("") == health.status(SERVICE_NAME) == NOT_SERVING
            assert metrics.shards_healthy._value.get() == 0
            assert any("ERROR" in line and "shard rank 1" in line and urls[1] in line for line in logs.lines), logs.lines

            shards[1].mode = "ok"
            assert await monitor.check_once() == {}
            assert health.status("") == health.status(SERVICE_NAME) == SERVING
            assert metrics.shards_healthy._value.get() == 1
            assert any("every shard answers Health again" in line for line in logs.lines)

            # A failed Health (the shard's own stall check) counts like silence, with its reason.
            shards[0].mode = "fail"
            failing = await monitor.check_once()
            assert list(failing) == [0] and "UNAVAILABLE model call running for 400 s" in failing[0]
            assert health.status("") == NOT_SERVING

            # Draining wins: shards recovering during a drain do not make the router SERVING again.
            await health.update(draining=True)
            shards[0].mode = "ok"
            assert await monitor.check_once() == {}
            assert health.status("") == health.status(SERVICE_NAME) == NOT_SERVING
            assert metrics.shards_healthy._value.get() == 1
        finally:
            logs.close()
            await client.close()
            for s in servers:
                await s.stop(None)

    asyncio.run(main())


def test_the_monitor_loop_notices_a_hang_within_interval_plus_deadline(tmp_path):
    async def main():
        shards = [FakeShard()]
        servers, urls = await start_shards(tmp_path, shards)
        client, metrics, health = ShardClient(urls), Metrics(), RouterHealth([""])
        monitor = ShardHealthMonitor(client, health, metrics, interval_s=0.1, timeout_s=0.2)
        await health.update(started=True)
        monitor.start()
        try:
            async def until(status, within_s):
                loop = asyncio.get_running_loop()
                deadline = loop.time() + within_s
                while health.status("") != status:
                    assert loop.time() < deadline, f"health never became {status}"
                    await asyncio.sleep(0.01)

            await until(SERVING, 2.0)
            shards[0].mode = "hang"
            started = asyncio.get_running_loop().time()
            await until(NOT_SERVING, 2.0)
            assert asyncio.get_running_loop().time() - started < 0.1 + 0.2 + 0.5
            shards[0].mode = "ok"
            await until(SERVING, 2.0)
            assert shards[0].calls >= 2  # the hung call, then the one that answered
        finally:
            await monitor.stop()
            await client.close()
            for s in servers:
                await s.stop(None)

    asyncio.run(main())


def test_monitor_rejects_nonpositive_timings():
    async def main():
        client = ShardClient(["unix:///nonexistent"])
        with pytest.raises(ValueError, match="must be > 0"):
            ShardHealthMonitor(client, RouterHealth([""]), Metrics(), interval_s=0)
        await client.close()

    asyncio.run(main())


def test_client_reads_attention_backend_from_info_metadata(tmp_path):
    async def main():
        shards = [FakeShard(metadata=(("tgs-attention", "paged"), ("tgs-kernels", "dense"))),
                  FakeShard(metadata=(("tgs-attention", "paged"),))]
        servers, urls = await start_shards(tmp_path, shards)
        (tmp_path / "bare").mkdir()
        bare_servers, bare_urls = await start_shards(tmp_path / "bare", [FakeShard()])
        try:
            client, bare = ShardClient(urls), ShardClient(bare_urls)
            assert await client.attention_backend() == "paged"
            assert await client.kernels() == ["dense"]
            assert await bare.attention_backend() == ""  # a TGI shard says nothing
            info = await client.info()
            assert info.support_chunking and not info.use_prefix_caching
            await client.close()
            await bare.close()
        finally:
            for s in servers + bare_servers:
                await s.stop(None)

    asyncio.run(main())


# -- health and reflection services on a real server -------------------------------------------------------
class RouterLikeServer:
    """The router's health and reflection services on a loopback port, its loop on a thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.health, self.server, self.port = self.call(self._start())

    async def _start(self):
        server = grpc.aio.server(interceptors=[MalformedRequestInterceptor()])
        health = RouterHealth(["", SERVICE_NAME])
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        enable_reflection(server, [SERVICE_NAME, HEALTH_SERVICE_NAME])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return health, server, port

    def call(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.call(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.fixture
def router_like():
    server = RouterLikeServer()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield server, channel
    channel.close()
    server.close()


def test_health_list_check_and_watch(router_like):
    server, channel = router_like
    stub = health_pb2_grpc.HealthStub(channel)
    listed = stub.List(health_pb2.HealthListRequest(), timeout=10)
    assert {k: v.status for k, v in listed.statuses.items()} == {"": NOT_SERVING, SERVICE_NAME: NOT_SERVING}

    watch = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=10)
    assert next(watch).status == NOT_SERVING
    server.call(server.health.update(started=True))
    assert next(watch).status == SERVING
    listed = stub.List(health_pb2.HealthListRequest(), timeout=10)
    assert {k: v.status for k, v in listed.statuses.items()} == {"": SERVING, SERVICE_NAME: SERVING}
    assert stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status == SERVING

    server.call(server.health.update(shards_healthy=False))
    assert next(watch).status == NOT_SERVING
    watch.cancel()
    with pytest.raises(grpc.RpcError) as info:
        stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND and "no.such.Service" in info.value.details()
    unknown = stub.Watch(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert next(unknown).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
    unknown.cancel()


def test_reflection_v1_and_v1alpha(router_like):
    _, channel = router_like
    v1.check_reflection(channel)
