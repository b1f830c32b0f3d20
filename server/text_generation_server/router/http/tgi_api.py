"""TGI's HTTP API: POST / (where huggingface_hub's InferenceClient(model=URL).text_generation
posts; `stream` picks the answer), /generate, /generate_stream, /tokenize; GET /info, /health.

Field names and shapes are TGI's (router/src/lib.rs): GenerateParameters below `parameters`,
`details` with finish_reason length | eos_token | stop_sequence, the stream's events
`data:{"index", "token", "top_tokens", "generated_text", "details"}`. The request becomes the
client API's GenerateRequest and runs through the same core as gRPC's Generate; TGI's
`parameters.adapter_id` names a LoRA adapter as the client API's does.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

import grpc
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from text_generation_server.about import __version__
from text_generation_server.pb.generate.v3 import generate_pb2 as spb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.router.http.body import Fields, read_json
from text_generation_server.router.http.core import HttpContext, collect, finished, merged, submit
from text_generation_server.router.http.errors import bad_request, from_status, tgi_status_and_body
from text_generation_server.router.scheduler import Entry
from text_generation_server.router.service import Refused

_FINISH = {spb.FINISH_REASON_LENGTH: "length", spb.FINISH_REASON_EOS_TOKEN: "eos_token",
           spb.FINISH_REASON_STOP_SEQUENCE: "stop_sequence"}
_GRAMMAR_TYPES = {"json": cpb.GRAMMAR_TYPE_JSON, "json_object": cpb.GRAMMAR_TYPE_JSON,
                  "json_schema": cpb.GRAMMAR_TYPE_JSON, "regex": cpb.GRAMMAR_TYPE_REGEX}


def _tokens(t: spb.Tokens) -> list[dict]:
    return [{"id": i, "text": text, "logprob": lp, "special": sp}
            for i, text, lp, sp in zip(t.ids, t.texts, t.logprobs, t.is_special)]


def parameters(f: Fields | None) -> tuple[cpb.GenerateParameters, bool]:
    """TGI's GenerateParameters as the client API's; and return_full_text."""
    p = cpb.GenerateParameters()
    if f is None:
        return p, False
    best_of = f.integer("best_of", minimum=1)
    if best_of is not None and best_of > 1:
        raise bad_request("parameters.best_of > 1 is not supported by this server", "parameters.best_of")
    if f.boolean("watermark", default=False):
        raise bad_request("parameters.watermark is not supported by this server", "parameters.watermark")
    adapter_id = f.string("adapter_id")
    if adapter_id:  # a LoRA adapter loaded on the server; an unknown one is 404 (the core's NOT_FOUND)
        p.adapter_id = adapter_id
    for name in ("temperature", "top_p", "typical_p", "repetition_penalty", "frequency_penalty"):
        value = f.number(name)
        if value is not None:
            setattr(p, name, value)
    for name, minimum in (("max_new_tokens", 1), ("top_k", 1), ("truncate", 1), ("top_n_tokens", 0),
                          ("seed", 0)):
        value = f.integer(name, minimum=minimum, maximum=2**64 - 1 if name == "seed" else 2**32 - 1)
        if value is not None:
            setattr(p, name, value)
    for name in ("do_sample", "details", "decoder_input_details"):
        value = f.boolean(name)
        if value is not None:
            setattr(p, name, value)
    p.stop.extend(f.strings("stop"))
    grammar = f.object("grammar")
    if grammar is not None:
        kind = grammar.string("type")
        if kind not in _GRAMMAR_TYPES:
            raise bad_request(f"parameters.grammar.type must be json, json_schema or regex, got {kind!r}",
                              "parameters.grammar.type")
        value = grammar.data.get("value")
        if kind == "regex" and not isinstance(value, str):
            raise bad_request("parameters.grammar.value must be a string for a regex", "parameters.grammar.value")
        if kind != "regex":
            if isinstance(value, dict) and kind == "json_schema" and "schema" in value:
                value = value["schema"]  # TGI's json_schema form: {"name", "schema"}
            if not isinstance(value, (dict, bool)):
                raise bad_request("parameters.grammar.value must be a JSON schema object",
                                  "parameters.grammar.value")
            value = json.dumps(value)
        p.grammar.CopyFrom(cpb.Grammar(type=_GRAMMAR_TYPES[kind], value=value))
    return p, bool(f.boolean("return_full_text", default=False))


class TgiApi:
    def __init__(self, ctx: HttpContext):
        self.ctx = ctx

    def routes(self) -> list[Route]:
        return [
            Route("/", self.compat, methods=["POST"]),
            Route("/generate", self.generate, methods=["POST"]),
            Route("/generate_stream", self.generate_stream, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/info", self.info, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]

    async def _request(self, request: Request) -> tuple[Fields, cpb.GenerateRequest, bool]:
        f = Fields(await read_json(request, self.ctx.max_body_bytes))
        inputs = f.string("inputs")
        if inputs is None:
            raise bad_request("inputs is required (a string)", "inputs")
        params, full_text = parameters(f.object("parameters"))
        return f, cpb.GenerateRequest(inputs=inputs, parameters=params), full_text

    async def compat(self, request: Request) -> Response:
        """TGI's `/`: /generate, or /generate_stream when `stream` is true."""
        f, generate, full_text = await self._request(request)
        if f.boolean("stream", default=False):
            return await self._stream(generate, full_text)
        return await self._generate(request, generate, full_text)

    async def generate(self, request: Request) -> Response:
        _, generate, full_text = await self._request(request)
        return await self._generate(request, generate, full_text)

    async def generate_stream(self, request: Request) -> Response:
        _, generate, full_text = await self._request(request)
        return await self._stream(generate, full_text)

    async def _generate(self, request: Request, generate: cpb.GenerateRequest, full_text: bool) -> Response:
        entry = await submit(self.ctx.service.submit(generate))
        gens = (await collect(self.ctx, request, [entry]))[0]
        text = gens[-1].generated_text.text
        body: dict[str, Any] = {"generated_text": (generate.inputs + text) if full_text else text}
        if generate.parameters.details:
            body["details"] = self._details(entry, gens)
        return JSONResponse(body, headers=self._headers(entry, gens))

    def _details(self, entry: Entry, gens: list[spb.Generation]) -> dict:
        last = gens[-1].generated_text
        details: dict[str, Any] = {
            "finish_reason": _FINISH.get(last.finish_reason, "length"), "generated_tokens": last.generated_tokens,
            "seed": last.seed if last.HasField("seed") else None,
            "prefill": [], "tokens": [t for g in gens for t in _tokens(g.tokens)],
        }
        if entry.request.decoder_input_details and gens[0].HasField("prefill_tokens"):
            p = gens[0].prefill_tokens
            details["prefill"] = [{"id": i, "text": text, "logprob": None if k == 0 else lp}
                                  for k, (i, text, lp) in enumerate(zip(p.ids, p.texts, p.logprobs))]
        if entry.request.top_n_tokens:
            details["top_tokens"] = [_tokens(top) for g in gens for top in g.top_tokens]
        return details

    @staticmethod
    def _headers(entry: Entry, gens: list[spb.Generation]) -> dict[str, str]:
        """TGI's x-* headers that clients and dashboards read."""
        last = gens[-1].generated_text
        return {"x-generated-tokens": str(last.generated_tokens), "x-prompt-tokens": str(entry.request.input_length),
                "x-compute-type": "text-generation-server"}

    async def _stream(self, generate: cpb.GenerateRequest, full_text: bool) -> Response:
        entry = await submit(self.ctx.service.submit(generate))
        return StreamingResponse(self._events(entry, generate, full_text), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self, entry: Entry, generate: cpb.GenerateRequest, full_text: bool) -> AsyncIterator[bytes]:
        index = 0
        try:
            async for _, g in merged(self.ctx, [entry]):
                tokens = _tokens(g.tokens)
                for i, token in enumerate(tokens):
                    index += 1
                    event: dict[str, Any] = {"index": index, "token": token, "generated_text": None, "details": None}
                    if i < len(g.top_tokens):
                        event["top_tokens"] = _tokens(g.top_tokens[i])
                    if i == len(tokens) - 1 and finished(g):
                        last = g.generated_text
                        event["generated_text"] = (generate.inputs + last.text) if full_text else last.text
                        event["details"] = {"finish_reason": _FINISH.get(last.finish_reason, "length"),
                                            "generated_tokens": last.generated_tokens,
                                            "seed": last.seed if last.HasField("seed") else None,
                                            "input_length": entry.request.input_length}
                    yield f"data:{json.dumps(event, ensure_ascii=False)}\n\n".encode()
        except Refused as exc:
            _, body = tgi_status_and_body(from_status(exc.code, exc.message))
            yield f"data:{json.dumps(body)}\n\n".encode()

    async def tokenize(self, request: Request) -> Response:
        f = Fields(await read_json(request, self.ctx.max_body_bytes))
        inputs = f.string("inputs")
        if inputs is None:
            raise bad_request("inputs is required (a string)", "inputs")
        limit = self.ctx.service.limits.max_input_chars
        if len(inputs) > limit:
            raise bad_request(f"inputs has {len(inputs)} characters, more than the limit of {limit}", "inputs")
        add = f.boolean("add_special_tokens", default=True)
        enc = await asyncio.to_thread(self.ctx.service.tokenizer.encode, inputs, add_special_tokens=add)
        return JSONResponse([{"id": i, "text": inputs[start:stop], "start": start, "stop": stop}
                             for i, (start, stop) in zip(enc.ids, enc.offsets)])

    async def info(self, request: Request) -> Response:
        info = self.ctx.service.info
        return JSONResponse({
            "model_id": info.model_id, "model_sha": None, "model_pipeline_tag": "text-generation",
            "model_dtype": info.model_dtype, "model_device_type": info.model_device_type,
            "max_concurrent_requests": info.max_concurrent_requests, "max_best_of": 1,
            "max_stop_sequences": info.max_stop_sequences, "max_input_tokens": info.max_input_tokens,
            "max_total_tokens": info.max_total_tokens, "max_batch_total_tokens": info.max_batch_total_tokens,
            "max_batch_prefill_tokens": info.max_batch_prefill_tokens,
            "validation_workers": 1, "max_client_batch_size": self.ctx.max_client_batch_size,
            "router": "text-generation-server", "version": info.version or __version__, "sha": None,
            "docker_label": None,
        })

    async def health(self, request: Request) -> Response:
        if self.ctx.healthy():
            return Response(status_code=200)
        status, body = tgi_status_and_body(from_status(grpc.StatusCode.UNAVAILABLE, "the server is not serving"))
        return JSONResponse(body, status_code=status)
