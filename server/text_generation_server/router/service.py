"""The client API (text_generation.v1.TextGeneration) on top of the scheduler."""

from __future__ import annotations

import asyncio
import inspect
import math
import time

import grpc
from google.protobuf.message import DecodeError
from loguru import logger
from tokenizers import Tokenizer

from text_generation_server.metrics import Metrics
from text_generation_server.pb.generate.v3 import generate_pb2 as spb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc
from text_generation_server.router.scheduler import Entry, Scheduler, StepFailed
from text_generation_server.router.validation import Limits, ValidationError, validate

# generate.v3 FinishReason (0-based) -> text_generation.v1 FinishReason (0 = unspecified)
_FINISH = {0: cpb.FINISH_REASON_LENGTH, 1: cpb.FINISH_REASON_EOS_TOKEN, 2: cpb.FINISH_REASON_STOP_SEQUENCE}


def _tokens(t: spb.Tokens) -> list[cpb.Token]:
    return [
        cpb.Token(id=i, text=text, logprob=lp, special=sp)
        for i, text, lp, sp in zip(t.ids, t.texts, t.logprobs, t.is_special)
    ]


class TextGenerationService(cpb_grpc.TextGenerationServicer):
    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, limits: Limits, info: cpb.InfoResponse,
                 metrics: Metrics):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.limits = limits
        self.info = info
        self.metrics = metrics

    async def _submit(self, request: cpb.GenerateRequest, context) -> Entry:
        self.metrics.request_count.inc()
        started = time.monotonic()
        try:
            valid = await asyncio.to_thread(validate, request, self.tokenizer, self.limits)
        except ValidationError as exc:
            self.metrics.request_failure.labels(err="validation").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.metrics.request_validation_duration.observe(time.monotonic() - started)
        self.metrics.input_length.observe(valid.input_length)  # per valid request, as TGI's validation does
        self.metrics.max_new_tokens.observe(valid.max_new_tokens)
        try:
            entry = self.scheduler.submit(valid)
        except StepFailed as exc:
            reason = "overloaded" if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED else "unavailable"
            self.metrics.request_failure.labels(err=reason).inc()
            await context.abort(exc.code, str(exc))
        logger.bind(request_id=entry.id).info(
            "request {} queued: {} input tokens, max_new_tokens {}", entry.id, valid.input_length,
            valid.max_new_tokens,
        )
        return entry

    async def _events(self, entry: Entry, context):
        """Yields the shard generations of one request; cancels it if the client goes away."""
        try:
            while True:
                event = await entry.events.get()
                if isinstance(event, StepFailed):
                    logger.bind(request_id=entry.id).warning("request {} failed: {}", entry.id, event)
                    await context.abort(event.code, str(event))
                yield event
                if event.HasField("generated_text"):
                    logger.bind(request_id=entry.id).info(
                        "request {} done: {} tokens", entry.id, event.generated_text.generated_tokens
                    )
                    return
        finally:
            if not entry.done:
                logger.bind(request_id=entry.id).info("request {} cancelled by the client", entry.id)
                self.scheduler.cancel(entry)

    def _details(self, entry: Entry, gens: list[spb.Generation]) -> cpb.Details:
        last = gens[-1].generated_text
        details = cpb.Details(
            finish_reason=_FINISH.get(last.finish_reason, cpb.FINISH_REASON_UNSPECIFIED),
            generated_tokens=last.generated_tokens,
        )
        if last.HasField("seed"):
            details.seed = last.seed
        if entry.request.details:
            for g in gens:
                details.tokens.extend(_tokens(g.tokens))
                if entry.request.top_n_tokens:
                    for top in g.top_tokens:
                        details.top_tokens.append(cpb.TopTokens(tokens=_tokens(top)))
        first = gens[0]
        if entry.request.decoder_input_details and first.HasField("prefill_tokens"):
            p = first.prefill_tokens
            for i, (tid, text, lp) in enumerate(zip(p.ids, p.texts, p.logprobs)):
                tok = cpb.PrefillToken(id=tid, text=text)
                if i > 0 and not math.isnan(lp):
                    tok.logprob = lp
                details.prefill.append(tok)
        return details

    async def Generate(self, request, context):
        entry = await self._submit(request, context)
        gens = [g async for g in self._events(entry, context)]
        response = cpb.GenerateResponse(generated_text=gens[-1].generated_text.text)
        if entry.request.details:  # the contract: Details only when asked for
            response.details.CopyFrom(self._details(entry, gens))
        return response

    async def GenerateStream(self, request, context):
        entry = await self._submit(request, context)
        gens: list[spb.Generation] = []
        async for g in self._events(entry, context):
            gens.append(g)
            tokens = _tokens(g.tokens)
            msg = cpb.GenerateStreamResponse(token=tokens[0])
            for top in g.top_tokens:
                msg.top_tokens.extend(_tokens(top))
            if g.HasField("generated_text"):
                msg.generated_text = g.generated_text.text
                if entry.request.details:
                    msg.details.CopyFrom(self._details(entry, gens))
            yield msg

    async def Tokenize(self, request, context):
        if len(request.inputs) > self.limits.max_input_chars:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"inputs has {len(request.inputs)} characters, more than the limit of {self.limits.max_input_chars}",
            )
        add = request.add_special_tokens if request.HasField("add_special_tokens") else True
        enc = await asyncio.to_thread(self.tokenizer.encode, request.inputs, add_special_tokens=add)
        tokens = [
            cpb.SimpleToken(id=i, text=request.inputs[start:stop], start=start, stop=stop)
            for i, (start, stop) in zip(enc.ids, enc.offsets)
        ]
        return cpb.TokenizeResponse(tokens=tokens)

    async def Info(self, request, context):
        return self.info


class _Malformed:
    """What a request message that does not parse turns into, so its call can say why."""

    def __init__(self, message: str):
        self.message = message


def _lenient(deserializer):
    def parse(data: bytes):
        try:
            return deserializer(data)
        except DecodeError as exc:
            return _Malformed(f"the request message does not parse: {exc}")

    return parse


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT for a request message that does not parse.

    gRPC's own answer is UNKNOWN ("Unexpected DecodeError"), which reads like a server
    fault; corrupt bytes or bad UTF-8 are the client's error. Applies to every
    unary-request method (the client API and health); streaming requests pass through.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse = _lenient(handler.request_deserializer)
        if not handler.response_streaming:
            inner = handler.unary_unary

            async def unary(request, context):
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(
                unary, request_deserializer=parse, response_serializer=handler.response_serializer)
        inner = handler.unary_stream
        if inspect.isasyncgenfunction(inner):
            async def stream(request, context):
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                async for message in inner(request, context):
                    yield message
        else:  # a coroutine that writes with context.write (e.g. health's Watch)
            async def stream(request, context):
                if isinstance(request, _Malformed):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
                return await inner(request, context)

        return grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=parse, response_serializer=handler.response_serializer)
