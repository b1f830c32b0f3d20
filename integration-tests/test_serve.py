"""`serve` end to end: real processes, real sockets, generated gRPC clients, Prometheus text.

Most tests share one server on the random tiny Llama (module scope: startup costs
seconds) and run in file order, so metric deltas are exact: nothing else talks to
that server meanwhile. Servers with other flags (max concurrency, two shards, the
embedded model) are started per test.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from serve_client import (
    CORPUS, Completion, client_stub, collect_stream, generate, launch_serve, long_greedy_prompt, poll_metrics,
    request, rpc_error, scrape, shard_stub, stream_completion,
)

from text_generation_server.about import __version__
from text_generation_server.router.metrics import Metrics
from text_generation_server.pb.generate.v3 import generate_pb2 as spb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb

SERVICE = "text_generation.v1.TextGeneration"
MAX_INPUT_CHARS = 4000
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "The quick brown fox", "class Stack:"]
OWN_BATCH = 10**12  # far above any id the router hands out, so driving the shard directly cannot collide


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """One serve on the tiny model with SMALL_LIMITS: max_input 255, max_total 256, prefill 512, 4096 KV tokens."""
    sock_dir = tmp_path_factory.mktemp("sock")
    proc = launch_serve(tiny_model, sock_dir, tmp_path_factory.mktemp("logs"), "--max-input-chars",
                        str(MAX_INPUT_CHARS))
    try:
        proc.wait_serving()
        yield proc
    finally:
        proc.cleanup()


@pytest.fixture(scope="module")
def stub(server):
    return client_stub(server)


# -- 1. the client API, health and reflection ------------------------------------------------------------
def test_info_health_and_reflection(server, stub, tiny_model):
    info = stub.Info(cpb.InfoRequest(), timeout=10)
    assert info.model_id == str(tiny_model)
    assert (info.model_dtype, info.model_device_type) == ("float32", "cpu")
    assert (info.max_input_tokens, info.max_total_tokens, info.max_batch_prefill_tokens) == (255, 256, 512)
    assert 0 < info.max_batch_total_tokens <= 4096
    assert (info.max_concurrent_requests, info.max_stop_sequences, info.num_shard) == (128, 4, 1)
    assert (info.block_size, info.quantize, info.version) == (16, "", __version__)
    assert list(info.kernels) == ["dense"]  # from the shard's Info trailing metadata

    health = health_pb2_grpc.HealthStub(server.channel())
    for name in ("", SERVICE):
        resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING, name
    unknown = rpc_error(health.Check, health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert unknown.code() == grpc.StatusCode.NOT_FOUND
    watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()

    reflection = reflection_pb2_grpc.ServerReflectionStub(server.channel())
    asks = [reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE)]
    listed, found = list(reflection.ServerReflectionInfo(iter(asks), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in found.file_descriptor_response.file_descriptor_proto]
    services = {f"{f.package}.{s.name}": [m.name for m in s.method] for f in files for s in f.service}
    assert sorted(services[SERVICE]) == ["Chat", "ChatStream", "Generate", "GenerateStream", "Info", "ListAdapters",
                                         "LoadAdapter", "Tokenize", "UnloadAdapter"]


def test_tokenize_offsets(stub):
    text = "def f(x): ü"
    tokens = stub.Tokenize(cpb.TokenizeRequest(inputs=text), timeout=10).tokens
    assert tokens and all(t.text == text[t.start:t.stop] and t.start <= t.stop for t in tokens)
    assert tokens[0].start == 0 and tokens[-1].stop == len(text)
    assert len(stub.Tokenize(cpb.TokenizeRequest(inputs=""), timeout=10).tokens) == 0
    too_long = rpc_error(stub.Tokenize, cpb.TokenizeRequest(inputs="x" * (MAX_INPUT_CHARS + 1)), timeout=10)
    assert too_long.code() == grpc.StatusCode.INVALID_ARGUMENT and "inputs" in too_long.details()


def test_generate_details_prefill_and_top_tokens(stub):
    prompt = PROMPTS[0]
    resp = stub.Generate(request(prompt, max_new_tokens=8, details=True, decoder_input_details=True,
                                 top_n_tokens=3), timeout=60)
    d = resp.details
    assert d.generated_tokens == len(d.tokens) >= 1
    assert d.finish_reason == (cpb.FINISH_REASON_LENGTH if len(d.tokens) == 8 else cpb.FINISH_REASON_EOS_TOKEN)
    assert not d.HasField("seed"), "greedy decoding reports no seed"
    assert resp.generated_text == "".join(t.text for t in d.tokens if not t.special)
    # Prefill: exactly the prompt's tokens; the first has no context, hence no logprob.
    prompt_ids = [t.id for t in stub.Tokenize(cpb.TokenizeRequest(inputs=prompt), timeout=10).tokens]
    assert [t.id for t in d.prefill] == prompt_ids
    assert not d.prefill[0].HasField("logprob")
    assert all(t.HasField("logprob") and t.logprob <= 0 for t in d.prefill[1:])
    # Top tokens: one entry per generated token, most likely first; greedy picked the first.
    assert len(d.top_tokens) == len(d.tokens)
    for chosen, top in zip(d.tokens, d.top_tokens):
        logprobs = [t.logprob for t in top.tokens]
        assert len(top.tokens) == 3 and logprobs == sorted(logprobs, reverse=True)
        assert top.tokens[0].id == chosen.id
        assert math.isclose(top.tokens[0].logprob, chosen.logprob, rel_tol=1e-5, abs_tol=1e-6)
        assert chosen.logprob <= 0


def test_seeded_sampling_is_reproducible(stub):
    req = request(PROMPTS[1], max_new_tokens=12, do_sample=True, seed=7, temperature=0.8, details=True)
    first, second = (stub.Generate(req, timeout=60) for _ in range(2))
    assert first.details.seed == second.details.seed == 7
    assert [t.id for t in first.details.tokens] == [t.id for t in second.details.tokens]
    assert first.generated_text == second.generated_text


def test_generate_and_stream_agree(stub):
    for prompt in PROMPTS:
        req = request(prompt, max_new_tokens=12, details=True, top_n_tokens=2)
        whole = stub.Generate(req, timeout=60)
        messages = collect_stream(stub, req)
        assert Completion.from_stream(messages) == Completion.from_response(whole), prompt
        assert len(messages) == whole.details.generated_tokens
        for m in messages[:-1]:
            assert not m.HasField("generated_text") and not m.HasField("details")
        last = messages[-1]
        assert last.generated_text == whole.generated_text
        assert list(last.details.tokens) == [m.token for m in messages]  # self-contained last message
        # The second request reuses the first one's prompt from the prefix cache: the same tokens,
        # logprobs equal up to float rounding (K/V computed in a differently shaped forward).
        streamed_tops = [[(t.id, t.text) for t in m.top_tokens] for m in messages]
        assert streamed_tops == [[(t.id, t.text) for t in top.tokens] for top in whole.details.top_tokens]
        close = lambda a, b: all(math.isclose(x, y, rel_tol=1e-5, abs_tol=1e-6) for x, y in zip(a, b))
        assert close([t.logprob for top in whole.details.top_tokens for t in top.tokens],
                     [t.logprob for m in messages for t in m.top_tokens])
        assert close([t.logprob for t in whole.details.tokens], [m.token.logprob for m in messages])
    # Details only when asked for, on both RPCs.
    plain = request(PROMPTS[0], max_new_tokens=4)
    assert not stub.Generate(plain, timeout=60).HasField("details")
    last = collect_stream(stub, plain)[-1]
    assert last.HasField("generated_text") and not last.HasField("details")


def test_stop_sequence_ends_generation(stub):
    full = stub.Generate(request(PROMPTS[0], max_new_tokens=12, details=True), timeout=60)
    texts = [t.text for t in full.details.tokens]
    # The text after k tokens first appears there, so stopping on it must end exactly at token k.
    k = next((i for i in range(2, len(texts)) if texts[i - 1]), None)
    assert k is not None, f"no usable token text in {texts}"
    stop = "".join(texts[:k])
    stopped = stub.Generate(request(PROMPTS[0], max_new_tokens=12, details=True, stop=[stop]), timeout=60)
    assert stopped.details.finish_reason == cpb.FINISH_REASON_STOP_SEQUENCE
    assert stopped.generated_text == stop
    assert [t.id for t in stopped.details.tokens] == [t.id for t in full.details.tokens[:k]]


# -- 2. the shard protocol on rank 0's socket --------------------------------------------------------------
def _shard_request(rid: int, prompt: str, max_new_tokens: int, **fields) -> spb.Request:
    greedy = spb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0)
    return spb.Request(id=rid, inputs=prompt, parameters=greedy, add_special_tokens=True,
                       stopping_parameters=spb.StoppingCriteriaParameters(max_new_tokens=max_new_tokens), **fields)


def _prefill(batch_id: int, *requests: spb.Request, cached: spb.CachedBatch | None = None) -> spb.PrefillRequest:
    req = spb.PrefillRequest(batch=spb.Batch(id=batch_id, requests=requests, size=len(requests)))
    if cached is not None:
        req.cached_batch.CopyFrom(cached)
    return req


def test_shard_protocol_on_rank_zero(server, stub):
    shard = shard_stub(server)
    info = shard.Info(spb.InfoRequest(), timeout=10)
    assert (info.block_size, info.dtype, info.device_type) == (16, "float32", "cpu")
    assert not info.requires_padding and info.speculate == 0
    shard.Health(spb.HealthRequest(), timeout=10)
    urls = shard.ServiceDiscovery(spb.ServiceDiscoveryRequest(), timeout=10).urls
    assert list(urls) == [f"unix://{server.socket_path(0)}"]

    unknown = spb.CachedBatch(id=OWN_BATCH + 1, request_ids=[OWN_BATCH], size=1)
    for call, msg in (
        (shard.FilterBatch, spb.FilterBatchRequest(batch_id=unknown.id, request_ids=[OWN_BATCH])),
        (shard.Decode, spb.DecodeRequest(batches=[unknown])),
        (shard.Prefill, _prefill(OWN_BATCH, _shard_request(OWN_BATCH, "x", 2, blocks=[1]), cached=unknown)),
    ):
        err = rpc_error(call, msg, timeout=30)
        assert err.code() == grpc.StatusCode.NOT_FOUND and str(unknown.id) in err.details(), err.details()

    snap = scrape(server)
    assert snap.value("tgs_kv_blocks_used", None) == 0, "the router must be idle while the shard is driven directly"
    last_block = int(snap.value("tgs_kv_blocks_free", None))  # block 0 is reserved: blocks are 1..free
    bad = {
        "max_new_tokens": _shard_request(OWN_BATCH, PROMPTS[0], 0, blocks=[last_block]),
        "blocks": _shard_request(OWN_BATCH, PROMPTS[0], 3, blocks=[10**6]),
        "cannot hold": _shard_request(OWN_BATCH, "hello " * 40, 3, blocks=[last_block]),
    }
    for needle, req in bad.items():
        err = rpc_error(shard.Prefill, _prefill(OWN_BATCH, req), timeout=30)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.details(), err.details()

    # The shard still serves: a whole greedy request driven by hand matches the router's answer.
    expected = generate(stub, request(PROMPTS[0], max_new_tokens=3))
    req = _shard_request(OWN_BATCH, PROMPTS[0], 3, blocks=[last_block])
    first = shard.Prefill(_prefill(OWN_BATCH, req), timeout=30)
    ids = [g.tokens.ids[0] for g in first.generations]
    assert first.batch.id == OWN_BATCH and list(first.batch.request_ids) == [OWN_BATCH]
    again = rpc_error(shard.Prefill, _prefill(OWN_BATCH, req), timeout=30)
    assert again.code() == grpc.StatusCode.INVALID_ARGUMENT and "already cached" in again.details()
    # Warmup re-sizes the KV cache, so a live shard with cached batches must refuse it untouched.
    warm = spb.WarmupRequest(batch=spb.Batch(id=0, requests=[_shard_request(0, "_test", 2)], size=1),
                             max_input_tokens=255, max_prefill_tokens=512, max_total_tokens=256)
    refused = rpc_error(shard.Warmup, warm, timeout=30)
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION and "ClearCache" in refused.details()
    kept = shard.FilterBatch(spb.FilterBatchRequest(batch_id=OWN_BATCH, request_ids=[OWN_BATCH]), timeout=30)
    batch = kept.batch
    generated = None
    while batch.id == OWN_BATCH and batch.request_ids:
        step = shard.Decode(spb.DecodeRequest(batches=[batch]), timeout=30)
        ids += [g.tokens.ids[0] for g in step.generations]
        generated = next((g.generated_text for g in step.generations if g.HasField("generated_text")), generated)
        batch = step.batch if step.HasField("batch") else spb.CachedBatch()
    assert ids == expected.token_ids
    assert generated is not None and generated.text == expected.text and generated.generated_tokens == len(ids)
    shard.ClearCache(spb.ClearCacheRequest(id=OWN_BATCH), timeout=30)
    shard.Health(spb.HealthRequest(), timeout=10)
    assert generate(stub, request(PROMPTS[0], max_new_tokens=3)) == expected


# -- 3. many concurrent streams ------------------------------------------------------------------------------
def test_64_concurrent_streams_match_their_alone_results(server, stub):
    lengths = [1, 3, 8, 20, 45, 90, 160, 250]  # prompt characters; ~1 to ~100 tokens
    news = [1, 2, 5, 9, 17, 33, 40, 12]
    cases = [request(CORPUS[(7 * i) % 40:][:lengths[i % 8]], max_new_tokens=news[(i // 8 + i) % 8])
             for i in range(64)]
    alone = [generate(stub, req) for req in cases]  # one at a time: nothing else in the batch

    before = scrape(server)
    with ThreadPoolExecutor(max_workers=64) as pool:
        together = list(pool.map(lambda req: stream_completion(stub, req, timeout=120), cases))
    for i, (a, t) in enumerate(zip(alone, together)):
        assert t == a, f"case {i} ({cases[i].inputs!r}, max_new_tokens {cases[i].parameters.max_new_tokens})"

    after = poll_metrics(server, lambda s: s.value("tgs_kv_blocks_used", None) == 0)
    assert after.value("tgi_queue_size", None) == 0
    assert after.value("tgi_request_success_total") - before.value("tgi_request_success_total") == 64
    prefilled = after.value("tgi_batch_next_size_sum") - before.value("tgi_batch_next_size_sum")
    prefills = after.value("tgi_batch_next_size_count") - before.value("tgi_batch_next_size_count")
    assert prefilled == 64 and prefills < 64, f"{prefills} prefills for 64 requests: nothing was batched"


# -- 4. cancellation frees KV blocks ---------------------------------------------------------------------------
def test_cancelled_stream_frees_its_blocks(server, stub):
    prompt = long_greedy_prompt(stub, min_tokens=150)
    before = poll_metrics(server, lambda s: s.value("tgs_kv_blocks_used", None) == 0)
    call = stub.GenerateStream(request(prompt, max_new_tokens=200), timeout=60)
    got = [next(call) for _ in range(3)]
    assert not any(m.HasField("generated_text") for m in got)
    held = scrape(server).value("tgs_kv_blocks_used", None)
    assert held > 0, "a running request holds KV blocks"
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED

    cancelled = before.value("tgs_request_cancelled_total")
    # The batch-size gauge is set when the scheduler next looks at its batch, a moment after the
    # blocks are freed: wait for all three.
    after = poll_metrics(server, lambda s: s.value("tgs_kv_blocks_used", None) == 0
                         and s.value("tgs_request_cancelled_total") == cancelled + 1
                         and s.value("tgi_batch_current_size", None) == 0)
    assert after.value("tgs_kv_blocks_free", None) == before.value("tgs_kv_blocks_free", None)
    assert after.value("tgi_request_success_total") == before.value("tgi_request_success_total")
    assert after.value("tgi_batch_current_size", None) == 0
    assert generate(stub, request(prompt, max_new_tokens=5)).token_ids  # still serving


# -- 5. validation --------------------------------------------------------------------------------------------------
_LONG_TEXT = " ".join(f"w{i}" for i in range(400))  # several hundred tokens, under MAX_INPUT_CHARS
INVALID = {
    "empty inputs": ("", {}, "inputs"),
    "inputs over max_input_chars": ("x" * (MAX_INPUT_CHARS + 1), {}, "inputs has"),
    "inputs over max_input_tokens": (_LONG_TEXT, {"max_new_tokens": 1}, "max_input_tokens"),
    "temperature 0": ("hi", {"temperature": 0.0}, "parameters.temperature"),
    "temperature negative": ("hi", {"temperature": -0.5}, "parameters.temperature"),
    "temperature nan": ("hi", {"temperature": math.nan}, "parameters.temperature"),
    "temperature inf": ("hi", {"temperature": math.inf}, "parameters.temperature"),
    "top_k 0": ("hi", {"top_k": 0}, "parameters.top_k"),
    "top_p 0": ("hi", {"top_p": 0.0}, "parameters.top_p"),
    "top_p above 1": ("hi", {"top_p": 1.5}, "parameters.top_p"),
    "typical_p 0": ("hi", {"typical_p": 0.0}, "parameters.typical_p"),
    "typical_p above 1": ("hi", {"typical_p": 1.01}, "parameters.typical_p"),
    "repetition_penalty 0": ("hi", {"repetition_penalty": 0.0}, "parameters.repetition_penalty"),
    "repetition_penalty nan": ("hi", {"repetition_penalty": math.nan}, "parameters.repetition_penalty"),
    "frequency_penalty 3": ("hi", {"frequency_penalty": 3.0}, "parameters.frequency_penalty"),
    "frequency_penalty -3": ("hi", {"frequency_penalty": -3.0}, "parameters.frequency_penalty"),
    "max_new_tokens 0": ("hi", {"max_new_tokens": 0}, "parameters.max_new_tokens"),
    "max_new_tokens over max_total_tokens": ("hi", {"max_new_tokens": 256}, "max_total_tokens"),
    "truncate 0": ("hi", {"truncate": 0}, "parameters.truncate"),
    "truncate over max_input_tokens": ("hi", {"truncate": 256}, "parameters.truncate"),
    "too many stop sequences": ("hi", {"stop": ["a", "b", "c", "d", "e"]}, "parameters.stop"),
    "empty stop sequence": ("hi", {"stop": ["a", ""]}, "parameters.stop"),
    "stop sequence too long": ("hi", {"stop": ["s" * 257]}, "parameters.stop"),
    "top_n_tokens over the limit": ("hi", {"top_n_tokens": 6}, "parameters.top_n_tokens"),
    "decoder_input_details without details": ("hi", {"decoder_input_details": True},
                                              "parameters.decoder_input_details"),
}


@pytest.mark.parametrize("case", list(INVALID), ids=list(INVALID))
def test_invalid_field_is_rejected(server, stub, case):
    inputs, params, needle = INVALID[case]
    req = request(inputs, **params)
    before = scrape(server)
    for call in (stub.Generate, stub.GenerateStream):
        err = rpc_error(call, req, timeout=30)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, f"{case}: {err.code()} {err.details()}"
        assert needle in err.details(), f"{case}: {err.details()!r} does not name {needle!r}"
    after = scrape(server)
    assert after.value("tgi_request_count_total") - before.value("tgi_request_count_total") == 2
    failed = after.value("tgi_request_failure_total", err="validation")
    assert failed - before.value("tgi_request_failure_total", err="validation") == 2


def test_limits_at_the_edge_are_accepted(stub):
    # The largest values the limits allow must pass: off-by-one checks reject them.
    prompt_len = len(stub.Tokenize(cpb.TokenizeRequest(inputs="hi"), timeout=10).tokens)
    edge = request("hi", max_new_tokens=256 - prompt_len, top_n_tokens=5, truncate=255, top_p=1.0,
                   stop=["a" * 256, "b", "c", "d"], frequency_penalty=-2.0, details=True)
    resp = stub.Generate(edge, timeout=120)
    assert resp.details.generated_tokens >= 1


def test_server_still_serves_and_metrics_parse(server, stub):
    before = scrape(server)
    assert generate(stub, request(PROMPTS[2], max_new_tokens=4)).token_ids
    after = scrape(server)  # MetricsSnapshot parses the whole text; a malformed line raises
    assert after.value("tgi_request_count_total") == before.value("tgi_request_count_total") + 1
    assert after.value("tgi_request_success_total") == before.value("tgi_request_success_total") + 1
    assert after.value("tgi_request_failure_total", err="validation") >= 2 * len(INVALID)
    assert after.value("tgi_batch_inference_success_total", method="prefill") > 0
    assert after.value("tgi_batch_inference_success_total", method="decode") > 0
    expected = {family.name for family in Metrics().registry.collect()}
    missing = expected - set(after.families)
    assert not missing, f"/metrics lacks {sorted(missing)}"


# -- 6. max_concurrent_requests ------------------------------------------------------------------------------
def test_max_concurrent_requests_rejects_the_excess(tiny_model, start_serve):
    server = start_serve(tiny_model, "--max-concurrent-requests", "2")
    server.wait_serving()
    stub = client_stub(server)
    assert stub.Info(cpb.InfoRequest(), timeout=10).max_concurrent_requests == 2
    prompt = long_greedy_prompt(stub, min_tokens=150)
    req = request(prompt, max_new_tokens=200, details=True)
    alone = Completion.from_response(stub.Generate(req, timeout=60))

    def consume(call) -> Completion | grpc.RpcError:
        try:
            return Completion.from_stream(list(call))
        except grpc.RpcError as exc:
            return exc

    calls = [stub.GenerateStream(req, timeout=120) for _ in range(6)]  # all sent before any is read
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(consume, calls))
    done = [r for r in results if isinstance(r, Completion)]
    refused = [r for r in results if isinstance(r, grpc.RpcError)]
    assert refused and len(done) >= 2, f"{len(done)} completed, {len(refused)} refused"
    for err in refused:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
        assert "max_concurrent_requests" in err.details()
    assert all(d == alone for d in done)
    snap = poll_metrics(server, lambda s: s.value("tgs_kv_blocks_used", None) == 0)
    assert snap.value("tgi_request_failure_total", err="overloaded") == len(refused)
    assert generate(stub, req) == alone  # capacity is back once they finish


# -- 7. tensor parallel --------------------------------------------------------------------------------------------
def test_two_shards_give_the_same_greedy_tokens(tiny_model, start_serve, stub):
    two = start_serve(tiny_model, num_shard=2)
    two.wait_serving(timeout_s=120)
    stub2 = client_stub(two)
    assert stub2.Info(cpb.InfoRequest(), timeout=10).num_shard == 2
    urls = shard_stub(two).ServiceDiscovery(spb.ServiceDiscoveryRequest(), timeout=10).urls
    assert list(urls) == [f"unix://{two.socket_path(r)}" for r in range(2)]
    for prompt in PROMPTS:
        req = request(prompt, max_new_tokens=24)
        one_shard = generate(stub, req)
        assert generate(stub2, req) == one_shard, prompt
        assert stream_completion(stub2, req) == one_shard, prompt


# -- 8. the embedded model ------------------------------------------------------------------------------------------
def test_embedded_model_serves_without_a_model_argument(start_serve):
    server = start_serve(None)
    server.wait_serving(timeout_s=120)
    stub = client_stub(server)
    info = stub.Info(cpb.InfoRequest(), timeout=10)
    assert info.model_id == "tiny-pycoder"
    prompt = "def fibonacci("
    assert stub.Tokenize(cpb.TokenizeRequest(inputs=prompt), timeout=10).tokens
    req = request(prompt, max_new_tokens=16)
    resp = stub.Generate(req, timeout=120)
    assert resp.generated_text.strip()
    assert stream_completion(stub, req) == generate(stub, req)
    shard = shard_stub(server)
    shard.Health(spb.HealthRequest(), timeout=10)
    assert shard.Info(spb.InfoRequest(), timeout=10).block_size == info.block_size
