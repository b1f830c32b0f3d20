"""Validation of client requests, before anything is queued.

Every rejection is a `ValidationError` whose message starts with the field name,
so a client can tell exactly what to change; the service answers INVALID_ARGUMENT.
Ranges follow TGI's HTTP API. Each field is checked by its validator in
generation/request_fields.py, the one a shard calls for a request from a TGI router.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tokenizers import Tokenizer

from text_generation_server.generation import request_fields
from text_generation_server.generation.grammar import GrammarCompiler, GrammarSpec
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
    # The LoRA adapter by name ("" = the base model) and its load's key, which seeds the prefix
    # cache's hashes (router/adapters.py): set by the service once it knows the adapter is loaded.
    adapter_id: str = ""
    adapter_key: int | None = None

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
        if self.adapter_id:
            request.adapter_id = self.adapter_id
        return request


def _grammar(p: cpb.GenerateParameters, grammars: GrammarCompiler | None) -> GrammarSpec | None:
    """The request's grammar, compiled here so that an invalid one never reaches a shard (the
    compiled grammar is cached, so this costs a lookup for schemas seen before)."""
    if not p.HasField("grammar"):
        return None
    if grammars is None:
        raise ValidationError(f"parameters.grammar: {GRAMMAR_DISABLED}")
    g = p.grammar
    type_name = cpb.GrammarType.Name(g.type) if g.type in cpb.GrammarType.values() else str(g.type)
    spec = request_fields.grammar(g.type, g.value, type_name)
    request_fields.compiled_grammar(spec, grammars.compile)
    return spec


def validate(request: cpb.GenerateRequest, tokenizer: Tokenizer, limits: Limits,
             grammars: GrammarCompiler | None = None, add_special_tokens: bool = True) -> ValidRequest:
    """Checks every field; tokenizes once to know the input length. Runs off the event loop.

    grammars: the tokenizer's compiler, which checks a request's grammar; None refuses any
    grammar (--disable-grammar-support). add_special_tokens: False for a prompt rendered by
    a chat template, which holds its special tokens already."""
    try:
        return _validate(request, tokenizer, limits, grammars, add_special_tokens)
    except request_fields.InvalidField as exc:
        raise ValidationError(exc.client_message()) from None


def _validate(request: cpb.GenerateRequest, tokenizer: Tokenizer, limits: Limits,
              grammars: GrammarCompiler | None, add_special_tokens: bool) -> ValidRequest:
    # Each field by its validator (generation/request_fields.py), which a shard calls too; an
    # unset optional field keeps the shard's default.
    inputs = request_fields.inputs(request.inputs, limits.max_input_chars)
    p = request.parameters

    def given(name: str, check):
        return check(getattr(p, name)) if p.HasField(name) else None

    temperature = given("temperature", request_fields.temperature)
    top_p = given("top_p", request_fields.top_p)
    typical_p = given("typical_p", request_fields.typical_p)
    repetition_penalty = given("repetition_penalty", request_fields.repetition_penalty)
    frequency_penalty = given("frequency_penalty", request_fields.frequency_penalty)
    top_k = given("top_k", request_fields.top_k) or 0
    top_n_tokens = given("top_n_tokens", lambda n: request_fields.top_n_tokens(n, limits.max_top_n_tokens)) or 0
    stop = request_fields.stop(p.stop, limits.max_stop_sequences, limits.max_stop_sequence_length)
    details = p.details if p.HasField("details") else False
    decoder_input_details = p.decoder_input_details if p.HasField("decoder_input_details") else False
    if decoder_input_details and not details:
        raise ValidationError("parameters.decoder_input_details requires parameters.details")
    sampling_implied = (
        (temperature is not None and temperature != 1.0) or top_k > 0
        or (top_p is not None and top_p < 1.0) or (typical_p is not None and typical_p < 1.0)
    )
    do_sample = p.do_sample if p.HasField("do_sample") else sampling_implied
    seed = given("seed", request_fields.seed)
    if seed is None:
        seed = random.getrandbits(63)
    truncate = given("truncate", lambda t: request_fields.truncate(t, limits.max_input_tokens))
    grammar = _grammar(p, grammars)
    ids = tokenizer.encode(inputs, add_special_tokens=add_special_tokens).ids
    if truncate is not None and len(ids) > truncate:
        ids = ids[-truncate:]  # keep the end, as the shards do
    length = request_fields.input_length(len(ids), limits.max_input_tokens)
    room = limits.max_total_tokens - length
    max_new_tokens = room
    if p.HasField("max_new_tokens"):
        max_new_tokens = request_fields.max_new_tokens(p.max_new_tokens, length, limits.max_total_tokens,
                                                       f"max_total_tokens ({limits.max_total_tokens})")
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
        frequency_penalty=frequency_penalty if frequency_penalty is not None else 0.0,
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
        top_n_tokens=top_n_tokens,
        ignore_eos_token=p.ignore_eos_token if p.HasField("ignore_eos_token") else False,
        add_special_tokens=add_special_tokens,
    )
