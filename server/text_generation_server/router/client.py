"""Talks to every shard at once: the same call fans out, rank 0's answer comes back.

All ranks must run the same sequence of batches (their collectives pair up), so
every state-changing call goes to every shard and waits for all of them.
"""

from __future__ import annotations

import asyncio

import grpc

from text_generation_server.pb.generate.v3 import generate_pb2 as pb
from text_generation_server.pb.generate.v3 import generate_pb2_grpc as pb_grpc

_OPTIONS = [("grpc.max_send_message_length", 256 * 2**20), ("grpc.max_receive_message_length", 256 * 2**20)]


class ShardClient:
    def __init__(self, urls: list[str]):
        if not urls:
            raise ValueError("no shard urls")
        self.urls = urls
        self._channels = [grpc.aio.insecure_channel(u, options=_OPTIONS) for u in urls]
        self._stubs = [pb_grpc.TextGenerationServiceStub(c) for c in self._channels]

    @classmethod
    async def connect(cls, master_url: str, timeout_s: float = 60.0) -> "ShardClient":
        """Connects to rank 0 and discovers the other shards (ServiceDiscovery)."""
        channel = grpc.aio.insecure_channel(master_url, options=_OPTIONS)
        try:
            stub = pb_grpc.TextGenerationServiceStub(channel)
            resp = await stub.ServiceDiscovery(pb.ServiceDiscoveryRequest(), timeout=timeout_s, wait_for_ready=True)
        finally:
            await channel.close()
        return cls(list(resp.urls))

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self._channels), return_exceptions=True)

    async def _all(self, method: str, request, timeout: float | None = None):
        calls = [getattr(stub, method)(request, timeout=timeout) for stub in self._stubs]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    async def info(self) -> pb.InfoResponse:
        return (await self._all("Info", pb.InfoRequest()))[0]

    async def _info_metadata(self, key: str) -> list[str]:
        """The comma-separated values every rank puts under `key` in Info's trailing metadata."""
        values: list[str] = []
        for stub in self._stubs:
            call = stub.Info(pb.InfoRequest())
            await call
            for k, value in (await call.trailing_metadata()) or ():
                if k == key and value:
                    values.extend(value.split(","))
        return values

    async def kernels(self) -> list[str]:
        """Kernel names every rank reports (trailing metadata of Info; empty from a TGI shard)."""
        return sorted(set(await self._info_metadata("tgs-kernels")))

    async def attention_backend(self) -> str:
        """The attention implementation the ranks report (`tgs-attention`); "" when none says."""
        return ",".join(sorted(set(await self._info_metadata("tgs-attention"))))

    async def model_impl(self) -> str:
        """Which implementation the ranks run (`tgs-model-impl`); "" when none says."""
        return ",".join(sorted(set(await self._info_metadata("tgs-model-impl"))))

    async def health(self, timeout: float = 5.0) -> None:
        await self._all("Health", pb.HealthRequest(), timeout=timeout)

    async def health_by_rank(self, timeout: float) -> list[BaseException | None]:
        """Every rank's Health at once: None where it answered, else its error (DEADLINE_EXCEEDED...)."""
        calls = [stub.Health(pb.HealthRequest(), timeout=timeout) for stub in self._stubs]
        results = await asyncio.gather(*calls, return_exceptions=True)
        return [r if isinstance(r, BaseException) else None for r in results]

    async def clear_cache(self, batch_id: int | None = None) -> None:
        req = pb.ClearCacheRequest() if batch_id is None else pb.ClearCacheRequest(id=batch_id)
        await self._all("ClearCache", req)

    async def warmup(self, request: pb.WarmupRequest) -> pb.WarmupResponse:
        """Every shard warms up; the smallest capacity wins."""
        results = await self._all("Warmup", request)
        best = results[0]
        for r in results[1:]:
            if r.max_supported_total_tokens < best.max_supported_total_tokens:
                best = r
        return best

    @staticmethod
    def prefill_request(batch: pb.Batch, cached: pb.CachedBatch | None = None) -> pb.PrefillRequest:
        """Our router's Prefill: a request a shard refuses comes back as a Generation with `error`
        set, and the others go on (per_request_errors; a TGI shard ignores the field)."""
        request = pb.PrefillRequest(batch=batch, per_request_errors=True)
        if cached is not None:
            request.cached_batch.CopyFrom(cached)
        return request

    async def prefill(self, batch: pb.Batch, cached: pb.CachedBatch | None = None) -> pb.PrefillResponse:
        """Prefills `batch`; with `cached`, the same step decodes the running batch too (TGI v3)."""
        return self._merged(await self._all("Prefill", self.prefill_request(batch, cached)))

    async def decode(self, batches: list[pb.CachedBatch]) -> pb.DecodeResponse:
        return self._merged(await self._all("Decode", pb.DecodeRequest(batches=batches)))

    @staticmethod
    def _merged(results):
        """One step's answer: rank 0's batch, every rank's generations (each rank answers for its
        share of the requests, as TGI's shards do), the slowest rank's timings."""
        first = results[0]
        for other in results[1:]:
            first.generations.extend(other.generations)
            if other.total_ns > first.total_ns:
                first.forward_ns, first.decode_ns, first.total_ns = other.forward_ns, other.decode_ns, other.total_ns
        return first

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> pb.CachedBatch | None:
        resp = (await self._all("FilterBatch", pb.FilterBatchRequest(batch_id=batch_id, request_ids=request_ids)))[0]
        return resp.batch if resp.HasField("batch") else None
