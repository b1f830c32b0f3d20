"""One validator per request field, called where a request enters the server, and nowhere else.

A request enters by one of two doors: our router's client API (router/validation.py, which
answers INVALID_ARGUMENT) and a shard's generate.v3 API, where a TGI router talks to a
`--shard-only` rank directly (shard/wire.py decodes the message, engine/batch_builder.py checks
the request before it takes a KV block; the shard answers INVALID_ARGUMENT, TGI's error path).
Both call these validators, so a field's rule is the same whichever door it came through; the
engine and the sampling and stopping code downstream trust what passed.

Each validator takes the value as set (the door decides what "unset" is on its wire: a missing
optional field on the client API, 0 for a proto3 scalar on v3) and raises `InvalidField`: the
field's name as the client API spells it below `parameters` and the problem. Each door renders
it under its own wire's name for the field (`client_name`, `shard_name`) and maps it to its
error: the client API's messages start with the field's path ("parameters.top_p must be <=
1.0, got 1.5"), the shard's with the request ("request 3: top_p must be <= 1.0, got 1.5").
"""

from __future__ import annotations

import math
from typing import Callable, Sequence, TypeVar

from text_generation_server.generation.grammar import GrammarError, GrammarSpec, GrammarType

MAX_SEED = 2**64 - 1  # seeds travel as uint64 on the wire
# Top-level fields of the client API's GenerateRequest; the others are below `parameters`.
_CLIENT_TOP_LEVEL = ("inputs",)
# generate.v3's names where they differ from the client API's.
_SHARD_NAMES = {"stop": "stop_sequences", "grammar.value": "grammar", "grammar.type": "grammar_type"}

T = TypeVar("T")


class InvalidField(ValueError):
    """A request field breaks its rule. `field`: its client API name below `parameters` (or
    `inputs`); `problem`: the rest of the message, which follows the field's name."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}{problem}")
        self.field = field
        self.problem = problem

    def client_message(self) -> str:
        """As the client API says it: the field's path in GenerateRequest first."""
        path = self.field if self.field in _CLIENT_TOP_LEVEL else f"parameters.{self.field}"
        return f"{path}{self.problem}"

    def shard_message(self) -> str:
        """As the shard says it (after "request N: "): generate.v3's name for the field first."""
        return f"{_SHARD_NAMES.get(self.field, self.field)}{self.problem}"


def _real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(field: str, value: float) -> float:
    # NaN fails `> 0`; inf would silently flatten or zero the logits.
    if not (_real(value) and value > 0):
        raise InvalidField(field, f" must be a finite number > 0, got {value}")
    return value


# -- token choice ----------------------------------------------------------------------------------
def temperature(value: float) -> float:
    return _positive("temperature", value)


def repetition_penalty(value: float) -> float:
    return _positive("repetition_penalty", value)


def _mass(field: str, value: float) -> float:
    _positive(field, value)
    if value > 1.0:
        raise InvalidField(field, f" must be <= 1.0, got {value}")
    return value


def top_p(value: float) -> float:
    return _mass("top_p", value)


def typical_p(value: float) -> float:
    return _mass("typical_p", value)


def top_k(value: int) -> int:
    if not _integer(value) or value < 1:
        raise InvalidField("top_k", f" must be >= 1, got {value}")
    return value


def frequency_penalty(value: float) -> float:
    if not (_real(value) and -2.0 <= value <= 2.0):
        raise InvalidField("frequency_penalty", f" must be in [-2, 2], got {value}")
    return value


def seed(value: int) -> int:
    if not _integer(value) or not 0 <= value <= MAX_SEED:
        raise InvalidField("seed", f" must be an integer in [0, {MAX_SEED}], got {value!r}")
    return value


def do_sample(value: bool) -> bool:
    if not isinstance(value, bool):
        raise InvalidField("do_sample", f" must be a bool, got {value!r}")
    return value


def top_n_tokens(value: int, limit: int) -> int:
    """limit: the client API's --max-top-n-tokens; the shard's vocabulary."""
    if not _integer(value) or value < 0:
        raise InvalidField("top_n_tokens", f" must be >= 0, got {value!r}")
    if value > limit:
        raise InvalidField("top_n_tokens", f" must be <= {limit}, got {value}")
    return value


# -- grammar -----------------------------------------------------------------------------------------
def grammar(type_number: int, value: str, type_name: str) -> GrammarSpec:
    """The grammar a request asks for (the door has decided that it asks for one). type_name:
    how the door's wire names `type_number`, for the message."""
    if type_number not in (GrammarType.JSON, GrammarType.REGEX):
        raise InvalidField("grammar.type", f" must be GRAMMAR_TYPE_JSON or GRAMMAR_TYPE_REGEX, got {type_name}")
    spec = GrammarSpec(GrammarType(type_number), value)
    if not value:
        raise InvalidField("grammar.value", f" must hold the {spec.describe()}, got an empty string")
    return spec


def compiled_grammar(spec: GrammarSpec, compile: Callable[[GrammarSpec], T]) -> T:
    """`compile(spec)` (a GrammarCompiler's compile or matcher: cached, so a grammar seen before
    costs a lookup); an invalid grammar is refused with the compiler's reason."""
    try:
        return compile(spec)
    except GrammarError as exc:
        raise InvalidField("grammar.value", f": {exc}") from None


# -- the prompt and the length of the answer ---------------------------------------------------------
def inputs(text: str, max_chars: int, *, allow_empty: bool = False) -> str:
    """Checked before tokenizing, so that no tokenizer works on a prompt over the limit."""
    if not text and not allow_empty:
        raise InvalidField("inputs", " must not be empty")
    if len(text) > max_chars:
        raise InvalidField("inputs", f" has {len(text)} characters, more than the limit of {max_chars}")
    return text


def truncate(value: int, max_input_tokens: int) -> int:
    if not _integer(value) or value < 1:
        raise InvalidField("truncate", f" must be >= 1, got {value}")
    if value > max_input_tokens:
        raise InvalidField("truncate", f" must be <= max_input_tokens ({max_input_tokens}), got {value}")
    return value


def input_length(length: int, max_input_tokens: int | None = None) -> int:
    """The prompt's tokens after truncation. max_input_tokens: the client API's limit (the
    shard bounds prompt + answer only: `max_new_tokens`)."""
    if length == 0:
        raise InvalidField("inputs", " tokenize to zero tokens")
    if max_input_tokens is not None and length > max_input_tokens:
        raise InvalidField("inputs", f" has {length} tokens, more than max_input_tokens ({max_input_tokens}); "
                                     "shorten it or set parameters.truncate")
    return length


def max_new_tokens(value: int, input_tokens: int, max_total: int, limit_name: str) -> int:
    """Tokens to generate after a prompt of `input_tokens`, which together must fit `max_total`
    (the client API's max_total_tokens; the shard's model context), named `limit_name` in the message."""
    if not _integer(value):
        raise InvalidField("max_new_tokens", f" must be an integer, got {value!r}")
    if value < 1:
        raise InvalidField("max_new_tokens", f" must be >= 1, got {value}")
    if input_tokens + value > max_total:
        raise InvalidField("max_new_tokens", f" ({value}) + {input_tokens} input tokens exceeds {limit_name}")
    return value


def stop(sequences: Sequence[str], max_count: int | None = None, max_length: int | None = None) -> list[str]:
    """Stop sequences; the client API also bounds their count and length (--max-stop-sequences,
    --max-stop-sequence-length)."""
    sequences = list(sequences)
    if max_count is not None and len(sequences) > max_count:
        raise InvalidField("stop", f" has {len(sequences)} sequences, at most {max_count} allowed")
    for index, sequence in enumerate(sequences):
        if not isinstance(sequence, str):
            raise InvalidField("stop", f"[{index}] must be a string, got {sequence!r}")
        if not sequence:
            raise InvalidField("stop", " must not contain an empty sequence")
        if max_length is not None and len(sequence) > max_length:
            raise InvalidField("stop", f" has a sequence of {len(sequence)} characters, at most {max_length}")
    return sequences
