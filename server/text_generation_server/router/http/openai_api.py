"""OpenAI's API: POST /v1/chat/completions, POST /v1/completions, GET /v1/models.

`model` names the base model or one of the loaded LoRA adapters, as vLLM reads it; /v1/models
lists the base model and every adapter loaded now (an adapter's card has the base as `parent`);
vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter are LoadAdapter and UnloadAdapter,
under the same opt-ins (--lora-load-dir, an API key or --lora-load-without-api-key).

Each choice is one request to the core (n copies of a prompt, each prompt of /v1/completions),
validated, queued and counted like a gRPC request. Streaming answers are server-sent events,
`data: {chunk}` per step and `data: [DONE]` at the end; with stream_options.include_usage a last
chunk carries the usage (and every other chunk `"usage": null`), as OpenAI sends them. A matched
stop sequence is left out of the text, as OpenAI does.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from text_generation_server.generation.tool_calls import Choice, ToolCall, ToolCallStream
from text_generation_server.pb.generate.v3 import generate_pb2 as spb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.router.http import openai_requests as reqs
from text_generation_server.router.http.body import Fields, read_json
from text_generation_server.router.http.core import (
    HttpContext, StopTrimmer, collect, finished, merged, step_texts, submit, trim_stop,
)
from text_generation_server.router.adapters import AdapterError
from text_generation_server.router.http.errors import HttpError, bad_request, from_status
from text_generation_server.router.scheduler import Entry
from text_generation_server.router.service import ChatPlan, Refused

_FINISH = {spb.FINISH_REASON_LENGTH: "length", spb.FINISH_REASON_EOS_TOKEN: "stop",
           spb.FINISH_REASON_STOP_SEQUENCE: "stop"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


def _completion_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def _calls_json(calls: list[ToolCall], indexed: bool = False) -> list[dict]:
    out = []
    for i, c in enumerate(calls):
        item: dict[str, Any] = {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        if indexed:
            item = {"index": i, **item}
        out.append(item)
    return out


def _chat_logprobs(g: spb.Generation) -> list[dict]:
    items = []
    for i, (text, lp) in enumerate(zip(g.tokens.texts, g.tokens.logprobs)):
        top = []
        if i < len(g.top_tokens):
            t = g.top_tokens[i]
            top = [{"token": tt, "logprob": tl, "bytes": list(tt.encode())} for tt, tl in zip(t.texts, t.logprobs)]
        items.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": top})
    return items


def _completion_logprobs(gens: list[spb.Generation], offset: int) -> dict:
    tokens: list[str] = []
    lps: list[float] = []
    tops: list[dict | None] = []
    offsets: list[int] = []
    at = offset
    for g in gens:
        for i, (text, lp) in enumerate(zip(g.tokens.texts, g.tokens.logprobs)):
            tokens.append(text)
            lps.append(lp)
            offsets.append(at)
            at += len(text)
            if i < len(g.top_tokens):
                tops.append(dict(zip(g.top_tokens[i].texts, g.top_tokens[i].logprobs)))
            else:
                tops.append(None)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


# The core names fields as the client API does; an OpenAI client sent them under these names.
_OPENAI_NAMES = (("parameters.max_new_tokens", "max_tokens"), ("parameters.grammar.value", "response_format"),
                 ("parameters.grammar", "response_format"), ("parameters.stop", "stop"),
                 ("parameters.ignore_eos_token", "ignore_eos"))


def openai_error(error: HttpError, chat: bool) -> HttpError:
    """A refusal of the core, its field named as the OpenAI client sent it."""
    if error.status != 400:
        return error
    message = error.message.replace("; shorten it or set parameters.truncate", "; shorten it")
    names = _OPENAI_NAMES + (("parameters.top_n_tokens", "top_logprobs" if chat else "logprobs"),
                             ("inputs", "messages" if chat else "prompt"), ("parameters.", ""))
    for ours, theirs in names:
        if message.startswith(ours):
            message = theirs + message[len(ours):]
            return HttpError(error.status, message, error.kind, message.split(" ")[0].rstrip(":") or None, error.code)
    return HttpError(error.status, message, error.kind, error.param, error.code)


class OpenAIApi:
    def __init__(self, ctx: HttpContext):
        self.ctx = ctx

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"]),
        ]

    # -- models ----------------------------------------------------------------------------------
    def _model_card(self, adapter: str = "") -> dict:
        """The base model's card, or a LoRA adapter's (vLLM's shape: `parent` the base model,
        `root` the adapter's folder)."""
        card = {"id": adapter or self.ctx.model_id, "object": "model", "created": self.ctx.created,
                "owned_by": "text-generation-server", "root": self.ctx.model_id, "parent": None}
        if adapter:
            card.update(root=self.ctx.service.scheduler.adapters.get(adapter).info.path, parent=self.ctx.model_id)
        return card

    async def models(self, request: Request) -> JSONResponse:
        adapters = self.ctx.service.scheduler.adapters.names()
        return JSONResponse({"object": "list", "data": [self._model_card(a) for a in ["", *adapters]]})

    async def model(self, request: Request) -> JSONResponse:
        return JSONResponse(self._model_card(self.ctx.model_adapter(request.path_params["model"])))

    # -- LoRA adapters at run time, as vLLM's endpoints take them (router/adapter_admin.py) ----------
    async def load_lora_adapter(self, request: Request) -> PlainTextResponse:
        """vLLM's {"lora_name", "lora_path"}: LoadAdapter, with its opt-ins and path checks."""
        f = Fields(await read_json(request, self.ctx.max_body_bytes))
        name, path = f.string("lora_name"), f.string("lora_path")
        if not name or not path:
            raise bad_request("lora_name and lora_path are required (strings)", "lora_name" if not name else "lora_path")
        try:
            await self.ctx.service.adapter_admin.load(name, path)
        except AdapterError as exc:
            raise from_status(exc.code, exc.message) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> PlainTextResponse:
        """vLLM's {"lora_name"}: UnloadAdapter (drains the adapter's requests first)."""
        f = Fields(await read_json(request, self.ctx.max_body_bytes))
        name = f.string("lora_name")
        if not name:
            raise bad_request("lora_name is required (a string)", "lora_name")
        try:
            await self.ctx.service.adapter_admin.unload(name)
        except AdapterError as exc:
            raise from_status(exc.code, exc.message) from None
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    # -- submitting --------------------------------------------------------------------------------
    async def _submit_all(self, calls, chat: bool) -> list:
        """Submits every choice; one refused cancels those already queued."""
        done: list = []
        try:
            for i, call in enumerate(calls):
                try:
                    done.append(await submit(call))
                except HttpError as exc:
                    raise openai_error(exc, chat) from None
                finally:
                    if len(done) <= i:  # this one failed: the later ones are never sent
                        for unsent in calls[i + 1:]:
                            unsent.close()
        except BaseException:
            for item in done:
                self.ctx.service.cancel(item[0] if isinstance(item, tuple) else item)
            raise
        return done

    @staticmethod
    def _copies(params: cpb.GenerateParameters, n: int) -> list[cpb.GenerateParameters]:
        """n copies; with a seed, copy i samples with seed + i so the choices differ."""
        out = []
        for i in range(n):
            copy = cpb.GenerateParameters()
            copy.CopyFrom(params)
            if i and params.HasField("seed"):
                copy.seed = (params.seed + i) % 2**64
            out.append(copy)
        return out

    # -- chat --------------------------------------------------------------------------------------
    async def chat(self, request: Request):
        f = Fields(await read_json(request, self.ctx.max_body_bytes))
        adapter = self.ctx.model_adapter(f.string("model"))
        params, opts = reqs.parameters(f, chat=True, max_top_n=self.ctx.service.limits.max_top_n_tokens,
                                       max_n=self.ctx.max_client_batch_size)
        if adapter:
            params.adapter_id = adapter
        conversation = reqs.conversation(f, params)
        calls = []
        for copy in self._copies(params, opts.n):
            conversation_i = reqs.Conversation(conversation.messages, copy, conversation.tools, conversation.choice,
                                               conversation.function)
            calls.append(self.ctx.service.submit_chat(conversation_i))
        submitted = await self._submit_all(calls, chat=True)
        entries = [e for e, _ in submitted]
        plans = [p for _, p in submitted]
        model = f.string("model") or self.ctx.model_id
        if opts.stream:
            return StreamingResponse(self._chat_stream(entries, plans, opts, model), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        results = await collect(self.ctx, request, entries)
        choices = [self._chat_choice(i, entries[i], plans[i], gens, opts) for i, gens in enumerate(results)]
        return JSONResponse({
            "id": _completion_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
            "model": model, "system_fingerprint": None, "choices": choices,
            "usage": self._usage(entries, results, prompts_of=[0] * len(entries)),
        })

    def _chat_choice(self, index: int, entry: Entry, plan: ChatPlan, gens: list[spb.Generation],
                     opts: reqs.Options) -> dict:
        visible = "".join(step_texts(g)[0] for g in gens)
        raw = "".join(step_texts(g)[1] for g in gens)
        last = gens[-1].generated_text
        stopped = last.finish_reason == spb.FINISH_REASON_STOP_SEQUENCE
        calls: list[ToolCall] = []
        content: str | None = trim_stop(visible, opts.stop, stopped)
        if plan.mode is not Choice.NONE:
            parsed, calls = plan.calls(raw)
            if calls:
                content = parsed or None
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = _calls_json(calls)
        logprobs = {"content": [lp for g in gens for lp in _chat_logprobs(g)]} if opts.logprobs else None
        return {"index": index, "message": message, "logprobs": logprobs,
                "finish_reason": "tool_calls" if calls else _FINISH.get(last.finish_reason, "stop")}

    async def _chat_stream(self, entries: list[Entry], plans: list[ChatPlan], opts: reqs.Options,
                           model: str) -> AsyncIterator[bytes]:
        cid, created = _completion_id("chatcmpl"), int(time.time())
        usage_field = {"usage": None} if opts.include_usage else {}

        def chunk(choices: list[dict]) -> bytes:
            return sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "system_fingerprint": None, "choices": choices, **usage_field})

        trimmers = [StopTrimmer(opts.stop) for _ in entries]
        tool_streams = [ToolCallStream(p.parser) if p.mode is Choice.AUTO and p.parser is not None else None
                        for p in plans]
        raws = ["" for _ in entries]
        results: list[list[spb.Generation]] = [[] for _ in entries]
        for i in range(len(entries)):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        try:
            async for i, g in merged(self.ctx, entries):
                results[i].append(g)
                visible, raw = step_texts(g)
                raws[i] += raw
                plan = plans[i]
                if plan.mode in (Choice.REQUIRED, Choice.FUNCTION):
                    text = ""  # the call goes out whole at the end
                elif (stream := tool_streams[i]) is not None:
                    text = stream.feed(raw)
                else:
                    text = trimmers[i].feed(visible)
                logprobs = {"content": _chat_logprobs(g)} if opts.logprobs else None
                if text or logprobs:
                    yield chunk([{"index": i, "delta": {"content": text}, "logprobs": logprobs, "finish_reason": None}])
                if finished(g):
                    for out in self._chat_stream_end(i, g, plan, tool_streams[i], trimmers[i], raws[i]):
                        yield chunk([out])
        except Refused as exc:
            error = from_status(exc.code, exc.message)
            yield sse({"error": {"message": error.message, "type": error.kind, "code": str(error.status)}})
            return
        if opts.include_usage:
            yield sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "system_fingerprint": None, "choices": [],
                       "usage": self._usage(entries, results, prompts_of=[0] * len(entries))})
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _chat_stream_end(index: int, g: spb.Generation, plan: ChatPlan, tools: ToolCallStream | None,
                         trimmer: StopTrimmer, raw: str) -> list[dict]:
        last = g.generated_text
        calls: list[ToolCall] = []
        rest = ""
        if plan.mode in (Choice.REQUIRED, Choice.FUNCTION):
            rest, calls = plan.calls(raw)
        elif tools is not None:
            rest, calls = tools.finish()
        else:
            rest = trimmer.finish(last.finish_reason == spb.FINISH_REASON_STOP_SEQUENCE)
        out = []
        if rest:
            out.append({"index": index, "delta": {"content": rest}, "logprobs": None, "finish_reason": None})
        if calls:
            out.append({"index": index, "delta": {"tool_calls": _calls_json(calls, indexed=True)}, "logprobs": None,
                        "finish_reason": None})
        out.append({"index": index, "delta": {}, "logprobs": None,
                    "finish_reason": "tool_calls" if calls else _FINISH.get(last.finish_reason, "stop")})
        return out

    # -- completions -----------------------------------------------------------------------------
    async def completions(self, request: Request):
        f = Fields(await read_json(request, self.ctx.max_body_bytes))
        adapter = self.ctx.model_adapter(f.string("model"))
        prompts = reqs.prompts(f)
        params, opts = reqs.parameters(f, chat=False, max_top_n=self.ctx.service.limits.max_top_n_tokens,
                                       max_n=self.ctx.max_client_batch_size)
        if adapter:
            params.adapter_id = adapter
        opts.echo = reqs.refuse_completion_extras(f)
        if len(prompts) * opts.n > self.ctx.max_client_batch_size:
            raise reqs.bad_request(f"{len(prompts)} prompts x n {opts.n} is more than this server's "
                                   f"--max-client-batch-size ({self.ctx.max_client_batch_size})", "prompt")
        prompt_of, calls = [], []
        for p_index, prompt in enumerate(prompts):
            for copy in self._copies(params, opts.n):
                prompt_of.append(p_index)
                calls.append(self.ctx.service.submit(cpb.GenerateRequest(inputs=prompt, parameters=copy)))
        entries = await self._submit_all(calls, chat=False)
        model = f.string("model") or self.ctx.model_id
        if opts.stream:
            return StreamingResponse(self._completion_stream(entries, prompts, prompt_of, opts, model),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        results = await collect(self.ctx, request, entries)
        choices = []
        for i, gens in enumerate(results):
            last = gens[-1].generated_text
            text = trim_stop("".join(step_texts(g)[0] for g in gens), opts.stop,
                             last.finish_reason == spb.FINISH_REASON_STOP_SEQUENCE)
            prefix = prompts[prompt_of[i]] if opts.echo else ""
            choices.append({"index": i, "text": prefix + text, "finish_reason": _FINISH.get(last.finish_reason, "stop"),
                            "logprobs": _completion_logprobs(gens, len(prefix)) if opts.logprobs else None})
        return JSONResponse({
            "id": _completion_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": None, "choices": choices, "usage": self._usage(entries, results, prompt_of),
        })

    async def _completion_stream(self, entries: list[Entry], prompts: list[str], prompt_of: list[int],
                                 opts: reqs.Options, model: str) -> AsyncIterator[bytes]:
        cid, created = _completion_id("cmpl"), int(time.time())
        usage_field = {"usage": None} if opts.include_usage else {}

        # Every chunk but its text is the same: the JSON around the text is written once.
        head = sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                    "system_fingerprint": None, "choices": [{"index": 0, "text": ""}], **usage_field})
        before, after = head.split(b'"text":""', 1)
        before = before.rsplit(b'"index":0', 1)[0]
        after_plain = b',"logprobs":null,"finish_reason":null' + after

        def chunk(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> bytes:
            if finish is None and logprobs is None:
                text_json = json.dumps(text, ensure_ascii=False).encode()
                return before + b'"index":%d,"text":' % index + text_json + after_plain
            return sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                        "system_fingerprint": None, "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                                                 "finish_reason": finish}], **usage_field})

        trimmers = [StopTrimmer(opts.stop) for _ in entries]
        results: list[list[spb.Generation]] = [[] for _ in entries]
        offsets = [len(prompts[prompt_of[i]]) if opts.echo else 0 for i in range(len(entries))]
        if opts.echo:
            for i in range(len(entries)):
                yield chunk(i, prompts[prompt_of[i]], None)
        try:
            async for i, g in merged(self.ctx, entries):
                results[i].append(g)
                text = trimmers[i].feed(step_texts(g)[0])
                logprobs = _completion_logprobs([g], offsets[i]) if opts.logprobs else None
                if opts.logprobs:
                    offsets[i] += sum(len(t) for t in g.tokens.texts)
                if text or logprobs:
                    yield chunk(i, text, None, logprobs)
                if finished(g):
                    reason = g.generated_text.finish_reason
                    rest = trimmers[i].finish(reason == spb.FINISH_REASON_STOP_SEQUENCE)
                    yield chunk(i, rest, _FINISH.get(reason, "stop"))
        except Refused as exc:
            error = from_status(exc.code, exc.message)
            yield sse({"error": {"message": error.message, "type": error.kind, "code": str(error.status)}})
            return
        if opts.include_usage:
            yield sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                       "system_fingerprint": None, "choices": [], "usage": self._usage(entries, results, prompt_of)})
        yield b"data: [DONE]\n\n"

    @staticmethod
    def _usage(entries: list[Entry], results: list[list[spb.Generation]], prompts_of: list[int]) -> dict:
        """Prompt tokens once per prompt (n copies share it, as OpenAI counts), completion tokens of every choice."""
        prompt_tokens = sum({p: e.request.input_length for p, e in zip(prompts_of, entries)}.values())
        completion = sum(gens[-1].generated_text.generated_tokens for gens in results if gens and finished(gens[-1]))
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}
