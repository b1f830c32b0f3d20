"""OpenAI's request bodies read into the core's requests: the sampling fields into
GenerateParameters, `messages` into a Conversation (with tools and tool_choice), `prompt` into
prompts. Every field the API defines that this server cannot honour is refused by name rather than
ignored or mapped onto something else (presence_penalty, logit_bias, suffix, best_of)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from text_generation_server.generation import tool_calls
from text_generation_server.generation.tool_calls import Choice, ToolError
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.router.http.body import Fields, type_name
from text_generation_server.router.http.errors import bad_request
from text_generation_server.router.service import Conversation

# OpenAI's bound on top_logprobs (chat) and logprobs (completions).
MAX_TOP_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Options:
    """What shapes the answer rather than the generation."""

    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    stop: list[str]
    echo: bool = False


def _refuse_unsupported(f: Fields) -> None:
    presence = f.number("presence_penalty", default=0.0, minimum=-2.0, maximum=2.0)
    if presence:
        raise bad_request("presence_penalty is not supported by this server (only 0); frequency_penalty is",
                          "presence_penalty")
    bias = f.data.get("logit_bias")
    if bias not in (None, {}):
        raise bad_request("logit_bias is not supported by this server", "logit_bias")


def parameters(f: Fields, *, chat: bool, max_top_n: int, max_n: int) -> tuple[cpb.GenerateParameters, Options]:
    """The sampling fields of a chat or completions body."""
    _refuse_unsupported(f)
    p = cpb.GenerateParameters()
    if chat:
        max_tokens = f.integer("max_completion_tokens", minimum=1)
        if max_tokens is None:
            max_tokens = f.integer("max_tokens", minimum=1)
    else:
        max_tokens = f.integer("max_tokens", default=COMPLETIONS_DEFAULT_MAX_TOKENS, minimum=1)
    if max_tokens is not None:
        p.max_new_tokens = min(max_tokens, 2**32 - 1)
    temperature = f.number("temperature", minimum=0.0, maximum=2.0)
    if temperature is not None and temperature > 0:  # 0 is OpenAI's greedy
        p.temperature = temperature
    top_p = f.number("top_p", minimum=0.0, maximum=1.0)
    if top_p is not None and top_p == 0:
        raise bad_request("top_p must be > 0 (use temperature 0 for greedy decoding)", "top_p")
    if top_p is not None and top_p < 1.0:
        p.top_p = top_p
    if temperature == 0:
        p.do_sample = False
    seed = f.integer("seed", minimum=0, maximum=2**64 - 1)
    if seed is not None:
        p.seed = seed
    frequency = f.number("frequency_penalty", minimum=-2.0, maximum=2.0)
    if frequency:
        p.frequency_penalty = frequency
    stop = f.strings("stop")
    p.stop.extend(stop)
    ignore_eos = f.boolean("ignore_eos")  # vLLM's extension: benchmarks need answers of a fixed length
    if ignore_eos is not None:
        p.ignore_eos_token = ignore_eos
    n = f.integer("n", default=1, minimum=1, maximum=max_n)
    stream = f.boolean("stream", default=False)
    stream_options = f.object("stream_options")
    if stream_options is not None and not stream:
        raise bad_request("stream_options is only allowed with stream true", "stream_options")
    include_usage = bool(stream_options and stream_options.boolean("include_usage", default=False))
    if chat:
        logprobs = f.boolean("logprobs", default=False)
        top = f.integer("top_logprobs", default=0, minimum=0, maximum=MAX_TOP_LOGPROBS)
        if top and not logprobs:
            raise bad_request("top_logprobs requires logprobs true", "top_logprobs")
    else:
        top = f.integer("logprobs", default=None, minimum=0, maximum=5)
        logprobs = top is not None
        top = top or 0
    if top > max_top_n:
        raise bad_request(f"{'top_logprobs' if chat else 'logprobs'} must be <= {max_top_n} on this server "
                          "(--max-top-n-tokens)", "top_logprobs" if chat else "logprobs")
    if top:
        p.top_n_tokens = top
    if logprobs:
        p.details = True
    grammar = response_format(f.object("response_format"))
    if grammar is not None:
        p.grammar.CopyFrom(grammar)
    return p, Options(n=n, stream=stream, include_usage=include_usage, logprobs=logprobs, top_logprobs=top,
                      stop=stop)


def response_format(f: Fields | None) -> cpb.Grammar | None:
    """text: none; json_object: any JSON object; json_schema: the schema."""
    if f is None:
        return None
    kind = f.string("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return cpb.Grammar(type=cpb.GRAMMAR_TYPE_JSON, value=json.dumps({"type": "object"}))
    if kind == "json_schema":
        spec = f.object("json_schema")
        if spec is None:
            raise bad_request("response_format.json_schema is required with type json_schema",
                              "response_format.json_schema")
        schema = spec.data.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise bad_request(f"response_format.json_schema.schema must be an object, got {type_name(schema)}",
                              "response_format.json_schema.schema")
        return cpb.Grammar(type=cpb.GRAMMAR_TYPE_JSON, value=json.dumps(schema))
    raise bad_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                      "response_format.type")


def _content(value: Any, where: str) -> str | None:
    """A message's content: a string, null, or an array of text parts (joined as vLLM joins them)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}[{i}] must be a text part ({{\"type\": \"text\", \"text\": ...}}); "
                                  "this server reads text only", where)
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"{where} must be a string, an array of text parts or null, got {type_name(value)}", where)


def messages(f: Fields) -> list[dict[str, Any]]:
    raw = f.array("messages")
    if raw is None:
        raise bad_request("messages is required", "messages")
    out = []
    for i, item in enumerate(raw):
        m = Fields(item, f"messages[{i}]")
        role = m.string("role")
        if not role:
            raise bad_request(f"messages[{i}].role is required", f"messages[{i}].role")
        message: dict[str, Any] = {"role": role, "content": _content(m.data.get("content"),
                                                                     f"messages[{i}].content")}
        calls = m.array("tool_calls")
        if calls:
            try:
                message["tool_calls"] = tool_calls.message_calls(calls, f"messages[{i}]")
            except ToolError as exc:
                raise bad_request(str(exc), f"messages[{i}].tool_calls") from None
        for name in ("tool_call_id", "name"):
            value = m.string(name)
            if value is not None:
                message[name] = value
        out.append(message)
    return out


def tools_and_choice(f: Fields) -> tuple[list[tool_calls.Tool], Choice | None, str | None]:
    tools = []
    for i, item in enumerate(f.array("tools", default=[])):
        t = Fields(item, f"tools[{i}]")
        if t.string("type", default="function") != "function":
            raise bad_request(f"tools[{i}].type must be 'function'", f"tools[{i}].type")
        function = t.object("function")
        if function is None:
            raise bad_request(f"tools[{i}].function is required", f"tools[{i}].function")
        try:
            tools.append(tool_calls.tool(function.data.get("name"), function.data.get("description"),
                                         function.data.get("parameters"), f"tools[{i}].function"))
        except ToolError as exc:
            raise bad_request(str(exc), f"tools[{i}].function") from None
    value = f.data.get("tool_choice")
    if value is None:
        return tools, None, None
    if isinstance(value, str):
        try:
            choice = Choice(value)
        except ValueError:
            raise bad_request(f"tool_choice must be none, auto, required or a function, got {value!r}",
                              "tool_choice") from None
        if choice is Choice.FUNCTION:
            raise bad_request("tool_choice 'function' must name it: {\"type\": \"function\", \"function\": "
                              "{\"name\": ...}}", "tool_choice")
        return tools, choice, None
    named = Fields(value, "tool_choice").object("function")
    name = named.string("name") if named is not None else None
    if not name:
        raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                          "{\"name\": ...}}", "tool_choice")
    return tools, Choice.FUNCTION, name


def conversation(f: Fields, params: cpb.GenerateParameters) -> Conversation:
    tools, choice, function = tools_and_choice(f)
    return Conversation(messages(f), params, tools, choice, function)


def prompts(f: Fields) -> list[str]:
    """`prompt`: a string or an array of strings."""
    value = f.data.get("prompt")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    if value is None:
        raise bad_request("prompt is required", "prompt")
    raise bad_request("prompt must be a string or a non-empty array of strings (token arrays are not accepted)",
                      "prompt")


def refuse_completion_extras(f: Fields) -> bool:
    """suffix and best_of > 1 are refused by name; returns `echo`."""
    if f.string("suffix"):
        raise bad_request("suffix is not supported by this server", "suffix")
    best_of = f.integer("best_of", minimum=1)
    if best_of is not None and best_of > 1:
        raise bad_request("best_of > 1 is not supported by this server", "best_of")
    return bool(f.boolean("echo", default=False))
