"""N-gram speculation (`--speculate`): proposals from a request's own tokens, verified in one forward.

What must hold: the tokens, texts, logprobs, top tokens and finish of every request are those of
decoding without speculation, greedy and seeded sampling alike (with penalties, whose history
includes the tokens accepted earlier in the same step), whatever stops a request inside a
speculative run (EOS, a stop sequence, max_new_tokens); rows with and without proposals (and
grammar rows, which never propose) share batches; prefix caching, chunked prefill, decode ahead
and the router's allocation and streaming keep working; and on repetitive code some proposed
tokens are really accepted.

The embedded model (a small trained code model) is used where acceptance matters; random
checkpoints (one with a sliding window) check exactness on other attention paths.
"""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
import typer
from helpers import Context, InProcessClient, write_checkpoint
from typer.testing import CliRunner

from text_generation_server.cli import main as cli
from text_generation_server.launcher import rank
from text_generation_server.launcher import supervisor as launcher
from text_generation_server.generation.grammar import GrammarSpec, GrammarType
from text_generation_server.generation.sampling import SamplingParams
from text_generation_server.generation.speculation import (
    MAX_SPECULATE,
    ngram_proposal,
    ngram_proposals,
    speculation_limit,
)
from text_generation_server.generation.stopping import FinishReason
from text_generation_server.layers.attention import TorchAttention, padded_decode
from text_generation_server.router.metrics import Metrics
from text_generation_server.models.loader import get_model
from text_generation_server.engine.cuda_graphs import EagerReplayCapturer
from text_generation_server.engine.types import GenerationRequest
from text_generation_server.pb.generate.v3 import generate_pb2 as pb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.router.block_pool import BlockPool
from text_generation_server.router.scheduler import Scheduler, SchedulerLimits
from text_generation_server.router.service import TextGenerationService as RouterService
from text_generation_server.router.validation import Limits
from text_generation_server.settings.serve_flags import TGI_ONLY_FLAGS
from text_generation_server.shard.service import TextGenerationService

torch.set_num_threads(1)

REPETITIVE = [
    ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
     "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n"),
    ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n\n"
     "class Size:\n    def __init__(self, width, height):\n"),
    ("def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
     "def factorial(n):\n"),
]
LOOPING = "import os\nimport sys\n"  # the embedded model repeats `import os` after it, over and over
PLAIN = ["x = "]
SAMPLINGS = {
    "greedy": SamplingParams(),
    "seeded": SamplingParams(do_sample=True, seed=11, temperature=0.7, top_k=40, top_p=0.95,
                             repetition_penalty=1.1),
    "seeded-frequency": SamplingParams(do_sample=True, seed=5, temperature=0.5, typical_p=0.9,
                                       frequency_penalty=0.3),
}


@pytest.fixture(scope="module")
def lm():
    model = get_model(None)
    yield model
    model.speculate = 0


@pytest.fixture
def fresh(lm):
    """The embedded model with its speculation counters zeroed, left with speculation off."""
    lm.speculated_tokens = lm.accepted_tokens = 0
    lm.max_prefill_tokens = None
    yield lm
    lm.speculate = 0
    lm.max_prefill_tokens = None


def requests(prompts: list[str], new: int, sampling: SamplingParams | None = None, **kw) -> list[GenerationRequest]:
    return [GenerationRequest(id=i, inputs=p, max_new_tokens=new, sampling=sampling or SamplingParams(), **kw)
            for i, p in enumerate(prompts)]


def run(lm, speculate: int, reqs: list[GenerationRequest]):
    lm.speculate = speculate
    return lm.generate(reqs)


def summary(completion) -> dict:
    """Everything a client sees of one request but the logprobs (`same`)."""
    steps = completion.steps
    return {
        "ids": completion.token_ids,
        "text": completion.text,
        "finish": completion.finish_reason,
        "seed": completion.seed,
        "texts": [t for g in steps for t in g.tokens.texts],
        "special": [s for g in steps for s in g.tokens.is_special],
        "tops": [list(t.ids) for g in steps for t in g.top_tokens],
        "generated_tokens": steps[-1].generated_text.generated_tokens,
    }


def same(got: list, want: list) -> None:
    """Completions equal token for token; logprobs equal up to float noise (a speculative step
    computes the same logits through a differently shaped forward)."""
    assert [summary(c) for c in got] == [summary(c) for c in want]
    for g, w in zip(got, want):
        lps = lambda c: torch.tensor([lp for step in c.steps for lp in step.tokens.logprobs])
        torch.testing.assert_close(lps(g), lps(w), atol=1e-4, rtol=0)


def multi_token_steps(completion) -> int:
    return sum(1 for g in completion.steps if len(g.tokens.ids) > 1)


# -- proposals -------------------------------------------------------------------------------------
def test_ngram_proposal_takes_the_latest_longest_match():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7]
    # The trailing 3-gram (5, 6, 7) occurred at 0 and 5: the latest wins, its next tokens follow.
    assert ngram_proposal(tokens, 3) == [9, 2, 5]
    assert ngram_proposal(tokens, 1) == [9]
    # No 3-gram match: the 2-gram, then the 1-gram.
    assert ngram_proposal([1, 2, 3, 9, 2, 3], 2) == [9, 2]
    assert ngram_proposal([4, 1, 7, 7, 1], 3) == [7, 7, 1]
    # A proposal never runs past the sequence's end; nothing repeats: no proposal.
    assert ngram_proposal([3, 3, 3], 4) == [3]
    assert ngram_proposal([1, 2, 3, 4], 3) == []
    assert ngram_proposal([1], 3) == [] and ngram_proposal(tokens, 0) == []


def test_batched_search_is_the_definition():
    rng = random.Random(0)
    rows = []
    for _ in range(60):
        n = rng.randrange(1, 40)
        rows.append([rng.randrange(0, rng.choice((3, 6, 50))) for _ in range(n)])
    width = max(map(len, rows)) + 5
    history = torch.full((len(rows), width), 999, dtype=torch.long)  # padding that must never match
    for i, row in enumerate(rows):
        history[i, :len(row)] = torch.tensor(row)
        history[i, len(row):] = torch.tensor([rng.randrange(0, 3) for _ in range(width - len(row))])
    limits = [rng.randrange(0, 6) for _ in rows]
    got = ngram_proposals(history, [len(r) for r in rows], limits)
    assert got == [ngram_proposal(r, k) for r, k in zip(rows, limits)]
    assert sum(1 for p in got if p) > 20


def test_a_row_never_proposes_past_its_last_token_or_across_a_longrope_switch():
    assert speculation_limit(3, length=10, max_length=20, rope_switch=None) == 3
    assert speculation_limit(3, length=18, max_length=20, rope_switch=None) == 1  # one step token + one guess
    assert speculation_limit(3, length=19, max_length=20, rope_switch=None) == 0
    assert speculation_limit(3, length=30, max_length=99, rope_switch=32) == 2  # lands on switch + 1 at most
    assert speculation_limit(3, length=33, max_length=99, rope_switch=32) == 3  # past it


# -- exactness ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(SAMPLINGS))
def test_speculation_changes_no_token(fresh, kind):
    prompts = REPETITIVE + [LOOPING] + PLAIN
    make = lambda: requests(prompts, 40, SAMPLINGS[kind], ignore_eos_token=True, top_n_tokens=2)
    plain = run(fresh, 0, make())
    for speculate in (1, 2, 3):
        fresh.speculated_tokens = fresh.accepted_tokens = 0
        done = run(fresh, speculate, make())
        same(done, plain)
        assert fresh.accepted_tokens > 0, f"speculate {speculate}: no proposal was ever accepted"
        assert sum(multi_token_steps(c) for c in done) > 0
        if kind == "greedy":
            # Code that repeats itself continues with what it repeated: fewer steps than tokens
            # (measured on the embedded model: 0.79 steps per token at speculate 1, 0.68 at 3).
            steps = sum(len(c.steps) for c in done)
            assert steps < 0.85 * 40 * len(prompts), (speculate, steps)


@pytest.fixture(scope="module")
def random_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculate")
    out = {}
    for seed, name in enumerate(("llama", "mistral_window")):
        write_checkpoint(root / name, name, seed=seed + 71)
        out[name] = get_model(str(root / name), dtype="float32", block_size=4)
    return out


@pytest.mark.parametrize("arch", ["llama", "mistral_window"])
def test_exact_on_other_attention_paths(random_models, arch):
    """Random weights (a sliding window of 7 in one) over a small block size: verification rows
    cross blocks and windows; random models loop, so proposals come."""
    lm = random_models[arch]
    lm.speculated_tokens = lm.accepted_tokens = 0
    ids = lambda seed: [random.Random(seed).randrange(1, 250) for _ in range(5)] * 3
    make = lambda: [GenerationRequest(id=i, inputs="", input_ids=ids(i), max_new_tokens=24, ignore_eos_token=True,
                                      sampling=SamplingParams(do_sample=True, seed=i, temperature=0.6)
                                      if i % 2 else SamplingParams()) for i in range(4)]
    same(run(lm, 3, make()), run(lm, 0, make()))
    assert lm.speculated_tokens > 0
    lm.speculate = 0


def test_max_new_tokens_ends_a_run_exactly(fresh):
    prompt = [LOOPING]
    want = run(fresh, 0, requests(prompt, 30, ignore_eos_token=True))[0].token_ids
    ended_in_a_run = 0
    for new in range(1, 26):
        got = run(fresh, 3, requests(prompt, new, ignore_eos_token=True))[0]
        assert got.token_ids == want[:new], new
        assert got.finish_reason == FinishReason.LENGTH and got.steps[-1].generated_text.generated_tokens == new
        ended_in_a_run += len(got.steps[-1].tokens.ids) > 1
    assert ended_in_a_run > 5


def test_stop_sequences_cut_a_run_short(fresh):
    prompt = [LOOPING]
    base = run(fresh, 0, requests(prompt, 30, ignore_eos_token=True))[0]
    texts = [t for g in base.steps for t in g.tokens.texts]
    inside = 0
    for i in range(3, 28):
        # The output up to token i: a stop sequence first complete at exactly that token.
        stop = "".join(texts[:i + 1])
        plain = run(fresh, 0, requests(prompt, 30, ignore_eos_token=True, stop_sequences=[stop]))[0]
        got = run(fresh, 2, requests(prompt, 30, ignore_eos_token=True, stop_sequences=[stop]))[0]
        same([got], [plain])
        assert got.finish_reason == FinishReason.STOP_SEQUENCE and len(got.token_ids) == i + 1
        inside += len(got.steps[-1].tokens.ids) > 1
    assert inside > 0, "no stop sequence landed inside a speculative step"


def test_eos_inside_a_run_ends_the_request(fresh, monkeypatch):
    inside = 0
    for prompt in ([REPETITIVE[1]], PLAIN):
        base = run(fresh, 0, requests(prompt, 30, ignore_eos_token=True))[0].token_ids
        # Tokens the output holds for the first time at `index`: made EOS, they end it there.
        for index in [i for i in range(12, 30) if base[i] not in base[:i]]:
            monkeypatch.setattr(fresh.builder, "eos_token_ids", {base[index]})
            plain = run(fresh, 0, requests(prompt, 30))[0]
            got = run(fresh, 3, requests(prompt, 30))[0]
            same([got], [plain])
            assert got.finish_reason == FinishReason.EOS_TOKEN and got.token_ids == base[:index + 1]
            inside += len(got.steps[-1].tokens.ids) > 1
    assert inside > 0, "no EOS landed inside a speculative step"


def test_rows_with_and_without_proposals_share_batches(fresh):
    def make():
        reqs = requests(REPETITIVE[:2], 30, ignore_eos_token=True)
        reqs.append(GenerationRequest(id=2, inputs=LOOPING, max_new_tokens=30, ignore_eos_token=True,
                                      sampling=SAMPLINGS["seeded-frequency"], top_n_tokens=3))
        reqs.append(GenerationRequest(id=3, inputs=REPETITIVE[2], max_new_tokens=30, ignore_eos_token=True,
                                      sampling=SamplingParams(grammar=GrammarSpec(GrammarType.REGEX,
                                                                                  "(def [a-z]+\\(n\\):\n)+"))))
        reqs.append(GenerationRequest(id=4, inputs=REPETITIVE[2], max_new_tokens=1))
        return reqs

    done = run(fresh, 2, make())
    same(done, run(fresh, 0, make()))
    assert multi_token_steps(done[1]) > 0 and multi_token_steps(done[2]) > 0
    assert multi_token_steps(done[3]) == 0, "a grammar row must not speculate"
    assert done[3].finish_reason in (FinishReason.EOS_TOKEN, FinishReason.LENGTH)


class GraphSafePadded(TorchAttention):
    """torch's padded decode, which a graph can hold (shapes from max_seq_len and the batch)."""

    name = "torch-padded"
    graph_safe = True

    def decode(self, q, key_cache, value_cache, meta, scale, window, softcap=None, sinks=None):
        return padded_decode(q, key_cache, value_cache, meta, scale, window, softcap, sinks)

    def capture_memo(self, batch: int, max_seq_len: int, device: torch.device) -> dict:
        return {}


def test_steps_without_proposals_still_replay_graphs():
    """CUDA graphs (emulated: EagerReplayCapturer checks each replay as a graph would) serve the
    steps where no row proposes; steps with proposals run eagerly; the tokens stay the same."""
    lm = get_model(None, cuda_graphs=(1, 2, 4), graph_capturer=EagerReplayCapturer())
    lm.attention = GraphSafePadded(lm.attention.spec)
    lm.allocate_kv_cache(64)
    lm.capture_decode_graphs(128)
    make = lambda: requests([LOOPING, PLAIN[0], REPETITIVE[1]], 30, ignore_eos_token=True)
    plain = run(lm, 0, make())
    graph_steps = sum(lm.graphs.stats.replays.values())
    assert graph_steps == 29  # every decode step of the plain run
    same(run(lm, 2, make()), plain)
    replayed = sum(lm.graphs.stats.replays.values()) - graph_steps
    assert 0 < replayed < graph_steps and lm.accepted_tokens > 0, replayed
    lm.speculate = 0


# -- the forward: within the prefill budget, within the request's slots, chunks and cached prefixes --------
def test_forwards_stay_within_budget_and_slots_with_chunks_and_cached_prefixes(fresh):
    lm = fresh
    lm.block_size = 16
    lm.allocate_kv_cache(120)
    seen: list[tuple[int, torch.Tensor]] = []
    forward = lm.model.forward

    def recording(ids, positions, cache, meta, *args, **kwargs):
        seen.append((ids.shape[0], meta.slots.clone()))
        return forward(ids, positions, cache, meta, *args, **kwargs)

    tokens = lambda text: lm.tokenizer.encode(text).ids
    system = tokens(REPETITIVE[0] * 2)
    first, second = system + tokens(REPETITIVE[1]), system + tokens(REPETITIVE[2])

    def scenario(speculate: int) -> dict[int, list[int]]:
        lm.speculate = speculate
        lm.max_prefill_tokens = 24
        # The router's part: the first request's blocks hold the shared prefix for the second.
        blocks = lm.allocator.allocate(lm.blocks_for(len(first) + 20 - 1))
        out: dict[int, list[int]] = {}
        batch = lm.make_batch(0, [GenerationRequest(id=1, inputs="", input_ids=first, max_new_tokens=20,
                                                    ignore_eos_token=True, blocks=blocks, chunk_len=20)])
        cached = len(system) // 16 * 16
        tail = lm.allocator.allocate(lm.blocks_for(len(second) + 25 - 1) - cached // 16)
        joined = False
        while batch is not None:
            generations, batch, _ = lm.generate_token(batch)
            for g in generations:
                out.setdefault(g.request_id, []).extend(g.tokens.ids)
            if batch is not None and not joined and len(out.get(1, [])) >= 3:
                # The second request over the first one's cached prefix, in chunks, while it decodes.
                newcomer = lm.make_batch(1, [GenerationRequest(
                    id=2, inputs="", input_ids=second, max_new_tokens=25, ignore_eos_token=True,
                    sampling=SAMPLINGS["seeded"], blocks=blocks[:cached // 16] + tail, cache_len=cached, chunk_len=8)])
                batch = type(batch).concatenate([batch, newcomer])
                joined = True
            finished = [g.request_id for g in generations if g.generated_text is not None]
            if batch is not None and finished:
                batch = lm.filter(batch, [r for r in batch.request_ids if r not in finished])
        lm.allocator.free(blocks)
        lm.allocator.free(tail)
        return out

    lm.model.forward = recording
    try:
        plain = scenario(0)
        seen.clear()
        got = scenario(2)
    finally:
        del lm.model.forward
    assert got == plain
    assert len(got[1]) == 20 and len(got[2]) == 25
    assert lm.accepted_tokens > 0
    assert max(n for n, _ in seen) <= 24, "a speculative forward outgrew max_prefill_tokens"
    assert all(bool((slots >= 0).all()) for _, slots in seen), "a position without a slot of its own was fed"
    assert any(n > 2 for n, _ in seen[-10:]), "the decode steps did not speculate"


# -- shard and router -------------------------------------------------------------------------------------
LIMITS = Limits(max_input_tokens=700, max_total_tokens=1000, max_stop_sequences=4, max_stop_sequence_length=64,
                max_top_n_tokens=5, max_input_chars=100_000)


def router_workload(lm, speculate: int, caching: bool, max_prefill: int, ahead: bool = True):
    """Requests through the router's scheduler and client API over a shard in this process: a shared
    system prompt (cached), chunked prompts, seeded sampling, a stop sequence and streams."""
    lm.block_size = 16
    lm.allocate_kv_cache(200)
    lm.max_prefill_tokens = max_prefill
    service = TextGenerationService(lm, "/tmp/unused", 1, 0.1, prefix_caching=caching)
    service.decode_ahead = ahead
    lm.speculate = speculate
    metrics = Metrics(model_name="test")
    scheduler = Scheduler(InProcessClient(service), BlockPool(200, 16, prefix_caching=caching),
                          SchedulerLimits(max_prefill, None, 64), metrics, support_chunking=True, speculate=speculate)
    router = RouterService(scheduler, lm.tokenizer, LIMITS, cpb.InfoResponse(), metrics)
    system = REPETITIVE[0]

    def generate_request(prompt: str, seed: int | None = None, stop: list[str] | None = None):
        params = cpb.GenerateParameters(max_new_tokens=24, stop=stop or [], details=True, top_n_tokens=2)
        if seed is not None:
            params.do_sample, params.seed, params.temperature, params.repetition_penalty = True, seed, 0.6, 1.1
        return cpb.GenerateRequest(inputs=prompt, parameters=params)

    async def stream(req) -> list[cpb.GenerateStreamResponse]:
        return [m async for m in router.GenerateStream(req, Context())]

    async def go():
        scheduler.start()
        try:
            results = {"first": await stream(generate_request(system + REPETITIVE[1]))}
            slots = []
            original = scheduler.pool.allocate

            def allocate(tokens, prompt_ids=None, salt=None):
                slots.append(tokens)
                return original(tokens, prompt_ids, salt)

            scheduler.pool.allocate = allocate
            names = ["shared", "seeded", "stopped", "plain"]
            reqs = [generate_request(system + REPETITIVE[2]), generate_request(system + REPETITIVE[1], seed=3),
                    generate_request(LOOPING, stop=["os\nimport"]), generate_request(PLAIN[0])]
            for name, messages in zip(names, await asyncio.gather(*(stream(r) for r in reqs))):
                results[name] = messages
            await asyncio.sleep(0.05)
            assert scheduler.pool.used == 0
            return results, slots
        finally:
            await scheduler.stop()
            service._executor.shutdown(wait=True)

    results, slots = asyncio.run(go())
    return results, metrics, slots, service


def test_router_streams_every_token_and_counts_skipped_ones(fresh):
    plain, plain_metrics, plain_slots, _ = router_workload(fresh, 0, caching=False, max_prefill=2048, ahead=False)
    got, metrics, slots, service = router_workload(fresh, 2, caching=True, max_prefill=24)

    def client_view(messages):
        return ([m.token.id for m in messages], messages[-1].generated_text, [len(m.top_tokens) for m in messages],
                [t.id for t in messages[-1].details.tokens], messages[-1].details.generated_tokens)

    for name, messages in plain.items():
        assert client_view(got[name]) == client_view(messages), name
        ids, _, tops, detail_ids, generated = client_view(got[name])
        assert len(ids) == generated == len(detail_ids) and set(tops) == {2}, name
        assert all(not m.HasField("generated_text") for m in got[name][:-1])
    # The router gives every request `speculate` slots more than it can fill itself (TGI's queue.rs).
    assert sorted(s - 2 for s in slots) == sorted(plain_slots) and slots
    value = lambda m, name: m.registry.get_sample_value(name)
    assert 0 < value(metrics, "tgi_request_skipped_tokens_sum") <= fresh.accepted_tokens  # (steps ahead dropped too)
    assert value(metrics, "tgs_generation_tokens_total") == value(plain_metrics, "tgs_generation_tokens_total")
    assert value(metrics, "tgs_prefix_cache_hits_total") >= 1
    assert service.ahead_hits > 0


def test_decode_ahead_and_speculation_agree(fresh):
    off, _, _, off_service = router_workload(fresh, 2, caching=True, max_prefill=2048, ahead=False)
    on, _, _, on_service = router_workload(fresh, 2, caching=True, max_prefill=2048, ahead=True)
    assert off_service.ahead_hits == 0 and on_service.ahead_hits > 0
    for name, messages in off.items():
        assert [m.token.id for m in on[name]] == [m.token.id for m in messages], name


def test_shard_info_reports_speculate(fresh):
    fresh.speculate = 3
    service = TextGenerationService(fresh, "/tmp/unused", 1, 0.1)
    info = asyncio.run(service.Info(pb.InfoRequest(), Context()))
    assert info.speculate == 3
    service._executor.shutdown(wait=True)
    with pytest.raises(ValueError, match="speculate"):
        fresh.speculate = MAX_SPECULATE + 1


# -- flags -----------------------------------------------------------------------------------------------
@pytest.fixture
def serve(monkeypatch):
    """serve(*argv, **env) -> (exit code, output, ServeArgs or None), with `launch` recorded."""
    for name in cli.serve_environment_variables():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv(rank.SERVE_ARGS_ENV, raising=False)
    seen: dict = {}

    def fake_launch(args, startup_timeout_s=600.0, warnings=()):
        seen["args"] = args
        return 0

    monkeypatch.setattr(launcher, "launch", fake_launch)

    def go(*argv: str, **env: str):
        seen.clear()
        result = CliRunner().invoke(cli.app, ["serve", *argv], env=env)
        return result.exit_code, result.output, seen.get("args")

    return go


def test_speculate_flag_and_environment(serve):
    assert "speculate" not in {f.name for f in TGI_ONLY_FLAGS}
    assert serve()[2].speculate == 0
    assert serve("--speculate", "2")[2].speculate == 2
    assert serve(SPECULATE="3")[2].speculate == 3
    assert serve("--speculate", "1", SPECULATE="3")[2].speculate == 1  # the command line wins
    for bad in ("9", "-1"):
        code, output, args = serve("--speculate", bad)
        assert code == 2 and args is None and "--speculate" in output, output
    code, output, _ = serve(SPECULATE="many")
    assert code == 2 and "SPECULATE" in output, output
    assert "--speculate" in typer.main.get_command(cli.app).commands["serve"].get_help(
        typer.Context(typer.main.get_command(cli.app).commands["serve"]))
