"""A request body read as JSON within the server's limits, and its fields read with their types.

Every problem is an HttpError naming the field, so a client learns what to change; nothing a
client sends (a body too large, nested too deep, a wrong type) reaches the core unchecked.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from starlette.requests import Request

from text_generation_server.router.http.errors import HttpError, bad_request
from text_generation_server.utils import bounded_json

_MISSING = object()


async def read_json(request: Request, max_bytes: int) -> dict:
    """The body as a JSON object: 413 over `max_bytes` (--max-message-bytes, TGI's
    --payload-limit), 400 for anything that is not a JSON object of bounded depth."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HttpError(413, f"the request body has {declared} bytes, more than the limit of {max_bytes}",
                        "request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise HttpError(413, f"the request body is larger than the limit of {max_bytes} bytes",
                            "request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise bad_request("the request body is empty; send a JSON object")
    try:
        value = bounded_json.loads(raw, "the request body")
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    if not isinstance(value, dict):
        raise bad_request(f"the request body must be a JSON object, got {type_name(value)}")
    return value


def type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


class Fields:
    """Typed access to one JSON object's fields; `prefix` is its path for messages."""

    def __init__(self, data: Any, prefix: str = ""):
        if not isinstance(data, dict):
            raise bad_request(f"{prefix or 'the body'} must be an object, got {type_name(data)}", prefix or None)
        self.data = data
        self.prefix = prefix

    def path(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def _get(self, name: str, check: Callable[[Any], bool], want: str, default: Any) -> Any:
        value = self.data.get(name, _MISSING)
        if value is _MISSING or value is None:
            return default
        if not check(value):
            raise bad_request(f"{self.path(name)} must be {want}, got {type_name(value)}", self.path(name))
        return value

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def string(self, name: str, default: Any = None) -> Any:
        return self._get(name, lambda v: isinstance(v, str), "a string", default)

    def boolean(self, name: str, default: Any = None) -> Any:
        return self._get(name, lambda v: isinstance(v, bool), "a boolean", default)

    def integer(self, name: str, default: Any = None, minimum: int | None = None, maximum: int | None = None) -> Any:
        value = self._get(name, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer", default)
        if value is not None and value is not default:
            if minimum is not None and value < minimum:
                raise bad_request(f"{self.path(name)} must be >= {minimum}, got {value}", self.path(name))
            if maximum is not None and value > maximum:
                raise bad_request(f"{self.path(name)} must be <= {maximum}, got {value}", self.path(name))
        return value

    def number(self, name: str, default: Any = None, minimum: float | None = None,
               maximum: float | None = None) -> Any:
        value = self._get(name, lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                          and math.isfinite(v), "a finite number", default)
        if value is not None and value is not default:
            if minimum is not None and value < minimum:
                raise bad_request(f"{self.path(name)} must be >= {minimum}, got {value}", self.path(name))
            if maximum is not None and value > maximum:
                raise bad_request(f"{self.path(name)} must be <= {maximum}, got {value}", self.path(name))
        return float(value) if value is not None else None

    def array(self, name: str, default: Any = None) -> Any:
        return self._get(name, lambda v: isinstance(v, list), "an array", default)

    def object(self, name: str) -> "Fields | None":
        value = self._get(name, lambda v: isinstance(v, dict), "an object", None)
        return None if value is None else Fields(value, self.path(name))

    def strings(self, name: str) -> list[str]:
        """A string or an array of strings (OpenAI's `stop`) as a list."""
        value = self.data.get(name)
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return list(value)
        raise bad_request(f"{self.path(name)} must be a string or an array of strings", self.path(name))
