"""One validator per request field, the same at both doors a request enters by.

The client API (router/validation.py) and a shard's generate.v3 Prefill, where a TGI router
talks to a `--shard-only` rank, call the validators of generation/request_fields.py: a bad field
gets the same rule and the same words at both, under each wire's name for it.
"""

from __future__ import annotations

import asyncio
import math
import re

import grpc
import pytest
import torch

from text_generation_server.generation import request_fields
from text_generation_server.generation.request_fields import InvalidField
from helpers import Aborted
from helpers import AbortingContext as Context

from text_generation_server.models.loader import get_model
from text_generation_server.pb.generate.v3 import generate_pb2 as spb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.router.validation import Limits, ValidationError, validate
from text_generation_server.shard.service import TextGenerationService

torch.set_num_threads(1)

LIMITS = Limits(max_input_tokens=64, max_total_tokens=128, max_stop_sequences=4, max_stop_sequence_length=16,
                max_top_n_tokens=5, max_input_chars=10_000)


# -- the validators ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("check, value, message", [
    (request_fields.temperature, 0.0, "temperature must be a finite number > 0, got 0.0"),
    (request_fields.temperature, math.nan, "temperature must be a finite number > 0, got nan"),
    (request_fields.repetition_penalty, math.inf, "repetition_penalty must be a finite number > 0, got inf"),
    (request_fields.top_p, 1.5, "top_p must be <= 1.0, got 1.5"),
    (request_fields.typical_p, 0.0, "typical_p must be a finite number > 0, got 0.0"),
    (request_fields.top_k, 0, "top_k must be >= 1, got 0"),
    (request_fields.frequency_penalty, 2.5, "frequency_penalty must be in [-2, 2], got 2.5"),
    (request_fields.frequency_penalty, math.nan, "frequency_penalty must be in [-2, 2], got nan"),
    (request_fields.seed, -1, "seed must be an integer in [0, 18446744073709551615], got -1"),
    (request_fields.do_sample, 1, "do_sample must be a bool, got 1"),
])
def test_a_bad_value_names_its_field_and_rule(check, value, message):
    with pytest.raises(InvalidField) as info:
        check(value)
    assert str(info.value) == message


def test_values_at_the_edges_pass():
    assert request_fields.top_p(1.0) == 1.0 and request_fields.frequency_penalty(-2.0) == -2.0
    assert request_fields.seed(request_fields.MAX_SEED) == request_fields.MAX_SEED
    assert request_fields.max_new_tokens(3, 5, 8, "max_total_tokens (8)") == 3
    assert request_fields.top_n_tokens(5, 5) == 5 and request_fields.truncate(64, 64) == 64
    assert request_fields.stop(["a" * 16] * 4, 4, 16) == ["a" * 16] * 4


@pytest.mark.parametrize("call, message", [
    (lambda: request_fields.max_new_tokens(0, 5, 100, "x"), "max_new_tokens must be >= 1, got 0"),
    (lambda: request_fields.max_new_tokens(2.5, 5, 100, "x"), "max_new_tokens must be an integer, got 2.5"),
    (lambda: request_fields.max_new_tokens(96, 5, 100, "max_total_tokens (100)"),
     "max_new_tokens (96) + 5 input tokens exceeds max_total_tokens (100)"),
    (lambda: request_fields.stop(["ok", ""]), "stop must not contain an empty sequence"),
    (lambda: request_fields.stop(["ok", 3]), "stop[1] must be a string, got 3"),
    (lambda: request_fields.stop(["a", "b", "c"], 2), "stop has 3 sequences, at most 2 allowed"),
    (lambda: request_fields.stop(["abc"], 4, 2), "stop has a sequence of 3 characters, at most 2"),
    (lambda: request_fields.top_n_tokens(-1, 5), "top_n_tokens must be >= 0, got -1"),
    (lambda: request_fields.input_length(0), "inputs tokenize to zero tokens"),
    (lambda: request_fields.grammar(7, "x", "7"), "grammar.type must be GRAMMAR_TYPE_JSON or GRAMMAR_TYPE_REGEX"),
])
def test_length_stop_and_grammar_rules(call, message):
    with pytest.raises(InvalidField, match=re.escape(message)):
        call()


def test_each_wire_names_the_field_its_way():
    error = InvalidField("stop", " must not contain an empty sequence")
    assert error.client_message() == "parameters.stop must not contain an empty sequence"
    assert error.shard_message() == "stop_sequences must not contain an empty sequence"
    grammar = InvalidField("grammar.value", ": the regex is empty")
    assert (grammar.client_message(), grammar.shard_message()) == ("parameters.grammar.value: the regex is empty",
                                                                   "grammar: the regex is empty")
    assert InvalidField("inputs", " tokenize to zero tokens").client_message() == "inputs tokenize to zero tokens"


# -- both doors ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm():
    model = get_model(None)
    model.allocate_kv_cache(64)
    return model


def shard_request(max_new: int = 4, stop: tuple[str, ...] = (), **parameters) -> spb.Request:
    params = spb.NextTokenChooserParameters(**parameters)
    return spb.Request(id=1, inputs="def add(a, b):", parameters=params, add_special_tokens=True,
                       stopping_parameters=spb.StoppingCriteriaParameters(max_new_tokens=max_new,
                                                                          stop_sequences=list(stop)))


# case -> (client API parameters, shard request, field as the client API names it, its problem)
BOTH_DOORS = {
    "temperature": ({"temperature": -0.5, "do_sample": True}, shard_request(temperature=-0.5),
                    "parameters.temperature", "temperature", " must be a finite number > 0, got -0.5"),
    "top_p": ({"top_p": 1.5}, shard_request(top_p=1.5), "parameters.top_p", "top_p", " must be <= 1.0, got 1.5"),
    "typical_p": ({"typical_p": 2.0}, shard_request(typical_p=2.0), "parameters.typical_p", "typical_p",
                  " must be <= 1.0, got 2.0"),
    "repetition_penalty": ({"repetition_penalty": math.inf}, shard_request(repetition_penalty=math.inf),
                           "parameters.repetition_penalty", "repetition_penalty",
                           " must be a finite number > 0, got inf"),
    "frequency_penalty": ({"frequency_penalty": 3.0}, shard_request(frequency_penalty=3.0),
                          "parameters.frequency_penalty", "frequency_penalty", " must be in [-2, 2], got 3.0"),
    "max_new_tokens": ({"max_new_tokens": 0}, shard_request(max_new=0), "parameters.max_new_tokens",
                       "max_new_tokens", " must be >= 1, got 0"),
    "stop": ({"stop": ["x", ""]}, shard_request(stop=("x", "")), "parameters.stop", "stop_sequences",
             " must not contain an empty sequence"),
    "grammar": ({"grammar": cpb.Grammar(type=cpb.GRAMMAR_TYPE_REGEX, value="")},
                shard_request(grammar_type=spb.GRAMMAR_TYPE_REGEX), "parameters.grammar.value", "grammar",
                " must hold the regex, got an empty string"),
    "grammar schema": ({"grammar": cpb.Grammar(type=cpb.GRAMMAR_TYPE_JSON, value='{"type": "strin"}')},
                       shard_request(grammar_type=spb.GRAMMAR_TYPE_JSON, grammar='{"type": "strin"}'),
                       "parameters.grammar.value", "grammar", ": invalid JSON schema: Invalid type: strin"),
}


@pytest.mark.parametrize("case", list(BOTH_DOORS))
def test_both_doors_refuse_a_field_by_the_same_rule(lm, case):
    client_params, shard_req, client_name, shard_name, problem = BOTH_DOORS[case]
    with pytest.raises(ValidationError) as refused:
        validate(cpb.GenerateRequest(inputs="def add(a, b):", parameters=cpb.GenerateParameters(**client_params)),
                 lm.tokenizer, LIMITS, lm.builder.grammars)
    assert str(refused.value).startswith(client_name + problem), str(refused.value)

    service = TextGenerationService(lm, "/tmp/unused", 1, 0.1)
    service.decode_ahead = False
    free = lm.allocator.free_blocks
    try:
        asyncio.run(service.Prefill(spb.PrefillRequest(batch=spb.Batch(id=1, requests=[shard_req], size=1)),
                                    Context()))
    except Aborted as exc:
        assert exc.code == grpc.StatusCode.INVALID_ARGUMENT
        assert exc.details.startswith(f"request 1: {shard_name}{problem}"), exc.details
    else:
        pytest.fail(f"the shard accepted {case}")
    finally:
        service._executor.shutdown(wait=True)
    assert lm.allocator.free_blocks == free and not service.cache
