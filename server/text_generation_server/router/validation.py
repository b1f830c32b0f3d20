"""Validation of client requests, before anything is queued.

Every rejection is a `ValidationError` whose message starts with the field name,
so a client can tell exactly what to change; the service answers INVALID_ARGUMENT.
Ranges follow TGI's HTTP API.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from tokenizers import Tokenizer

from text_generation_server.generation.grammar import GrammarCompiler, GrammarError, GrammarSpec, GrammarType
from text_generation_server.pb.generate.v3 import generate_pb2 as spb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb


class ValidationError(ValueError):
    pass


# Why a grammar is refused when the server runs without grammar support (the flag is named so an
# operator knows what to change).
GRAMMAR_DISABLED = "grammar-constrained generation is disabled on this server (--disable-grammar-support)"


@dataclass(frozen=True)
class Limits:
    max_input_tokens: int
    max_total_tokens: int
    max_stop_sequences: int
    max_stop_sequence_length: int
    max_top_n_tokens: int
    max_input_chars: int


@dataclass
class ValidRequest:
    inputs: str
    input_length: int
    truncate: int
    input_ids: list[int]  # the prompt's tokens after truncation: what the shards compute and the prefix cache hashes
    max_new_tokens: int
    parameters: spb.NextTokenChooserParameters
    stop: list[str]
    details: bool
    decoder_input_details: bool
    top_n_tokens: int
    ignore_eos_token: bool = False
    # False for a chat prompt: the template wrote the special tokens already.
    add_special_tokens: bool = True

    def to_shard(self, request_id: int, blocks: list[int], slots: list[int], cache_len: int = 0,
                 chunk_len: int | None = None) -> spb.Request:
        request = spb.Request(
            id=request_id,
            inputs=self.inputs,
            input_chunks=spb.Input(chunks=[spb.InputChunk(text=self.inputs)]),
            truncate=self.truncate,
            parameters=self.parameters,
            stopping_parameters=spb.StoppingCriteriaParameters(
                max_new_tokens=self.max_new_tokens, stop_sequences=self.stop,
                ignore_eos_token=self.ignore_eos_token
            ),
            prefill_logprobs=self.decoder_input_details,
            top_n_tokens=self.top_n_tokens,
            blocks=blocks,
            slots=slots,
            add_special_tokens=self.add_special_tokens,
            cache_len=cache_len,
            input_ids=self.input_ids,
        )
        if chunk_len is not None:
            request.chunk_len = chunk_len
        return request


def _positive_float(p: cpb.GenerateParameters, name: str, upper: float | None = None,
                    upper_inclusive: bool = True) -> float | None:
    if not p.HasField(name):
        return None
    value = getattr(p, name)
    if not (value > 0 and math.isfinite(value)):  # NaN fails `> 0`; inf would silently flatten or zero logits
        raise ValidationError(f"parameters.{name} must be a finite number > 0, got {value}")
    if upper is not None and (value > upper if upper_inclusive else value >= upper):
        bound = f"<= {upper}" if upper_inclusive else f"< {upper}"
        raise ValidationError(f"parameters.{name} must be {bound}, got {value}")
    return value


def _grammar(p: cpb.GenerateParameters, grammars: GrammarCompiler | None) -> GrammarSpec | None:
    """The request's grammar, compiled here so that an invalid one never reaches a shard (the
    compiled grammar is cached, so this costs a lookup for schemas seen before)."""
    if not p.HasField("grammar"):
        return None
    if grammars is None:
        raise ValidationError(f"parameters.grammar: {GRAMMAR_DISABLED}")
    g = p.grammar
    if g.type not in (cpb.GRAMMAR_TYPE_JSON, cpb.GRAMMAR_TYPE_REGEX):
        raise ValidationError(
            f"parameters.grammar.type must be GRAMMAR_TYPE_JSON or GRAMMAR_TYPE_REGEX, got "
            f"{cpb.GrammarType.Name(g.type) if g.type in cpb.GrammarType.values() else g.type}"
        )
    spec = GrammarSpec(GrammarType(g.type), g.value)
    if not g.value:
        raise ValidationError(f"parameters.grammar.value must hold the {spec.describe()}, got an empty string")
    try:
        grammars.compile(spec)
    except GrammarError as exc:
        raise ValidationError(f"parameters.grammar.value: {exc}") from None
    return spec


def validate(request: cpb.GenerateRequest, tokenizer: Tokenizer, limits: Limits,
             grammars: GrammarCompiler | None = None, add_special_tokens: bool = True) -> ValidRequest:
    """Checks every field; tokenizes once to know the input length. Runs off the event loop.

    grammars: the tokenizer's compiler, which checks a request's grammar; None refuses any
    grammar (--disable-grammar-support). add_special_tokens: False for a prompt rendered by
    a chat template, which holds its special tokens already."""
    inputs = request.inputs
    if not inputs:
        raise ValidationError("inputs must not be empty")
    if len(inputs) > limits.max_input_chars:
        raise ValidationError(f"inputs has {len(inputs)} characters, more than the limit of {limits.max_input_chars}")
    p = request.parameters
    temperature = _positive_float(p, "temperature")
    top_p = _positive_float(p, "top_p", 1.0)
    typical_p = _positive_float(p, "typical_p", 1.0)
    repetition_penalty = _positive_float(p, "repetition_penalty")
    frequency_penalty = 0.0
    if p.HasField("frequency_penalty"):
        frequency_penalty = p.frequency_penalty
        if not -2.0 <= frequency_penalty <= 2.0:
            raise ValidationError(f"parameters.frequency_penalty must be in [-2, 2], got {frequency_penalty}")
    top_k = 0
    if p.HasField("top_k"):
        if p.top_k < 1:
            raise ValidationError(f"parameters.top_k must be >= 1, got {p.top_k}")
        top_k = p.top_k
    if p.HasField("top_n_tokens") and p.top_n_tokens > limits.max_top_n_tokens:
        raise ValidationError(f"parameters.top_n_tokens must be <= {limits.max_top_n_tokens}, got {p.top_n_tokens}")
    stop = list(p.stop)
    if len(stop) > limits.max_stop_sequences:
        raise ValidationError(f"parameters.stop has {len(stop)} sequences, at most {limits.max_stop_sequences} allowed")
    for s in stop:
        if not s:
            raise ValidationError("parameters.stop must not contain an empty sequence")
        if len(s) > limits.max_stop_sequence_length:
            raise ValidationError(
                f"parameters.stop has a sequence of {len(s)} characters, at most {limits.max_stop_sequence_length}"
            )
    details = p.details if p.HasField("details") else False
    decoder_input_details = p.decoder_input_details if p.HasField("decoder_input_details") else False
    if decoder_input_details and not details:
        raise ValidationError("parameters.decoder_input_details requires parameters.details")
    sampling_implied = (
        (temperature is not None and temperature != 1.0) or top_k > 0
        or (top_p is not None and top_p < 1.0) or (typical_p is not None and typical_p < 1.0)
    )
    do_sample = p.do_sample if p.HasField("do_sample") else sampling_implied
    seed = p.seed if p.HasField("seed") else random.getrandbits(63)

    truncate = None
    if p.HasField("truncate"):
        if p.truncate < 1:
            raise ValidationError(f"parameters.truncate must be >= 1, got {p.truncate}")
        if p.truncate > limits.max_input_tokens:
            raise ValidationError(
                f"parameters.truncate must be <= max_input_tokens ({limits.max_input_tokens}), got {p.truncate}"
            )
        truncate = p.truncate
    grammar = _grammar(p, grammars)
    ids = tokenizer.encode(inputs, add_special_tokens=add_special_tokens).ids
    if truncate is not None and len(ids) > truncate:
        ids = ids[-truncate:]  # keep the end, as the shards do
    length = len(ids)
    if length == 0:
        raise ValidationError("inputs tokenize to zero tokens")
    if length > limits.max_input_tokens:
        raise ValidationError(
            f"inputs has {length} tokens, more than max_input_tokens ({limits.max_input_tokens}); "
            "shorten it or set parameters.truncate"
        )
    room = limits.max_total_tokens - length
    if p.HasField("max_new_tokens"):
        if p.max_new_tokens < 1:
            raise ValidationError(f"parameters.max_new_tokens must be >= 1, got {p.max_new_tokens}")
        if p.max_new_tokens > room:
            raise ValidationError(
                f"parameters.max_new_tokens ({p.max_new_tokens}) + {length} input tokens exceeds "
                f"max_total_tokens ({limits.max_total_tokens})"
            )
        max_new_tokens = p.max_new_tokens
    else:
        max_new_tokens = room
    if not do_sample:
        # Shards (TGI semantics) sample whenever a warper is set: greedy means neutral warpers.
        temperature, top_k, top_p, typical_p = None, 0, None, None
    parameters = spb.NextTokenChooserParameters(
        temperature=temperature if temperature is not None else 1.0,
        top_k=top_k,
        top_p=top_p if top_p is not None else 1.0,
        typical_p=typical_p if typical_p is not None else 1.0,
        do_sample=do_sample,
        seed=seed,
        repetition_penalty=repetition_penalty if repetition_penalty is not None else 1.0,
        frequency_penalty=frequency_penalty,
        # generate.v3's GrammarType has the same numbers as ours (GrammarType's values)
        grammar=grammar.value if grammar is not None else "",
        grammar_type=spb.GrammarType.Name(grammar.type.value) if grammar is not None else "GRAMMAR_TYPE_NONE",
    )
    return ValidRequest(
        inputs=inputs,
        input_length=length,
        truncate=length,
        input_ids=ids,
        max_new_tokens=max_new_tokens,
        parameters=parameters,
        stop=stop,
        details=details,
        decoder_input_details=decoder_input_details,
        top_n_tokens=p.top_n_tokens if p.HasField("top_n_tokens") else 0,
        ignore_eos_token=p.ignore_eos_token if p.HasField("ignore_eos_token") else False,
        add_special_tokens=add_special_tokens,
    )
