"""`serve --shard-in-process`: the one rank's model inside the launcher's process, driven by the
router through direct calls of the shard service instead of gRPC over a unix socket.

Why: with a short forward the router-to-rank hop is a large part of a decode step's host time.
With the model replaced by canned logits (benchmarks/host_overhead.py --compare-server-args=
--shard-in-process, BENCHMARKS.md "The rank inside the router's process"), a batch-1 step took
0.52 ms in one process against 1.07 ms over the rank's gRPC stream. At batch 8 and 64 it gained
nothing: the client API's per-message gRPC work paces those steps, and in one process the
router's event loop and the model thread's Python share the GIL, so decode ahead overlaps less.
What the hop costs is the Python gRPC machinery on both sides, protobuf encoding and decoding,
and the thread hops in and out of the rank's event loop; what two processes buy is two cores for
that host work, and a launcher that survives its rank long enough to say how it died (an OOM
kill, say). A rank serves the same service either way: the messages, the step logic, decode
ahead, warmup and the kernels are the same code.

Only one rank: tensor-parallel ranks each need their own process (`ServeArgs.validate` refuses
--shard-in-process with --num-shard > 1 and with --shard-only).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Awaitable

import grpc

from text_generation_server.pb.generate.v3 import generate_pb2 as pb

if TYPE_CHECKING:
    from text_generation_server.engine.causal_lm import CausalLM
    from text_generation_server.settings.serve_args import ServeArgs
    from text_generation_server.shard.service import TextGenerationService

IN_PROCESS_URL = "in-process"  # what the router's logs and Info.num_shard count


class _Context:
    """What the shard service's handlers use of a gRPC servicer context: an abort becomes the
    AioRpcError a gRPC call would have raised in the router, trailing metadata is kept."""

    def __init__(self) -> None:
        self.trailing: tuple[tuple[str, str], ...] = ()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)


class LocalShardClient:
    """The router's ShardClient calls, answered by the shard service in this process."""

    def __init__(self, service: TextGenerationService):
        self.service = service
        self.urls = [IN_PROCESS_URL]

    @property
    def streaming(self) -> bool:
        return False

    async def _call(self, method: str, request) -> Any:
        return await getattr(self.service, method)(request, _Context())

    async def open_steps(self) -> bool:
        """No stream to open: every call is a direct one."""
        return False

    async def close(self) -> None:
        self.service.close()

    async def info(self) -> pb.InfoResponse:
        return await self._call("Info", pb.InfoRequest())

    async def _info_metadata(self, key: str) -> list[str]:
        ctx = _Context()
        await self.service.Info(pb.InfoRequest(), ctx)
        return [v for k, value in ctx.trailing if k == key and value for v in value.split(",")]

    async def kernels(self) -> list[str]:
        from text_generation_server.shard.service import KERNELS_METADATA

        return sorted(set(await self._info_metadata(KERNELS_METADATA)))

    async def attention_backend(self) -> str:
        from text_generation_server.shard.service import ATTENTION_METADATA

        return ",".join(sorted(set(await self._info_metadata(ATTENTION_METADATA))))

    async def model_impl(self) -> str:
        from text_generation_server.shard.service import MODEL_IMPL_METADATA

        return ",".join(sorted(set(await self._info_metadata(MODEL_IMPL_METADATA))))

    async def health(self, timeout: float = 5.0) -> None:
        await _within(self._call("Health", pb.HealthRequest()), timeout)

    async def health_by_rank(self, timeout: float) -> list[BaseException | None]:
        try:
            await self.health(timeout)
        except grpc.aio.AioRpcError as exc:
            return [exc]
        return [None]

    async def clear_cache(self, batch_id: int | None = None) -> None:
        await self._call("ClearCache", pb.ClearCacheRequest() if batch_id is None else pb.ClearCacheRequest(id=batch_id))

    async def warmup(self, request: pb.WarmupRequest) -> pb.WarmupResponse:
        return await self._call("Warmup", request)

    async def prefill(self, batch: pb.Batch, cached: pb.CachedBatch | None = None) -> pb.PrefillResponse:
        from text_generation_server.router.client import ShardClient

        return await self._chained(self.service._prefill, ShardClient.prefill_request(batch, cached))

    async def decode(self, batches: list[pb.CachedBatch]) -> pb.DecodeResponse:
        return await self._chained(self.service._decode, pb.DecodeRequest(batches=batches))

    async def _chained(self, handler, request) -> Any:
        """A Prefill or Decode as the Steps stream runs it: its step may be followed by a chain of
        steps ahead (shard/service.py), which the next call takes."""
        return await self.service._unary(_Context(), handler(request, chain=self.service.ahead_steps))

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> pb.CachedBatch | None:
        resp = await self._call("FilterBatch", pb.FilterBatchRequest(batch_id=batch_id, request_ids=request_ids))
        return resp.batch if resp.HasField("batch") else None

    async def load_adapter(self, name: str, path: str) -> pb.AdapterInfo:
        return (await self._call("LoadAdapter", pb.LoadAdapterRequest(name=name, path=path))).adapter

    async def unload_adapter(self, name: str, missing_ok: bool = False) -> None:
        try:
            await self._call("UnloadAdapter", pb.UnloadAdapterRequest(name=name))
        except grpc.aio.AioRpcError as exc:
            if not (missing_ok and exc.code() == grpc.StatusCode.NOT_FOUND):
                raise


def local_client(model: CausalLM, args: ServeArgs, memory_fraction: float) -> LocalShardClient:
    """The shard service over `model` with the settings serve_shard gives a rank process."""
    from text_generation_server.shard.service import TextGenerationService

    model.speculate = args.speculate
    service = TextGenerationService(model, args.uds_path, 1, memory_fraction, args.max_batch_total_tokens,
                                    args.prefix_caching, args.rank_stall_timeout_s, 0)
    return LocalShardClient(service)


async def _within(call: Awaitable, timeout: float) -> Any:
    """A call's answer, or DEADLINE_EXCEEDED as a gRPC call with that timeout would fail."""
    try:
        return await asyncio.wait_for(call, timeout)
    except asyncio.TimeoutError:
        raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                   details=f"no answer within {timeout:.1f} s") from None
