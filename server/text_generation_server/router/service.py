"""The client API (text_generation.v1.TextGeneration) on top of the scheduler.

Chat and ChatStream are Generate and GenerateStream on the prompt the model's chat template
renders from the messages (text_generation_server.generation.chat_template), tokenized without adding
special tokens again (the template wrote them), as transformers' apply_chat_template does.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

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
from text_generation_server.generation import request_fields, tool_calls
from text_generation_server.generation.grammar import GrammarCompiler, GrammarError, GrammarSpec, GrammarType
from text_generation_server.generation.tool_calls import Choice, Tool, ToolCall, ToolCallParser, ToolError
from text_generation_server.router.adapter_admin import AdapterAdmin
from text_generation_server.router.adapters import AdapterError, LoadPolicy
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


_PROTO_CHOICE = {cpb.TOOL_CHOICE_NONE: Choice.NONE, cpb.TOOL_CHOICE_AUTO: Choice.AUTO,
                 cpb.TOOL_CHOICE_REQUIRED: Choice.REQUIRED, cpb.TOOL_CHOICE_FUNCTION: Choice.FUNCTION}


class Refused(Exception):
    """A request the server does not run (or stops running), with the gRPC status it answers; the
    HTTP APIs map the same status to theirs."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Conversation:
    """A chat request from either door: messages as the template reads them (role, content,
    tool_calls with parsed arguments, tool_call_id), the tools, and the choice."""

    messages: list[dict[str, Any]]
    parameters: cpb.GenerateParameters
    tools: list[Tool] = field(default_factory=list)
    choice: Choice | None = None
    function: str | None = None


@dataclass(frozen=True)
class ChatPlan:
    """How a chat's answer is read: its tool choice, the named tool, and the parser for auto."""

    mode: Choice
    named: Tool | None
    parser: ToolCallParser | None

    def calls(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of the answer's raw text (special tokens included but the final EOS)."""
        if self.mode in (Choice.REQUIRED, Choice.FUNCTION):
            found = tool_calls.forced_call(self.mode, self.named, text)
            return ("" if found else text), found
        if self.mode is Choice.AUTO and self.parser is not None:
            return self.parser.parse(text)
        return text, []


def raw_text(gens: list[spb.Generation]) -> str:
    """The answer with its special tokens (a [TOOL_CALLS] marker may be one), less the final EOS."""
    texts = [t for g in gens for t in g.tokens.texts]
    last = gens[-1] if gens and gens[-1].HasField("generated_text") else None
    # A grammar that is complete ends the answer with no EOS token: then the last token is text.
    if (last is not None and last.generated_text.finish_reason == spb.FINISH_REASON_EOS_TOKEN
            and last.tokens.is_special and last.tokens.is_special[-1]):
        texts = texts[:-1]
    return "".join(texts)


def proto_calls(calls: list[ToolCall]) -> list[cpb.ToolCall]:
    return [cpb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls]


def conversation_of(request: cpb.ChatRequest) -> Conversation:
    """A ChatRequest as the template and the tool machinery read it; ToolError naming the field."""
    messages = []
    for i, m in enumerate(request.messages):
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            message["tool_calls"] = tool_calls.message_calls([
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in m.tool_calls], f"messages[{i}]")
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        messages.append(message)
    tools = []
    for i, t in enumerate(request.tools):
        where = f"tools[{i}]"
        try:
            parameters = json.loads(t.parameters) if t.parameters else None
        except (ValueError, RecursionError) as exc:
            raise ToolError(f"{where}.parameters is not JSON: {str(exc)[:200]}") from None
        tools.append(tool_calls.tool(t.name, t.description, parameters, where))
    if request.tool_choice not in (cpb.TOOL_CHOICE_UNSPECIFIED, *_PROTO_CHOICE):
        raise ToolError(f"tool_choice {request.tool_choice} is not a ToolChoice")
    parameters = request.parameters
    if request.adapter_id:
        given = parameters.adapter_id if parameters.HasField("adapter_id") else ""
        if given and given != request.adapter_id:
            raise ToolError(f"adapter_id {request.adapter_id!r} and parameters.adapter_id {given!r} differ")
        parameters = cpb.GenerateParameters()
        parameters.CopyFrom(request.parameters)
        parameters.adapter_id = request.adapter_id
    return Conversation(messages, parameters, tools, _PROTO_CHOICE.get(request.tool_choice),
                        request.tool_choice_function or None)


class TextGenerationService(cpb_grpc.TextGenerationServicer):
    """The gRPC client API, and the core the HTTP APIs (router/http/) run their requests through:
    submit / submit_chat / events raise Refused instead of answering a gRPC context, so every door
    validates, queues and counts a request the same way."""

    def __init__(self, scheduler: Scheduler, tokenizer: Tokenizer, limits: Limits, info: cpb.InfoResponse,
                 metrics: Metrics, *, model_folder: Path | None = None, eos_token_ids: Iterable[int] = (),
                 grammar_support: bool = True, tool_call_parser: str | None = None,
                 load_policy: LoadPolicy | None = None, drain_timeout_s: float = 60.0):
        """model_folder: where the chat template is read from (None: Chat is unavailable).
        load_policy: whether and from where LoRA adapters may be loaded at run time (default:
        not at all). drain_timeout_s: how long an unload waits for the adapter's requests.
        eos_token_ids: the tokens that end a grammar's output. grammar_support: False refuses
        requests with a grammar (--disable-grammar-support). tool_call_parser: the syntax of
        the model's tool calls (--tool-call-parser); None reads it from the template."""
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.limits = limits
        self.info = info
        self.metrics = metrics
        self.chat_template: ChatTemplate | None = None
        self.chat_unavailable = "the server was started without a model folder to read a chat template from"
        if model_folder is not None:
            self.chat_template, self.chat_unavailable = load_chat_template(model_folder)
        self.tool_parser: ToolCallParser | None = None
        if self.chat_template is not None:
            self.tool_parser = tool_calls.parser_for(self.chat_template.text, tool_call_parser)
            logger.info("tool calls (tool_choice auto) are read as {}", self.tool_parser.name)
        self.grammar_support = grammar_support
        self.adapter_admin = AdapterAdmin(scheduler, load_policy or LoadPolicy(None, False), metrics, drain_timeout_s)
        self._eos_token_ids = set(eos_token_ids)
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    def _compiler(self) -> GrammarCompiler | None:
        """The tokenizer's grammar compiler, built by the first request with a grammar (reading
        a large vocabulary into llguidance takes about a second); None when grammars are off."""
        if not self.grammar_support:
            return None
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler.for_tokenizer(self.tokenizer, self._eos_token_ids)
            return self._grammars

    def _validate(self, request: cpb.GenerateRequest, add_special_tokens: bool = True):
        grammars = self._compiler() if request.parameters.HasField("grammar") else None
        return validate(request, self.tokenizer, self.limits, grammars, add_special_tokens)

    # -- the core every door uses ---------------------------------------------------------------
    async def submit(self, request: cpb.GenerateRequest, add_special_tokens: bool = True) -> Entry:
        """Validates and queues a request; Refused with the status a client gets otherwise."""
        adapter_id = request.parameters.adapter_id if request.parameters.HasField("adapter_id") else ""
        if adapter_id:
            try:
                self.scheduler.adapters.usable(adapter_id)
            except AdapterError as exc:  # counted under the base: a made-up name never becomes a label
                self._count_refused()
                raise Refused(exc.code, exc.message) from None
        self.metrics.request_count.labels(adapter=adapter_id).inc()
        started = time.monotonic()
        try:
            valid = await asyncio.to_thread(self._validate, request, add_special_tokens)
        except ValidationError as exc:
            self.metrics.request_failure.labels(err="validation", adapter=adapter_id).inc()
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        valid.adapter_id = adapter_id
        self.metrics.request_validation_duration.observe(time.monotonic() - started)
        self.metrics.input_length.observe(valid.input_length)  # per valid request, as TGI's validation does
        self.metrics.max_new_tokens.observe(valid.max_new_tokens)
        try:
            entry = self.scheduler.submit(valid)
        except StepFailed as exc:
            reason = {grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
                      grpc.StatusCode.NOT_FOUND: "validation"}.get(exc.code, "unavailable")
            self.metrics.request_failure.labels(err=reason, adapter=adapter_id).inc()
            raise Refused(exc.code, str(exc)) from None
        logger.bind(request_id=entry.id).info(
            "request {} queued: {} input tokens, max_new_tokens {}{}", entry.id, valid.input_length,
            valid.max_new_tokens, f", adapter {adapter_id}" if adapter_id else "",
        )
        return entry

    async def submit_chat(self, conversation: Conversation) -> tuple[Entry, ChatPlan]:
        """The conversation rendered by the chat template (with its tools), then queued as a
        Generate of that prompt; a forced tool choice sets the answer's grammar."""
        try:
            if self.chat_template is None:
                raise ChatTemplateMissing(self.chat_unavailable)
            generate, plan = await asyncio.to_thread(self._chat_request, self.chat_template, conversation)
        except ChatTemplateMissing as exc:  # the server's lack, not the request's fault
            self._count_refused()
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
        except (ValidationError, ChatTemplateError, ToolError) as exc:
            self._count_refused()
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        return await self.submit(generate, add_special_tokens=False), plan

    def cancel(self, entry: Entry) -> None:
        """The client is gone: a request still running is cancelled."""
        if not entry.done and not entry.cancelled:
            logger.bind(request_id=entry.id).info("request {} cancelled by the client", entry.id)
            self.scheduler.cancel(entry)

    async def events(self, entry: Entry):
        """Yields the shard generations of one request; Refused when a step fails. Cancels the
        request when the consumer stops early (the client went away)."""
        try:
            while True:
                event = await entry.events.get()
                if isinstance(event, StepFailed):
                    logger.bind(request_id=entry.id).warning("request {} failed: {}", entry.id, event)
                    raise Refused(event.code, str(event))
                yield event
                if event.HasField("generated_text"):
                    logger.bind(request_id=entry.id).info(
                        "request {} done: {} tokens", entry.id, event.generated_text.generated_tokens
                    )
                    return
        finally:
            self.cancel(entry)

    def details(self, entry: Entry, gens: list[spb.Generation]) -> cpb.Details:
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

    # -- chat ------------------------------------------------------------------------------------
    def _count_refused(self) -> None:
        """A chat refused before it became a Generate counts as a request that failed validation."""
        self.metrics.request_count.labels(adapter="").inc()
        self.metrics.request_failure.labels(err="validation", adapter="").inc()

    def _chat_request(self, template: ChatTemplate, chat: Conversation) -> tuple[cpb.GenerateRequest, ChatPlan]:
        if not chat.messages:
            raise ValidationError("messages must hold at least one message")
        chars = 0
        for i, message in enumerate(chat.messages):
            if not message.get("role"):
                raise ValidationError(f"messages[{i}].role must not be empty")
            chars += len(message.get("content") or "")
        chars += sum(len(json.dumps(t.parameters)) + len(t.description) for t in chat.tools)
        if chars > self.limits.max_input_chars:  # before rendering: the template may repeat them
            raise ValidationError(
                f"messages and tools have {chars} characters, more than the limit of {self.limits.max_input_chars}")
        tool_calls.check_unique(chat.tools)
        mode, named = tool_calls.choice(chat.choice, chat.function, chat.tools)
        self._check_tool_schemas(chat.tools)
        prompt = template.render(chat.messages, tools=[t.for_template() for t in chat.tools] or None)
        parameters = cpb.GenerateParameters()
        parameters.CopyFrom(chat.parameters)
        schema = tool_calls.forced_schema(mode, chat.tools, named)
        if schema is not None:
            if parameters.HasField("grammar"):
                raise ToolError(f"parameters.grammar cannot be combined with tool_choice {mode.value!r}, "
                                "which constrains the answer itself")
            parameters.grammar.CopyFrom(cpb.Grammar(type=cpb.GRAMMAR_TYPE_JSON, value=json.dumps(schema)))
        return cpb.GenerateRequest(inputs=prompt, parameters=parameters), ChatPlan(mode, named, self.tool_parser)

    def _check_tool_schemas(self, tools: list[Tool]) -> None:
        """Each tool's schema compiles (llguidance reads it as the grammar of a forced call would),
        so an invalid one is refused naming the tool, whatever the choice."""
        compiler = self._compiler() if tools else None
        if compiler is None:
            return
        for i, t in enumerate(tools):
            try:
                compiler.compile(GrammarSpec(GrammarType.JSON, json.dumps(t.parameters)))
            except GrammarError as exc:
                raise ToolError(f"tools[{i}].function.parameters ({t.name}) is not a usable JSON schema: {exc}") \
                    from None

    # -- gRPC ------------------------------------------------------------------------------------
    async def _grpc_submit(self, request: cpb.GenerateRequest, context) -> Entry:
        try:
            entry = await self.submit(request)
        except Refused as exc:
            await context.abort(exc.code, exc.message)
        self._watch(entry, context)
        return entry

    async def _grpc_chat(self, request: cpb.ChatRequest, context) -> tuple[Entry, ChatPlan]:
        try:
            try:
                conversation = conversation_of(request)
            except ToolError as exc:
                self._count_refused()
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            entry, plan = await self.submit_chat(conversation)
        except Refused as exc:
            await context.abort(exc.code, exc.message)
        self._watch(entry, context)
        return entry, plan

    def _watch(self, entry: Entry, context) -> None:
        # When a client cancels a stream while gRPC is writing to it, gRPC drops the handler's async
        # generator without closing it, so a `finally` inside would run only when the garbage
        # collector gets to it: the request would decode to its end and count as a success. The
        # RPC's done callback runs when the call ends, however it ends.
        context.add_done_callback(lambda _context: self.cancel(entry))

    async def _grpc_events(self, entry: Entry, context):
        try:
            async for event in self.events(entry):
                yield event
        except Refused as exc:
            await context.abort(exc.code, exc.message)

    async def Generate(self, request, context):
        return await self._generate(await self._grpc_submit(request, context), context)

    async def _generate(self, entry: Entry, context, plan: ChatPlan | None = None) -> cpb.GenerateResponse:
        gens = [g async for g in self._grpc_events(entry, context)]
        response = cpb.GenerateResponse(generated_text=gens[-1].generated_text.text)
        if entry.request.details:  # the contract: Details only when asked for
            response.details.CopyFrom(self.details(entry, gens))
        if plan is not None:
            response.tool_calls.extend(proto_calls(plan.calls(raw_text(gens))[1]))
        return response

    async def GenerateStream(self, request, context):
        async for msg in self._stream(await self._grpc_submit(request, context), context):
            yield msg

    async def Chat(self, request, context):
        entry, plan = await self._grpc_chat(request, context)
        return await self._generate(entry, context, plan)

    async def ChatStream(self, request, context):
        entry, plan = await self._grpc_chat(request, context)
        async for msg in self._stream(entry, context, plan):
            yield msg

    async def _stream(self, entry: Entry, context, plan: ChatPlan | None = None):
        """One message per token. A speculative step's Generation carries several tokens (and one
        top_tokens entry per token); each goes out as its own message, the last one of the request
        with the generated text and details (and a chat's tool calls)."""
        gens: list[spb.Generation] = []
        async for g in self._grpc_events(entry, context):
            gens.append(g)
            t = g.tokens
            last = min(len(t.ids), len(t.texts), len(t.logprobs), len(t.is_special)) - 1
            for i, (tid, text, logprob, special) in enumerate(zip(t.ids, t.texts, t.logprobs, t.is_special)):
                # Filled in place: a cpb.Token built first and copied in costs ~2.8x as much (issue #31).
                # SetInParent: the token is on the wire even when every field is its default, as before.
                msg = cpb.GenerateStreamResponse()
                token = msg.token
                token.SetInParent()
                token.id = tid
                token.text = text
                token.logprob = logprob
                token.special = special
                if i < len(g.top_tokens):
                    msg.top_tokens.extend(_tokens(g.top_tokens[i]))
                if i == last and g.HasField("generated_text"):
                    msg.generated_text = g.generated_text.text
                    if entry.request.details:
                        msg.details.CopyFrom(self.details(entry, gens))
                    if plan is not None:
                        msg.tool_calls.extend(proto_calls(plan.calls(raw_text(gens))[1]))
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

    def current_info(self) -> cpb.InfoResponse:
        """Info with the adapters loaded now."""
        info = cpb.InfoResponse()
        info.CopyFrom(self.info)
        info.adapters.extend(self.adapter_admin.list())
        info.adapter_loading = self.adapter_admin.policy.open
        return info

    async def Info(self, request, context):
        return self.current_info()

    # -- LoRA adapters (router/adapter_admin.py) -------------------------------------------------
    async def LoadAdapter(self, request, context):
        try:
            info = await self.adapter_admin.load(request.name, request.path)
        except AdapterError as exc:
            await context.abort(exc.code, exc.message)
        return cpb.LoadAdapterResponse(adapter=info)

    async def UnloadAdapter(self, request, context):
        try:
            await self.adapter_admin.unload(request.name)
        except AdapterError as exc:
            await context.abort(exc.code, exc.message)
        return cpb.UnloadAdapterResponse()

    async def ListAdapters(self, request, context):
        return cpb.ListAdaptersResponse(adapters=self.adapter_admin.list())


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
