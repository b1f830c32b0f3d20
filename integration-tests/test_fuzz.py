"""Fuzzing the client API of a real `serve`: no message may crash it or get a status other
than OK, INVALID_ARGUMENT or RESOURCE_EXHAUSTED, and it must keep serving afterwards.

Hypothesis draws text_generation.v1 requests with every parameter optional and any value
the wire allows (NaN, infinities, negatives as float, the uint32/uint64 extremes, unicode,
empty and oversize inputs, random stop lists), plus raw bytes that need not even parse.
The server runs with small limits so every limit is reachable and generation stays short.
"""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from serve_client import generate, launch_serve, poll_metrics, request, scrape

from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc

MAX_INPUT_CHARS = 2000
MAX_MESSAGE_BYTES = 16 * 1024
LIMITS = [
    "--max-input-tokens", "48", "--max-total-tokens", "64", "--max-input-chars", str(MAX_INPUT_CHARS),
    "--max-stop-sequences", "3", "--max-stop-sequence-length", "20", "--max-top-n-tokens", "3",
    "--max-message-bytes", str(MAX_MESSAGE_BYTES), "--max-concurrent-requests", "8",
]
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
GENERATE = "/text_generation.v1.TextGeneration/Generate"
GENERATE_STREAM = "/text_generation.v1.TextGeneration/GenerateStream"
RPC_TIMEOUT_S = 60.0
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    proc = launch_serve(tiny_model, tmp_path_factory.mktemp("sock"), tmp_path_factory.mktemp("logs"), *LIMITS,
                        name="fuzz")
    try:
        proc.wait_serving()
        yield proc
    finally:
        proc.cleanup()


@pytest.fixture(scope="module")
def channel(server) -> grpc.Channel:
    return server.channel()  # closed by the server's cleanup


@pytest.fixture(scope="module")
def stub(channel):
    return cpb_grpc.TextGenerationStub(channel)


# -- strategies -----------------------------------------------------------------------------------------
# Half the requests are legal (odd but valid values: they run through the engine); in the
# other half each field comes from its valid range two times in three and from anything the
# wire allows otherwise (NaN, infinities, the uint32/uint64 extremes, oversize text).
text = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=64)  # protobuf strings are UTF-8
any_float = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, -0.0, 1.0, 2.0000002, 1e-45, 1e38, -1.0, math.nan, math.inf, -math.inf]),
)
uint32 = st.one_of(st.integers(0, 2**32 - 1), st.sampled_from([0, 47, 48, 49, 63, 64, 65, 2**31, 2**32 - 1]))
VALID_INPUTS = st.one_of(text.filter(str.strip),
                         st.sampled_from(["def f(x):", "import os\n", "The quick brown fox", "😀" * 10]))
ANY_INPUTS = st.one_of(
    st.sampled_from(["", " ", "\n\n\t", "\x00"]),
    st.integers(MAX_INPUT_CHARS - 2, MAX_INPUT_CHARS + 2).map(lambda n: "a" * n),  # around max_input_chars
    st.integers(MAX_MESSAGE_BYTES - 64, 4 * MAX_MESSAGE_BYTES).map(lambda n: "b" * n),  # around the message limit
    st.integers(40, 400).map(lambda n: "w " * n),  # around max_input_tokens
)
# name -> (valid values, anything the wire allows)
FIELDS = {
    "max_new_tokens": (st.integers(1, 16), uint32),
    "temperature": (st.floats(0.0625, 5.0, width=32), any_float),
    "top_k": (st.integers(1, 400), uint32),  # above the vocabulary (300) is legal
    "top_p": (st.floats(0.0625, 1.0, width=32), any_float),
    "typical_p": (st.floats(0.0625, 1.0, width=32), any_float),
    "repetition_penalty": (st.floats(0.5, 2.0, width=32), any_float),
    "frequency_penalty": (st.floats(-2.0, 2.0, width=32), any_float),
    "do_sample": (st.booleans(), st.booleans()),
    "seed": (st.integers(0, 2**64 - 1), st.sampled_from([0, 2**63, 2**64 - 1])),
    "truncate": (st.integers(1, 48), uint32),
    "details": (st.booleans(), st.booleans()),
    "decoder_input_details": (st.booleans(), st.booleans()),
    "top_n_tokens": (st.integers(0, 3), uint32),
}
VALID_STOP = text.filter(bool).map(lambda s: s[:20])
ANY_STOP = st.one_of(st.just(""), st.integers(18, 40).map(lambda n: "s" * n))


def _pick(draw, valid, anything, wild: bool):
    return draw(st.one_of(valid, valid, anything) if wild else valid)


@st.composite
def generate_requests(draw) -> cpb.GenerateRequest:
    wild = draw(st.booleans())
    req = cpb.GenerateRequest(inputs=_pick(draw, VALID_INPUTS, ANY_INPUTS, wild))
    if draw(st.integers(0, 5)) == 0:
        return req  # no parameters message at all
    chosen = {name: _pick(draw, valid, anything, wild) for name, (valid, anything) in FIELDS.items()
              if draw(st.integers(0, 2)) == 0}
    chosen.setdefault("max_new_tokens", draw(st.integers(1, 8)))  # short unless drawn, so 150 examples stay quick
    if not wild and chosen.get("decoder_input_details"):
        chosen["details"] = True
    stop = draw(st.lists(st.one_of(VALID_STOP, ANY_STOP) if wild else VALID_STOP, max_size=4 if wild else 3))
    req.parameters.CopyFrom(cpb.GenerateParameters(stop=stop, **chosen))
    return req


# -- checks -----------------------------------------------------------------------------------------------
def _status(call) -> tuple[grpc.StatusCode, object]:
    try:
        result = call()
        return grpc.StatusCode.OK, result
    except grpc.RpcError as exc:
        return exc.code(), exc


def _check_answer(req: cpb.GenerateRequest, stream: bool, code: grpc.StatusCode, result) -> None:
    detail = result.details() if isinstance(result, grpc.RpcError) else ""
    assert code in ALLOWED, f"{code.name} ({detail}) for {'GenerateStream' if stream else 'Generate'} {req!r:.400}"
    if isinstance(result, grpc.RpcError):
        assert detail, f"{code.name} without a message"
        return
    wanted_details = req.parameters.details
    if stream:
        assert result, "a stream that succeeded sent no message"
        last = result[-1]
        assert last.HasField("generated_text")
        assert last.HasField("details") == wanted_details
        assert all(not m.HasField("generated_text") for m in result[:-1])
    else:
        assert result.HasField("details") == wanted_details


@FUZZ
@given(req=generate_requests(), stream=st.booleans())
def test_fuzzed_requests_get_a_clean_status(stub, req, stream):
    if stream:
        code, result = _status(lambda: list(stub.GenerateStream(req, timeout=RPC_TIMEOUT_S)))
    else:
        code, result = _status(lambda: stub.Generate(req, timeout=RPC_TIMEOUT_S))
    event(code.name)  # --hypothesis-show-statistics shows the mix of outcomes
    _check_answer(req, stream, code, result)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=512), stream=st.booleans())
def test_random_bytes_never_crash_the_server(channel, data, stream):
    """Raw bytes as the request message: corrupt wire format, bad UTF-8, unknown fields."""
    try:
        parsed = cpb.GenerateRequest.FromString(data)
    except Exception:  # the deserializer fails the same way inside the server
        parsed = None
    method = GENERATE_STREAM if stream else GENERATE
    event("parses" if parsed is not None else "does not parse")
    if stream:
        call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)
        code, result = _status(lambda: list(call(data, timeout=RPC_TIMEOUT_S)))
    else:
        call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        code, result = _status(lambda: call(data, timeout=RPC_TIMEOUT_S))
    if parsed is None:  # gRPC alone would say UNKNOWN; the server's interceptor names the client's error
        assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{code.name} for unparseable bytes {data[:64]!r}"
        assert "does not parse" in result.details()
    else:
        assert code in ALLOWED, f"{code.name} ({getattr(result, 'details', lambda: '')()}) for {parsed!r:.300}"


@FUZZ
@given(inputs=st.one_of(text, st.integers(0, 3 * MAX_INPUT_CHARS).map(lambda n: "t" * n)),
       special=st.none() | st.booleans())
def test_fuzzed_tokenize(stub, inputs, special):
    req = cpb.TokenizeRequest(inputs=inputs)
    if special is not None:
        req.add_special_tokens = special
    code, result = _status(lambda: stub.Tokenize(req, timeout=RPC_TIMEOUT_S))
    assert code in ALLOWED, f"{code.name} for {req!r:.200}"
    if code == grpc.StatusCode.OK:
        assert all(inputs[t.start:t.stop] == t.text for t in result.tokens)


def test_still_serving_after_the_fuzz(server, stub):
    """Runs last: every earlier message left no trace (no failed step, no held block)."""
    assert generate(stub, request("def f(x):", max_new_tokens=4)).token_ids
    snap = poll_metrics(server, lambda s: s.value("tgs_kv_blocks_used", None) == 0)
    assert snap.value("tgi_queue_size", None) == 0 and snap.value("tgi_batch_current_size", None) == 0
    for reason in ("internal", "prefill", "decode"):
        assert snap.value("tgi_request_failure_total", err=reason) == 0, f"requests failed with {reason}"
    assert snap.value("tgi_request_success_total") > 0
    assert snap.value("tgi_request_failure_total", err="validation") > 0
    assert server.proc.poll() is None
    assert scrape(server).families  # /metrics still parses
