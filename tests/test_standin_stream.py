"""The stand-in's "stream" device (engine/standin.py, engine/readback.EmulatedStream): a GPU's
timing on a CPU, so that benchmarks/host_overhead.py measures the host work a GPU's decode loop
leaves exposed (issue #31) on a machine without one.

What must hold: a launch returns at once and queues its X after what is queued; the step's one
sync (the readback) waits for the queue and no longer; the decode steps replay emulated graphs
and launch ahead as on CUDA, serving the same tokens as the blocking stand-in; the clock and the
stats file report the device's time, not the host's; a mode that is neither is refused by name.
"""

from __future__ import annotations

import time

import pytest
import torch

from text_generation_server.engine.cuda_graphs import DirectReplayCapturer
from text_generation_server.engine.readback import DeviceClock, EmulatedStream, Readback
from text_generation_server.engine.standin import (
    ACK_ENV, ACK_VALUE, DEVICE_ENV, FORWARD_US_ENV, STATS_ENV, StandinForward, StandinStats, standin_device_mode,
)
from text_generation_server.engine.types import GenerationRequest
from text_generation_server.models.loader import get_model


def test_launches_queue_behind_each_other_and_the_sync_waits_for_the_last():
    done = []
    stream = EmulatedStream(lambda prefill, ns: done.append((prefill, ns)))
    clock = DeviceClock(torch.device("cpu"), stream)
    start = time.perf_counter_ns()
    clock.start()
    stream.launch(3_000_000, prefill=True)
    stream.launch(2_000_000)
    clock.stop()
    launched = time.perf_counter_ns()
    assert launched - start < 3_000_000  # the host did not wait for the device
    assert stream.ready_ns >= start + 5_000_000  # the second launch runs after the first
    assert done == []  # nothing is complete before a sync
    stream.synchronize()
    assert time.perf_counter_ns() >= start + 5_000_000
    assert [p for p, _ in done] == [True, False]
    assert done[0][1] == 3_000_000 and done[1][1] >= 2_000_000  # a late wake-up is the last launch's
    assert clock.elapsed_ns() == done[0][1] + done[1][1]
    # An idle device starts a launch now, not at the end of the last one.
    time.sleep(0.002)
    before = time.perf_counter_ns()
    stream.launch(0)
    assert stream.ready_ns >= before
    stream.synchronize()
    assert stream.device_ns(0, 2) == done[0][1] + done[1][1] and stream.device_ns(2, 3) == 0


def test_an_event_waits_for_the_work_before_it_only():
    """What lets a step launch its successor before it reads its own tokens: the readback's wait
    is for the copy it enqueued, not for the step launched after it (CUDA's event semantics)."""
    done = []
    stream = EmulatedStream(lambda prefill, ns: done.append(ns))
    start = time.perf_counter_ns()
    stream.launch(3_000_000)
    event = stream.record()
    stream.launch(30_000_000)
    stream.wait(event)
    assert len(done) == 1 and time.perf_counter_ns() - start < 30_000_000
    stream.synchronize()
    assert len(done) == 2 and time.perf_counter_ns() - start >= 33_000_000


def test_the_readback_is_the_sync():
    stream = EmulatedStream()
    readback = Readback(torch.device("cpu"), stream)
    start = time.perf_counter_ns()
    stream.launch(4_000_000)
    assert readback.fetch(torch.tensor([1.0, 2.5], dtype=torch.float64)) == [1.0, 2.5]
    assert time.perf_counter_ns() - start >= 4_000_000


def test_a_mode_that_is_neither_is_refused_by_name():
    assert standin_device_mode({}) == "blocking"
    assert standin_device_mode({DEVICE_ENV: "Stream"}) == "stream"
    with pytest.raises(ValueError, match=DEVICE_ENV):
        standin_device_mode({DEVICE_ENV: "gpu"})


def _standin(monkeypatch, tmp_path, mode: str, wait_us: int):
    stats_path = tmp_path / f"{mode}.stats"
    stats = StandinStats.create(stats_path, wait_us=-1)
    monkeypatch.setenv(FORWARD_US_ENV, str(wait_us))
    monkeypatch.setenv(ACK_ENV, ACK_VALUE)
    monkeypatch.setenv(STATS_ENV, str(stats_path))
    monkeypatch.setenv(DEVICE_ENV, mode)
    lm = get_model(None, dtype="float32", cuda_graphs=[1, 2, 4])
    return lm, stats


def _requests() -> list[GenerationRequest]:
    return [GenerationRequest(id=i, inputs="def f(x):", max_new_tokens=6 + 3 * i, ignore_eos_token=True)
            for i in range(3)]


def test_stream_mode_replays_graphs_and_launches_ahead_with_the_blocking_tokens(monkeypatch, tmp_path):
    blocking, _ = _standin(monkeypatch, tmp_path, "blocking", 0)
    assert blocking.graph_buckets == [] and not blocking.launch_ahead  # a CPU's forward: no graphs
    want = [c.token_ids for c in blocking.generate(_requests())]

    lm, stats = _standin(monkeypatch, tmp_path, "stream", 1500)
    assert isinstance(lm.model, StandinForward) and lm.model.stream is not None
    assert lm.graph_buckets == [1, 2, 4] and lm.graphs_off_reason() is None and lm.launch_ahead
    lm.allocate_kv_cache(32)
    lm.capture_decode_graphs(64)
    assert isinstance(lm.graphs.capturer, DirectReplayCapturer)
    done = lm.generate(_requests())
    assert [c.token_ids for c in done] == want
    # Rows finish at 6, 9 and 12 tokens and are filtered out: launched steps are taken whole and by
    # the rows left; every decode step after a batch's first came from a launch.
    assert lm.launched_taken >= 8 and sum(lm.graphs.stats.replays.values()) >= lm.launched_taken
    counts = stats.read()
    # The device's time per forward is X (plus a late wake-up), whatever the host did around it.
    assert counts["decode_calls"] >= 11
    assert 1500e3 <= counts["decode_wall_ns"] / counts["decode_calls"] < 1500e3 + 5e6
    stats.close()


def test_a_step_reports_the_device_time_and_overlaps_the_host(monkeypatch, tmp_path):
    lm, stats = _standin(monkeypatch, tmp_path, "stream", 60_000)  # 60 ms: far above this step's host work
    lm.allocate_kv_cache(32)
    lm.capture_decode_graphs(64)
    batch = lm.make_batch(0, [GenerationRequest(id=0, inputs="def f(x):", max_new_tokens=8, ignore_eos_token=True)])
    _, batch, _ = lm.generate_token(batch)  # the prefill, then a step that launches its successor
    _, batch, _ = lm.generate_token(batch)
    assert lm._launched is not None
    time.sleep(0.025)  # 25 ms of host work between steps, while the launched step computes
    start = time.perf_counter_ns()
    _, batch, timings = lm.generate_token(batch)
    waited = time.perf_counter_ns() - start
    assert lm.last_device_ns >= 60_000_000  # the device's time, not the host's call
    assert timings.forward_ns == min(lm.last_device_ns, timings.total_ns)
    assert waited < 55_000_000  # the host work ran while the device computed: the step waited the rest
    lm.release(batch)
    stats.close()
