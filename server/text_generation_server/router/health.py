"""grpc.health.v1 for the router, and the shard checks that drive it.

The router reports SERVING only while it is started, not draining, and every shard
answers its Health RPC in time. A rank stuck in a collective (a hung NCCL/gloo peer)
leaves the router's own event loop perfectly alive, so without asking the shards the
health service would keep saying SERVING while every request hangs; the monitor asks
every rank every few seconds with a deadline and turns the service NOT_SERVING (naming
the rank) until all of them answer again.
"""

from __future__ import annotations

import asyncio
from typing import Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from loguru import logger

from text_generation_server.router.metrics import Metrics
from text_generation_server.router.client import ShardClient

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class RouterHealth(health_pb2_grpc.HealthServicer):
    """Check, Watch and List over a fixed set of services that share one status.

    The status is derived, never set directly: SERVING iff started, not draining and
    the shards healthy, so a shard recovering during a drain cannot flip it back.
    """

    def __init__(self, services: Iterable[str]):
        self._status = {name: NOT_SERVING for name in services}
        self._changed = asyncio.Condition()
        self.started = False
        self.draining = False
        self.shards_healthy = True

    def status(self, service: str = "") -> int | None:
        return self._status.get(service)

    async def update(self, *, started: bool | None = None, draining: bool | None = None,
                     shards_healthy: bool | None = None) -> None:
        if started is not None:
            self.started = started
        if draining is not None:
            self.draining = draining
        if shards_healthy is not None:
            self.shards_healthy = shards_healthy
        status = SERVING if self.started and not self.draining and self.shards_healthy else NOT_SERVING
        async with self._changed:
            for name in self._status:
                self._status[name] = status
            self._changed.notify_all()

    async def Check(self, request, context):
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request, context):
        last = None
        while True:
            async with self._changed:
                status = self._status.get(request.service, SERVICE_UNKNOWN)
                if status == last:
                    await self._changed.wait()
                    continue
            yield health_pb2.HealthCheckResponse(status=status)
            last = status

    async def List(self, request, context):
        response = health_pb2.HealthListResponse()
        for name, status in self._status.items():
            response.statuses[name].status = status
        return response


class ShardHealthMonitor:
    """Calls every shard's Health every interval_s with a timeout_s deadline."""

    def __init__(self, client: ShardClient, health: RouterHealth, metrics: Metrics, interval_s: float = 5.0,
                 timeout_s: float = 5.0):
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError(f"shard health interval ({interval_s} s) and deadline ({timeout_s} s) must be > 0")
        self.client = client
        self.health = health
        self.metrics = metrics
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failing: dict[int, str] = {}  # rank -> why, from the last check
        self._task: asyncio.Task | None = None
        metrics.shards_healthy.set(1)

    def _reason(self, error: BaseException) -> str:
        if isinstance(error, grpc.aio.AioRpcError):
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"no Health answer within {self.timeout_s:g} s (stuck in a collective or overloaded?)"
            return f"Health failed: {error.code().name} {error.details()}"
        return f"Health failed: {type(error).__name__}: {error}"

    async def check_once(self) -> dict[int, str]:
        """One round over every rank; updates the health service and gauge; returns rank -> reason."""
        results = await self.client.health_by_rank(self.timeout_s)
        failing = {rank: self._reason(err) for rank, err in enumerate(results) if err is not None}
        if failing != self.failing:
            if failing:
                for rank, why in sorted(failing.items()):
                    logger.error("shard rank {} ({}): {}; health is NOT_SERVING", rank, self.client.urls[rank], why)
            else:
                logger.info("every shard answers Health again")
        self.failing = failing
        self.metrics.shards_healthy.set(0 if failing else 1)
        await self.health.update(shards_healthy=not failing)
        return failing

    async def _run(self) -> None:
        while True:
            try:
                await self.check_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # the monitor must outlive any surprise; the next round retries
                logger.exception("shard health check failed unexpectedly")
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="shard-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
