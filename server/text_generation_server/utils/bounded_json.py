"""Client JSON read with a bound on its nesting.

Python's JSON decoder recurses per nesting level: a document ~1000 levels deep raises
RecursionError (a server fault to whoever catches only ValueError), and one a little shallower
parses, only to overflow the next recursive reader (json.dumps, a template, a grammar compiler
written in a language without a recursion guard). Every door that reads client JSON (HTTP
bodies, grammar schemas, tool schemas) reads it here, and too deep is a client error naming it.
"""

from __future__ import annotations

import json
from typing import Any

# Deeper than any real request or schema (OpenAI's structured outputs allow 10 levels of schema
# nesting; one level of schema is about three of JSON), far below the interpreter's recursion limit.
MAX_DEPTH = 128


class JsonTooDeep(ValueError):
    """The document nests deeper than MAX_DEPTH."""


def depth(value: Any) -> int:
    """The nesting depth of a parsed document (a scalar is 0), without recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def loads(text: str | bytes, what: str, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads, with ValueError (json.JSONDecodeError, or JsonTooDeep) for anything a client
    may send wrong, the message starting with `what`."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JsonTooDeep(f"{what} nests deeper than {max_depth} levels") from None
    except json.JSONDecodeError as exc:
        raise json.JSONDecodeError(f"{what} is not valid JSON: {exc.msg}", exc.doc, exc.pos) from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} is not UTF-8: {exc.reason}") from None
    if depth(value) > max_depth:
        raise JsonTooDeep(f"{what} nests deeper than {max_depth} levels")
    return value
