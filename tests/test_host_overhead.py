"""The benchmark-only stand-in forward (engine/standin.py) and benchmarks/host_overhead.py.

The switch must be impossible to throw by half: a forward-time variable without the exact
acknowledgement refuses to start, in the function and through a real `serve`. Thrown right, the
model's forward is the stand-in's: greedy tokens walk its cycle, CUDA graphs are off, its stats
file counts its calls, and the benchmark's --quick run prints a well-formed table whose measured
X is near the nominal one and whose every streamed token was canned.
"""

from __future__ import annotations

import asyncio
import math
import sys
from pathlib import Path

import pytest
import torch

from text_generation_server.engine.standin import (
    ACK_ENV, ACK_VALUE, DEVICE_ENV, FORWARD_US_ENV, STATS_ENV, StandinForward, StandinStats, canned_cycle, standin_wait_us,
)
from text_generation_server.engine.types import GenerationRequest
from text_generation_server.models.loader import get_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import host_overhead as ho  # noqa: E402
from bench_common import StartedServer  # noqa: E402


def test_the_switch_needs_its_exact_acknowledgement():
    assert standin_wait_us({}) is None
    assert standin_wait_us({ACK_ENV: ACK_VALUE}) is None  # the acknowledgement alone turns nothing on
    for environ in ({FORWARD_US_ENV: "1000"}, {FORWARD_US_ENV: "1000", ACK_ENV: "1"},
                    {FORWARD_US_ENV: "1000", ACK_ENV: ACK_VALUE.upper()}, {FORWARD_US_ENV: "0", ACK_ENV: ""}):
        with pytest.raises(ValueError, match=f"refusing to start without {ACK_ENV}={ACK_VALUE}"):
            standin_wait_us(environ)
    assert standin_wait_us({FORWARD_US_ENV: "1000", ACK_ENV: ACK_VALUE}) == 1000
    for bad in ("1e3", "-1", "10000001", ""):
        with pytest.raises(ValueError, match=FORWARD_US_ENV):
            standin_wait_us({FORWARD_US_ENV: bad, ACK_ENV: ACK_VALUE})


def test_without_the_switch_the_model_is_the_model(monkeypatch):
    monkeypatch.delenv(FORWARD_US_ENV, raising=False)
    assert not isinstance(get_model(None).model, StandinForward)


def test_serve_refuses_the_switch_without_the_acknowledgement():
    """Through the real launcher and rank: startup fails, naming the missing variable."""
    server = StartedServer("tiny-pycoder", ["--max-total-tokens", "64"], startup_timeout_s=240,
                           env={FORWARD_US_ENV: "0", ACK_ENV: "yes"})
    try:
        with pytest.raises(RuntimeError, match="exited with code") as failure:
            asyncio.run(server.wait_ready())
        assert f"refusing to start without {ACK_ENV}={ACK_VALUE}" in str(failure.value)
    finally:
        server.stop()


def test_canned_cycle_skips_special_and_eos_ids():
    cycle = canned_cycle(100, 90, excluded={45, 47}, length=5)
    assert cycle == [46, 48, 49, 50, 51]
    assert canned_cycle(100, 200, excluded=(), length=3) == [50, 51, 52]
    with pytest.raises(ValueError, match="no 16 ordinary tokens"):
        canned_cycle(20, 20, excluded=range(15))


def test_the_stand_in_serves_its_cycle_and_counts_its_calls(monkeypatch, tmp_path):
    stats = StandinStats.create(tmp_path / "stats", wait_us=-1)
    monkeypatch.setenv(FORWARD_US_ENV, "0")
    monkeypatch.setenv(ACK_ENV, ACK_VALUE)
    monkeypatch.setenv(STATS_ENV, str(tmp_path / "stats"))
    monkeypatch.delenv(DEVICE_ENV, raising=False)  # the blocking device (test_standin_stream.py: the other)
    lm = get_model(None)
    standin = lm.model
    assert isinstance(standin, StandinForward)
    # What CausalLM.graphs_off_reason reads: a graph replay would skip the wait.
    blockers = [b for b in (getattr(m, "graph_blocker", None) for m in lm.model.modules()) if isinstance(b, str)]
    assert len(blockers) == 1 and FORWARD_US_ENV in blockers[0]
    assert lm.model.config.vocab_size == standin.inner.config.vocab_size  # the rest is the model's
    eos = set(lm.eos_token_ids)
    assert not eos & set(standin.cycle) and len(set(standin.cycle)) == len(standin.cycle)

    new = 20
    prompt_len = len(lm.tokenizer.encode("def f(x):").ids)
    requests = [GenerationRequest(id=i, inputs="def f(x):", max_new_tokens=new) for i in range(3)]
    done = lm.generate(requests)
    expected = [standin.cycle[(prompt_len - 1 + k) % len(standin.cycle)] for k in range(new)]
    assert [c.token_ids for c in done] == [expected] * 3
    counts = stats.read()
    assert counts["decode_calls"] == new - 1 and counts["prefill_calls"] == 1
    assert counts["decode_wall_ns"] > 0 and counts["decode_cpu_ns"] > 0

    stats.set_wait_us(2000)  # the stats file's override of X, read at every forward
    before = stats.read()
    lm.generate([GenerationRequest(id=9, inputs="def f(x):", max_new_tokens=4)])
    after = stats.read()
    assert (after["decode_wall_ns"] - before["decode_wall_ns"]) / (after["decode_calls"] - before["decode_calls"]) \
        >= 2000e3
    stats.close()


def test_logits_are_the_vocabulary_in_float32(monkeypatch):
    monkeypatch.setenv(FORWARD_US_ENV, "0")
    monkeypatch.setenv(ACK_ENV, ACK_VALUE)
    monkeypatch.delenv(STATS_ENV, raising=False)
    standin = get_model(None).model
    logits = standin(torch.tensor([5, 6]), torch.tensor([3, 4 + len(standin.cycle)]), None, None)
    assert logits.shape == (2, standin.config.vocab_size) and logits.dtype == torch.float32
    assert logits.argmax(-1).tolist() == [standin.cycle[3], standin.cycle[4]]


def test_inter_token_counts_the_steady_window_only():
    # Two clients, 1 ms steps; the second joins 10 ms late (its prefill stalls the first once).
    first = [0.000, 0.001, 0.002, 0.012, 0.013, 0.014, 0.015, 0.016, 0.017, 0.018]
    second = [0.012, 0.013, 0.014, 0.015, 0.016, 0.017, 0.018, 0.019]
    assert ho.inter_token_us([first, second]) == pytest.approx(1000.0)
    assert ho.inter_token_us([[0.0, 0.002]]) == pytest.approx(2000.0)  # too short a window: whole stream
    assert ho.inter_token_us([[0.0]]) is None


def test_above_floor_is_over_the_larger_of_device_and_floor():
    assert ho.above_floor(1500.0, 1000.0, 400.0) == pytest.approx(500.0)  # the device's step hides the floor
    assert ho.above_floor(1500.0, 0.0, 1200.0) == pytest.approx(300.0)
    assert ho.above_floor(1500.0, 1000.0, None) is None


def test_the_floor_server_streams_every_client_its_tokens():
    """benchmarks/grpc_floor.py through real sockets: each of several concurrent streams gets
    exactly the tokens it asked for, the last message with the generated text."""
    floor = ho.FloorServer(startup_timeout_s=60)
    try:
        asyncio.run(floor.wait_ready())

        async def run() -> list[list]:
            import grpc

            from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
            from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc

            async with grpc.aio.insecure_channel(floor.target) as channel:
                stub = cpb_grpc.TextGenerationStub(channel)
                request = cpb.GenerateRequest(inputs="x", parameters=cpb.GenerateParameters(max_new_tokens=5))

                async def one() -> list:
                    return [msg async for msg in stub.GenerateStream(request)]

                itl = await ho.floor_round(stub, 3, 6)
                assert itl is not None and itl > 0
                return await asyncio.gather(*(one() for _ in range(4)))

        for messages in asyncio.run(run()):
            assert len(messages) == 5
            assert [m.HasField("generated_text") for m in messages] == [False] * 4 + [True]
            ids = [m.token.id for m in messages]
            assert ids == list(range(ids[0], ids[0] + 5))  # one token a step, the steps in order
    finally:
        floor.stop()
    assert floor.proc.returncode is not None


def test_off_cycle_counts_tokens_the_stand_in_did_not_choose():
    cycle = [7, 8, 9]
    assert ho.off_cycle([8, 9, 7, 8], cycle) == 0
    assert ho.off_cycle([8, 9, 9, 9], cycle) == 2
    assert ho.off_cycle([1, 2], cycle) == 2


def _tables(out: str) -> list[list[dict[str, str]]]:
    """Every Markdown table of the output, as rows keyed by the header (the rule line dropped)."""
    tables, current = [], []
    for line in out.splitlines() + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            header = [c.strip() for c in current[0].strip("|").split("|")]
            tables.append([dict(zip(header, (c.strip() for c in row.strip("|").split("|")))) for row in current[2:]])
            current = []
    return tables


def _table(out: str) -> list[dict[str, str]]:
    return _tables(out)[0]


def test_quick_run_on_the_embedded_model(capsys, monkeypatch):
    """Both servers of the comparison: the default (a rank process) and --shard-in-process (the
    rank inside the router's process) serve the stand-in's cycle, with their ratio table."""
    monkeypatch.delenv(FORWARD_US_ENV, raising=False)
    assert ho.main(["--quick", "--startup-timeout-s", "240", "--compare-server-args=--shard-in-process"]) == 0
    assert FORWARD_US_ENV not in __import__("os").environ  # the switch does not outlive the run
    out = capsys.readouterr().out
    tables = _tables(out)
    assert len(tables) == 3
    cells = [("1", "0"), ("8", "0"), ("1", "1000"), ("8", "1000")]
    compared, ratios = tables[1], tables[2]
    assert list(compared[0]) == ["batch", "X nominal µs", *ho.SERVED_COLUMNS]
    assert [(r["batch"], r["X nominal µs"]) for r in compared] == cells
    for row in compared:
        values = {k: float(v) for k, v in row.items()}
        assert all(math.isfinite(v) for v in values.values()), row
        assert values["X nominal µs"] <= values["served X µs"] < values["X nominal µs"] + 5000, row
        assert values["host CPU per step µs"] > 0, row
    assert [(r["batch"], r["X nominal µs"]) for r in ratios] == cells
    for row in ratios:
        assert all(row[k].endswith("x") for k in ("served inter-token", "host CPU per step")), row
    rows = tables[0]
    assert list(rows[0]) == list(ho.COLUMNS)
    assert [(r["batch"], r["X nominal µs"]) for r in rows] == [("1", "0"), ("8", "0"), ("1", "1000"), ("8", "1000")]
    for row in rows:
        values = {k: float(v) for k, v in row.items()}
        assert all(math.isfinite(v) for v in values.values()), row
        nominal = values["X nominal µs"]
        for side in ("in-process", "served"):
            # Measured, not assumed: never below nominal; above it by a late wake-up and the logits' copy.
            assert nominal <= values[f"{side} X µs"] < nominal + 5000, row
        assert values["in-process step µs"] >= values["in-process X µs"], row
        assert values["in-process host µs"] == pytest.approx(values["in-process step µs"] - values["in-process X µs"],
                                                             abs=1.01), row
        assert values["exposed host µs"] == pytest.approx(values["served inter-token µs"] - values["served X µs"],
                                                          abs=1.01), row
        # The floor server streamed the same clients; what serve adds is measured over it.
        assert values["gRPC floor µs"] > 0, row
        assert values["above floor µs"] == pytest.approx(
            values["served inter-token µs"] - max(values["served X µs"], values["gRPC floor µs"]), abs=1.01), row
        # A step holds the wait (a short window's mean can dip below it when two tokens arrive together).
        assert values["served inter-token µs"] >= nominal * 0.5, row
        assert values["host CPU per step µs"] > 0 and values["client CPU per step µs"] > 0, row
    # 2 servers x 2 waits x (1 + 8) clients x 24 tokens
    assert "canned tokens: 864 of 864 streamed tokens followed the stand-in's cycle" in out
