"""The one typed reader of a checkpoint's JSON configs (model settings and quantization configs).

Every error names the file and the key (with its path inside the file), so users can find what
to fix; a key set to null reads as absent.
"""

from __future__ import annotations

import pytest

from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.sources import CheckpointError

SOURCE = "/models/m/config.json"


def reader(prefix: str = "", **data) -> ConfigReader:
    return ConfigReader(data, SOURCE, prefix)


def refused(call, *needles: str) -> str:
    with pytest.raises(CheckpointError) as info:
        call()
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    return str(info.value)


def test_untyped_reads_treat_null_as_absent():
    r = reader(a=1, b=None)
    assert r.has("a") and not r.has("b") and not r.has("c")
    assert r.get("a") == 1 and r.get("b", 5) == 5 and r.get("c") is None
    assert r.need("a") == 1
    assert refused(lambda: r.need("b")) == f"{SOURCE}: missing required key 'b'"


def test_first_of_several_names():
    r = reader(n_embd=48, hidden_size=None)
    assert r.first("hidden_size", "n_embd") == 48
    assert r.first("x", "y", default=3) == 3
    assert refused(lambda: r.first("x", "y", "z", required=True)) == \
        f"{SOURCE}: missing required key 'x' (or y, z)"
    assert refused(lambda: r.first("x", required=True)) == f"{SOURCE}: missing required key 'x'"


def test_positive_int():
    r = reader(a=4096.0, b=0, c=True, d="7", e=2.5)
    assert r.positive_int("a") == 4096 and isinstance(r.positive_int("a"), int)
    assert r.positive_int("missing", default=2048) == 2048
    assert r.positive_int("missing", "a") == 4096
    for key in ("b", "c", "d", "e"):
        refused(lambda: r.positive_int(key), f"{SOURCE}: '{key}' must be a positive integer, got")


def test_number():
    r = reader(a=1, b=float("inf"), c=False)
    assert r.number("a") == 1.0 and r.number("missing") is None and r.number("missing", 2.0) == 2.0
    for key in ("b", "c"):
        refused(lambda: r.number(key), f"{SOURCE}: '{key}' must be a finite number")


def test_int_with_aliases_and_prefix():
    r = reader("quantization_config.", bits=4, w_bit=None, format=8, flag=True, name="x")
    assert r.int("bits") == 4 and r.int("group_size", -1) == -1
    assert r.int("w_bit", aliases=("bits",)) == 4
    assert refused(lambda: r.int("zero")) == f"{SOURCE}: 'quantization_config.zero' is required"
    refused(lambda: r.int("flag"), "'quantization_config.flag' must be an integer, got True")
    refused(lambda: r.int("name"), "'quantization_config.name' must be an integer, got 'x'")


def test_bool_str_and_names():
    r = reader(sym=False, on=None, fmt="gptq", bad=1, mods=["lm_head", "mlp.gate"], badmods="lm_head")
    assert r.bool("sym", True) is False and r.bool("on", True) is True and r.bool("missing", False) is False
    refused(lambda: r.bool("bad", False), f"{SOURCE}: 'bad' must be true or false, got 1")
    assert r.str("fmt") == "gptq" and r.str("missing") is None and r.str("format", aliases=("fmt",)) == "gptq"
    refused(lambda: r.str("bad"), "'bad' must be a string, got 1")
    assert r.names("mods") == ("lm_head", "mlp.gate") and r.names("missing") == ()
    refused(lambda: r.names("badmods"), "'badmods' must be a list of module names")


def test_refusals_name_file_key_and_value():
    r = reader("quantization_config.", bits=3, alibi=True)
    assert str(r.unsupported("bits", 3, "gptq", "4, 8")) == (
        f"{SOURCE}: 'quantization_config.bits' = 3 is not yet supported for gptq (supported: 4, 8)")
    assert str(reader(alibi=True).refuse("alibi", "ALiBi is not implemented")) == (
        f"{SOURCE}: alibi = True is not supported: ALiBi is not implemented")


def test_with_values_keeps_the_source():
    r = reader("p.", a=1)
    other = r.with_values(b=2)
    assert other.get("a") == 1 and other.get("b") == 2 and not r.has("b")
    assert other.where("b") == f"{SOURCE}: 'p.b'"
