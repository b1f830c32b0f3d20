"""Queue, admission, KV block allocation and continuous batching.

One task drives the shards: it prefills a batch of queued requests, then
decodes it step by step; between steps it admits new requests (prefilled as a
new batch and concatenated into the running one), and removes requests that
finished or whose client went away, freeing their KV blocks at once. Blocks are
the router's to hand out (TGI v3): a request is admitted only when blocks for
its input plus max_new_tokens are free, so a running request never runs out.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import grpc
from loguru import logger

from text_generation_server.metrics import CONCAT_REASON, FINISH_REASONS, Metrics
from text_generation_server.pb.generate.v3 import generate_pb2 as spb
from text_generation_server.router.client import ShardClient
from text_generation_server.router.validation import ValidRequest


class RouterBlockPool:
    """The KV blocks of all shards (same layout on every rank). Block 0 is reserved."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = deque(range(1, num_blocks))

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return (tokens + self.block_size - 1) // self.block_size

    def allocate(self, tokens: int) -> tuple[list[int], list[int]] | None:
        count = self.blocks_for(tokens)
        if count > len(self._free):
            return None
        blocks = [self._free.popleft() for _ in range(count)]
        bs = self.block_size
        slots = [b * bs + o for b in blocks for o in range(bs)][:tokens]
        return blocks, slots

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


@dataclass
class Entry:
    """One request's journey through the router."""

    id: int
    request: ValidRequest
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.monotonic)
    admitted: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    blocks: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    cancelled: bool = False
    done: bool = False

    @property
    def total_tokens(self) -> int:
        return self.request.input_length + self.request.max_new_tokens


class StepFailed(Exception):
    """A prefill/decode failed on a shard; its requests end with this status."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class SchedulerLimits:
    max_batch_prefill_tokens: int
    max_batch_size: int | None
    max_concurrent_requests: int


class Scheduler:
    def __init__(self, client: ShardClient, pool: RouterBlockPool, limits: SchedulerLimits, metrics: Metrics):
        self.client = client
        self.pool = pool
        self.limits = limits
        self.metrics = metrics
        self.queue: deque[Entry] = deque()
        self.running: dict[int, Entry] = {}
        self._ids = itertools.count()
        self._batch_ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._inflight = 0
        self._task: asyncio.Task | None = None
        self.admitting = True
        metrics.set_kv_blocks(pool.used, pool.free)

    # -- the client-facing side --------------------------------------------------------
    @property
    def inflight(self) -> int:
        return self._inflight

    def submit(self, request: ValidRequest) -> Entry:
        """Queues a validated request. Raises StepFailed when the server cannot take it."""
        if not self.admitting:
            raise StepFailed(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if self._inflight >= self.limits.max_concurrent_requests:
            raise StepFailed(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the server is at max_concurrent_requests ({self.limits.max_concurrent_requests}); retry later",
            )
        if self.pool.blocks_for(request.input_length + request.max_new_tokens) > self.pool.num_blocks - 1:
            raise StepFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, "the request does not fit in the KV cache")
        entry = Entry(id=next(self._ids), request=request)
        self._inflight += 1
        self.queue.append(entry)
        self.metrics.queue_size.set(len(self.queue))
        self._wake.set()
        return entry

    def cancel(self, entry: Entry) -> None:
        """The client went away: drop it from the queue now, or from the batch after this step."""
        if entry.done or entry.cancelled:
            return
        entry.cancelled = True
        self.metrics.request_cancelled.inc()
        self.metrics.request_failure.labels(err="dropped").inc()  # TGI's name for a client gone away
        if entry in self.queue:
            self.queue.remove(entry)
            self.metrics.queue_size.set(len(self.queue))
            self._finish(entry)
        self._wake.set()

    def _finish(self, entry: Entry) -> None:
        if entry.done:
            return
        entry.done = True
        self._inflight -= 1
        if entry.blocks:
            self.pool.release(entry.blocks)
            entry.blocks = []
        # All gauges at once (callers take the entry out of `running` first): a scrape between
        # here and the end of the step must not see its blocks freed but its batch slot held.
        self._refresh_gauges()

    def _fail(self, entry: Entry, code: grpc.StatusCode, message: str, reason: str) -> None:
        if not entry.done:
            self.metrics.request_failure.labels(err=reason).inc()
            entry.events.put_nowait(StepFailed(code, message))
            self._finish(entry)

    # -- the loop -----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for entry in list(self.queue) + list(self.running.values()):
            self._fail(entry, grpc.StatusCode.UNAVAILABLE, "the server stopped", "shutdown")
        self.queue.clear()
        self.running.clear()

    def _admit(self, running: int) -> list[Entry]:
        """Takes queued requests in order while the prefill budget, batch size and KV blocks allow."""
        taken: list[Entry] = []
        prefill_tokens = 0
        while self.queue:
            entry = self.queue[0]
            if self.limits.max_batch_size is not None and running + len(taken) >= self.limits.max_batch_size:
                break
            if taken and prefill_tokens + entry.request.input_length > self.limits.max_batch_prefill_tokens:
                break
            allocation = self.pool.allocate(entry.total_tokens)
            if allocation is None:
                break  # wait for running requests to free blocks; keep FIFO order
            self.queue.popleft()
            entry.blocks, entry.slots = allocation
            entry.admitted = time.monotonic()
            self.metrics.request_queue_duration.observe(entry.admitted - entry.arrived)
            prefill_tokens += entry.request.input_length
            taken.append(entry)
        self.metrics.queue_size.set(len(self.queue))
        self.metrics.set_kv_blocks(self.pool.used, self.pool.free)
        return taken

    async def _run(self) -> None:
        cached: spb.CachedBatch | None = None
        while True:
            if cached is None:
                await self._wake.wait()
                self._wake.clear()
            try:
                cached = await self._step(cached)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never let one bad step stop the server
                logger.exception("scheduler step failed")
                for entry in list(self.running.values()):
                    self.running.pop(entry.id, None)
                    self._fail(entry, grpc.StatusCode.INTERNAL, f"internal error: {exc}", "internal")
                try:
                    await self.client.clear_cache()
                except grpc.aio.AioRpcError:
                    pass
                cached = None

    async def _step(self, cached: spb.CachedBatch | None) -> spb.CachedBatch | None:
        """Admits what fits (prefilled as a new batch), then decodes everything running once."""
        batches: list[spb.CachedBatch] = [cached] if cached is not None else []
        new = self._admit(len(self.running))
        if new and batches:
            self.metrics.batch_concat.labels(reason=CONCAT_REASON).inc()
        if new:
            new_cached = await self._prefill(new)
            if new_cached is not None:
                batches.append(new_cached)
        if not batches:
            if self.queue:
                self._wake.set()
            return None
        return await self._decode(batches)

    async def _prefill(self, entries: list[Entry]) -> spb.CachedBatch | None:
        batch_id = next(self._batch_ids)
        requests = [e.request.to_shard(e.id, e.blocks, e.slots) for e in entries]
        for e in entries:
            self.running[e.id] = e
        batch = spb.Batch(
            id=batch_id, requests=requests, size=len(requests),
            max_tokens=sum(e.total_tokens for e in entries),
            max_blocks=max(len(e.blocks) for e in entries),
        )
        self.metrics.batch_next_size.observe(len(entries))
        self.metrics.batch_inference_count.labels(method="prefill").inc()
        start = time.monotonic()
        try:
            resp = await self.client.prefill(batch)
        except grpc.aio.AioRpcError as exc:
            await self._step_failed("prefill", [batch_id], entries, exc)
            return None
        self.metrics.prompt_tokens.inc(sum(e.request.input_length for e in entries))
        filtering = time.monotonic()
        cached = await self._dispatch(resp, entries_of_batch=entries)
        self._observe("prefill", start, filtering, resp)
        return cached

    async def _decode(self, batches: list[spb.CachedBatch]) -> spb.CachedBatch | None:
        entries = [self.running[i] for b in batches for i in b.request_ids if i in self.running]
        self.metrics.batch_inference_count.labels(method="decode").inc()
        start = time.monotonic()
        try:
            resp = await self.client.decode(batches)
        except grpc.aio.AioRpcError as exc:
            await self._step_failed("decode", [b.id for b in batches], entries, exc)
            return None
        filtering = time.monotonic()
        cached = await self._dispatch(resp, entries_of_batch=entries)
        self._observe("decode", start, filtering, resp)
        return cached

    def _observe(self, method: str, start: float, filtering: float, resp) -> None:
        """A successful step, timed as TGI does: inference = call + filtering, filter = after the call."""
        m = self.metrics
        now = time.monotonic()
        m.batch_inference_duration.labels(method=method).observe(now - start)
        m.batch_filter_duration.labels(method=method).observe(now - filtering)
        m.batch_forward_duration.labels(method=method).observe(resp.forward_ns / 1e9)
        m.batch_decode_duration.labels(method=method).observe(resp.decode_ns / 1e9)
        if resp.HasField("concat_ns"):  # TGI labels every concatenation "decode", prefill-time ones too
            m.batch_concat_duration.labels(method="decode").observe(resp.concat_ns / 1e9)
        m.batch_inference_success.labels(method=method).inc()

    async def _step_failed(self, method: str, batch_ids: list[int], entries: list[Entry], exc) -> None:
        """A failing step fails its requests; the rest of the server keeps serving."""
        self.metrics.batch_inference_failure.labels(method=method).inc()
        code = exc.code()
        message = f"{method} failed: {exc.details()}"
        logger.error("{} of batches {} failed: {} {}", method, batch_ids, code.name, exc.details())
        for entry in entries:
            self.running.pop(entry.id, None)
            self._fail(entry, grpc.StatusCode.INTERNAL if code != grpc.StatusCode.INVALID_ARGUMENT else code,
                       message, method)
        self._refresh_gauges()  # before the awaits below, so /metrics never shows the failed batch as running
        for bid in batch_ids:
            try:
                await self.client.clear_cache(bid)
            except grpc.aio.AioRpcError:
                pass

    async def _dispatch(self, resp, entries_of_batch: list[Entry]) -> spb.CachedBatch | None:
        now = time.monotonic()
        generated = 0
        for gen in resp.generations:
            entry = self.running.get(gen.request_id)
            if entry is None or entry.done:
                continue
            generated += len(gen.tokens.ids)
            self.metrics.request_skipped_tokens.observe(max(len(gen.tokens.ids) - 1, 0))
            if entry.last_token is None:
                entry.first_token = now
                self.metrics.time_to_first_token.observe(now - entry.arrived)
            else:
                self.metrics.inter_token_latency.observe(now - entry.last_token)
            entry.last_token = now
            if not entry.cancelled:
                entry.events.put_nowait(gen)
            if gen.HasField("generated_text"):
                self.running.pop(entry.id, None)
                self._record_success(entry, gen, now)
                self._finish(entry)
        self.metrics.generation_tokens.inc(generated)
        for entry in entries_of_batch:
            if entry.cancelled and not entry.done:
                self.running.pop(entry.id, None)
                self._finish(entry)
        batch = resp.batch if resp.HasField("batch") else None
        if batch is None:
            self._refresh_gauges()
            return None
        keep = [i for i in batch.request_ids if i in self.running]
        if len(keep) != len(batch.request_ids):
            if keep:
                batch = await self.client.filter_batch(batch.id, keep)
            else:
                await self.client.clear_cache(batch.id)
                batch = None
        self._refresh_gauges()
        return batch

    def _refresh_gauges(self) -> None:
        m = self.metrics
        m.batch_current_size.set(len(self.running))
        m.batch_current_max_tokens.set(sum(e.total_tokens for e in self.running.values()))
        m.set_kv_blocks(self.pool.used, self.pool.free)

    def _record_success(self, entry: Entry, gen, now: float) -> None:
        m = self.metrics
        generated = gen.generated_text.generated_tokens
        m.request_success.labels(finish_reason=FINISH_REASONS.get(gen.generated_text.finish_reason, "unknown")).inc()
        m.request_duration.observe(now - entry.arrived)
        if entry.admitted is not None:
            m.request_inference_duration.observe(now - entry.admitted)
            if generated:
                m.mean_time_per_token.observe((now - entry.admitted) / generated)
            if entry.first_token is not None:
                m.request_prefill_duration.observe(entry.first_token - entry.admitted)
                m.request_decode_duration.observe(now - entry.first_token)
        m.generated_tokens.observe(generated)
