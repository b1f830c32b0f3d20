"""Router-side validation: what a valid request carries to the shards."""

from __future__ import annotations

from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.router.validation import Limits, validate
from text_generation_server.utils.locate import open_checkpoint

LIMITS = Limits(max_input_tokens=64, max_total_tokens=128, max_stop_sequences=2, max_stop_sequence_length=16,
                max_top_n_tokens=5, max_input_chars=10_000)


def tokenizer():
    return open_checkpoint(None).tokenizer


def test_token_ids_travel_truncated_from_the_end():
    tok = tokenizer()
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n"
    full = tok.encode(text, add_special_tokens=True).ids
    valid = validate(cpb.GenerateRequest(inputs=text, parameters=cpb.GenerateParameters(truncate=5)), tok, LIMITS)
    assert valid.input_ids == full[-5:] and valid.input_length == 5
    shard = valid.to_shard(7, [1, 2], list(range(16, 32))[:valid.input_length + valid.max_new_tokens], 0, 3)
    assert list(shard.input_ids) == full[-5:] and shard.chunk_len == 3 and shard.cache_len == 0
    assert not validate(cpb.GenerateRequest(inputs=text), tok, LIMITS).to_shard(1, [], []).HasField("chunk_len")


def test_ignore_eos_reaches_the_shard_only_when_asked():
    tok = tokenizer()
    plain = validate(cpb.GenerateRequest(inputs="import os"), tok, LIMITS)
    assert not plain.to_shard(1, [], []).stopping_parameters.ignore_eos_token
    asked = validate(cpb.GenerateRequest(inputs="import os", parameters=cpb.GenerateParameters(
        ignore_eos_token=True, max_new_tokens=4)), tok, LIMITS)
    assert asked.to_shard(1, [], []).stopping_parameters.ignore_eos_token
