"""benchmarks/serve_overhead.py: its flag parsing, and one real run on the embedded model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import serve_overhead as so  # noqa: E402


def test_server_args_reach_the_in_process_model():
    flags, model_args = so.parse_server_args("--dtype bfloat16 --quantize eetq --quantize-lm-head int8 --port 1")
    assert flags[-2:] == ["--port", "1"]
    assert model_args == {"dtype": "bfloat16", "quantize": "eetq", "quantize_lm_head": "int8"}
    assert so.parse_server_args("")[1] == {"dtype": None, "quantize": None, "quantize_lm_head": None}
    with pytest.raises(ValueError, match="--quantize needs a value"):
        so.parse_server_args("--dtype float32 --quantize")


def test_step_ms():
    assert so.step_ms(0.5, 10) == pytest.approx(50.0)
    assert so.step_ms(0.5, 0) is None and so.step_ms(0.0, 3) is None


def test_a_model_that_does_not_load_is_named(tmp_path, capsys):
    assert so.main(["--model", str(tmp_path / "missing"), "--rounds", "1"]) == 2
    assert f"cannot load {tmp_path / 'missing'}" in capsys.readouterr().err


def test_one_round_on_the_embedded_model(capsys):
    """Both sides really run: a server on free ports and the in-process model, one round."""
    assert so.main(["--server-args", "--dtype float32 --max-total-tokens 128", "--new-tokens", "6",
                    "--rounds", "1", "--startup-timeout-s", "240"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.splitlines()
            if line.startswith("| ") and "---" not in line}
    for name in ("in-process step", "in-process forward", "served client", "served router step", "served forward"):
        assert float(rows[name]) > 0, (name, out)
    assert "within 1.1x" in out


def test_compare_env_items():
    assert so.parse_compare_env("") == {}
    assert so.parse_compare_env("TGS_ROUTER_NICE=0,TGS_X=a=b") == {"TGS_ROUTER_NICE": "0", "TGS_X": "a=b"}
    with pytest.raises(ValueError, match="VAR=VALUE"):
        so.parse_compare_env("TGS_ROUTER_NICE")
    with pytest.raises(ValueError, match="VAR=VALUE"):
        so.parse_compare_env("=1")  # no variable name


def test_a_compared_server_gets_its_own_rows(capsys):
    """--compare-env: a second server with the variables set, its rounds beside the first's."""
    assert so.main(["--server-args", "--dtype float32 --max-total-tokens 128", "--new-tokens", "6",
                    "--rounds", "1", "--startup-timeout-s", "240", "--compare-env", "TGS_DECODE_AHEAD=0"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in out.splitlines()
            if line.startswith("| ") and "---" not in line}
    for name in ("served client", "served TGS_DECODE_AHEAD=0 client", "served TGS_DECODE_AHEAD=0 forward"):
        assert float(rows[name]) > 0, (name, out)
    assert "--compare-env TGS_DECODE_AHEAD=0" in out
