"""Pipelined decode in the router's scheduler: when a step's answer leaves the batch as the router
keeps it, the next Decode goes out before the step's tokens are streamed (router/scheduler.py,
`_pipeline`). Against a real shard in process: the same tokens with it as without, through
arrivals, finishes, stop sequences, seeded sampling and a cancellation; the next call really goes
out first; and it never goes out when a row finished, someone waits for admission, or the call
before failed.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from test_scheduler_prefix import collect, generate_request, LIMITS, make, workload

from text_generation_server.models.loader import get_model
from text_generation_server.router.scheduler import StepFailed
from text_generation_server.router.validation import validate

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def lm():
    return get_model(None)


def test_the_same_tokens_with_and_without_pipelining(lm, monkeypatch):
    monkeypatch.setenv("TGS_DECODE_PIPELINE", "0")
    plain, _, _, plain_scheduler = asyncio.run(workload(lm, caching=True, max_prefill=2048))
    assert plain_scheduler.pipelined_steps == 0
    monkeypatch.setenv("TGS_DECODE_PIPELINE", "1")  # always (auto could judge a loaded test machine router-bound)
    piped, _, _, scheduler = asyncio.run(workload(lm, caching=True, max_prefill=2048))
    assert scheduler.pipelined_steps > 20
    for name, (ids, text) in plain.items():
        if name == "cancelled":  # cancelled after 3 tokens: it may see one more step before it leaves
            assert piped[name][0][:3] == ids[:3]
            continue
        assert piped[name] == (ids, text), name


def log_calls(client, order: list[str], names=("decode",)) -> None:
    """Appends each named shard call's name to `order` as it goes out."""
    for name in names:
        real = getattr(client, name)

        async def logged(*args, _real=real, _name=name):
            order.append(_name)
            return await _real(*args)

        setattr(client, name, logged)


def log_tokens(entry, order: list[str], label: str) -> None:
    """Appends `label` to `order` as each of the request's events is handed to its stream."""
    put = entry.events.put_nowait

    def token(event):
        order.append(label)
        put(event)

    entry.events.put_nowait = token


def test_the_next_decode_goes_out_before_the_tokens_of_the_step_before(lm, monkeypatch):
    monkeypatch.setenv("TGS_DECODE_PIPELINE", "1")  # the mechanics, whatever RouterPace would judge
    async def go():
        scheduler, client, _, _ = make(lm, 200, True, 2048)
        order: list[str] = []
        log_calls(client, order)
        scheduler.start()
        try:
            entry = scheduler.submit(validate(generate_request("def fibonacci(n):", 8), lm.tokenizer, LIMITS))
            log_tokens(entry, order, "token")
            ids, _ = await collect(scheduler, entry)
        finally:
            await scheduler.stop()
        return order, ids, scheduler

    order, ids, scheduler = asyncio.run(go())
    assert len(ids) == 8 and order.count("token") == 8
    # The prefill's token, then the first Decode; from its answer on, each decode answer but the last
    # (which finishes the request) sends the next Decode before its token goes to the client.
    assert order == ["token", "decode"] + ["decode", "token"] * 6 + ["token"], order
    assert scheduler.pipelined_steps == 6


def test_finished_rows_are_filtered_out_in_the_call_sent_ahead_and_a_queued_request_waits(lm, monkeypatch):
    monkeypatch.setenv("TGS_DECODE_PIPELINE", "1")
    async def go():
        scheduler, client, _, _ = make(lm, 200, True, 2048)
        order: list[str] = []
        log_calls(client, order, ("decode", "filter_batch", "prefill"))
        scheduler.start()
        try:
            short = scheduler.submit(validate(generate_request("import os\n", 3), lm.tokenizer, LIMITS))
            long = scheduler.submit(validate(generate_request("def main():", 8), lm.tokenizer, LIMITS))
            log_tokens(short, order, "short token")
            short_ids, _ = await collect(scheduler, short)
            # A newcomer while the long one runs: queued, so no Decode goes out ahead of its Prefill.
            late = scheduler.submit(validate(generate_request("class A:", 3), lm.tokenizer, LIMITS))
            results = await asyncio.gather(collect(scheduler, long), collect(scheduler, late))
        finally:
            await scheduler.stop()
        return short_ids, results, order, client.calls, scheduler

    short_ids, (long_res, late_res), order, calls, scheduler = asyncio.run(go())
    assert len(short_ids) == 3 and len(long_res[0]) == 8 and len(late_res[0]) == 3
    # The short request's last token: the call that filters it out and steps the rest (FilterBatch,
    # then Decode on its answer) went out before that token did.
    last = len(order) - 1 - order[::-1].index("short token")
    assert order[last - 1:last + 2] == ["filter_batch", "short token", "decode"], str(order)
    assert "prefill+cached" in calls  # the late request joined the running batch in a Prefill
    assert scheduler.pipelined_steps >= 4 and scheduler.pool.used == 0


def test_a_failed_pipelined_decode_fails_its_requests_and_the_server_goes_on(lm, monkeypatch):
    monkeypatch.setenv("TGS_DECODE_PIPELINE", "1")
    async def go():
        scheduler, client, _, _ = make(lm, 200, True, 2048)
        decode = client.decode
        calls = {"n": 0}

        async def flaky(batches):
            calls["n"] += 1
            if calls["n"] == 3:  # a pipelined one: the first decode answers, the second went out ahead
                raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           details="boom")
            return await decode(batches)

        client.decode = flaky
        scheduler.start()
        try:
            entry = scheduler.submit(validate(generate_request("def fibonacci(n):", 10), lm.tokenizer, LIMITS))
            with pytest.raises(StepFailed) as failed:
                await collect(scheduler, entry)
            again = scheduler.submit(validate(generate_request("def fibonacci(n):", 4), lm.tokenizer, LIMITS))
            ids, _ = await collect(scheduler, again)
        finally:
            await scheduler.stop()
        return failed.value, ids, scheduler

    failed, ids, scheduler = asyncio.run(go())
    assert failed.code == grpc.StatusCode.INTERNAL and "boom" in str(failed)
    assert len(ids) == 4 and scheduler.pool.used == 0


def test_router_pace_enters_when_the_router_is_the_slower_side_and_leaves_when_chains_stop():
    """RouterPace with stand-in timings: answers twice as far apart as the shards' steps took make the
    router the slower side (the next Decode then waits for the dispatch); it stays so while answers
    carry chains of steps, and leaves once they carry one step each."""
    from text_generation_server.router.scheduler import RouterPace

    pace = RouterPace()
    step_ns = 1_000_000  # the shards' 1 ms a step
    for _ in range(12):  # the router keeps up: an answer every 1.1 ms
        assert not pace.observe(0.0011, 1, step_ns)
    flips = [pace.observe(0.004, 1, step_ns) for _ in range(4)]  # an answer every 4 ms of 1 ms steps
    assert flips[0] is False and flips[-1] is True  # smoothed: not on the first slow answer
    for _ in range(12):  # chains form: 3 steps an answer, still the slower side
        assert pace.observe(0.0035, 3, 3 * step_ns)
    left = [pace.observe(0.0012, 1, step_ns) for _ in range(12)]  # one step an answer again
    assert left[0] is True and left[-1] is False
    assert pace.observe(0.01, 1, 0) is False  # a shard without timings changes nothing
    # A mode holds for DWELL answers whatever they say: slow answers from the start do not flip it.
    fresh = RouterPace()
    assert not any(fresh.observe(1.0, 1, step_ns) for _ in range(RouterPace.DWELL - 1))
    assert fresh.observe(1.0, 1, step_ns)


def test_pipeline_mode_reads_the_switch_and_refuses_other_values():
    from text_generation_server.router.scheduler import pipeline_mode

    assert pipeline_mode("auto") == "auto"
    assert pipeline_mode(None) == pipeline_mode("1") == pipeline_mode("on") == "on"  # the default: always ahead
    assert pipeline_mode("0") == pipeline_mode("false") == "off"
    with pytest.raises(ValueError, match="TGS_DECODE_PIPELINE='sometimes'"):
        pipeline_mode("sometimes")


def test_a_router_bound_scheduler_sends_the_next_decode_after_the_tokens_with_the_same_tokens(lm, monkeypatch):
    """With the pace judged router-bound, no Decode goes out ahead (each waits for its step's tokens),
    and the tokens are those of the pipelined run; TGS_DECODE_PIPELINE=1 pipelines whatever the pace."""
    from text_generation_server.router import scheduler as scheduler_module

    class RouterBound(scheduler_module.RouterPace):
        def __init__(self):
            super().__init__()
            self.router_bound = True

        def observe(self, wall_s, steps, shard_ns):
            return True

    monkeypatch.setenv("TGS_DECODE_PIPELINE", "1")
    piped, _, _, _ = asyncio.run(workload(lm, caching=True, max_prefill=2048))
    monkeypatch.setenv("TGS_DECODE_PIPELINE", "auto")
    monkeypatch.setattr(scheduler_module, "RouterPace", RouterBound)
    waited, _, _, scheduler = asyncio.run(workload(lm, caching=True, max_prefill=2048))
    assert scheduler.pipelined_steps == 0 and scheduler.unpipelined_steps > 20
    for name, (ids, text) in piped.items():
        if name == "cancelled":
            assert waited[name][0][:3] == ids[:3]
            continue
        assert waited[name] == (ids, text), name
    monkeypatch.setenv("TGS_DECODE_PIPELINE", "1")
    _, _, _, forced = asyncio.run(workload(lm, caching=True, max_prefill=2048))
    assert forced.pipelined_steps > 20 and forced.unpipelined_steps == 0
