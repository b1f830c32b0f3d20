"""Queue, admission, KV blocks, prefix caching, chunked prefill and continuous batching.

One task drives the shards, one call at a time. With shards that support chunking (ours, TGI
v3's): each step admits queued requests within the prefill budget left by the running batch
(max_batch_prefill_tokens - the tokens its next forward computes) and sends them with the
running batch in one Prefill (PrefillRequest.cached_batch): one forward gives every running
request its next token and computes the newcomers' prompts. A prompt longer than the budget
goes in with `chunk_len` set; the shard computes its later chunks within the same budget in
the following steps, interleaved with everyone's decode, so no stream stalls behind it. With
nothing to admit, the step is a Decode. Finished and cancelled requests are filtered out
between steps, their blocks released at once. With nothing to admit, the next Decode (behind a
FilterBatch when rows ended) goes out as soon as a step's answer arrives, before its tokens are
streamed to the clients (`_pipeline`; TGS_DECODE_PIPELINE=0 turns it off). With
TGS_DECODE_PIPELINE=auto it goes out after them while the router is the slower side (`RouterPace`),
and takes the steps the shard computed ahead meanwhile in one answer.

Blocks are the router's to hand out (TGI v3, `BlockPool`): a request is admitted only when
blocks for its input plus max_new_tokens (plus the shards' Info.speculate, as TGI's queue adds
it) are free (or evictable), so a running request never runs out. With prefix caching the
request's prompt is looked up first: the longest cached run of whole blocks is reused and only
the rest computed (`cache_len`). A request's blocks enter the cache when their K/V are known to
be computed: its prompt's blocks with its first token, and the generated ones when it finishes,
so a follow-up turn reuses the whole conversation.

Speculation (shards with Info.speculate > 0): a step may give a request several tokens in one
Generation; each is streamed to the client as a token of its own, and tgi_request_skipped_tokens
records how many a step gave beyond the first (TGI's histogram). Only accepted tokens ever reach
the router, so the K/V it registers in the prefix cache never holds a rejected guess.

LoRA adapters (router/adapters.py): a request names its adapter on the wire (Request.adapter_id)
and looks up the prefix cache under the adapter's key. Loading and unloading an adapter change
the shards' state, so they go through this loop too (`between_steps`): never while a Prefill or
Decode is in flight, and an unload only once no queued or running request uses the adapter
(`uses`).

Shards without chunking (requires a separate prefill and a prompt that fits the budget) are
driven the older way, with TGI's waiting_served_ratio and max_waiting_tokens deciding when a
new batch joins a running one.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable, TypeVar

import grpc
from loguru import logger

from text_generation_server.router.adapters import AdapterError, AdapterSet
from text_generation_server.router.metrics import FINISH_REASONS, Metrics, fast_observer
from text_generation_server.pb.generate.v3 import generate_pb2 as spb
from text_generation_server.router.block_pool import Allocation, BlockPool
from text_generation_server.router.client import ShardClient
from text_generation_server.router.validation import ValidRequest

T = TypeVar("T")


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
    allocation: Allocation | None = None
    first_chunk: int | None = None  # chunk_len of its first prefill when its prompt spans several forwards
    generated_ids: list[int] = field(default_factory=list)
    cancelled: bool = False
    done: bool = False

    @property
    def total_tokens(self) -> int:
        return self.request.input_length + self.request.max_new_tokens

    @property
    def chunked(self) -> bool:
        return self.first_chunk is not None

    @property
    def prompt_done(self) -> bool:
        return self.first_token is not None


def steps_in(generations) -> int:
    """Steps an answer holds: the most Generations one request has in it (1 for a plain step)."""
    if len(generations) < 2:
        return 1
    counts = Counter(g.request_id for g in generations)
    return max(counts.values())


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
    # Without chunking only (TGI's semantics): a running batch takes newcomers once the queue
    # holds waiting_served_ratio x its size, or after max_waiting_tokens steps without any.
    waiting_served_ratio: float = 1.2
    max_waiting_tokens: int = 20


PIPELINE_ENV = "TGS_DECODE_PIPELINE"  # 1: always ahead (default) | auto: RouterPace decides | 0: after the tokens
PIPELINE_MODES = {"auto": "auto", "": "on", "1": "on", "on": "on", "true": "on", "yes": "on",
                  "0": "off", "off": "off", "false": "off", "no": "off"}


def pipeline_mode(raw: str | None) -> str:
    """TGS_DECODE_PIPELINE as "on" (unset: the default), "auto" or "off"; another value is refused by name.
    `auto` is opt-in: on a quiet machine it measured level with always sending ahead (0.87-1.07x, BENCHMARKS.md
    issue #31 session 9), though busy runs of an earlier form found it 1.5-2.1x faster with no model time."""
    mode = PIPELINE_MODES.get((raw or "").strip().lower())
    if mode is None:
        raise ValueError(f"{PIPELINE_ENV}={raw!r}: expected auto, 1 or 0")
    return mode


class RouterPace:
    """Whether the router, not the shards, sets the pace of decoding, judged from consecutive decode
    answers: the wall time between them against the shards' own time for the steps they carry.

    Why: a Decode sent ahead (`Scheduler._pipeline`) reaches our shard while it computes the next step,
    and a call that waits ends the shard's chain of steps ahead (shard/service.py) after that one step.
    When the router is the slower side (many streams, a fast model), every Decode then carries one step
    and the router pays its per-call and per-message costs on each; sent after the tokens went out
    instead, it finds the steps the chain computed meanwhile and takes them in one answer. Measured
    (`host_overhead.py --compare-env TGS_DECODE_PIPELINE=0`, BENCHMARKS.md issue #31 session 9):
    without pipelining 0.68x the inter-token time at batch 64 and 0.89x at batch 8 with no model time,
    but 1.08x at batch 8 with a 1 ms forward. So: pipelining while the router keeps up; once the time
    between answers exceeds ENTER x the shards' step time, the Decode waits for the dispatch, until the
    answers stop carrying chains (under LEAVE steps each, smoothed: the router keeps up again, or the
    shards cannot chain, with several ranks), and pipelining resumes."""

    SMOOTHING = 0.3  # weight of the newest answer
    ENTER = 2.0  # wall time between answers / the shards' time for their steps
    LEAVE = 1.5  # steps per answer
    DWELL = 8  # answers in a mode before it may change again (a chain takes a few answers to form)

    def __init__(self) -> None:
        self.ratio: float | None = None
        self.steps: float | None = None
        self.router_bound = False
        self.answers = 0  # in the current mode

    def _smooth(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.SMOOTHING) * old + self.SMOOTHING * new

    def observe(self, wall_s: float, steps: int, shard_ns: int) -> bool:
        """One decode answer: the wall time since the answer before it, the steps it carries, and the
        shards' time for them (its total_ns). Returns whether the router is the slower side now."""
        if shard_ns <= 0 or wall_s <= 0:
            return self.router_bound  # a shard that reports no timings: nothing to compare
        self.ratio = self._smooth(self.ratio, wall_s / (shard_ns / 1e9))
        self.steps = self._smooth(self.steps, float(max(steps, 1)))
        self.answers += 1
        if self.answers < self.DWELL:
            return self.router_bound
        bound = self.steps >= self.LEAVE if self.router_bound else self.ratio > self.ENTER
        if bound != self.router_bound:
            self.router_bound = bound
            self.answers = 0
            self.steps = None  # the steps per answer of the new mode
            logger.debug("router pace: {} (the next Decode goes out {} the tokens are streamed)",
                         "router-bound" if bound else "shard-bound", "after" if bound else "before")
        return self.router_bound


@dataclass
class _InFlight:
    """A Decode sent before the step before it was dispatched (`Scheduler._pipeline`)."""

    call: asyncio.Future
    batch: spb.CachedBatch
    entries: list[Entry]
    start: float
    filtered: bool = False  # the call filters the finished rows out first: the step's dispatch must not


class Scheduler:
    RETRY_AFTER_FAILED_STEP_S = 0.05

    def __init__(self, client: ShardClient, pool: BlockPool, limits: SchedulerLimits, metrics: Metrics,
                 support_chunking: bool = True, speculate: int = 0, adapters: AdapterSet | None = None):
        """speculate: the shards' Info.speculate, the most tokens a step may propose per request.
        adapters: the LoRA adapters loaded on the shards (none by default)."""
        self.client = client
        self.adapters = adapters if adapters is not None else AdapterSet()
        self._between: deque[tuple[Callable[[], Awaitable], asyncio.Future]] = deque()
        self.speculate = speculate
        self.pool = pool
        self.limits = limits
        self.metrics = metrics
        self.support_chunking = support_chunking
        self.queue: deque[Entry] = deque()
        self.running: dict[int, Entry] = {}
        self._ids = itertools.count()
        self._batch_ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._inflight = 0
        self._task: asyncio.Task | None = None
        self._steps_without_admission = 0
        self._evictions_seen = 0
        self.admitting = True
        self._labelled: dict[str, tuple] = {}  # method -> its step metrics (_step_metrics)
        # Per-step and per-token metrics, looked up once (a labels() lookup takes a lock and hashes
        # the labels) and observed through fast_observer: host time on the router's loop otherwise.
        self._decode_calls = metrics.batch_inference_count.labels(method="decode")
        self._observe_skipped = fast_observer(metrics.request_skipped_tokens)
        self._observe_inter_token = fast_observer(metrics.inter_token_latency)
        self._gauges: tuple[int, ...] | None = None  # the values _refresh_gauges last set
        # A client that can write a Decode before returning (ShardClient.decode_now); the in-process
        # rank's client and the tests' have none: `_pipeline` runs their decode as a task.
        self._decode_now = getattr(client, "decode_now", None)
        # Pipelined decode: when a step's answer leaves a batch to continue and nobody waits to be
        # admitted, the next Decode (after a FilterBatch of the rows that step finished) goes out
        # before this step's tokens are streamed, so the shards compute while the router works.
        self.pipeline_mode = pipeline_mode(os.environ.get(PIPELINE_ENV))
        self.pipeline = self.pipeline_mode != "off"
        self._in_flight: _InFlight | None = None
        self.pipelined_steps = 0
        self.pace = RouterPace()  # pipelining pauses while the router is the slower side
        self.unpipelined_steps = 0  # answers whose next Decode waited for the dispatch (router-bound)
        self._last_answer: float | None = None  # when the last decode answer was dispatched (RouterPace)
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
        if self.pool.blocks_for(self._kv_tokens(request)) > self.pool.num_blocks - 1:
            raise StepFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, "the request does not fit in the KV cache")
        if request.adapter_id:
            # Checked again here, on the loop: an unload may have begun since validation.
            try:
                adapter = self.adapters.usable(request.adapter_id)
            except AdapterError as exc:
                raise StepFailed(exc.code, exc.message) from None
            request.adapter_key = adapter.key
        entry = Entry(id=next(self._ids), request=request)
        self._inflight += 1
        self.queue.append(entry)
        self.metrics.queue_size.set(len(self.queue))
        self._wake.set()
        return entry

    def _kv_tokens(self, request: ValidRequest) -> int:
        """KV slots a request is given: the positions it can fill (its last token is never fed back),
        plus Info.speculate (TGI's queue.rs allocates input + max_new_tokens + speculate - 1). A
        speculating TGI shard writes the K/V of guessed tokens past the last token it keeps; ours
        never guess past a request's last token (generation/speculation.py), so for them the extra
        slots are only headroom."""
        return max(request.input_length + request.max_new_tokens - 1, 1) + self.speculate

    def uses(self, adapter_id: str) -> int:
        """Requests queued or running (not yet filtered out of the shards' batch) with the adapter."""
        entries = itertools.chain(self.queue, self.running.values())
        return sum(1 for e in entries if e.request.adapter_id == adapter_id)

    async def between_steps(self, call: Callable[[], Awaitable[T]]) -> T:
        """Runs `call` (a shard call that changes their state: LoadAdapter, UnloadAdapter) on the
        loop, after the step in flight and before the next: the shards never see it beside a
        Prefill or Decode. Its result or error comes back here."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._between.append((call, future))
        self._wake.set()
        return await future

    async def _run_between(self) -> None:
        self._last_answer = None  # adapter calls between two decode answers are not their pace (RouterPace)
        while self._between:
            call, future = self._between.popleft()
            if future.cancelled():
                continue
            try:
                result = await call()
            except asyncio.CancelledError:
                future.cancel()
                raise
            except Exception as exc:  # noqa: BLE001: the caller gets it, whatever it was
                if not future.done():
                    future.set_exception(exc)
            else:
                if not future.done():
                    future.set_result(result)

    def cancel(self, entry: Entry) -> None:
        """The client went away: drop it from the queue now, or from the batch after this step."""
        if entry.done or entry.cancelled:
            return
        entry.cancelled = True
        self.metrics.request_cancelled.inc()
        # TGI's name for a client gone away
        self.metrics.request_failure.labels(err="dropped", adapter=entry.request.adapter_id).inc()
        if entry in self.queue:
            self.queue.remove(entry)
            self.metrics.queue_size.set(len(self.queue))
            self._finish(entry)
        self._wake.set()

    def _finish(self, entry: Entry, computed: bool = True) -> None:
        """The request leaves: its blocks go back, the computed ones (`computed`: its K/V are
        trustworthy, so not after a failed step) into the prefix cache."""
        if entry.done:
            return
        entry.done = True
        self._inflight -= 1
        allocation = entry.allocation
        if allocation is not None and allocation.blocks:
            if computed and entry.prompt_done:
                # The last generated token was never fed back, so its K/V were never written.
                tokens = entry.request.input_ids + entry.generated_ids
                self.pool.register(allocation, tokens, len(tokens) - 1)
            self.pool.release(allocation)
        # All gauges at once (callers take the entry out of `running` first): a scrape between
        # here and the end of the step must not see its blocks freed but its batch slot held.
        self._refresh_gauges()

    def _fail(self, entry: Entry, code: grpc.StatusCode, message: str, reason: str) -> None:
        if not entry.done:
            self.metrics.request_failure.labels(err=reason, adapter=entry.request.adapter_id).inc()
            entry.events.put_nowait(StepFailed(code, message))
            self._finish(entry, computed=False)

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
        await self._drop_in_flight()
        for entry in list(self.queue) + list(self.running.values()):
            self._fail(entry, grpc.StatusCode.UNAVAILABLE, "the server stopped", "shutdown")
        while self._between:
            _, future = self._between.popleft()
            if not future.done():
                future.set_exception(StepFailed(grpc.StatusCode.UNAVAILABLE, "the server stopped"))
        self.queue.clear()
        self.running.clear()

    def _admit(self, budget: int, running: int) -> list[Entry]:
        """Takes queued requests in order while the prefill budget, batch size and KV blocks allow.

        With chunking, the request that does not fit the budget whole takes what is left of it
        as its first chunk and closes the batch; without, it waits (unless it comes first)."""
        if not self.queue:
            return []  # nothing changes: no gauge to refresh (a decode step's usual case)
        taken: list[Entry] = []
        prefill_tokens = 0
        while self.queue:
            entry = self.queue[0]
            if self.limits.max_batch_size is not None and running + len(taken) >= self.limits.max_batch_size:
                break
            room = budget - prefill_tokens
            if room <= 0:
                break
            request = entry.request
            # Prompt logprobs need logits at every prompt position: a cached prefix has none.
            lookup = None if request.decoder_input_details else request.input_ids
            try:
                allocation = self.pool.allocate(self._kv_tokens(request), lookup, request.adapter_key)
            except Exception as exc:  # noqa: BLE001: a fault admitting one request fails it, not the queue
                logger.exception(f"admitting request {entry.id} failed")
                self.queue.popleft()
                self._fail(entry, grpc.StatusCode.INTERNAL, f"internal error admitting the request: {exc}", "internal")
                continue
            if allocation is None:
                break  # wait for running requests to free blocks; keep FIFO order
            compute = request.input_length - allocation.cache_len
            chunk = None
            if compute > room:
                if not self.support_chunking and taken:
                    self.pool.release(allocation)
                    break
                if self.support_chunking:
                    chunk = room
            self.queue.popleft()
            entry.allocation = allocation
            entry.first_chunk = chunk
            entry.admitted = time.monotonic()
            self._count_lookup(entry, lookup is not None)
            self.metrics.request_queue_duration.observe(entry.admitted - entry.arrived)
            prefill_tokens += compute if chunk is None else chunk
            taken.append(entry)
            if chunk is not None:
                self.metrics.chunked_prefills.inc()
                break
        self.metrics.queue_size.set(len(self.queue))
        self._refresh_gauges()
        return taken

    def _count_lookup(self, entry: Entry, looked_up: bool) -> None:
        m = self.metrics
        if looked_up and self.pool.prefix_caching:
            m.prefix_cache_queries.inc()
            m.prefix_cache_query_tokens.inc(entry.request.input_length)
            if entry.allocation.cache_len:
                m.prefix_cache_hits.inc()
                m.prefix_cache_hit_tokens.inc(entry.allocation.cache_len)
        if self.pool.evictions > self._evictions_seen:
            m.prefix_cache_evictions.inc(self.pool.evictions - self._evictions_seen)
            self._evictions_seen = self.pool.evictions

    async def _run(self) -> None:
        cached: spb.CachedBatch | None = None
        while True:
            if cached is None and not self.queue and not self._between and self._in_flight is None:
                self._last_answer = None  # an idle wait is no decode's time (RouterPace)
                await self._wake.wait()
            self._wake.clear()
            try:
                if self._between and self._in_flight is None:
                    await self._run_between()
                cached = await self._step(cached)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never let one bad step stop the server
                logger.exception("scheduler step failed")
                await self._drop_in_flight()
                for entry in list(self.running.values()):
                    self.running.pop(entry.id, None)
                    self._fail(entry, grpc.StatusCode.INTERNAL, f"internal error: {exc}", "internal")
                try:
                    await self.client.clear_cache()
                except grpc.aio.AioRpcError:
                    pass
                cached = None
                # A fault that repeats (the shards down, say) retries at most this often, not in a
                # busy loop that floods the log while queued requests wait.
                await asyncio.sleep(self.RETRY_AFTER_FAILED_STEP_S)

    async def _step(self, cached: spb.CachedBatch | None) -> spb.CachedBatch | None:
        """One shard call: newcomers (with the running batch when the shards chunk), else a decode."""
        if self._in_flight is not None:  # the Decode of `cached` already went out: its answer first
            flight, self._in_flight = self._in_flight, None
            return await self._decode_answer(flight.call, [flight.batch], flight.entries, flight.start)
        if self.support_chunking:
            current = cached.current_tokens if cached is not None else 0
            new = self._admit(self.limits.max_batch_prefill_tokens - current, len(self.running))
            if new:
                if cached is not None:
                    self.metrics.batch_concat.labels(reason="chunking").inc()
                return await self._prefill(new, cached)
            if cached is None:
                if self.queue:
                    self._wake.set()
                return None
            return await self._decode([cached])
        return await self._step_unchunked(cached)

    async def _step_unchunked(self, cached: spb.CachedBatch | None) -> spb.CachedBatch | None:
        """Shards without chunking: prefill newcomers as a batch of their own, then decode all."""
        batches: list[spb.CachedBatch] = [cached] if cached is not None else []
        new: list[Entry] = []
        if cached is None or self._wants_newcomers(len(self.running)):
            new = self._admit(self.limits.max_batch_prefill_tokens, len(self.running))
        if new and batches:
            reason = "wait_exceeded" if self._steps_without_admission >= self.limits.max_waiting_tokens \
                else "backpressure"
            self.metrics.batch_concat.labels(reason=reason).inc()
        if new:
            self._steps_without_admission = 0
            new_cached = await self._prefill(new, None)
            if new_cached is not None:
                batches.append(new_cached)
        else:
            self._steps_without_admission += 1
        if not batches:
            if self.queue:
                self._wake.set()
            return None
        return await self._decode(batches)

    def _wants_newcomers(self, running: int) -> bool:
        if self._steps_without_admission >= self.limits.max_waiting_tokens:
            return True
        return len(self.queue) >= int(running * self.limits.waiting_served_ratio)

    async def _prefill(self, entries: list[Entry], cached: spb.CachedBatch | None) -> spb.CachedBatch | None:
        self._last_answer = None  # a prefill between two decode answers is not their pace (RouterPace)
        batch_id = next(self._batch_ids)
        requests = []
        for e in entries:
            a = e.allocation
            requests.append(e.request.to_shard(e.id, a.blocks, a.slots, a.cache_len, e.first_chunk))
            self.running[e.id] = e
        batch = spb.Batch(
            id=batch_id, requests=requests, size=len(requests),
            max_tokens=sum(e.total_tokens for e in entries),
            max_blocks=max(len(e.allocation.blocks) for e in entries),
        )
        stepped = entries + ([self.running[i] for i in cached.request_ids if i in self.running] if cached else [])
        self.metrics.batch_next_size.observe(len(entries))
        self.metrics.batch_inference_count.labels(method="prefill").inc()
        start = time.monotonic()
        try:
            resp = await self.client.prefill(batch, cached)
        except grpc.aio.AioRpcError as exc:
            # The newcomers fail; our shards keep the running batch as it was (a failed merged
            # step runs on a fork of it), so it steps on (a shard that lost it answers NOT_FOUND
            # to the next call, which fails its requests then).
            await self._step_failed("prefill", [batch_id], entries, exc)
            return cached
        refused = {g.request_id for g in resp.generations if g.HasField("error")}
        self.metrics.prompt_tokens.inc(sum(e.request.input_length - e.allocation.cache_len for e in entries
                                           if e.id not in refused))
        filtering = time.monotonic()
        result = await self._dispatch(resp, entries_of_batch=stepped)
        self._observe("prefill", start, filtering, resp)
        return result

    async def _decode(self, batches: list[spb.CachedBatch]) -> spb.CachedBatch | None:
        entries = [self.running[i] for b in batches for i in b.request_ids if i in self.running]
        self._decode_calls.inc()
        return await self._decode_answer(self.client.decode(batches), batches, entries, time.monotonic())

    async def _decode_answer(self, call: Awaitable, batches: list[spb.CachedBatch], entries: list[Entry],
                             start: float) -> spb.CachedBatch | None:
        try:
            resp = await call
        except grpc.aio.AioRpcError as exc:
            await self._step_failed("decode", [b.id for b in batches], entries, exc)
            return None
        filtering = time.monotonic()
        await self._pipeline(resp)
        result = await self._dispatch(resp, entries_of_batch=entries)
        if self.pipeline_mode == "auto":  # only `auto` reads the pace: no work a step otherwise
            now = time.monotonic()
            if self._last_answer is not None:
                self.pace.observe(now - self._last_answer, steps_in(resp.generations), resp.total_ns)
            self._last_answer = now if result is not None else None
        self._observe("decode", start, filtering, resp)
        return result

    async def _pipeline(self, resp) -> None:
        """Sends the next Decode now, before this step's tokens are streamed, when the step leaves a
        batch to continue and nothing else must go first: nobody is queued for admission (a Prefill
        would take the batch instead), no adapter call waits, no row was refused. Rows the step
        finished (or the client cancelled) are filtered out first, in the same call. The shards then
        compute (ours answer from the step they computed ahead) while this step's tokens go out; the
        next `_step` takes the answer. Why: at a few hundred µs a step, the router's streaming of a
        step's tokens was serial with the next shard call (issue #31). A request arriving meanwhile
        is admitted after that step."""
        if not (self.pipeline and self.admitting and resp.HasField("batch")) or self.queue or self._between:
            return
        if self.pace.router_bound and self.pipeline_mode == "auto":  # the router is the slower side (RouterPace)
            self.unpipelined_steps += 1
            return
        if any(g.HasField("error") for g in resp.generations):
            return
        finished = {g.request_id for g in resp.generations if g.HasField("generated_text")}
        batch = resp.batch
        keep, entries = [], []
        for rid in batch.request_ids:
            entry = self.running.get(rid)
            if entry is None or entry.done:
                return
            if rid not in finished and not entry.cancelled:
                keep.append(rid)
                entries.append(entry)
        if not keep:
            return
        self._decode_calls.inc()
        self.pipelined_steps += 1
        filtered = len(keep) != len(batch.request_ids)
        # One rank on its step socket: written now, no task (ShardClient.decode_now); else a task.
        call = None if filtered or self._decode_now is None else self._decode_now([batch])
        sent = call is not None
        if call is None:
            call = asyncio.ensure_future(self._filter_then_decode(batch.id, keep) if filtered
                                         else self.client.decode([batch]))
        self._in_flight = _InFlight(call=call, batch=batch, entries=entries, start=time.monotonic(),
                                    filtered=filtered)
        if not sent:
            # Two turns of the loop: the call runs up to its send (ShardClient gathers one task per rank, each
            # writing to its rank's stream in its first turn; in-process, the hand-off to the model thread).
            await asyncio.sleep(0)
            await asyncio.sleep(0)

    async def _filter_then_decode(self, batch_id: int, keep: list[int]):
        batch = await self.client.filter_batch(batch_id, keep)
        if batch is None:  # not ours: a shard that dropped every row it was asked to keep
            raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details=f"FilterBatch of batch {batch_id} to {keep} left no batch")
        return await self.client.decode([batch])

    async def _drop_in_flight(self) -> None:
        """Stops waiting for a Decode sent ahead and drops its answer unread (the server stops, or the
        step that sent it failed and the batch is gone); the shards finish the call on their own."""
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return
        flight.call.cancel()
        try:
            await flight.call
        except (asyncio.CancelledError, Exception):  # noqa: BLE001: nobody reads this answer
            pass

    def _observe(self, method: str, start: float, filtering: float, resp) -> None:
        """A successful step, timed as TGI does: inference = call + filtering, filter = after the call."""
        m = self.metrics
        now = time.monotonic()
        inference, filtered, forward, decode, success = self._step_metrics(method)
        inference(now - start)
        filtered(now - filtering)
        # An answer from a chain of steps ahead (shard/service.py) holds several steps, one
        # Generation per request each: the forward and decode histograms stay per step.
        steps = steps_in(resp.generations)
        for _ in range(steps):
            forward(resp.forward_ns / 1e9 / steps)
            decode(resp.decode_ns / 1e9 / steps)
        if resp.HasField("concat_ns"):  # TGI labels every concatenation "decode", prefill-time ones too
            m.batch_concat_duration.labels(method="decode").observe(resp.concat_ns / 1e9)
        success.inc()

    def _step_metrics(self, method: str) -> tuple:
        """The step's labelled metrics, looked up once per method (a lookup takes a lock and
        hashes the labels: host time on every step otherwise)."""
        found = self._labelled.get(method)
        if found is None:
            m = self.metrics
            found = self._labelled[method] = (
                *(fast_observer(h.labels(method=method)) for h in (
                    m.batch_inference_duration, m.batch_filter_duration, m.batch_forward_duration,
                    m.batch_decode_duration)),
                m.batch_inference_success.labels(method=method))
        return found

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

    def _refused(self, gen: spb.Generation) -> None:
        """A newcomer the shards refused on its own (per_request_errors): it alone fails, with the
        shard's reason; it is in no batch, and its blocks were never written."""
        entry = self.running.pop(gen.request_id, None)
        if entry is None or entry.done:
            return
        reason = gen.error.removeprefix(f"request {entry.id}: ")  # the shard's id means nothing to the client
        logger.bind(request_id=entry.id).warning("request {} refused by the shards: {}", entry.id, reason)
        self._fail(entry, grpc.StatusCode.INVALID_ARGUMENT, f"the shards refused the request: {reason}", "validation")

    async def _dispatch(self, resp, entries_of_batch: list[Entry]) -> spb.CachedBatch | None:
        now = time.monotonic()
        generated = 0
        for gen in resp.generations:
            if gen.HasField("error"):
                self._refused(gen)
        for entry in entries_of_batch:
            if entry.chunked and not entry.prompt_done and not entry.done:
                self.metrics.prefill_chunks.inc()  # a forward that carried a piece of its prompt
        for gen in resp.generations:
            entry = self.running.get(gen.request_id)
            if entry is None or entry.done:
                continue  # a refused request's Generation too: _refused failed it above
            generated += len(gen.tokens.ids)
            self._observe_skipped(max(len(gen.tokens.ids) - 1, 0))
            if entry.last_token is None:
                entry.first_token = now
                self.metrics.time_to_first_token.observe(now - entry.arrived)
                # The whole prompt is computed now: its blocks can serve other requests at once.
                self.pool.register(entry.allocation, entry.request.input_ids, entry.request.input_length)
            else:
                self._observe_inter_token(now - entry.last_token)
            entry.last_token = now
            entry.generated_ids.extend(gen.tokens.ids)
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
        # A Decode sent ahead with a FilterBatch first (`_pipeline`) filters the batch; `_step` reads its answer.
        filtered_ahead = self._in_flight is not None and self._in_flight.filtered
        if len(keep) != len(batch.request_ids) and not filtered_ahead:
            if keep:
                batch = await self.client.filter_batch(batch.id, keep)
            else:
                await self.client.clear_cache(batch.id)
                batch = None
        self._refresh_gauges()
        return batch

    def _refresh_gauges(self) -> None:
        """The batch and KV gauges, set only when one of them changed: in a steady decode (no row
        admitted or finished) none does, and six Gauge.set calls (a lock each) are host time a step."""
        pool = self.pool
        values = (len(self.running), sum(e.total_tokens for e in self.running.values()), pool.used, pool.free,
                  pool.cached)
        if values == self._gauges:
            return
        self._gauges = values
        m = self.metrics
        m.batch_current_size.set(values[0])
        m.batch_current_max_tokens.set(values[1])
        m.set_kv_blocks(values[2], values[3])
        m.prefix_cache_blocks.set(values[4])

    def _record_success(self, entry: Entry, gen, now: float) -> None:
        m = self.metrics
        generated = gen.generated_text.generated_tokens
        m.request_success.labels(finish_reason=FINISH_REASONS.get(gen.generated_text.finish_reason, "unknown"),
                                 adapter=entry.request.adapter_id).inc()
        m.request_duration.observe(now - entry.arrived)
        if entry.admitted is not None:
            m.request_inference_duration.observe(now - entry.admitted)
            if generated:
                m.mean_time_per_token.observe((now - entry.admitted) / generated)
            if entry.first_token is not None:
                m.request_prefill_duration.observe(entry.first_token - entry.admitted)
                m.request_decode_duration.observe(now - entry.first_token)
        m.generated_tokens.observe(generated)
