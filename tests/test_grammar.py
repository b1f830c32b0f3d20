"""Grammar-constrained generation (generation/grammar.py and where it meets the batch).

Unit tier: the bitmask unpacking and masking against a reference, the compiler's cache and its
messages for invalid schemas and regexes, matchers (completion, EOS only when accepted, forks).
Model tier, on the embedded model: JSON-schema outputs (enums, booleans, bounded strings and
arrays, bounded integers) parse and validate for every prompt tried, greedy and seeded; regex
outputs match fully; unconstrained rows beside constrained ones get the tokens they get alone;
seeds, stop sequences, chunked prefill, prefix caching, decode ahead and (emulated) CUDA graphs
keep working; an invalid grammar is refused by the router's validation and, per request, by the
shard, while the running batch steps on.
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import Future

import grpc
import jsonschema
import pytest
import torch
from helpers import Context, StepFailedInShard

from text_generation_server.generation.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    GrammarType,
    PendingMasks,
    apply_masks,
    mask_bias,
    unpack_bitmask,
)
from text_generation_server.generation.sampling import HeterogeneousNextTokenChooser, SamplingParams
from text_generation_server.generation.stopping import FinishReason
from text_generation_server.models.loader import get_model
from text_generation_server.engine.types import GenerationRequest
from text_generation_server.pb.generate.v3 import generate_pb2 as spb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.router.validation import GRAMMAR_DISABLED, Limits, ValidationError, validate
from text_generation_server.shard.wire import request_from_pb

torch.set_num_threads(1)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "kind": {"enum": ["function", "class", "module"]},
        "public": {"type": "boolean"},
        "args": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
        "lines": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "kind", "public", "args", "lines"],
    "additionalProperties": False,
}
JSON_GRAMMAR = GrammarSpec(GrammarType.JSON, json.dumps(SCHEMA))
# Every output of SCHEMA fits: structure and bounded values, a token per character at worst.
JSON_BUDGET = 160
PROMPTS = ["def parse(", "import os\n", "class Stack:", "# config\n", "x = ", "The quick brown fox"]
REGEXES = [r"(yes|no)", r"\d{3}-\d{4}", r"[a-z]{2,6}( [a-z]{2,6}){0,2}\.", r"(0|[1-9][0-9]{0,5})",
           r"(GET|POST) /[a-z]{1,8}"]
LIMITS = Limits(max_input_tokens=700, max_total_tokens=1000, max_stop_sequences=4, max_stop_sequence_length=64,
                max_top_n_tokens=5, max_input_chars=100_000)


@pytest.fixture(scope="module")
def lm():
    return get_model(None)


@pytest.fixture(scope="module")
def compiler(lm) -> GrammarCompiler:
    return lm.builder.grammars


def run(lm, requests: list[GenerationRequest]):
    return {c.request_id: c for c in lm.generate(requests)}


def grammar_request(rid: int, prompt: str, grammar: GrammarSpec | None, new: int = JSON_BUDGET, **sampling):
    return GenerationRequest(id=rid, inputs=prompt, sampling=SamplingParams(grammar=grammar, **sampling),
                             max_new_tokens=new)


# -- bitmasks ------------------------------------------------------------------------------------
def done_future() -> Future:
    future: Future = Future()
    future.set_result(None)
    return future


def test_unpack_bitmask_matches_a_bit_by_bit_reference():
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 5), generator=gen, dtype=torch.int64).to(torch.int32)
    bitmask[0, 0] = -2**31  # bit 31 alone: an arithmetic shift must still read it as token 31
    got = unpack_bitmask(bitmask, 150)
    want = torch.tensor([[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 == 1 for t in range(150)] for r in range(3)])
    assert got.shape == (3, 150)
    assert torch.equal(got, want)
    assert got[0, 31] and not got[0, :31].any()
    bias = mask_bias(bitmask, 150)  # the step's form: 0 where allowed, -inf elsewhere
    assert bias.dtype == torch.float32 and bias.shape == (3, 150)
    assert torch.equal(bias == 0, want) and torch.isinf(bias[~want]).all()


def test_masks_touch_only_their_rows_and_follow_a_filter():
    scores = torch.randn(4, 64)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[0, 0] = 0b101  # row 1 allows tokens 0 and 2
    bitmask[1, 1] = 1  # row 3 allows token 32
    masks = PendingMasks([1, 3], bitmask, done_future())
    out = apply_masks(scores, masks)
    assert torch.equal(out[[0, 2]], scores[[0, 2]])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(out[3]).nonzero().flatten().tolist() == [32]
    # A chooser filtered to batch rows [3, 0] keeps row 3's mask, now at row 0.
    picked = masks.select([3, 0])
    assert picked.rows == [0]
    assert torch.isfinite(apply_masks(scores[[3, 0]], picked)[0]).nonzero().flatten().tolist() == [32]
    assert masks.select([0, 2]) is None


# -- the compiler -------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, message", [
    (GrammarSpec(GrammarType.JSON, "{not json"), "not valid JSON"),
    (GrammarSpec(GrammarType.JSON, "[1, 2]"), "must be an object"),
    (GrammarSpec(GrammarType.JSON, '{"type": "strin"}'), "strin"),
    (GrammarSpec(GrammarType.JSON, '{"type": "integer", "minimum": 5, "maximum": 2}'), "minimum"),
    (GrammarSpec(GrammarType.JSON, '{"$ref": "#/definitions/missing"}'), "missing"),
    (GrammarSpec(GrammarType.JSON, ""), "empty"),
    (GrammarSpec(GrammarType.REGEX, "(ab"), "unclosed group"),
    (GrammarSpec(GrammarType.REGEX, "a{3,1}"), "repetition"),
    (GrammarSpec(GrammarType.REGEX, r"\p{NoSuchClass}"), "Unicode property"),
])
def test_invalid_grammars_name_the_problem(compiler, spec, message):
    with pytest.raises(GrammarError, match=re.escape(message)):
        compiler.matcher(spec)
    with pytest.raises(GrammarError, match=re.escape(message)):  # refusals are cached, with their reason
        compiler.compile(spec)


def test_compiled_grammars_are_cached_per_grammar(lm):
    compiler = GrammarCompiler.for_tokenizer(lm.tokenizer, lm.eos_token_ids, cache_size=2)
    a, b, c = (GrammarSpec(GrammarType.REGEX, r) for r in ("a+", "b+", "c+"))
    compiler.compile(a)
    first = compiler._cache[a]
    compiler.matcher(a)
    assert compiler._cache[a] is first  # a hit: the compiled grammar is copied, not rebuilt
    compiler.compile(b)
    compiler.compile(c)  # evicts a, the least recently used
    assert list(compiler._cache) == [b, c]
    compiler.close()


def test_a_matcher_completes_when_nothing_can_follow_and_allows_eos_only_then(lm, compiler):
    eos = next(iter(lm.eos_token_ids))
    ids = lm.tokenizer.encode("yes", add_special_tokens=False).ids
    matcher = compiler.matcher(GrammarSpec(GrammarType.REGEX, "(yes|no)"))
    device = torch.device("cpu")

    def allowed() -> torch.Tensor:
        masks = compiler.start_masks([matcher], device)
        return unpack_bitmask(masks.wait(), compiler.vocab_size)[0]

    assert not allowed()[eos]
    fork = matcher.fork()
    for token in ids[:-1]:
        assert allowed()[token]
        assert not matcher.accept(token)
    assert matcher.accept(ids[-1])  # "yes" is complete: the request ends here
    assert allowed().nonzero().flatten().tolist() == [eos]
    assert not fork.complete  # the fork stayed where it was
    assert not fork.accept(ids[0])


def test_the_worker_and_its_thread_pool_fill_the_same_masks(lm):
    """Expensive masks go to the worker thread, many rows to llguidance's thread pool (machines
    with cores to spare), cheap ones are filled when needed: the masks must be the same."""
    pooled = GrammarCompiler.for_tokenizer(lm.tokenizer, lm.eos_token_ids, mask_threads=2)
    pooled._fill_s = 1.0  # as if recent steps' masks had been slow: the worker fills them
    serial = GrammarCompiler.for_tokenizer(lm.tokenizer, lm.eos_token_ids, mask_threads=1)
    prefixes = ['{"name":"', '{"name":"ab","kind":"', '{"name":"x","kind":"class","public":', "", '{"na']
    masks = []
    for compiler in (pooled, serial):
        matchers = []
        for prefix in prefixes:
            matcher = compiler.matcher(JSON_GRAMMAR)
            for token in lm.tokenizer.encode(prefix, add_special_tokens=False).ids:
                matcher.accept(token)
            matchers.append(matcher)
        masks.append(compiler.start_masks([matchers[0], None, *matchers[1:]], torch.device("cpu")))
    assert masks[0].rows == masks[1].rows == [0, 2, 3, 4, 5]
    assert pooled._worker is not None and pooled._executor is not None
    assert torch.equal(masks[0].wait(), masks[1].wait())
    assert len({tuple(row.tolist()) for row in masks[0].wait()}) >= 4  # the rows differ
    pooled.close()
    serial.close()


def test_json_is_compact(lm, compiler):
    """No whitespace between tokens: a weak model cannot pad the output forever."""
    matcher = compiler.matcher(GrammarSpec(GrammarType.JSON, '{"type": "object", "properties": '
                                                              '{"a": {"type": "array", "items": {"type": "integer"}}},'
                                                              ' "required": ["a"]}'))
    for text in ("{", '"a"', ":", "[", "1", ",", "2", "]"):  # a whitespace-free document, piece by piece
        allowed = unpack_bitmask(compiler.start_masks([matcher], torch.device("cpu")).wait(), compiler.vocab_size)
        texts = [lm.tokenizer.decode([t]) for t in allowed[0].nonzero().flatten().tolist()]
        assert texts and not [t for t in texts if any(c.isspace() for c in t)], text
        for token in lm.tokenizer.encode(text, add_special_tokens=False).ids:
            assert not matcher.accept(token)
    assert matcher.accept(lm.tokenizer.encode("}", add_special_tokens=False).ids[0])


def test_the_chooser_keeps_constrained_rows_inside_their_grammar(lm, compiler):
    spec = GrammarSpec(GrammarType.REGEX, "[0-9]+")
    params = [SamplingParams(grammar=spec), SamplingParams(), SamplingParams(grammar=spec, do_sample=True, seed=3)]
    matchers = [compiler.matcher(spec), None, compiler.matcher(spec)]
    with pytest.raises(ValueError, match="needs its matcher"):
        HeterogeneousNextTokenChooser(params, torch.device("cpu"))
    chooser = HeterogeneousNextTokenChooser(params, torch.device("cpu"), matchers)
    vocab = lm.tokenizer.get_vocab_size()
    scores = torch.zeros(3, vocab)
    letter = lm.tokenizer.encode("a", add_special_tokens=False).ids[0]
    scores[:, letter] = 50.0  # every row's favourite is a letter
    with pytest.raises(ValueError, match="need their masks"):
        chooser(scores, torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    masks = compiler.start_masks(chooser.matchers, torch.device("cpu"))
    next_ids, logprobs = chooser(scores, torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, dtype=torch.long), masks)
    assert next_ids[1] == letter
    for row in (0, 2):
        assert lm.tokenizer.decode([int(next_ids[row])]).isdigit()
        assert torch.isinf(logprobs[row, letter])
    assert chooser.accept(next_ids.tolist()) == [False, False, False]


# -- generation on the embedded model ----------------------------------------------------------
def test_json_schema_outputs_parse_and_validate(lm):
    requests = [grammar_request(i, p, JSON_GRAMMAR) for i, p in enumerate(PROMPTS)]
    requests += [grammar_request(100 + s, PROMPTS[s % len(PROMPTS)], JSON_GRAMMAR, do_sample=True, seed=s,
                                 temperature=1.3) for s in range(4)]
    done = run(lm, requests)
    for rid, completion in done.items():
        value = json.loads(completion.text)  # the whole output parses: the grammar ended the request
        jsonschema.validate(value, SCHEMA)
        assert completion.finish_reason == FinishReason.EOS_TOKEN, rid
        assert completion.text == json.dumps(value, separators=(",", ":"), ensure_ascii=False), "not compact"


@pytest.mark.parametrize("regex", REGEXES)
def test_regex_outputs_match_fully(lm, regex):
    spec = GrammarSpec(GrammarType.REGEX, regex)
    requests = [grammar_request(i, p, spec, new=24) for i, p in enumerate(PROMPTS[:4])]
    requests.append(grammar_request(50, PROMPTS[0], spec, new=24, do_sample=True, seed=11))
    for completion in run(lm, requests).values():
        assert re.fullmatch(regex, completion.text), (regex, completion.text)


def test_rows_without_a_grammar_are_untouched_and_seeds_replay(lm):
    plain = [grammar_request(0, "def parse(", None, new=12), grammar_request(1, "class Stack:", None, new=12,
                                                                               do_sample=True, seed=5)]
    constrained = [grammar_request(2, "import os\n", JSON_GRAMMAR, do_sample=True, seed=9),
                   grammar_request(3, "x = ", GrammarSpec(GrammarType.REGEX, r"\d{3}-\d{4}"))]
    together = run(lm, plain + constrained)
    alone = {r.id: run(lm, [r])[r.id] for r in plain + constrained}
    for rid, completion in alone.items():
        assert together[rid].token_ids == completion.token_ids, rid
    assert run(lm, [constrained[0]])[2].token_ids == alone[2].token_ids  # the seeded row replays


def test_stop_sequences_still_end_a_constrained_request(lm):
    spec = GrammarSpec(GrammarType.REGEX, r"[a-z]{1,3},[a-z]{1,3},[a-z]{1,3}")
    request = GenerationRequest(id=0, inputs="x = ", sampling=SamplingParams(grammar=spec), max_new_tokens=20,
                                stop_sequences=[","])
    done = run(lm, [request])[0]
    assert done.finish_reason == FinishReason.STOP_SEQUENCE
    assert done.text.endswith(",") and done.text.count(",") == 1
    assert re.fullmatch(r"[a-z]{1,3},", done.text)


def test_a_length_limit_cuts_the_output_and_says_so(lm):
    done = run(lm, [grammar_request(0, "def parse(", JSON_GRAMMAR, new=5)])[0]
    assert done.finish_reason == FinishReason.LENGTH and len(done.token_ids) == 5
    assert done.text.startswith('{"name":"')


def test_masks_apply_after_an_emulated_cuda_graph_replay():
    """The mask is applied to the logits a replayed graph wrote (tests/test_cuda_graphs.py's
    emulator replays the recorded forward against the static buffers on CPU)."""
    from text_generation_server.layers.attention import TorchAttention, padded_decode
    from text_generation_server.engine.cuda_graphs import EagerReplayCapturer

    class GraphSafePadded(TorchAttention):
        name = "torch-padded"
        graph_safe = True  # padded decode: shapes from max_seq_len and the batch, no host reads

        def decode(self, q, key_cache, value_cache, meta, scale, window, *args, **kwargs):
            return padded_decode(q, key_cache, value_cache, meta, scale, window, *args, **kwargs)

        def capture_memo(self, batch, max_seq_len, device):
            return {}

    def scenario(lm):
        requests = [grammar_request(0, "def parse(", JSON_GRAMMAR), grammar_request(1, "import os\n", None, new=30),
                    grammar_request(2, "class Stack:", JSON_GRAMMAR, do_sample=True, seed=4)]
        return {rid: c.token_ids for rid, c in run(lm, requests).items()}

    def load(**kw):
        lm = get_model(None, dtype="float32", block_size=4, **kw)
        lm.attention = GraphSafePadded(lm.attention.spec)
        lm.allocate_kv_cache(200)
        return lm

    eager = scenario(load())
    graphed = load(cuda_graphs=[1, 2, 4], graph_capturer=EagerReplayCapturer())
    graphed.capture_decode_graphs(256)
    assert scenario(graphed) == eager
    assert sum(graphed.graphs.stats.replays.values()) > 10
    # Launch ahead (on by default on CUDA): each step's successor launched before the step's
    # host work, its grammar rows masked when a step takes it.
    graphed.launch_ahead = True
    assert scenario(graphed) == eager
    assert graphed.launched_taken > 5


# -- the router and the shard --------------------------------------------------------------------
def client_request(grammar: cpb.Grammar | None, inputs: str = "def parse(") -> cpb.GenerateRequest:
    params = cpb.GenerateParameters(max_new_tokens=20)
    if grammar is not None:
        params.grammar.CopyFrom(grammar)
    return cpb.GenerateRequest(inputs=inputs, parameters=params)


@pytest.mark.parametrize("grammar, message", [
    (cpb.Grammar(type=cpb.GRAMMAR_TYPE_JSON, value='{"type": "strin"}'),
     "parameters.grammar.value: invalid JSON schema: Invalid type: strin"),
    (cpb.Grammar(type=cpb.GRAMMAR_TYPE_JSON, value="{"), "parameters.grammar.value: the JSON schema is not valid JSON"),
    (cpb.Grammar(type=cpb.GRAMMAR_TYPE_REGEX, value="[a-"), "unclosed character class"),
    (cpb.Grammar(type=cpb.GRAMMAR_TYPE_REGEX, value=""), "parameters.grammar.value must hold the regex"),
    (cpb.Grammar(value="a+"), "parameters.grammar.type must be GRAMMAR_TYPE_JSON or GRAMMAR_TYPE_REGEX, got "
                              "GRAMMAR_TYPE_UNSPECIFIED"),
])
def test_the_router_refuses_invalid_grammars_by_field(lm, compiler, grammar, message):
    with pytest.raises(ValidationError) as info:
        validate(client_request(grammar), lm.tokenizer, LIMITS, compiler)
    assert message in str(info.value)


def test_the_router_passes_grammars_to_the_shards_or_refuses_them_when_disabled(lm, compiler):
    grammar = cpb.Grammar(type=cpb.GRAMMAR_TYPE_REGEX, value=r"\d+")
    valid = validate(client_request(grammar), lm.tokenizer, LIMITS, compiler)
    shard = valid.to_shard(7, [1], [16])
    assert (shard.parameters.grammar, shard.parameters.grammar_type) == (r"\d+", spb.GRAMMAR_TYPE_REGEX)
    assert request_from_pb(shard).sampling.grammar == GrammarSpec(GrammarType.REGEX, r"\d+")
    with pytest.raises(ValidationError, match=re.escape(GRAMMAR_DISABLED)):
        validate(client_request(grammar), lm.tokenizer, LIMITS, None)
    assert "--disable-grammar-support" in GRAMMAR_DISABLED
    plain = validate(client_request(None), lm.tokenizer, LIMITS, None)  # no grammar: fine either way
    assert plain.to_shard(8, [1], [16]).parameters.grammar_type == spb.GRAMMAR_TYPE_NONE


def test_tgi_shard_requests_carry_grammars_as_tgi_sends_them():
    def pb_request(grammar: str, grammar_type: spb.GrammarType) -> spb.Request:
        return spb.Request(id=3, inputs="x", parameters=spb.NextTokenChooserParameters(
            grammar=grammar, grammar_type=grammar_type), stopping_parameters=spb.StoppingCriteriaParameters(
            max_new_tokens=4))

    schema = json.dumps(SCHEMA)
    assert request_from_pb(pb_request(schema, spb.GRAMMAR_TYPE_JSON)).sampling.grammar == JSON_GRAMMAR
    assert request_from_pb(pb_request("ignored", spb.GRAMMAR_TYPE_NONE)).sampling.grammar is None
    with pytest.raises(ValueError, match="request 3: grammar must hold the regex, got an empty string"):
        request_from_pb(pb_request("", spb.GRAMMAR_TYPE_REGEX))


def test_the_shard_refuses_a_bad_grammar_per_request_and_the_running_batch_steps_on(lm):
    from text_generation_server.shard.service import TextGenerationService

    lm.allocate_kv_cache(64)
    service = TextGenerationService(lm, "/tmp/unused", 1, 0.1)
    ctx = Context()

    def pb_request(rid: int, grammar: str = "", grammar_type: spb.GrammarType = spb.GRAMMAR_TYPE_NONE) -> spb.Request:
        return spb.Request(id=rid, inputs="def parse(", parameters=spb.NextTokenChooserParameters(
            grammar=grammar, grammar_type=grammar_type), stopping_parameters=spb.StoppingCriteriaParameters(
            max_new_tokens=40), add_special_tokens=True)

    async def scenario():
        first = await service.Prefill(spb.PrefillRequest(batch=spb.Batch(id=1, requests=[
            pb_request(1, r"[a-z]{30}", spb.GRAMMAR_TYPE_REGEX)])), ctx)
        bad = spb.Batch(id=2, requests=[pb_request(2), pb_request(3, '{"type": "strin"}', spb.GRAMMAR_TYPE_JSON)])
        with pytest.raises(StepFailedInShard) as info:
            await service.Prefill(spb.PrefillRequest(batch=bad, cached_batch=first.batch), ctx)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request 3: grammar: invalid JSON schema: Invalid type: strin" in info.value.details()
        tokens = [first.generations[0].tokens.ids[0]]
        batch = first.batch
        while batch.id:
            step = await service.Decode(spb.DecodeRequest(batches=[batch]), ctx)
            tokens += step.generations[0].tokens.ids
            batch = step.batch if step.HasField("batch") else spb.CachedBatch()
        return tokens

    tokens = asyncio.run(scenario())
    assert re.fullmatch("[a-z]{30}", lm.tokenizer.decode(tokens, skip_special_tokens=True))


def _pb_request(rid: int, prompt: str, new: int, grammar: str = "",
                grammar_type: spb.GrammarType = spb.GRAMMAR_TYPE_NONE) -> spb.Request:
    return spb.Request(id=rid, inputs=prompt, parameters=spb.NextTokenChooserParameters(
        grammar=grammar, grammar_type=grammar_type), stopping_parameters=spb.StoppingCriteriaParameters(
        max_new_tokens=new, ignore_eos_token=True), add_special_tokens=True)


async def _decode_to_end(service, ctx, step, tokens: dict[int, list[int]]) -> None:
    """Steps as a router does (finished requests filtered out) until every request finished;
    `step`: the Prefill's answer, whose tokens are in `tokens` already."""
    done = {g.request_id for g in step.generations if g.HasField("generated_text") or g.HasField("error")}
    batch = step.batch if step.HasField("batch") else None
    while batch is not None:
        kept = [i for i in batch.request_ids if i not in done]
        if len(kept) < len(batch.request_ids):
            batch = (await service.FilterBatch(spb.FilterBatchRequest(batch_id=batch.id, request_ids=kept), ctx)).batch
        step = await service.Decode(spb.DecodeRequest(batches=[batch]), ctx)
        for g in step.generations:
            tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
            if g.HasField("generated_text"):
                done.add(g.request_id)
        batch = step.batch if step.HasField("batch") else None


def test_with_per_request_errors_only_the_refused_newcomer_fails(lm):
    """Our router's Prefill (per_request_errors): of three newcomers merged into a running batch,
    the middle one's grammar is refused; it alone gets its error, as its own Generation, and is
    left out of the batch; the other two and the running request get exactly their tokens."""
    from text_generation_server.shard.service import TextGenerationService

    lm.allocate_kv_cache(64)
    service = TextGenerationService(lm, "/tmp/unused", 1, 0.1)
    ctx = Context()
    bad_json = '{"type": "strin"}'

    async def alone(rid: int, prompt: str, new: int) -> list[int]:
        first = await service.Prefill(spb.PrefillRequest(batch=spb.Batch(id=rid, requests=[
            _pb_request(rid, prompt, new)])), ctx)
        tokens = {rid: list(first.generations[0].tokens.ids)}
        await _decode_to_end(service, ctx, first, tokens)
        return tokens[rid]

    async def scenario():
        expected = {2: await alone(2, PROMPTS[1], 12), 4: await alone(4, PROMPTS[2], 9)}
        running = await service.Prefill(spb.PrefillRequest(batch=spb.Batch(id=1, requests=[
            _pb_request(1, "def parse(", 40, r"[a-z]{30}", spb.GRAMMAR_TYPE_REGEX)])), ctx)
        tokens = {1: list(running.generations[0].tokens.ids)}
        newcomers = spb.Batch(id=2, requests=[_pb_request(2, PROMPTS[1], 12),
                                              _pb_request(3, PROMPTS[0], 5, bad_json, spb.GRAMMAR_TYPE_JSON),
                                              _pb_request(4, PROMPTS[2], 9)])
        merged = await service.Prefill(spb.PrefillRequest(batch=newcomers, cached_batch=running.batch,
                                                          per_request_errors=True), ctx)
        refused = [g for g in merged.generations if g.HasField("error")]
        assert [(g.request_id, g.error, len(g.tokens.ids)) for g in refused] == \
            [(3, "request 3: grammar: invalid JSON schema: Invalid type: strin", 0)]
        assert list(merged.batch.request_ids) == [1, 2, 4]
        for g in merged.generations:
            if not g.HasField("error"):
                tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
        await _decode_to_end(service, ctx, merged, tokens)
        assert {rid: tokens[rid] for rid in expected} == expected
        assert re.fullmatch("[a-z]{30}", lm.tokenizer.decode(tokens[1], skip_special_tokens=True))

        # Every newcomer refused: the running batch still gets its step; without one, no batch.
        running = await service.Prefill(spb.PrefillRequest(batch=spb.Batch(id=5, requests=[
            _pb_request(5, PROMPTS[3], 6)])), ctx)
        only_bad = spb.Batch(id=6, requests=[_pb_request(6, PROMPTS[0], 5, "(ab", spb.GRAMMAR_TYPE_REGEX)])
        step = await service.Prefill(spb.PrefillRequest(batch=only_bad, cached_batch=running.batch,
                                                        per_request_errors=True), ctx)
        assert sorted((g.request_id, g.HasField("error")) for g in step.generations) == [(5, False), (6, True)]
        assert list(step.batch.request_ids) == [5]
        rest = {5: list(running.generations[0].tokens.ids) + [i for g in step.generations for i in g.tokens.ids]}
        await _decode_to_end(service, ctx, step, rest)
        assert rest[5] == await alone(7, PROMPTS[3], 6)
        alone_bad = await service.Prefill(spb.PrefillRequest(batch=only_bad, per_request_errors=True), ctx)
        assert not alone_bad.HasField("batch") and "unclosed group" in alone_bad.generations[0].error
        assert not service.cache
        with pytest.raises(StepFailedInShard, match="at least one request") as empty:  # still the batch's fault
            await service.Prefill(spb.PrefillRequest(batch=spb.Batch(id=9), per_request_errors=True), ctx)
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(scenario())
    # With two ranks, each answers for its share of the ids (id % world_size), refusals too.
    for rank in (0, 1):
        ranked = TextGenerationService(lm, "/tmp/unused", 2, 0.1, rank=rank)
        batch = spb.Batch(id=8, requests=[_pb_request(rid, PROMPTS[0], 3, "(ab", spb.GRAMMAR_TYPE_REGEX)
                                          for rid in (10, 11)])
        answer = asyncio.run(ranked.Prefill(spb.PrefillRequest(batch=batch, per_request_errors=True), ctx))
        assert [g.request_id for g in answer.generations] == [10 + rank]


def test_grammars_survive_chunked_prefill_prefix_caching_and_decode_ahead(lm):
    """The same grammar workload through the router's scheduler and a shard, prefix caching and
    chunking off and on (decode ahead is on in the shard): identical tokens, valid JSON."""
    from test_scheduler_prefix import collect, make

    system = "# A helper module for parsing configuration files.\nimport os\nimport sys\nimport json\n\n"
    grammar = cpb.Grammar(type=cpb.GRAMMAR_TYPE_JSON, value=json.dumps(SCHEMA))

    def generate_request(prompt: str, seed: int | None) -> cpb.GenerateRequest:
        params = cpb.GenerateParameters(max_new_tokens=JSON_BUDGET, grammar=grammar)
        if seed is not None:
            params.do_sample, params.seed, params.temperature = True, seed, 1.2
        return cpb.GenerateRequest(inputs=system + prompt, parameters=params)

    async def workload(caching: bool, max_prefill: int):
        scheduler, _, _, _ = make(lm, 200, caching, max_prefill)
        scheduler.start()
        try:
            entries = []
            for i, prompt in enumerate(["def load(path):", "class Config:", "def main():", "def merge(a, b):"]):
                valid = validate(generate_request(prompt, i if i % 2 else None), lm.tokenizer, LIMITS,
                                 lm.builder.grammars)
                entries.append(scheduler.submit(valid))
                await asyncio.sleep(0.01 * i)
            return [await collect(scheduler, e) for e in entries]
        finally:
            await scheduler.stop()

    baseline = asyncio.run(workload(caching=False, max_prefill=1000))
    for ids, text in baseline:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert asyncio.run(workload(caching=True, max_prefill=16)) == baseline
