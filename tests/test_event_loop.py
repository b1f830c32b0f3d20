"""utils/event_loop.py: uvloop under the launcher, router and ranks, asyncio's loop on request."""

from __future__ import annotations

import asyncio
import sys

import pytest

from text_generation_server.utils import event_loop


async def _loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop is a dependency on Linux and macOS only")
def test_uvloop_runs_by_default(monkeypatch):
    monkeypatch.delenv(event_loop.UVLOOP_ENV, raising=False)
    assert event_loop.run(_loop_module()).startswith("uvloop")


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_the_switch_keeps_asyncio_own_loop(monkeypatch, value):
    monkeypatch.setenv(event_loop.UVLOOP_ENV, value)
    assert event_loop.loop_factory() is None
    assert event_loop.run(_loop_module()).startswith("asyncio")


def test_grpc_aio_serves_on_the_chosen_loop(monkeypatch):
    """The servers run grpc.aio on this loop: one unary call there and back over a real socket."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    monkeypatch.delenv(event_loop.UVLOOP_ENV, raising=False)

    async def main() -> int:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                return reply.status
        finally:
            await server.stop(None)

    assert event_loop.run(main()) == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.skipif(sys.platform == "win32", reason="uvloop is a dependency on Linux and macOS only")
def test_a_value_that_is_no_switch_is_named_and_uvloop_stays(monkeypatch):
    from loguru import logger

    said: list[str] = []
    sink = logger.add(said.append, level="WARNING", format="{message}")
    try:
        monkeypatch.setenv(event_loop.UVLOOP_ENV, "maybe")
        assert event_loop.loop_factory() is not None
    finally:
        logger.remove(sink)
    assert any("TGS_UVLOOP='maybe'" in line for line in said), said
