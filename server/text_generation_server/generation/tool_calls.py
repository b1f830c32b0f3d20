"""Tool calling: the tools a chat request offers, the grammar that forces a call, and the parsers
that read a call back out of what a model wrote in its own syntax.

A request's tools reach the chat template as transformers' `apply_chat_template(tools=...)`
hands them for JSON-schema tools: OpenAI's `{"type": "function", "function": {"name",
"description", "parameters"}}` dicts, unchanged. `tool_choice`:

- none: the model sees the tools and answers in text; nothing is parsed.
- auto: the model chooses; the parser of its call syntax (from the template, or
  `--tool-call-parser`) turns what it wrote into typed calls. Hermes/Qwen wrap each call in
  `<tool_call>{"name", "arguments"}</tool_call>`; Llama 3.1 writes a bare JSON object
  `{"name", "parameters"}` (after `<|python_tag|>` for built-in tools); Mistral writes
  `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}` (v0.3) or `name[ARGS]{...}` (v11+).
- required / a named function: the answer is constrained by a JSON-schema grammar (the existing
  grammar machinery), so the arguments validate against the tool's schema: for required an
  object `{"name": <one of the tools>, "arguments": <its schema>}`, for a named function the
  arguments object itself.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ID_ALPHABET = string.ascii_letters + string.digits
EMPTY_PARAMETERS: dict = {"type": "object", "properties": {}}


class ToolError(ValueError):
    """A request's tools or tool choice are wrong; the message names the field (INVALID_ARGUMENT / 400)."""


class Choice(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    FUNCTION = "function"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON schema (an object)

    def for_template(self) -> dict:
        """As OpenAI sends it and templates read it (tool.function.name, ...)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


def call_id() -> str:
    """OpenAI's shape: call_ and 24 characters."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def tool(name: Any, description: Any, parameters: Any, where: str) -> Tool:
    """One tool, checked; `where` is the field's path for messages (tools[2].function)."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolError(f"{where}.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}")
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise ToolError(f"{where}.description must be a string, got {type(description).__name__}")
    if parameters is None:
        parameters = dict(EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise ToolError(f"{where}.parameters must be a JSON schema object, got {type(parameters).__name__}")
    kind = parameters.get("type", "object")
    if kind != "object":
        raise ToolError(f"{where}.parameters must describe an object (type 'object'), got type {kind!r}")
    return Tool(name, description, parameters)


def check_unique(tools: Sequence[Tool]) -> None:
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if t.name in seen:
            raise ToolError(f"tools[{i}].function.name {t.name!r} is given twice")
        seen.add(t.name)


def choice(value: Choice | None, function: str | None, tools: Sequence[Tool]) -> tuple[Choice, Tool | None]:
    """The effective choice (unset: auto with tools, none without) and the named function's tool."""
    if value is None:
        value = Choice.AUTO if tools else Choice.NONE
    if value is not Choice.NONE and not tools:
        raise ToolError(f"tool_choice {value.value!r} needs tools")
    if value is not Choice.FUNCTION:
        return value, None
    for t in tools:
        if t.name == function:
            return value, t
    raise ToolError(f"tool_choice names the function {function!r}, which is not among the tools "
                    f"({', '.join(t.name for t in tools)})")


def forced_schema(mode: Choice, tools: Sequence[Tool], named: Tool | None) -> dict | None:
    """The JSON schema an answer must follow for required or a named function; None otherwise."""
    if mode is Choice.FUNCTION:
        assert named is not None
        return named.parameters
    if mode is not Choice.REQUIRED:
        return None
    options = [{
        "type": "object",
        "properties": {"name": {"const": t.name}, "arguments": t.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def forced_call(mode: Choice, named: Tool | None, text: str) -> list[ToolCall]:
    """The call a constrained answer holds. A constrained answer cut short (max_new_tokens, a stop
    sequence) does not parse: then there is no call, and the text is the content."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if mode is Choice.FUNCTION and named is not None and isinstance(value, dict):
        return [ToolCall(call_id(), named.name, json.dumps(value, ensure_ascii=False))]
    if mode is Choice.REQUIRED and isinstance(value, dict) and isinstance(value.get("name"), str):
        return [ToolCall(call_id(), value["name"], json.dumps(value.get("arguments", {}), ensure_ascii=False))]
    return []


def message_calls(calls: Sequence[Mapping[str, Any]], where: str) -> list[dict]:
    """An assistant message's tool_calls as templates expect them: OpenAI's shape with the
    arguments parsed into an object (OpenAI sends JSON text; templates write `arguments | tojson`)."""
    out = []
    for i, call in enumerate(calls):
        at = f"{where}.tool_calls[{i}]"
        if not isinstance(call, Mapping):
            raise ToolError(f"{at} must be an object")
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise ToolError(f"{at}.function must be an object with name and arguments")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError(f"{at}.function.name must be a non-empty string")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except (ValueError, RecursionError) as exc:
                raise ToolError(f"{at}.function.arguments is not JSON: {exc}") from None
        if not isinstance(arguments, dict):
            raise ToolError(f"{at}.function.arguments must be a JSON object")
        call_id_ = call.get("id", "")
        if not isinstance(call_id_, str):
            raise ToolError(f"{at}.id must be a string")
        out.append({"id": call_id_, "type": "function", "function": {"name": name, "arguments": arguments}})
    return out


# -- parsers of a model's own call syntax ----------------------------------------------------------------
def _dump(arguments: Any) -> str | None:
    if isinstance(arguments, str):  # some models write the arguments as JSON text already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


def _call(obj: Any, arguments_key: str = "arguments") -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    dumped = _dump(arguments)
    return None if dumped is None else ToolCall(call_id(), obj["name"], dumped)


def _json_values(text: str, separators: str = "") -> list[Any] | None:
    """The JSON values `text` holds one after another (separated by whitespace or `separators`);
    None when anything else is in it."""
    decoder = json.JSONDecoder()
    values: list[Any] = []
    at = 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] in separators):
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        values.append(value)


class ToolCallParser:
    """Splits a model's answer into content and calls. `markers`: text that opens the calls;
    `anywhere`: False when the calls must open the answer (after whitespace)."""

    name = ""
    markers: tuple[str, ...] = ()
    anywhere = True

    def start(self, text: str) -> int | None:
        """Where the calls begin in `text`, or None."""
        if not self.anywhere:
            stripped = text.lstrip()
            return len(text) - len(stripped) if stripped.startswith(self.markers) else None
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(found) if found else None

    def held(self, text: str) -> int:
        """How much of `text` may be sent as content now: a tail that could still become a
        marker waits."""
        if not self.anywhere:
            stripped = text.lstrip()
            if any(m.startswith(stripped) for m in self.markers):
                return 0  # whitespace, or the beginning of a marker: wait
            return len(text)
        for cut in range(max(0, len(text) - max(len(m) for m in self.markers) + 1), len(text)):
            tail = text[cut:]
            if any(m.startswith(tail) for m in self.markers):
                return cut
        return len(text)

    def calls(self, section: str) -> list[ToolCall] | None:
        """The calls in the text from the marker on; None when it does not parse."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls); text that does not parse as calls stays content, whole."""
        at = self.start(text)
        if at is None:
            return text, []
        calls = self.calls(text[at:])
        if not calls:
            return text, []
        return text[:at].rstrip(), calls


class HermesParser(ToolCallParser):
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number (Hermes, Qwen2.5)."""

    name = "hermes"
    markers = ("<tool_call>",)
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def calls(self, section: str) -> list[ToolCall] | None:
        found = []
        rest = self._BLOCK.sub("", section).strip()
        if rest:
            return None
        for body in self._BLOCK.findall(section):
            values = _json_values(body)
            if values is None or len(values) != 1 or (call := _call(values[0])) is None:
                return None
            found.append(call)
        return found


class Llama3JsonParser(ToolCallParser):
    """A JSON object {"name": ..., "parameters": {...}} opening the answer, optionally after
    <|python_tag|>; several separated by ';' (Llama 3.1/3.2 JSON tool calling)."""

    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    anywhere = False

    def calls(self, section: str) -> list[ToolCall] | None:
        section = section.strip().removeprefix("<|python_tag|>")
        values = _json_values(section, separators=";")
        if not values:
            return None
        found = [_call(v, "parameters") for v in values]
        return None if any(c is None for c in found) else found  # type: ignore[return-value]


class MistralParser(ToolCallParser):
    """[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (v0.3), or [TOOL_CALLS]name[ARGS]{...}
    repeated (tokenizer v11+)."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def calls(self, section: str) -> list[ToolCall] | None:
        parts = [p.strip() for p in section.split("[TOOL_CALLS]") if p.strip()]
        found: list[ToolCall] = []
        for part in parts:
            if "[ARGS]" in part:
                name, _, arguments = part.partition("[ARGS]")
                values = _json_values(arguments)
                if values is None or len(values) != 1 or (dumped := _dump(values[0])) is None:
                    return None
                found.append(ToolCall(call_id(), name.strip(), dumped))
                continue
            values = _json_values(part)
            if values is None or len(values) != 1:
                return None
            items = values[0] if isinstance(values[0], list) else [values[0]]
            calls = [_call(item) for item in items]
            if not calls or any(c is None for c in calls):
                return None
            found.extend(calls)  # type: ignore[arg-type]
        return found or None


PARSERS: dict[str, type[ToolCallParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}
# What in a template's source tells which syntax its model was trained to call tools in.
_TEMPLATE_SIGNS = (("[TOOL_CALLS]", "mistral"), ("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"),
                   ("ipython", "llama3_json"))


def parser_for(template_source: str, configured: str | None) -> ToolCallParser:
    """`configured` (--tool-call-parser) when set; else the syntax the template shows; else Hermes,
    the most common."""
    if configured:
        if configured not in PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(PARSERS)}, got {configured!r}")
        return PARSERS[configured]()
    for sign, name in _TEMPLATE_SIGNS:
        if sign in template_source:
            return PARSERS[name]()
    return HermesParser()


class ToolCallStream:
    """Streams the content of an answer while holding back what may be calls: feed() gives the
    content that can go to the client now; finish() the rest and the calls."""

    def __init__(self, parser: ToolCallParser):
        self.parser = parser
        self.text = ""
        self.sent = 0
        self.in_calls = False

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.in_calls:
            return ""
        at = self.parser.start(self.text)
        if at is not None:
            self.in_calls = True
            limit = at
        else:
            limit = self.parser.held(self.text)
        if limit <= self.sent:
            return ""
        out = self.text[self.sent:limit]
        self.sent = limit
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = self.parser.parse(self.text)
        if calls:
            return "", calls  # the content before the calls went out already
        out = self.text[self.sent:]
        self.sent = len(self.text)
        return out, []
