"""The client API (text_generation.v1.TextGeneration) on top of the scheduler.

Chat and ChatStream are Generate and GenerateStream on the prompt the model's chat template
renders from the messages (text_generation_server.generation.chat_template), tokenized without adding
special tokens again (the template wrote them), as transformers' apply_chat_template does.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from pathlib import Path
from typing import Iterable

import grpc
from google.protobuf.message import DecodeError
from loguru import logger
from tokenizers import Tokenizer

from text_generation_server.generation.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateMissing,
    load_chat_template,
)
from text_generation_server.generation import request_fields
from text_generation_server.generation.grammar import GrammarCompiler
from text_generation_server.router.metrics import Metrics
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
                 metrics: Metrics, *, model_folder: Path | None = None, eos_token_ids: Iterable[int] = (),
                 grammar_support: bool = True):
        """model_folder: where the chat template is read from (None: Chat is unavailable).
        eos_token_ids: the tokens that end a grammar's output. grammar_support: False refuses
        requests with a grammar (--disable-grammar-support)."""
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.limits = limits
        self.info = info
        self.metrics = metrics
        self.chat_template: ChatTemplate | None = None
        self.chat_unavailable = "the server was started without a model folder to read a chat template from"
        if model_folder is not None:
            self.chat_template, self.chat_unavailable = load_chat_template(model_folder)
        self.grammar_support = grammar_support
        self._eos_token_ids = set(eos_token_ids)
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    def _grammar_compiler(self, request: cpb.GenerateRequest) -> GrammarCompiler | None:
        """The tokenizer's grammar compiler, built by the first request with a grammar (reading
        a large vocabulary into llguidance takes about a second); None when grammars are off."""
        if not self.grammar_support or not request.parameters.HasField("grammar"):
            return None
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler.for_tokenizer(self.tokenizer, self._eos_token_ids)
            return self._grammars

    def _validate(self, request: cpb.GenerateRequest, add_special_tokens: bool = True):
        return validate(request, self.tokenizer, self.limits, self._grammar_compiler(request), add_special_tokens)

    async def _submit(self, request: cpb.GenerateRequest, context, add_special_tokens: bool = True) -> Entry:
        self.metrics.request_count.inc()
        started = time.monotonic()
        try:
            valid = await asyncio.to_thread(self._validate, request, add_special_tokens)
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
        # When a client cancels a stream while gRPC is writing to it, gRPC drops the handler's async
        # generator without closing it, so a `finally` inside would run only when the garbage
        # collector gets to it: the request would decode to its end and count as a success. The
        # RPC's done callback runs when the call ends, however it ends.
        context.add_done_callback(lambda _context: self._client_gone(entry))
        return entry

    def _client_gone(self, entry: Entry) -> None:
        """The call ended; a request still running has lost its client and is cancelled."""
        if not entry.done and not entry.cancelled:
            logger.bind(request_id=entry.id).info("request {} cancelled by the client", entry.id)
            self.scheduler.cancel(entry)

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
            self._client_gone(entry)

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
        return await self._generate(await self._submit(request, context), context)

    async def _generate(self, entry: Entry, context) -> cpb.GenerateResponse:
        gens = [g async for g in self._events(entry, context)]
        response = cpb.GenerateResponse(generated_text=gens[-1].generated_text.text)
        if entry.request.details:  # the contract: Details only when asked for
            response.details.CopyFrom(self._details(entry, gens))
        return response

    async def GenerateStream(self, request, context):
        async for msg in self._stream(await self._submit(request, context), context):
            yield msg

    async def Chat(self, request, context):
        return await self._generate(await self._submit_chat(request, context), context)

    async def ChatStream(self, request, context):
        async for msg in self._stream(await self._submit_chat(request, context), context):
            yield msg

    async def _submit_chat(self, request: cpb.ChatRequest, context) -> Entry:
        """The conversation rendered by the chat template, then queued as a Generate of that prompt."""
        try:
            if self.chat_template is None:
                raise ChatTemplateMissing(self.chat_unavailable)
            prompt = await asyncio.to_thread(self._render_chat, self.chat_template, request)
        except ChatTemplateMissing as exc:  # the server's lack, not the request's fault
            self._count_refused()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except (ValidationError, ChatTemplateError) as exc:
            self._count_refused()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        generate = cpb.GenerateRequest(inputs=prompt, parameters=request.parameters)
        return await self._submit(generate, context, add_special_tokens=False)

    def _count_refused(self) -> None:
        """A chat refused before it became a Generate counts as a request that failed validation."""
        self.metrics.request_count.inc()
        self.metrics.request_failure.labels(err="validation").inc()

    def _render_chat(self, template: ChatTemplate, request: cpb.ChatRequest) -> str:
        if not request.messages:
            raise ValidationError("messages must hold at least one message")
        chars = 0
        for i, message in enumerate(request.messages):
            if not message.role:
                raise ValidationError(f"messages[{i}].role must not be empty")
            chars += len(message.content)
        if chars > self.limits.max_input_chars:  # before rendering: the template may repeat them
            raise ValidationError(
                f"messages have {chars} characters, more than the limit of {self.limits.max_input_chars}")
        return template.render([{"role": m.role, "content": m.content} for m in request.messages])

    async def _stream(self, entry: Entry, context):
        """One message per token. A speculative step's Generation carries several tokens (and one
        top_tokens entry per token); each goes out as its own message, the last one of the request
        with the generated text and details."""
        gens: list[spb.Generation] = []
        async for g in self._events(entry, context):
            gens.append(g)
            tokens = _tokens(g.tokens)
            for i, token in enumerate(tokens):
                msg = cpb.GenerateStreamResponse(token=token)
                if i < len(g.top_tokens):
                    msg.top_tokens.extend(_tokens(g.top_tokens[i]))
                if i == len(tokens) - 1 and g.HasField("generated_text"):
                    msg.generated_text = g.generated_text.text
                    if entry.request.details:
                        msg.details.CopyFrom(self._details(entry, gens))
                yield msg

    async def Tokenize(self, request, context):
        try:
            request_fields.inputs(request.inputs, self.limits.max_input_chars, allow_empty=True)
        except request_fields.InvalidField as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.client_message())
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
