"""Talks to every shard at once: the same call fans out, rank 0's answer comes back.

All ranks must run the same sequence of batches (their collectives pair up), so
every state-changing call goes to every shard and waits for all of them.

With shards of ours (Info's `tgs-steps` metadata) the state-changing calls travel over one
connection per rank, opened once (`open_steps`): a message each way per call instead of a
unary call's new HTTP/2 stream, headers and trailers, which cost more host time than a decode
step of a small model. The connection is the rank's step socket (Info's `tgs-steps-socket`:
length-prefixed frames of the same messages, no gRPC on either side; utils/step_frames.py) or,
where a rank serves none or it cannot be reached, a gRPC `Steps` stream. TGS_STEP_STREAM picks:
`1` (the default: the socket where every rank serves one), `grpc` (the gRPC stream), `0` (the
unary calls). A TGI shard is driven with the unary calls. A failed call raises the same
`grpc.aio.AioRpcError` whichever carries it, so callers cannot tell them apart.
"""

from __future__ import annotations

import asyncio
import itertools
import os

import grpc
from loguru import logger

from text_generation_server.pb.generate.v3 import generate_pb2 as pb
from text_generation_server.pb.generate.v3 import generate_pb2_grpc as pb_grpc
from text_generation_server.utils.step_frames import FrameError, FrameProtocol

_OPTIONS = [("grpc.max_send_message_length", 256 * 2**20), ("grpc.max_receive_message_length", 256 * 2**20)]
STEP_STREAM_ENV = "TGS_STEP_STREAM"  # 1 (default): step socket, else Steps stream | grpc: Steps stream | 0: unary
_STEP_MODES = {"1": "socket", "true": "socket", "yes": "socket", "on": "socket", "socket": "socket", "grpc": "grpc",
               "0": "unary", "false": "unary", "no": "unary", "off": "unary"}
STEP_SOCKET_METADATA = "tgs-steps-socket"  # (shard/service.py's name; the router does not import the shard)
_STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}
# ShardClient method name -> the StepCall / StepAnswer field that carries it.
_STEP_FIELDS = {"Prefill": "prefill", "Decode": "decode", "FilterBatch": "filter_batch", "ClearCache": "clear_cache"}


class _Calls:
    """The calls of one rank's step connection waiting for their answers, by `seq`; `broken`: the
    error that ended the connection, which every waiting and later call gets."""

    def __init__(self, url: str):
        self.url = url
        self._pending: dict[int, asyncio.Future] = {}
        self._unwrap: dict[int, str] = {}  # seq -> the answer's field its future gets (`send_now`)
        self.broken: grpc.aio.AioRpcError | None = None

    def _expect(self, seq: int) -> asyncio.Future:
        if self.broken is not None:
            raise self.broken
        future = asyncio.get_running_loop().create_future()
        self._pending[seq] = future
        return future

    def _answered(self, answer: pb.StepAnswer) -> None:
        future = self._pending.pop(answer.seq, None)
        field = self._unwrap.pop(answer.seq, None) if self._unwrap else None
        if future is None or future.done():
            return
        if field is None:
            future.set_result(answer)
            return
        try:
            future.set_result(_answer_of(answer, field))
        except grpc.aio.AioRpcError as exc:
            future.set_exception(exc)

    def _break(self, error: grpc.aio.AioRpcError) -> None:
        self.broken = error
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)
        self._pending.clear()
        self._unwrap.clear()


class _StepStream(_Calls):
    """One rank's Steps stream: calls written in order, answers matched to them by `seq`.

    A stream that breaks (the rank went away, the channel closed) fails every call waiting on
    it and every later one with the stream's error; the client opens a new stream for the next
    call (`broken`)."""

    def __init__(self, stub: pb_grpc.TextGenerationServiceStub, url: str):
        super().__init__(url)
        self._call = stub.Steps()
        self._write_lock = asyncio.Lock()
        self._reader = asyncio.create_task(self._read(), name=f"steps-reader {url}")

    async def _read(self) -> None:
        try:
            while True:
                answer = await self._call.read()
                if answer is grpc.aio.EOF:
                    raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, details="the shard closed its Steps stream")
                self._answered(answer)
        except BaseException as exc:  # noqa: BLE001: every waiter must learn why, whatever it was
            self._break(exc if isinstance(exc, grpc.aio.AioRpcError) else grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, details=f"the Steps stream to {self.url} broke: {exc!r}"))
            if isinstance(exc, asyncio.CancelledError):
                raise
            if not isinstance(exc, grpc.aio.AioRpcError):
                logger.warning("Steps stream to {} broke: {!r}", self.url, exc)

    async def call(self, seq: int, step: pb.StepCall) -> pb.StepAnswer:
        future = self._expect(seq)
        try:
            async with self._write_lock:
                await self._call.write(step)
        except BaseException:
            self._pending.pop(seq, None)
            raise
        return await future

    async def close(self) -> None:
        self._call.cancel()
        self._reader.cancel()
        try:
            await self._reader
        except BaseException:  # noqa: BLE001: closing; its error was given to the waiters
            pass


class _SocketStepStream(_Calls):
    """One rank's step socket, with _StepStream's interface: calls written in order as frames,
    answers matched by `seq`. A connection that ends fails every waiting call and every later one
    with an UNAVAILABLE error, as a broken stream does, and the client opens a new one."""

    def __init__(self, url: str, path: str):
        super().__init__(url)
        self.path = path
        self._protocol = FrameProtocol(self._on_frame, self._on_lost)

    @classmethod
    async def open(cls, url: str, path: str) -> "_SocketStepStream":
        stream = cls(url, path)
        await asyncio.get_running_loop().create_unix_connection(lambda: stream._protocol, path)
        return stream

    def _on_frame(self, payload: bytes) -> None:
        try:
            answer = pb.StepAnswer.FromString(payload)
        except Exception as exc:  # noqa: BLE001: not an answer of ours: the connection is of no use
            self._protocol.fail(FrameError(f"{len(payload)} bytes from {self.path} are not a StepAnswer ({exc})"))
            return
        self._answered(answer)

    def _on_lost(self, exc: BaseException | None) -> None:
        why = f"the step socket {self.path} closed" + (f": {exc}" if exc is not None else "")
        if isinstance(exc, FrameError):
            logger.warning("{}", why)
        self._break(grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, details=why))

    async def call(self, seq: int, step: pb.StepCall) -> pb.StepAnswer:
        future = self._expect(seq)
        try:
            self._protocol.send(step.SerializeToString())
        except (ConnectionError, FrameError) as exc:
            self._pending.pop(seq, None)
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, details=f"the step socket {self.path}: {exc}") from None
        return await future

    def send_now(self, seq: int, step: pb.StepCall, field: str) -> asyncio.Future:
        """Writes `step` before returning; the future gets the answer's `field` (the unary call's
        response) or its failure, as `call` + `_answer_of` would, with no task in between."""
        future = self._expect(seq)
        try:
            self._protocol.send(step.SerializeToString())
        except (ConnectionError, FrameError) as exc:
            self._pending.pop(seq, None)
            future.set_exception(grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, details=f"the step socket {self.path}: {exc}"))
            return future
        self._unwrap[seq] = field
        return future

    async def close(self) -> None:
        if self._protocol.transport is not None:
            self._protocol.transport.close()


def _answer_of(answer: pb.StepAnswer, field: str):
    """The unary call's response carried by `answer`, or its failure raised as the unary call would."""
    kind = answer.WhichOneof("answer")
    if kind == "error":
        raise grpc.aio.AioRpcError(_STATUS_BY_NUMBER.get(answer.error.code, grpc.StatusCode.UNKNOWN),
                                   details=answer.error.message)
    if kind != field:
        raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL,
                                   details=f"the shard answered a {field} call with {kind or 'nothing'}")
    return getattr(answer, field)


def _values(trailing: dict[str, str], key: str) -> list[str]:
    value = trailing.get(key, "")
    return value.split(",") if value else []


class ShardClient:
    def __init__(self, urls: list[str]):
        if not urls:
            raise ValueError("no shard urls")
        self.urls = urls
        self._channels = [grpc.aio.insecure_channel(u, options=_OPTIONS) for u in urls]
        self._stubs = [pb_grpc.TextGenerationServiceStub(c) for c in self._channels]
        self._streams: list[_StepStream | _SocketStepStream] | None = None  # open_steps: one per rank
        self._socket_paths: list[str] | None = None  # the ranks' step sockets, when the streams are those
        self._seq = itertools.count()

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
        if self._streams is not None:
            await asyncio.gather(*(s.close() for s in self._streams), return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self._channels), return_exceptions=True)

    async def open_steps(self) -> bool:
        """Sends the state-changing calls over one connection per rank from now on, when every rank
        serves them: its step socket, else a gRPC Steps stream (TGS_STEP_STREAM, module docstring);
        False: the unary calls stay. A value of TGS_STEP_STREAM that is none of those is refused."""
        raw = os.environ.get(STEP_STREAM_ENV, "1")
        mode = _STEP_MODES.get(raw.strip().lower())
        if mode is None:
            raise ValueError(f"{STEP_STREAM_ENV}={raw!r}: expected 1 (the step socket, else the Steps stream), "
                             "grpc (the Steps stream) or 0 (unary calls)")
        if mode == "unary":
            logger.info("shard calls: unary ({}={})", STEP_STREAM_ENV, raw)
            return False
        trailing = await self._info_trailing_by_rank()
        if not all("1" in _values(t, "tgs-steps") for t in trailing):
            return False
        paths = [t.get(STEP_SOCKET_METADATA, "") for t in trailing]
        if mode == "socket" and all(paths):
            opened = await asyncio.gather(*(_SocketStepStream.open(url, path) for url, path in zip(self.urls, paths)),
                                          return_exceptions=True)
            failed = [o for o in opened if isinstance(o, BaseException)]
            if not failed:
                self._streams = list(opened)
                self._socket_paths = paths
                return True
            for o in opened:
                if not isinstance(o, BaseException):
                    await o.close()
            if not all(isinstance(f, OSError) for f in failed):
                raise failed[0]
            logger.warning("the ranks' step sockets cannot be reached ({!r}): Steps streams instead", failed[0])
        self._streams = [_StepStream(stub, url) for stub, url in zip(self._stubs, self.urls)]
        return True

    @property
    def streaming(self) -> bool:
        return self._streams is not None

    @property
    def step_transport(self) -> str:
        """What carries the state-changing calls, for the logs: step socket, Steps stream or unary."""
        if self._streams is None:
            return "unary calls"
        return "one step socket per rank" if self._socket_paths is not None else "one Steps stream per rank"

    async def _all(self, method: str, request, timeout: float | None = None):
        if self._streams is not None and method in _STEP_FIELDS and timeout is None:
            return await self._all_streamed(method, request)
        calls = [getattr(stub, method)(request, timeout=timeout) for stub in self._stubs]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return results

    async def _reopen(self, i: int) -> None:
        """A new connection to rank i for the next call; the broken one failed its own calls. A
        socket that cannot be reached fails this call as the rank's absence would (UNAVAILABLE)."""
        stream = self._streams[i]
        logger.warning("reopening the step connection to {}: {}", stream.url, stream.broken.details())
        await stream.close()
        if self._socket_paths is None:
            self._streams[i] = _StepStream(self._stubs[i], self.urls[i])
            return
        try:
            self._streams[i] = await _SocketStepStream.open(self.urls[i], self._socket_paths[i])
        except OSError as exc:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE,
                                       details=f"the step socket {self._socket_paths[i]}: {exc}") from None

    async def _all_streamed(self, method: str, request):
        field = _STEP_FIELDS[method]
        seq = next(self._seq)
        step = pb.StepCall(seq=seq, **{field: request})
        for i, stream in enumerate(self._streams):
            if stream.broken is not None:
                await self._reopen(i)
        streams = self._streams
        if len(streams) == 1:  # (one rank: no gather, its task and its callbacks, on every step)
            return [_answer_of(await streams[0].call(seq, step), field)]
        answers = await asyncio.gather(*(s.call(seq, step) for s in streams), return_exceptions=True)
        for a in answers:
            if isinstance(a, BaseException):
                raise a
        return [_answer_of(a, field) for a in answers]

    async def info(self) -> pb.InfoResponse:
        return (await self._all("Info", pb.InfoRequest()))[0]

    async def _info_metadata(self, key: str) -> list[str]:
        """The comma-separated values every rank puts under `key` in Info's trailing metadata."""
        return [v for values in await self._info_metadata_by_rank(key) for v in values]

    async def _info_metadata_by_rank(self, key: str) -> list[list[str]]:
        """Per rank, the comma-separated values it puts under `key` in Info's trailing metadata."""
        return [_values(trailing, key) for trailing in await self._info_trailing_by_rank()]

    async def _info_trailing_by_rank(self) -> list[dict[str, str]]:
        """Per rank, Info's trailing metadata as key -> value (the last value of a repeated key)."""
        ranks: list[dict[str, str]] = []
        for stub in self._stubs:
            call = stub.Info(pb.InfoRequest())
            await call
            ranks.append({k: value for k, value in (await call.trailing_metadata()) or () if isinstance(value, str)})
        return ranks

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

    def decode_now(self, batches: list[pb.CachedBatch]) -> asyncio.Future | None:
        """The Decode written to the rank's step socket before this returns, its answer (or failure)
        coming in the future returned, as `decode` would return or raise it; None where that cannot
        be (several ranks, a gRPC stream or unary calls, a connection to reopen): the caller runs
        `decode` as a task then.

        Why: the scheduler sends a step's Decode ahead while it streams the step before
        (`Scheduler._pipeline`); as a task, that is a task made, two turns of the event loop to get
        it to its write, and one more to hand its answer on: host time on the router's one thread,
        every token at batch 1 (issue #31)."""
        streams = self._streams
        if self._socket_paths is None or streams is None or len(streams) != 1 or streams[0].broken is not None:
            return None
        seq = next(self._seq)
        return streams[0].send_now(seq, pb.StepCall(seq=seq, decode=pb.DecodeRequest(batches=batches)), "decode")

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

    async def load_adapter(self, name: str, path: str) -> pb.AdapterInfo:
        """Every rank loads the LoRA adapter at `path` (checked by the router already) as `name`;
        rank 0's report comes back. When some rank refuses, the ranks that loaded it unload it
        again, so no rank is left holding an adapter the others lack; the first refusal (in rank
        order) is raised."""
        request = pb.LoadAdapterRequest(name=name, path=path)
        results = await asyncio.gather(*(stub.LoadAdapter(request) for stub in self._stubs), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            loaded = [stub for stub, r in zip(self._stubs, results) if not isinstance(r, BaseException)]
            undo = pb.UnloadAdapterRequest(name=name)
            await asyncio.gather(*(stub.UnloadAdapter(undo) for stub in loaded), return_exceptions=True)
            raise failed[0]
        return results[0].adapter

    async def unload_adapter(self, name: str, missing_ok: bool = False) -> None:
        """Every rank drops the adapter `name`. `missing_ok`: a rank that no longer has it (an
        earlier attempt dropped it there) counts as done."""
        request = pb.UnloadAdapterRequest(name=name)
        results = await asyncio.gather(*(stub.UnloadAdapter(request) for stub in self._stubs), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and not (
                    missing_ok and isinstance(r, grpc.aio.AioRpcError) and r.code() == grpc.StatusCode.NOT_FOUND):
                raise r

    async def filter_batch(self, batch_id: int, request_ids: list[int]) -> pb.CachedBatch | None:
        resp = (await self._all("FilterBatch", pb.FilterBatchRequest(batch_id=batch_id, request_ids=request_ids)))[0]
        return resp.batch if resp.HasField("batch") else None
