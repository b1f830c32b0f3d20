"""The shard gRPC service (generate.v3.TextGenerationService), one per rank.

Wire-compatible with TGI v3: the caller (our router or TGI's) owns the batch ids
and the KV blocks; this service keeps a cache of live batches by id and runs the
model on them. Model calls run one at a time on a worker thread, so Health and
Info answer while a long prefill runs, and every rank executes the same sequence
of collectives. A bad request answers INVALID_ARGUMENT and an unknown batch
NOT_FOUND; the shard keeps serving either way. A Prefill that sets per_request_errors (our
router's) answers a refused request alone, with a Generation whose `error` says why, and
prefills the others (and steps the cached batch) as if it had not been sent. Messages become
the engine's types and back in shard/wire.py.

Decode ahead: as soon as a step leaves a cached batch, the model thread computes that
batch's next decode step on a fork (`Batch.fork`) while the response travels to the
router and the router streams tokens, filters and asks for the next step. When the
Decode for that batch arrives and the batch still holds exactly the rows the fork ran
(the router's FilterBatch dropping the finished rows, or more, is allowed), the fork's
result is the answer; otherwise (the batch was merged into a prefill, cleared, or kept
a finished row) the fork is dropped and the step runs as usual. Either way the tokens
are those of a plain step: forks copy every piece of state a step advances. Every rank
sees the same RPCs in the same order, so every rank forks and commits alike and the
collectives stay in step. TGS_DECODE_AHEAD=0 turns it off.

Steps ahead in a chain (one rank, our router's Steps stream or its in-process calls): when the router has not asked
for anything by the time a step ahead is done, the model thread goes on to the step after it,
up to TGS_DECODE_AHEAD_STEPS steps (default 8), and the Decode that arrives takes them all: one
Generation per request per step, in step order, as if it had sent that many Decodes. The model
thread never waits on the router's round trip (vLLM's multi-step scheduling makes the same
trade): a router, a gRPC hop or a busy core slower than the forward costs throughput no more,
only burstier streams. A chain stops as soon as any call waits for the model thread, so a
FilterBatch, a newcomer's Prefill or a ClearCache waits one step at most; rows that finish inside
a chain leave it at once, and the rows a client cancelled meanwhile run at most the chain's
length for nothing. Ranks would have to agree on each chain's length (their collectives pair
step by step), so with several ranks, and on TGI's unary Decode, a chain is one step long.

Steps (not in TGI): our router sends the four state-changing calls to each rank over one connection,
answered in order with the unary calls' own messages or a StepError carrying the status the
unary call would have failed with; the calls run exactly as their unary twins do (`step`). The
connection is the rank's step socket (shard/step_socket.py: length-prefixed frames, no gRPC) where
the router can reach it, else a gRPC `Steps` stream.

Speculation (`serve --speculate N`, Info.speculate): a decode step may give a request several
tokens, all in its one Generation (tokens.ids, with a logprob, text and is_special each, and one
top_tokens entry per id), as TGI's shards send them. It goes with decode ahead unchanged: a fork
proposes from its own copy of the history, and the K/V it writes past a row's accepted tokens
lie beyond the sequence, where a replayed step writes again before anything reads them.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import grpc
import torch
from loguru import logger

from text_generation_server.generation.grammar import GrammarError
from text_generation_server.engine.batch import Batch, OutOfBlocksError
from text_generation_server.engine.causal_lm import CausalLM
from text_generation_server.engine.standin import StandinForward
from text_generation_server.engine.types import BatchNotFound, Generation, GenerationRequest, RequestError, StepTimings
from text_generation_server.engine.warmup import WarmupError
from text_generation_server.shard import adapters
from text_generation_server.pb.generate.v3 import generate_pb2 as pb
from text_generation_server.pb.generate.v3 import generate_pb2_grpc as pb_grpc
from text_generation_server.shard.model_thread import STEP_SOCKET_SUFFIX, Deferred, ModelThread, open_step_listener
from text_generation_server.shard.wire import cached_batch_to_pb, generation_to_pb, request_from_pb
from text_generation_server.utils.step_frames import MAX_FRAME_BYTES, FrameError


def shard_uds(uds_path: str, rank: int) -> str:
    return f"{uds_path}-{rank}"


def ahead_steps_setting(world_size: int) -> int:
    """The longest chain of steps ahead (TGS_DECODE_AHEAD_STEPS, default DEFAULT_AHEAD_STEPS); one
    step with several ranks, whose chains would have to end at the same step on every rank."""
    raw = os.environ.get(AHEAD_STEPS_ENV, "").strip()
    try:
        steps = int(raw) if raw else DEFAULT_AHEAD_STEPS
    except ValueError:
        raise ValueError(f"{AHEAD_STEPS_ENV}={raw!r}: expected a whole number of steps >= 1") from None
    if steps < 1:
        raise ValueError(f"{AHEAD_STEPS_ENV}={raw!r}: expected a whole number of steps >= 1")
    return steps if world_size == 1 else 1


class ShardError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


DECODE_AHEAD_ENV = "TGS_DECODE_AHEAD"
# Steps a chain of steps ahead may hold (module docstring); 1: one step ahead, as on TGI's wire.
AHEAD_STEPS_ENV = "TGS_DECODE_AHEAD_STEPS"
DEFAULT_AHEAD_STEPS = 8
# The v3 InfoResponse has no field for kernels; they travel as trailing metadata, which a
# TGI router ignores, so the message itself stays exactly TGI's.
KERNELS_METADATA = "tgs-kernels"
ATTENTION_METADATA = "tgs-attention"
MODEL_IMPL_METADATA = "tgs-model-impl"
KV_BYTES_METADATA = "tgs-kv-bytes-per-token"  # this rank's KV cache bytes per token (all layers)
STEPS_METADATA = "tgs-steps"  # "1": the rank serves the Steps stream
STEP_SOCKET_METADATA = "tgs-steps-socket"  # the path of the rank's step socket (shard/step_socket.py), when served


def model_kernels(model: torch.nn.Module) -> list[str]:
    """Distinct kernel names the model's linears run on, sorted (dense layers say "dense")."""
    return sorted({str(m.kernel_name) for m in model.modules() if getattr(m, "kernel_name", None)})


@dataclass
class _Ahead:
    """A decode step computed on a fork of a cached batch, waiting for its Decode."""

    source: Batch  # the cached batch object it was forked from (identity shows it is unchanged)
    request_ids: list[int]
    generations: list[Generation] | None = None  # every step's, in step order
    next_batch: Batch | None = None
    timings: StepTimings | None = None
    error: BaseException | None = None
    steps: int = 0  # steps computed (a chain holds more than one)

    def restrict(self, batch: Batch) -> bool:
        """Follows a FilterBatch of the source: keeps the rows still wanted. False: unusable."""
        kept = batch.request_ids
        if not set(kept) <= set(self.request_ids):
            return False  # the router kept a row the fork did not run (a finished one)
        if self.error is None and kept != self.request_ids:
            wanted = set(kept)
            self.generations = [g for g in self.generations if g.request_id in wanted]
            if self.next_batch is not None:
                alive = [rid for rid in kept if rid in set(self.next_batch.request_ids)]
                self.next_batch = self.next_batch.filter(alive, None) if alive else None
        self.source, self.request_ids = batch, kept
        return True


def _step_error(seq: int, exc: ShardError) -> pb.StepAnswer:
    return pb.StepAnswer(seq=seq, error=pb.StepError(code=exc.code.value[0], message=str(exc)))


class TextGenerationService(pb_grpc.TextGenerationServiceServicer):
    def __init__(
        self,
        model: CausalLM,
        uds_path: str,
        world_size: int,
        memory_fraction: float,
        max_batch_total_tokens: int | None = None,
        prefix_caching: bool = True,
        stall_timeout_s: float = 300.0,
        rank: int = 0,
    ):
        self.model = model
        self.uds_path = uds_path
        self.world_size = world_size
        self.rank = rank
        self.memory_fraction = memory_fraction
        self.max_batch_total_tokens = max_batch_total_tokens
        self.prefix_caching = prefix_caching
        if prefix_caching and model.config.rope_length_dependent:
            # K/V computed while a sequence was short would be reused by one whose length puts its
            # rotary in another regime: not what transformers computes.
            self.prefix_caching = False
            if rank == 0:
                logger.warning("prefix caching off: {} rope scaling makes a token's rotary angle depend on its "
                               "sequence's length, so cached K/V would not match a recompute",
                               model.config.rope.rope_type)
        self.stall_timeout_s = stall_timeout_s
        self.cache: dict[int, Batch] = {}
        self._executor = ModelThread("model")  # also serves the step socket (shard/model_thread.py)
        self._tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.decode_ahead = os.environ.get(DECODE_AHEAD_ENV, "1") not in ("0", "false", "no")
        self.ahead_steps = ahead_steps_setting(world_size)
        # Calls queued for the model thread, counted by the two threads that each write one
        # counter (sent: the event loop; started: the model thread): a chain stops when they differ.
        self._calls_sent = 0
        self._calls_started = 0
        self.chained_steps = 0  # steps a chain computed past its first (counted; tests and logs)
        self._ahead: dict[int, _Ahead] = {}  # batch id -> its next step; touched on the model thread only
        self.ahead_hits = 0
        self.ahead_misses = 0
        self.busy_since: float | None = None  # monotonic start of the model thread's current call
        self.step_socket: str | None = None  # the step socket's path once serve_step_socket listens on it
        self._chain_started_ns = 0  # when the chain of steps ahead under way began (_call_waiting)

    def _on_model_thread(self, fn, *args):
        self.busy_since = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.busy_since = None

    def _call_on_model_thread(self, fn, *args):
        self._calls_started += 1
        return self._on_model_thread(fn, *args)

    def _call_waiting(self) -> bool:
        """Whether a call (not a step ahead) waits for the model thread: a chain of steps ahead ends.

        A Decode on the step socket waits until the chain has run for twice what answering a Decode
        costs this thread: with a fast step (a small model, no device) and a router that asks at once,
        every answer would otherwise carry one step, and the thread would spend as long answering as
        stepping. A slow step (a real model, a device) passes that bar with its first step, so the
        Decode's answer leaves after that step as before; any other call ends the chain at once."""
        if self._calls_sent != self._calls_started:
            return True
        pace = self._executor.answer_ns
        held = pace is not None and time.perf_counter_ns() - self._chain_started_ns < 2 * pace
        return self._executor.steps_waiting(decodes_wait=held)

    def close(self) -> None:
        """Lets go of the model thread and the tokenizer pool (queued work is dropped): the service's end."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn, *args):
        """Runs `fn` on the model thread; raises its failure as a ShardError with a clear message."""
        loop = asyncio.get_running_loop()
        self._calls_sent += 1
        try:
            return await loop.run_in_executor(self._executor, self._call_on_model_thread, fn, *args)
        except Exception as exc:
            raise self._shard_error(exc, fn) from None

    @staticmethod
    def _shard_error(exc: Exception, fn) -> ShardError:
        """A model call's failure as the status it answers.

        Only the caller's mistakes are INVALID_ARGUMENT (a RequestError: a field, an id, a block)
        or NOT_FOUND (an unknown batch); anything raised inside the model or a kernel is INTERNAL,
        whatever its type, so a client never blames itself for a server fault.
        """
        if isinstance(exc, ShardError):
            return exc
        if isinstance(exc, RequestError):  # (an unknown or refused LoRA adapter names its own status: `code`)
            return ShardError(grpc.StatusCode[exc.code], str(exc))
        if isinstance(exc, BatchNotFound):
            return ShardError(grpc.StatusCode.NOT_FOUND, str(exc))
        if isinstance(exc, (WarmupError, OutOfBlocksError)):
            return ShardError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        # a failure inside the model: report it, keep serving
        logger.opt(exception=exc).error("shard call {} failed", getattr(fn, "__name__", fn))
        return ShardError(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")

    @staticmethod
    async def _unary(context, call):
        """A unary RPC's answer, or its failure as the call's status."""
        try:
            return await call
        except ShardError as exc:
            await context.abort(exc.code, str(exc))

    async def _requests(self, batch: pb.Batch, refused: dict[int, RequestError] | None = None,
                        warmup: bool = False) -> list[GenerationRequest]:
        """The batch's requests, decoded and tokenized (and their grammars compiled) on a thread of
        their own: the model thread only runs steps, and finds each grammar in the compiler's cache.
        The fields' validators run in make_batch, on the model thread (engine/batch_builder.py).
        `refused`: where a request the wire decoding refuses goes (by id), left out of the list;
        None: it fails the call."""
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._tokenizer_pool, self._convert_requests, batch, refused, warmup)
        except RequestError as exc:
            raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    def _convert_requests(self, batch: pb.Batch, refused: dict[int, RequestError] | None,
                          warmup: bool) -> list[GenerationRequest]:
        requests = []
        for r in batch.requests:
            try:
                requests.append(request_from_pb(r, warmup))
            except RequestError as exc:
                if refused is None:
                    raise
                refused[r.id] = exc
        for req in requests:
            if req.input_ids is None:
                req.input_ids = self.model.tokenizer.encode(
                    req.inputs, add_special_tokens=req.add_special_tokens).ids
            if req.sampling.grammar is not None:
                try:
                    self.model.builder.grammars.compile(req.sampling.grammar)
                except GrammarError:
                    pass  # cached with its reason, which make_batch's grammar validator reports
        return requests

    # -- the eight RPCs ------------------------------------------------------------
    async def Info(self, request, context):
        m = self.model
        window = m.config.sliding_window
        info = pb.InfoResponse(
            requires_padding=False,
            dtype=str(m.dtype).removeprefix("torch."),
            device_type=m.device.type,
            speculate=m.speculate,
            support_chunking=True,
            use_prefix_caching=self.prefix_caching,
            attention_impl="paged",
            block_size=m.block_size,
        )
        if window is not None:
            info.window_size = window
        info.adapters.extend(adapters.infos(getattr(m, "adapters", None)))
        context.set_trailing_metadata((
            (KERNELS_METADATA, ",".join(model_kernels(m.model))),
            (ATTENTION_METADATA, m.attention.name),
            (MODEL_IMPL_METADATA, m.model_impl),
            (KV_BYTES_METADATA, str(m.kv_bytes_per_token)),
            (STEPS_METADATA, "1"),
            *(((STEP_SOCKET_METADATA, self.step_socket),) if self.step_socket else ()),
        ))
        return info

    async def Health(self, request, context):
        """Fails while the model thread has been inside one call for longer than the stall limit:
        a rank blocked in a collective (its peer hung or died) answers nothing else, so its
        router can tell orchestrators that this replica stopped serving."""
        busy = self.busy_since
        if busy is not None and time.monotonic() - busy > self.stall_timeout_s:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the model has been inside one call for {time.monotonic() - busy:.0f} s (limit "
                f"{self.stall_timeout_s:.0f} s, --rank-stall-timeout-s): a collective is probably stuck",
            )
        return pb.HealthResponse()

    async def ServiceDiscovery(self, request, context):
        urls = [f"unix://{shard_uds(self.uds_path, r)}" for r in range(self.world_size)]
        return pb.ServiceDiscoveryResponse(urls=urls)

    async def ClearCache(self, request, context):
        return await self._unary(context, self._clear_cache(request))

    async def _clear_cache(self, request: pb.ClearCacheRequest) -> pb.ClearCacheResponse:
        return await self._run(self._clear_cache_work, request)

    def _clear_cache_work(self, request: pb.ClearCacheRequest) -> pb.ClearCacheResponse:
        if request.HasField("id"):
            self._ahead.pop(request.id, None)
            batch = self.cache.pop(request.id, None)
            if batch is not None:
                self.model.release(batch)
        else:
            self._ahead.clear()
            for batch in self.cache.values():
                self.model.release(batch)
            self.cache.clear()
        return pb.ClearCacheResponse()

    async def FilterBatch(self, request, context):
        return await self._unary(context, self._filter_batch(request))

    async def _filter_batch(self, request: pb.FilterBatchRequest) -> pb.FilterBatchResponse:
        return await self._run(self._filter_batch_work, request)

    def _filter_batch_work(self, request: pb.FilterBatchRequest) -> pb.FilterBatchResponse:
        batch = self._pop(request.batch_id)
        ahead = self._ahead.pop(request.batch_id, None)
        try:
            kept = self.model.filter(batch, list(request.request_ids))
        except RequestError:
            self.cache[batch.batch_id] = batch  # a bad filter leaves the batch as it was
            if ahead is not None:
                self._ahead[batch.batch_id] = ahead
            raise
        if kept is None:
            return pb.FilterBatchResponse()
        self.cache[kept.batch_id] = kept
        if ahead is not None and ahead.restrict(kept):
            self._ahead[kept.batch_id] = ahead
        return pb.FilterBatchResponse(batch=cached_batch_to_pb(kept.info()))

    async def Warmup(self, request, context):
        return await self._unary(context, self._warmup(request))

    async def _warmup(self, request: pb.WarmupRequest) -> pb.WarmupResponse:
        requests = await self._requests(request.batch, warmup=True)

        def warm():
            if self.model.kv_cache is not None and self.cache:
                raise ShardError(grpc.StatusCode.FAILED_PRECONDITION, "Warmup while batches are cached; ClearCache first")
            max_input = request.max_input_tokens if request.HasField("max_input_tokens") else None
            max_total = request.max_total_tokens if request.HasField("max_total_tokens") else None
            limit = self.model.config.max_context
            if max_total is None:
                max_total = min(limit, 4096)
            if max_input is None:
                max_input = max_total - 1
            if not requests:
                raise RequestError("the warmup batch has no requests")
            if request.max_prefill_tokens < 1:
                raise RequestError("max_prefill_tokens must be >= 1")
            # TGI's router sends every warmup request with id 0 and no blocks: the warmup batch is
            # the shard's own, numbered and placed by CausalLM.warmup.
            supported = self.model.warmup(
                requests, max_input, request.max_prefill_tokens, max_total, self.memory_fraction,
                self.max_batch_total_tokens,
            )
            return pb.WarmupResponse(
                max_supported_total_tokens=supported, max_input_tokens=max_input, max_total_tokens=max_total
            )

        return await self._run(warm)

    async def Prefill(self, request, context):
        return await self._unary(context, self._prefill(request))

    async def _prefill(self, request: pb.PrefillRequest, chain: int = 1) -> pb.PrefillResponse:
        """`chain`: the most steps ahead the model thread may compute after this one (module docstring)."""
        refused = self._prefill_refusals(request)
        requests = await self._requests(request.batch, refused)
        return (await self._run(self._prefill_work, request, requests, refused, chain))()

    @staticmethod
    def _prefill_refusals(request: pb.PrefillRequest) -> dict[int, RequestError] | None:
        """Where the Prefill's refused requests go: our router asks for each to be answered on its own
        (per_request_errors); a TGI router gets TGI's contract, one refused request fails the call (None)."""
        refused: dict[int, RequestError] | None = {} if request.per_request_errors else None
        ids = [r.id for r in request.batch.requests]
        if refused is not None and len(set(ids)) != len(ids):  # one id, two answers: a fault of the batch
            twice = next(i for i in ids if ids.count(i) > 1)
            raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, f"request id {twice} appears twice in the batch")
        return refused

    def _prefill_work(self, request: pb.PrefillRequest, requests: list[GenerationRequest],
                      refused: dict[int, RequestError] | None, chain: int):
        if request.batch.id in self.cache:
            raise RequestError(f"batch {request.batch.id} is already cached")
        cached_id = request.cached_batch.id if request.HasField("cached_batch") else None
        if cached_id is not None:
            # Checked before the forward: afterwards the new batch (and blocks it owns) would be lost.
            if cached_id not in self.cache:
                raise BatchNotFound(f"batch {cached_id} not found")
            clash = set(self.cache[cached_id].request_ids) & {r.id for r in requests}
            if clash:
                raise RequestError(f"request ids {sorted(clash)[:4]} are already in batch {cached_id}")
        batch: Batch | None = None
        if refused is None:
            batch = self.model.make_batch(request.batch.id, requests)
        elif requests or not request.batch.requests:  # (an empty batch is refused as a whole)
            batch, more = self.model.builder.make_batch_refusing(request.batch.id, requests)
            refused.update(more)
        if cached_id is None:
            generations, next_batch, timings = self._generate(batch) if batch is not None else \
                ([], None, StepTimings(0, 0, 0))
            return self._step_response(pb.PrefillResponse, generations, next_batch, timings, None, refused,
                                       chain=chain)
        # TGI's contract: one token for the cached batch and the new one. A step computed ahead
        # for the cached batch is that token; otherwise both run as one forward, on a fork of the
        # cached batch: if the step fails, only the new requests are lost, and the cached batch
        # (and its step ahead) stay as they were for the caller's next call.
        cached = self.cache[cached_id]
        ahead = self._take_ahead(cached)
        if ahead is not None and ahead.error is not None:
            ahead = None  # the merged step runs it again, and fails (or not) on its own
        try:
            if ahead is None:
                concat_start = time.perf_counter_ns()
                merged = Batch.concatenate([cached.fork(cached.request_ids)] + ([batch] if batch is not None else []))
                concat_ns = time.perf_counter_ns() - concat_start
                generations, next_batch, timings = self.model.generate_token(merged)
                if next_batch is None:
                    self.model.release(cached)
                else:
                    next_batch.adopt_blocks(cached)
            else:
                new_gens, new_next, timings = self.model.generate_token(batch) if batch is not None else \
                    ([], None, StepTimings(0, 0, 0))
                generations, parts, ahead_timings = self._commit_ahead(cached, ahead)
                generations += new_gens
                timings = ahead_timings + timings
                concat_start = time.perf_counter_ns()
                next_batch = Batch.concatenate(parts + ([new_next] if new_next is not None else [])) \
                    if parts or new_next is not None else None
                concat_ns = time.perf_counter_ns() - concat_start
        except BaseException:
            if batch is not None:
                self.model.release(batch)  # the new requests' own blocks; the cached batch is untouched
            if ahead is not None:
                self._ahead[cached_id] = ahead
            raise
        del self.cache[cached_id]
        return self._step_response(pb.PrefillResponse, generations, self._renumber(next_batch, cached_id),
                                   timings, concat_ns, refused, chain=chain)

    def _answers_for(self, request_id: int) -> bool:
        return request_id % self.world_size == self.rank

    async def Decode(self, request, context):
        return await self._unary(context, self._decode(request))

    async def _decode(self, request: pb.DecodeRequest, chain: int = 1) -> pb.DecodeResponse:
        """`chain`: the most steps ahead the model thread may compute after this one (module docstring)."""
        return (await self._run(self._decode_work, request, chain))()

    def _decode_work(self, request: pb.DecodeRequest, chain: int):
        if not request.batches:
            raise RequestError("Decode needs at least one batch")
        ids = [b.id for b in request.batches]
        if len(set(ids)) != len(ids):
            raise RequestError(f"Decode names batch ids {ids}: each batch at most once")
        missing = [i for i in ids if i not in self.cache]
        if missing:
            raise BatchNotFound(f"batch {missing[0]} not found")
        batches = [self.cache.pop(i) for i in ids]
        ready = {id(b): a for b in batches if (a := self._take_ahead(b)) is not None}
        if not ready:
            generations, next_batch, timings = self._generate(Batch.concatenate(batches))
            return self._step_response(pb.DecodeResponse, generations, self._renumber(next_batch, ids[0]),
                                       timings, None, chain=chain)
        # Batches without a step ready (just prefilled) join without a token this time: running
        # them alone would cost a forward of its own, and the next step carries every row.
        generations, parts, timings = [], [], StepTimings(0, 0, 0)
        for b in batches:
            ahead = ready.get(id(b))
            if ahead is None:
                parts.append(b)
                continue
            gens, kept, step = self._commit_ahead(b, ahead)
            generations += gens
            parts += kept
            timings = timings + step
        next_batch = self._renumber(Batch.concatenate(parts), ids[0]) if parts else None
        return self._step_response(pb.DecodeResponse, generations, next_batch, timings, None, chain=chain)

    async def LoadAdapter(self, request, context):
        return await self._unary(context, self._run(adapters.load, getattr(self.model, "adapters", None), request))

    async def UnloadAdapter(self, request, context):
        return await self._unary(context, self._run(lambda: adapters.unload(
            getattr(self.model, "adapters", None), request, [*self.cache.values(), *(a.source for a in self._ahead.values())])))

    # Steps: StepCall's oneof field -> (its handler, the StepAnswer field of its answer).
    _STEP_CALLS = {
        "prefill": "_prefill",
        "decode": "_decode",
        "filter_batch": "_filter_batch",
        "clear_cache": "_clear_cache",
    }
    # The calls whose step may be followed by a chain of steps ahead (module docstring).
    _CHAINED_CALLS = frozenset({"prefill", "decode"})

    async def Steps(self, request_iterator, context):
        """The state-changing calls over one stream, answered in order (not in TGI: our router's
        fast path). A failed call answers its status in a StepError and the stream goes on, so one
        bad request costs what it costs on the unary calls and no more."""
        async for call in request_iterator:
            yield await self.step(call)

    async def step(self, call: pb.StepCall) -> pb.StepAnswer:
        """One call of the gRPC `Steps` stream, run exactly as its unary twin; its failure is the
        answer's StepError."""
        kind = call.WhichOneof("call")
        try:
            if kind is None:
                raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, "a StepCall carries no call")
            handler = getattr(self, self._STEP_CALLS[kind])
            message = getattr(call, kind)
            result = await (handler(message, chain=self.ahead_steps) if kind in self._CHAINED_CALLS
                            else handler(message))
            return pb.StepAnswer(seq=call.seq, **{kind: result})
        except ShardError as exc:
            return _step_error(call.seq, exc)
        except Exception as exc:  # never lose the stream (and every later call) to one call's fault
            logger.exception("step call {} failed", kind)
            return _step_error(call.seq, ShardError(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"))

    def serve_step_socket(self, path: str, inline: bool | None = None) -> None:
        """Serves the step socket at `path` on the model thread (shard/model_thread.py); Info names it.
        `inline`: the model thread writes the answers itself (None: on a CPU, ModelThread.serve_steps)."""
        if inline is None:
            # The benchmarks' stand-in forward (engine/standin.py) leaves the host free as a device does.
            inline = self.model.device.type == "cpu" and not isinstance(self.model.model, StandinForward)
        # A device step too short to hide an answer's conversion in: the model thread writes it.
        self._executor.serve_steps(open_step_listener(path), self._socket_step, inline=inline,
                                   device_ns=lambda: self.model.last_device_ns)
        self.step_socket = path

    def _socket_step(self, payload: bytes) -> Callable[[], bytes] | Deferred:
        """A step socket's call, run on the model thread as its unary twin runs there; returns what
        builds the answer's bytes (the model thread or its sender calls it). A Prefill's requests are
        converted here when that is cheap (our router sends token ids); a grammar to compile or a
        prompt to tokenize sends them to the tokenizer's thread first (Deferred), as the unary call does."""
        try:
            call = pb.StepCall.FromString(payload)
        except Exception as exc:  # noqa: BLE001: not a StepCall; its seq is unknown, so no answer can say so
            raise FrameError(f"a frame of {len(payload)} bytes is not a StepCall ({exc})") from None
        self.busy_since = time.monotonic()
        kind = call.WhichOneof("call")
        try:
            if kind is None:
                raise ShardError(grpc.StatusCode.INVALID_ARGUMENT, "a StepCall carries no call")
            message = getattr(call, kind)
            if kind == "decode":
                build = self._decode_work(message, self.ahead_steps)
            elif kind == "prefill":
                refused = self._prefill_refusals(message)
                if any(r.parameters.grammar_type != pb.GRAMMAR_TYPE_NONE or not r.input_ids
                       for r in message.batch.requests):
                    # Compiling grammars or tokenizing prompts would hold up every row's steps:
                    # done on the tokenizer's thread, the call goes on here afterwards.
                    future = self._tokenizer_pool.submit(self._convert_requests, message.batch, refused, False)
                    return Deferred(future, lambda done: self._socket_prefill(call.seq, message, done, refused))
                build = self._prefill_work(message, self._convert_requests(message.batch, refused, False), refused,
                                           self.ahead_steps)
            elif kind == "filter_batch":
                response = self._filter_batch_work(message)
                build = lambda: response  # noqa: E731
            else:
                response = self._clear_cache_work(message)
                build = lambda: response  # noqa: E731
        except Exception as exc:
            failed = _step_error(call.seq, self._shard_error(exc, kind)).SerializeToString()
            return lambda: failed
        finally:
            self.busy_since = None
        return self._answer_builder(call.seq, kind, build)

    def _socket_prefill(self, seq: int, request: pb.PrefillRequest, converted: Future,
                        refused: dict[int, RequestError] | None) -> Callable[[], bytes]:
        """A deferred Prefill of the step socket, on the model thread once its requests are converted."""
        self.busy_since = time.monotonic()
        try:
            build = self._prefill_work(request, converted.result(), refused, self.ahead_steps)
        except Exception as exc:
            failed = _step_error(seq, self._shard_error(exc, "prefill")).SerializeToString()
            return lambda: failed
        finally:
            self.busy_since = None
        return self._answer_builder(seq, "prefill", build)

    @staticmethod
    def _answer_builder(seq: int, kind: str, build: Callable) -> Callable[[], bytes]:
        def answer() -> bytes:
            try:
                data = pb.StepAnswer(seq=seq, **{kind: build()}).SerializeToString()
                if len(data) > MAX_FRAME_BYTES:  # (the gRPC stream's limit too)
                    raise ShardError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"the {kind} answer is {len(data)} bytes, over the {MAX_FRAME_BYTES}-byte limit")
                return data
            except ShardError as exc:
                return _step_error(seq, exc).SerializeToString()
            except Exception as exc:  # noqa: BLE001: the router waits for this seq: it gets an answer
                logger.exception("step call {} failed building its answer", kind)
                return _step_error(seq, ShardError(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")) \
                    .SerializeToString()

        return answer

    # -- helpers ---------------------------------------------------------------------
    def _generate(self, batch: Batch):
        """One model step. A step that raises leaves the batch half-updated and out of the
        cache for good (the caller fails its requests), so the KV blocks it assigned itself
        go back to the pool here; otherwise every model failure would leak them."""
        try:
            return self.model.generate_token(batch)
        except BaseException:
            self.model.release(batch)
            raise

    def _take_ahead(self, batch: Batch) -> "_Ahead | None":
        """The step computed ahead for `batch`, if it ran on exactly the batch's rows (counted)."""
        ahead = self._ahead.pop(batch.batch_id, None)
        if ahead is not None and ahead.source is batch and ahead.request_ids == batch.request_ids:
            self.ahead_hits += 1
            return ahead
        self.ahead_misses += 1
        return None

    def _commit_ahead(self, batch: Batch, ahead: "_Ahead") -> tuple[list[Generation], list[Batch], StepTimings]:
        """Makes a step computed ahead the batch's real step: its generations, and its next batch
        (which takes over the blocks) or nothing when every row finished."""
        if ahead.error is not None:
            # The step itself failed: fail the call as the plain step would have.
            self.model.release(batch)
            raise ahead.error
        if ahead.next_batch is None:
            self.model.release(batch)  # every row finished; the fork owned no blocks
            return list(ahead.generations), [], ahead.timings
        present = set(ahead.next_batch.request_ids)
        if len(present) != len(batch.request_ids):
            # Rows that finished inside a chain left it: their blocks go back as a FilterBatch's would.
            batch = self.model.filter(batch, [rid for rid in batch.request_ids if rid in present])
        ahead.next_batch.adopt_blocks(batch)
        return list(ahead.generations), [ahead.next_batch], ahead.timings

    @staticmethod
    def _renumber(batch: Batch | None, batch_id: int) -> Batch | None:
        """A step's next batch carries the id of the first batch it continues (TGI's rule)."""
        if batch is not None:
            batch.batch_id = batch_id
        return batch

    def _schedule_ahead(self, batch: Batch, chain: int = 1) -> None:
        """Queues the batch's next step (and up to `chain` - 1 after it) behind this call on the model thread."""
        if not self.decode_ahead:
            return
        self._executor.post(self._on_model_thread, self._run_ahead, batch, chain)

    def _run_ahead(self, batch: Batch, chain: int = 1) -> None:
        if self.cache.get(batch.batch_id) is not batch or batch.batch_id in self._ahead:
            return  # cleared, filtered or merged before the model thread got here
        alive = [s.request.id for s in batch.states if not s.finished]
        if not alive:
            return
        ahead = _Ahead(source=batch, request_ids=alive)
        self._chain_started_ns = time.perf_counter_ns()
        try:
            ahead.generations, ahead.next_batch, ahead.timings = self.model.generate_token(batch.fork(alive))
            ahead.steps = 1
            while ahead.steps < chain and ahead.next_batch is not None and not self._call_waiting():
                if not self._chain_step(ahead):
                    break
        except Exception as exc:  # kept for the call that commits this step (a replay would fail alike)
            logger.debug("decode ahead of batch {} failed: {!r}", batch.batch_id, exc)
            ahead.error = exc
        self._ahead[batch.batch_id] = ahead

    def _chain_step(self, ahead: "_Ahead") -> bool:
        """One more step ahead on the chain's own batch, its finished rows left out first (a
        step must not run them again). False: nothing to step (every row is done, or a row is
        still prefilling: prompt chunks are the router's to budget). A step that raises fails
        the whole chain: its batch is half-updated, as a plain step's would be."""
        batch = ahead.next_batch
        alive = [s.request.id for s in batch.states if not s.finished]
        if not alive or batch.prefilling:
            return False
        if len(alive) != len(batch.states):
            batch = batch.filter(alive, None)  # the chain's rows own no blocks (the cached batch does)
        generations, ahead.next_batch, timings = self.model.generate_token(batch)
        ahead.generations += generations
        ahead.timings = ahead.timings + timings
        ahead.steps += 1
        self.chained_steps += 1
        return True

    def _pop(self, batch_id: int) -> Batch:
        batch = self.cache.pop(batch_id, None)
        if batch is None:
            raise BatchNotFound(f"batch {batch_id} not found")
        return batch

    def _step_response(self, cls, generations, next_batch, timings: StepTimings, concat_ns,
                       refused: dict[int, RequestError] | None = None, chain: int = 1):
        """Caches the step's next batch and queues its step ahead; returns what builds the answer.

        The message is built by the caller, on the event loop's thread, while the model thread
        already runs the step ahead: converting every row's Generation is host work a decode step
        need not wait for. `refused`: the Prefill's requests refused on their own, each answered
        with its error."""
        mine = self._answers_for
        # TGI's split: each rank answers for the requests with id % world_size == rank, and the
        # router merges the ranks' answers (every rank still runs every request).
        answered = [g for g in generations if mine(g.request_id)]
        errors = [(i, str(e)) for i, e in (refused or {}).items() if mine(i)]
        info = None
        if next_batch is not None:
            self.cache[next_batch.batch_id] = next_batch
            info = next_batch.info()
            self._schedule_ahead(next_batch, chain)

        def message():
            resp = cls(
                generations=[generation_to_pb(g) for g in answered] +
                            [pb.Generation(request_id=i, error=e) for i, e in errors],
                forward_ns=timings.forward_ns,
                decode_ns=timings.decode_ns,
                total_ns=timings.total_ns,
            )
            if concat_ns is not None:
                resp.concat_ns = concat_ns
            if info is not None:
                resp.batch.CopyFrom(cached_batch_to_pb(info))
            return resp

        return message


async def serve_shard(
    model: CausalLM,
    uds_path: str,
    rank: int,
    world_size: int,
    memory_fraction: float,
    max_batch_total_tokens: int | None,
    stop: asyncio.Event,
    prefix_caching: bool = True,
    stall_timeout_s: float = 300.0,
    speculate: int = 0,
) -> None:
    """Serves one rank on `unix://{uds_path}-{rank}` until `stop` is set; `speculate`: the most
    n-gram tokens a decoding request proposes per step (0: none)."""
    model.speculate = speculate
    path = shard_uds(uds_path, rank)
    if os.path.exists(path):
        os.unlink(path)
    server = grpc.aio.server(
        options=[("grpc.max_send_message_length", 256 * 2**20), ("grpc.max_receive_message_length", 256 * 2**20)]
    )
    service = TextGenerationService(model, uds_path, world_size, memory_fraction, max_batch_total_tokens,
                                    prefix_caching, stall_timeout_s, rank)
    pb_grpc.add_TextGenerationServiceServicer_to_server(service, server)
    # The socket is owner-only: anyone who can connect can drive the model. gRPC binds
    # in add_insecure_port, so the umask must cover that call (start() is too late).
    old_umask = os.umask(0o077)
    try:
        server.add_insecure_port(f"unix://{path}")
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    await server.start()
    steps_path = path + STEP_SOCKET_SUFFIX
    try:
        service.serve_step_socket(steps_path)
        logger.info("shard {} listening on unix://{} (step socket {})", rank, path, steps_path)
    except OSError as exc:  # (a path over the unix socket's length limit, say): the Steps stream serves instead
        logger.warning("shard {} listening on unix://{}; no step socket at {}: {}", rank, path, steps_path, exc)
    try:
        await stop.wait()
    finally:
        await server.stop(grace=1.0)
        service.close()
        for socket_path in (path, steps_path):
            try:
                Path(socket_path).unlink()
            except FileNotFoundError:
                pass
