"""LoadAdapter, UnloadAdapter and ListAdapters: the router's side of loading LoRA adapters at run time.

A load is checked here (router/adapters.py: the opt-in, the name, the path inside
--lora-load-dir), then sent to every rank between two steps of the scheduler, so it never races
a Prefill or Decode; requests may name the adapter once every rank has it.

An unload drains: from its first moment new requests naming the adapter are refused (NOT_FOUND),
the ones queued or running finish as they would have, then every rank drops it, again between
steps. Refusing an unload while the adapter is busy would make a popular adapter impossible to
unload; cancelling its requests would fail clients that did nothing wrong. A drain that outlasts
`drain_timeout_s` (the server's --drain-timeout-s) gives up: DEADLINE_EXCEEDED, and the adapter
stays loaded and usable.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, TypeVar

import grpc
from loguru import logger

from text_generation_server.pb.generate.v3 import generate_pb2 as spb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.router.adapters import AdapterError, AdapterSet, LoadPolicy, check_name
from text_generation_server.router.metrics import Metrics
from text_generation_server.router.scheduler import Scheduler, StepFailed

DRAIN_POLL_S = 0.02
T = TypeVar("T")


async def _to_its_end(call: Awaitable[T]) -> T:
    """Awaits `call` in a task of its own that the caller's cancellation does not stop (its
    outcome, when no one waits for it any more, is retrieved so asyncio does not warn)."""
    task = asyncio.ensure_future(call)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return await asyncio.shield(task)


def client_info(info: spb.AdapterInfo) -> cpb.AdapterInfo:
    """A shard's AdapterInfo as the client API's (the same fields)."""
    return cpb.AdapterInfo(name=info.name, path=info.path, rank=info.rank,
                           target_modules=list(info.target_modules), alpha=info.alpha)


class AdapterAdmin:
    """The adapter calls of the client API, over the scheduler that serialises them with steps."""

    def __init__(self, scheduler: Scheduler, policy: LoadPolicy, metrics: Metrics, drain_timeout_s: float = 60.0):
        self.scheduler = scheduler
        self.policy = policy
        self.metrics = metrics
        self.drain_timeout_s = drain_timeout_s

    @property
    def adapters(self) -> AdapterSet:
        return self.scheduler.adapters

    async def load(self, name: str, path: str) -> cpb.AdapterInfo:
        """Loads the adapter on every rank; AdapterError with the status to answer otherwise. A
        caller that goes away does not stop it halfway (the ranks and the router would disagree
        about what is loaded): it runs to its end in a task of its own."""
        return await _to_its_end(self._load(name, path))

    async def unload(self, name: str) -> None:
        """Drains the adapter's requests, then unloads it from every rank (to its end, as load)."""
        await _to_its_end(self._unload(name))

    async def _load(self, name: str, path: str) -> cpb.AdapterInfo:
        self.policy.check_open()
        check_name(name, self.adapters.reserved)
        folder = await asyncio.to_thread(self.policy.resolve, path)
        self.adapters.reserve(name)
        info = None
        started = time.monotonic()
        try:
            shard_info = await self.scheduler.between_steps(
                lambda: self.scheduler.client.load_adapter(name, str(folder)))
            info = client_info(shard_info)
            info.name = name
        except grpc.aio.AioRpcError as exc:
            raise AdapterError(exc.code(), f"loading adapter {name!r} failed: {exc.details()}") from None
        except StepFailed as exc:
            raise AdapterError(exc.code, str(exc)) from None
        finally:
            self.adapters.settle(name, info)
        self.metrics.adapter_series(name)
        logger.info("adapter {} loaded from {} in {:.2f} s (rank {}, {})", name, folder, time.monotonic() - started,
                    info.rank, ", ".join(info.target_modules))
        return info

    async def _unload(self, name: str) -> None:
        self.policy.check_open()
        adapter = self.adapters.get(name)
        if adapter.draining:
            raise AdapterError(grpc.StatusCode.FAILED_PRECONDITION, f"adapter {name!r} is being unloaded already")
        adapter.draining = True
        try:
            deadline = time.monotonic() + self.drain_timeout_s
            waiting = self.scheduler.uses(name)
            if waiting:
                logger.info("adapter {}: unloading once its {} requests finish", name, waiting)
            while self.scheduler.uses(name):
                if time.monotonic() >= deadline:
                    raise AdapterError(
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"adapter {name!r} still has {self.scheduler.uses(name)} requests after "
                        f"{self.drain_timeout_s:g} s (--drain-timeout-s); it stays loaded")
                await asyncio.sleep(DRAIN_POLL_S)

            async def drop(retry: bool) -> None:
                busy = self.scheduler.uses(name)
                if busy:  # cannot happen while draining refuses newcomers; never unload under a request
                    raise AdapterError(grpc.StatusCode.FAILED_PRECONDITION,
                                       f"adapter {name!r} is in use by {busy} requests")
                await self.scheduler.client.unload_adapter(name, missing_ok=retry)

            retry = False
            while True:
                try:
                    await self.scheduler.between_steps(lambda: drop(retry))
                    break
                except grpc.aio.AioRpcError as exc:
                    # A rank may still hold a row of it a step longer than the router (a batch
                    # decoded ahead): it refuses, and the next attempt comes after another step.
                    if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or time.monotonic() >= deadline:
                        raise
                    retry = True
                    await asyncio.sleep(DRAIN_POLL_S)
        except grpc.aio.AioRpcError as exc:
            adapter.draining = False
            raise AdapterError(exc.code(), f"unloading adapter {name!r} failed: {exc.details()}") from None
        except StepFailed as exc:
            adapter.draining = False
            raise AdapterError(exc.code, str(exc)) from None
        except BaseException:
            adapter.draining = False
            raise
        self.adapters.remove(name)
        logger.info("adapter {} unloaded", name)

    def list(self) -> list[cpb.AdapterInfo]:
        return self.adapters.infos()
