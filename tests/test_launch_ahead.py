"""Launch ahead (engine/causal_lm.py): a decode step's successor is enqueued from its graph as
soon as the step's tokens are on the host, before the step's Python work, and the next
`generate_token` takes it when its batch is the rows it ran, as they now stand.

On CUDA it is on by default; here it runs on the CUDA-emulating CPU path (EagerReplayCapturer
replays a "graph" by running the recorded forward), where a launch is the forward itself. What
these tests hold: the tokens and logprobs are those of steps run one by one, whatever the batch
does between the launch and the next step (rows finishing by length, EOS or a stop sequence and
filtered out, newcomers merged in, a batch forked for the shard's decode ahead, sampled rows); a
dropped launch leaves nothing behind that a later step reads; and a steady step still costs one
sync and at most eight launches outside the graph.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from helpers import write_checkpoint
from test_cuda_graphs import assert_same, load, request, Recorder
from test_step_budget import MAX_LAUNCHES, MAX_SYNCS, StepCounter

from text_generation_server.engine.batch import Batch
from text_generation_server.engine.causal_lm import LaunchedStep
from text_generation_server.engine.cuda_graphs import EagerReplayCapturer
from text_generation_server.engine.types import GenerationRequest
from text_generation_server.generation.sampling import SamplingParams

BUCKETS = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("launch") / "llama"
    write_checkpoint(path, "llama", seed=43)
    return str(path)


def graphed(folder: str, ahead: bool = True):
    lm = load(folder, buckets=BUCKETS, capturer=EagerReplayCapturer())
    lm.launch_ahead = ahead
    return lm


def replays(lm) -> int:
    return sum(lm.graphs.stats.replays.values())


def finishing_scenario(lm) -> dict:
    """Four greedy rows ending by length at different steps, filtered out as they end (the
    router's FilterBatch), so launched steps are taken whole, by a prefix of rows, and by rows
    with a gap."""
    rec = Recorder(lm)
    news = {0: 9, 1: 4, 2: 12, 3: 6}
    batch = lm.make_batch(0, [request(rid, 5 + rid, new) for rid, new in news.items()])
    while batch is not None:
        before = {rid: len(rec.out.get(rid, [])) for rid in batch.request_ids}
        batch = rec.step(batch)
        if batch is None:
            break
        done = [rid for rid in batch.request_ids if len(rec.out[rid]) == news[rid] and before[rid] < news[rid]]
        if done:
            batch = lm.filter(batch, [rid for rid in batch.request_ids if rid not in done])
    return rec.out


def test_tokens_equal_steps_run_one_by_one_as_rows_finish(folder):
    plain = graphed(folder, ahead=False)
    want = finishing_scenario(plain)
    lm = graphed(folder)
    got = finishing_scenario(lm)
    assert_same(got, want)
    # Every decode step but the first of each batch shape came from a launch; none ran twice.
    assert lm.launched_taken >= 8, (lm.launched_taken, lm.launched_dropped)
    assert replays(lm) == replays(plain) + lm.launched_dropped + (1 if lm._launched is not None else 0)


def test_rows_ending_by_eos_and_stop_sequences_are_left_out_of_the_launched_step(folder):
    """Rows that end by a token the host has not seen yet (EOS, a stop sequence) run in the
    launched step; the batch that takes it has filtered them out."""
    plain = graphed(folder, ahead=False)
    probe = plain.generate([request(0, 7, 10)])[0]
    eos = probe.token_ids[3]  # a token the first row picks at its 4th step: make it that row's EOS
    text = plain.tokenizer.decode([probe.token_ids[5]])

    def requests():
        eos_row = GenerationRequest(id=0, inputs="", input_ids=request(0, 7, 10).input_ids, max_new_tokens=10,
                                    ignore_eos_token=False, sampling=SamplingParams())
        stop_row = GenerationRequest(id=1, inputs="", input_ids=request(0, 7, 10).input_ids, max_new_tokens=10,
                                     ignore_eos_token=True, sampling=SamplingParams(), stop_sequences=[text])
        return [eos_row, stop_row, request(2, 9, 10), request(3, 4, 7)]

    for lm in (plain, graphed(folder)):
        lm.eos_token_ids = {eos}
        lm.builder.eos_token_ids = {eos}
    want = plain.generate(requests())
    lm = graphed(folder)
    lm.eos_token_ids = lm.builder.eos_token_ids = {eos}
    got = lm.generate(requests())
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    assert len(got[0].token_ids) < 10 and len(got[1].token_ids) < 10  # they did end early
    assert lm.launched_taken > 0


def test_rows_that_sample_or_ask_for_top_n_choose_from_the_launched_logits(folder):
    """Seeded sampling with processors, and top-n alternatives: the chooser runs on the launched
    step's logits when a batch takes it, so random streams advance only for steps taken, and a
    seed gives the tokens of steps run one by one."""

    def requests():
        out = []
        for rid, (new, top_n, seed) in enumerate([(9, 0, 11), (5, 3, None), (12, 0, 5), (7, 2, 9)]):
            sampling = SamplingParams() if seed is None else SamplingParams(
                do_sample=True, seed=seed, temperature=0.8, top_k=30, top_p=0.9, repetition_penalty=1.2)
            out.append(GenerationRequest(id=rid, inputs="", input_ids=request(rid, 5 + rid, new).input_ids,
                                         max_new_tokens=new, ignore_eos_token=True, sampling=sampling, top_n_tokens=top_n))
        return out

    want = graphed(folder, ahead=False).generate(requests())
    lm = graphed(folder)
    got = lm.generate(requests())
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want):
        for gs, ws in zip(g.steps, w.steps):
            assert gs.tokens.logprobs == pytest.approx(ws.tokens.logprobs, abs=1e-5)
            assert [t.ids for t in gs.top_tokens] == [t.ids for t in ws.top_tokens]
    assert lm.launched_taken >= 8 and lm.launched_dropped == 0


def test_a_batch_that_moved_on_drops_the_launch_and_steps_on_its_own(folder):
    """Newcomers merged in (a prefill-shaped step), a sampled row, and a fork that kept a row the
    launch left out: each drops the launched step, whose K/V writes the later steps overwrite."""

    def scenario(lm):
        rec = Recorder(lm)
        batch = rec.steps(lm.make_batch(0, [request(0, 6, 20), request(1, 9, 20)]), 3)
        newcomers = rec.step(lm.make_batch(1, [request(5, 7, 20)]))  # drops the launch of batch 0
        batch = rec.steps(Batch.concatenate([batch, newcomers]), 3)
        sampled = rec.step(lm.make_batch(2, [request(7, 5, 20, seed=3)]))  # another prefill: drops again
        batch = rec.steps(Batch.concatenate([batch, sampled]), 2)  # a sampled row: launches go on
        batch = rec.steps(lm.filter(batch, [0, 1, 5]), 3)
        # The shard's decode ahead: the next step runs on a fork of the batch, and is taken there.
        fork = batch.fork(batch.request_ids)
        fork = rec.steps(fork, 2)
        # A fork dropped (the shard's Decode found the batch changed): the batch it came from
        # steps from where it was, two tokens behind what was launched from the fork.
        ahead = Recorder(lm)
        ahead.steps(batch.fork(batch.request_ids), 1)
        batch = rec.steps(batch, 3)
        return rec.out, ahead.out

    want, want_ahead = scenario(graphed(folder, ahead=False))
    lm = graphed(folder)
    got, got_ahead = scenario(lm)
    assert_same(got, want)
    assert_same(got_ahead, want_ahead)
    assert lm.launched_dropped >= 3 and lm.launched_taken >= 6


def test_no_launch_on_a_cpu_by_default_nor_past_the_graphs(folder, monkeypatch):
    lm = load(folder, buckets=BUCKETS, capturer=EagerReplayCapturer())
    assert lm.launch_ahead is False  # a CPU: a launch would be the forward itself
    rec = Recorder(lm)
    rec.steps(lm.make_batch(0, [request(0, 5, 6)]), 4)
    assert lm.launched_taken == lm.launched_dropped == 0 and lm._launched is None

    lm = graphed(folder)
    rec = Recorder(lm)
    # Nine rows: above the largest graph (8): every step eager, nothing launched.
    batch = rec.steps(lm.make_batch(0, [request(i, 4, 6) for i in range(9)]), 4)
    assert lm._launched is None and lm.launched_taken == 0 and replays(lm) == 0
    lm.release(batch)


@pytest.mark.parametrize("rows", [1, 32])
def test_a_steady_step_that_takes_a_launch_stays_within_the_budget(folder, rows):
    lm = load(folder, buckets=[1, 2, 4, 8, 16, 32], capturer=EagerReplayCapturer())
    lm.launch_ahead = True
    capturer = lm.graphs.capturer
    batch = lm.make_batch(0, [request(i, 3 + i % 5, 12) for i in range(rows)])
    for _ in range(3):
        _, batch, _ = lm.generate_token(batch)
    assert lm._launched is not None
    before, taken = replays(lm), lm.launched_taken
    with StepCounter(capturer) as step:
        generations, batch, timings = lm.generate_token(batch)
    assert lm.launched_taken == taken + 1  # this step's tokens came from the launch
    assert replays(lm) == before + 1  # and it launched the next one
    assert len(generations) == rows and timings.forward_ns > 0
    assert len(step.syncs) <= MAX_SYNCS, step.syncs
    assert len(step.launches) <= MAX_LAUNCHES, step.launches
    # As the shard runs it ahead of its Decode: on a fork of the batch.
    with StepCounter(capturer) as ahead:
        lm.generate_token(batch.fork(batch.request_ids))
    assert lm.launched_taken == taken + 2
    assert len(ahead.syncs) <= MAX_SYNCS, ahead.syncs
    assert len(ahead.launches) <= MAX_LAUNCHES, ahead.launches
    lm.release(batch)


def test_a_launch_fits_a_batch_only_at_the_lengths_and_tokens_it_ran(folder):
    """A row that repeats its token (greedy loops do) must still not take a step launched for
    another position of it: the length tells them apart where the token cannot."""
    lm = graphed(folder)
    batch = lm.make_batch(0, [request(0, 5, 8), request(1, 6, 8)])
    states = batch.states
    ids = torch.zeros(2, dtype=torch.long)
    pairs = torch.zeros(2, 2, dtype=torch.float64)

    def launched(lengths, inputs, request_ids=(0, 1)):
        return LaunchedStep(request_ids=list(request_ids), lengths=lengths, inputs=inputs, logits=pairs, tokens=ids,
                            picked=pairs)

    now = [s.length for s in states]
    last = [s.last_token for s in states]
    assert launched(now, last).rows_for(batch) == [0, 1]
    assert launched(now[::-1], last[::-1], (1, 0)).rows_for(batch) == [1, 0]
    assert launched([now[0] + 1, now[1]], last).rows_for(batch) is None  # same token, a step ahead
    assert launched(now, [last[0], last[1] + 1]).rows_for(batch) is None
    assert launched(now[:1], last[:1], (0,)).rows_for(batch) is None  # row 1 was not launched
    assert launched([now[0], 0], [last[0], 0]).rows_for(batch) is None  # row 1 was a padding row
    lm.release(batch)


def test_the_shard_with_decode_ahead_gives_the_same_tokens_and_kv_pool(folder):
    """The shard service's decode ahead forks each batch and steps the fork before the router
    asks: the fork takes the launched step, the fork's step launches the next; arrivals, stop
    sequences, sampled rows, a cancellation and prefills merging the cached batch in drop
    launches. Every token and finish equals the same driver's without launches."""
    from test_cuda_graphs import GraphSafePadded
    from test_decode_ahead import PROMPTS, Driver, request as wire_request, scenario

    from text_generation_server.models.loader import get_model
    from text_generation_server.shard.service import TextGenerationService

    def greedy():
        arrivals = {
            0: [wire_request(1, PROMPTS[0], 16), wire_request(2, PROMPTS[1], 5)],
            2: [wire_request(3, PROMPTS[2], 9, stop=[")"])],
            5: [wire_request(4, PROMPTS[3], 14), wire_request(5, PROMPTS[4], 1)],
            9: [wire_request(6, PROMPTS[5], 6)],
        }
        return arrivals, {12: 4}  # request 4 is cancelled before step 12's decode

    def run(ahead: bool, merge: bool, arrivals):
        lm = get_model(None, dtype="float32", cuda_graphs=BUCKETS, graph_capturer=EagerReplayCapturer())
        lm.attention = GraphSafePadded(lm.attention.spec)
        lm.allocate_kv_cache(256)
        lm.capture_decode_graphs(128)
        lm.launch_ahead = ahead
        service = TextGenerationService(lm, "/tmp/unused", 1, 0.1)
        free = lm.allocator.free_blocks
        driver = Driver(service, merge_in_prefill=merge)
        asyncio.run(driver.run(*arrivals()))
        assert not service.cache and not service._ahead
        assert lm.allocator.free_blocks == free, "KV blocks leaked"
        service._executor.shutdown(wait=True)
        return driver, lm

    for merge in (False, True):
        for arrivals, least in ((greedy, 8), (scenario, 5)):  # scenario: test_decode_ahead's, sampled rows too
            plain, _ = run(False, merge, arrivals)
            fast, lm = run(True, merge, arrivals)
            assert lm.launched_taken >= least, (lm.launched_taken, lm.launched_dropped)
            assert fast.finished == plain.finished
            assert fast.tokens == plain.tokens
