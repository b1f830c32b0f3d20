"""The wire contract: committed stubs match proto/, and the protocols match their specs.

The shard protocol must stay wire-compatible with TGI's v3 router, so its expected
shape is written out below from specs/shard-protocol.md rather than read back from
the .proto file: a renumbered or relabelled field fails here even when the stubs were
regenerated faithfully.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from types import ModuleType

import grpc
import pytest
from google.protobuf import descriptor_pb2

from text_generation_server.pb.generate.v3 import generate_pb2, generate_pb2_grpc
from text_generation_server.pb.text_generation.v1 import (
    text_generation_pb2 as tg_pb2,
    text_generation_pb2_grpc as tg_pb2_grpc,
)

REPO = Path(__file__).resolve().parents[1]
STUBS = REPO / "server" / "text_generation_server" / "pb"
SCRIPT = REPO / "proto" / "generate_stubs.py"

# --- the spec table (specs/shard-protocol.md, "Messages" and "RPCs"), verbatim --------
SHARD_MESSAGES = """
InfoResponse: bool requires_padding = 1; string dtype = 2; string device_type = 3; optional uint32 window_size = 4; uint32 speculate = 5; bool support_chunking = 6; bool use_prefix_caching = 7; string attention_impl = 8; uint32 block_size = 9
Image: bytes data = 1; string mimetype = 2
InputChunk: oneof chunk { string text = 1; Image image = 2 }
Input: repeated InputChunk chunks = 1
enum GrammarType: GRAMMAR_TYPE_NONE = 0; GRAMMAR_TYPE_JSON = 1; GRAMMAR_TYPE_REGEX = 2
enum FinishReason: FINISH_REASON_LENGTH = 0; FINISH_REASON_EOS_TOKEN = 1; FINISH_REASON_STOP_SEQUENCE = 2
NextTokenChooserParameters: float temperature = 1; uint32 top_k = 2; float top_p = 3; float typical_p = 4; bool do_sample = 5; uint64 seed = 6; float repetition_penalty = 7; bool watermark = 8; float frequency_penalty = 9; string grammar = 10; GrammarType grammar_type = 11
StoppingCriteriaParameters: uint32 max_new_tokens = 1; repeated string stop_sequences = 2; bool ignore_eos_token = 3
Request: uint64 id = 1; string inputs = 2; uint32 truncate = 3; NextTokenChooserParameters parameters = 4; StoppingCriteriaParameters stopping_parameters = 5; bool prefill_logprobs = 6; uint32 top_n_tokens = 7; Input input_chunks = 8; repeated uint32 blocks = 9; repeated uint32 slots = 10; optional string adapter_id = 11; uint32 cache_len = 12; bool add_special_tokens = 13; optional uint32 chunk_len = 14
Batch: uint64 id = 1; repeated Request requests = 2; uint32 size = 3; uint32 max_tokens = 4; uint32 max_blocks = 5
CachedBatch: uint64 id = 1; repeated uint64 request_ids = 2; uint32 size = 3; uint32 max_tokens = 4; uint32 current_tokens = 5
GeneratedText: string text = 1; uint32 generated_tokens = 2; FinishReason finish_reason = 3; optional uint64 seed = 4
Tokens: repeated uint32 ids = 1; repeated float logprobs = 2; repeated string texts = 3; repeated bool is_special = 4
Generation: uint64 request_id = 1; Tokens prefill_tokens = 2; Tokens tokens = 3; optional GeneratedText generated_text = 4; repeated Tokens top_tokens = 5
PrefillResponse: repeated Generation generations = 1; optional CachedBatch batch = 2; uint64 forward_ns = 3; uint64 decode_ns = 4; uint64 total_ns = 5; optional uint64 concat_ns = 6
DecodeResponse: repeated Generation generations = 1; optional CachedBatch batch = 2; uint64 forward_ns = 3; uint64 decode_ns = 4; uint64 total_ns = 5; optional uint64 concat_ns = 6
WarmupRequest: Batch batch = 1; optional uint32 max_input_tokens = 2; uint32 max_prefill_tokens = 3; optional uint32 max_total_tokens = 4
WarmupResponse: optional uint32 max_supported_total_tokens = 1; uint32 max_input_tokens = 2; uint32 max_total_tokens = 3
InfoRequest:
HealthRequest:
HealthResponse:
ServiceDiscoveryRequest:
ServiceDiscoveryResponse: repeated string urls = 1
ClearCacheRequest: optional uint64 id = 1
ClearCacheResponse:
FilterBatchRequest: uint64 batch_id = 1; repeated uint64 request_ids = 2
FilterBatchResponse: CachedBatch batch = 1
PrefillRequest: Batch batch = 1; CachedBatch cached_batch = 2
DecodeRequest: repeated CachedBatch batches = 1
"""
# Beyond the spec table: TGI's own v3 proto also carries this field, and newer TGI
# routers send it (see the comment on it in generate.proto).
SHARD_EXTRAS = {
    "NextTokenChooserParameters": {("logit_bias", 12, "LogitBiasEntry", "repeated", None)},
    # Ours alone, far from TGI's numbers: the router's token ids (a TGI router never sets it).
    "Request": {("input_ids", 1001, "uint32", "repeated", None)},
    # Ours alone: a refused request answered on its own (only when the Prefill asks for it).
    "PrefillRequest": {("per_request_errors", 1001, "bool", "", None)},
    "Generation": {("error", 1001, "string", "optional", None)},
    # Ours alone: the LoRA adapters loaded (a TGI router ignores an unknown field).
    "InfoResponse": {("adapters", 1000, "AdapterInfo", "repeated", None)},
}

# Ours alone (a TGI router never opens Steps): the state-changing calls over one stream per rank.
SHARD_OWN_MESSAGES = {
    "StepCall": {("seq", 1, "uint64", "", None), ("prefill", 2, "PrefillRequest", "", "call"),
                 ("decode", 3, "DecodeRequest", "", "call"), ("filter_batch", 4, "FilterBatchRequest", "", "call"),
                 ("clear_cache", 5, "ClearCacheRequest", "", "call")},
    "StepAnswer": {("seq", 1, "uint64", "", None), ("prefill", 2, "PrefillResponse", "", "answer"),
                   ("decode", 3, "DecodeResponse", "", "answer"),
                   ("filter_batch", 4, "FilterBatchResponse", "", "answer"),
                   ("clear_cache", 5, "ClearCacheResponse", "", "answer"), ("error", 6, "StepError", "", "answer")},
    "StepError": {("code", 1, "uint32", "", None), ("message", 2, "string", "", None)},
    # Ours alone (a TGI router never calls them): LoRA adapters loaded and unloaded at run time.
    "AdapterInfo": {("name", 1, "string", "", None), ("path", 2, "string", "", None), ("rank", 3, "uint32", "", None),
                    ("target_modules", 4, "string", "repeated", None), ("alpha", 5, "float", "", None)},
    "LoadAdapterRequest": {("name", 1, "string", "", None), ("path", 2, "string", "", None)},
    "LoadAdapterResponse": {("adapter", 1, "AdapterInfo", "", None)},
    "UnloadAdapterRequest": {("name", 1, "string", "", None)},
    "UnloadAdapterResponse": set(),
}

SHARD_RPCS = {
    "Info": ("InfoRequest", "InfoResponse"),
    "ServiceDiscovery": ("ServiceDiscoveryRequest", "ServiceDiscoveryResponse"),
    "ClearCache": ("ClearCacheRequest", "ClearCacheResponse"),
    "FilterBatch": ("FilterBatchRequest", "FilterBatchResponse"),
    "Warmup": ("WarmupRequest", "WarmupResponse"),
    "Prefill": ("PrefillRequest", "PrefillResponse"),
    "Decode": ("DecodeRequest", "DecodeResponse"),
    "Health": ("HealthRequest", "HealthResponse"),
}
SHARD_OWN_STREAMS = {"Steps": ("StepCall", "StepAnswer")}  # client and server streaming
# Ours alone, unary: LoRA adapters at run time.
SHARD_OWN_RPCS = {"LoadAdapter": ("LoadAdapterRequest", "LoadAdapterResponse"),
                  "UnloadAdapter": ("UnloadAdapterRequest", "UnloadAdapterResponse")}

# (name, number, type, label, oneof); label is "" (plain proto3), "optional" or "repeated".
Field = tuple[str, int, str, str, str | None]
_FIELD = re.compile(r"^(?:(optional|repeated) )?(\w+) (\w+) = (\d+)$")


def _parse_spec(table: str) -> tuple[dict[str, set[Field]], dict[str, dict[str, int]]]:
    messages: dict[str, set[Field]] = {}
    enums: dict[str, dict[str, int]] = {}
    for line in filter(None, (raw.strip() for raw in table.splitlines())):
        head, _, body = line.partition(":")
        parts = [p.strip() for p in body.split(";") if p.strip()]
        if head.startswith("enum "):
            enums[head[len("enum "):]] = {n: int(v) for n, v in (p.split(" = ") for p in parts)}
            continue
        oneof = None
        fields: set[Field] = set()
        for part in parts:
            opened = re.match(r"^oneof (\w+) \{ (.*)$", part)
            if opened:
                oneof, part = opened.group(1), opened.group(2)
            closes = part.endswith("}")
            match = _FIELD.match(part.rstrip("} ").strip())
            assert match, f"spec table line not understood: {part!r}"
            label, type_, name, number = match.groups()
            fields.add((name, int(number), type_, label or "", oneof))
            if closes:
                oneof = None
        messages[head] = fields
    return messages, enums


_SCALARS = {
    getattr(descriptor_pb2.FieldDescriptorProto, f"TYPE_{t.upper()}"): t
    for t in ("bool", "bytes", "string", "float", "double", "int32", "int64", "uint32", "uint64")
}


def _actual_fields(message: descriptor_pb2.DescriptorProto) -> set[Field]:
    fields: set[Field] = set()
    for f in message.field:
        type_ = _SCALARS.get(f.type) or f.type_name.rsplit(".", 1)[-1]
        if f.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED:
            label = "repeated"
        elif f.proto3_optional:
            label = "optional"
        else:
            label = ""
        oneof = None
        if f.HasField("oneof_index") and not f.proto3_optional:
            oneof = message.oneof_decl[f.oneof_index].name
        fields.add((f.name, f.number, type_, label, oneof))
    return fields


def _file_proto(module: ModuleType) -> descriptor_pb2.FileDescriptorProto:
    proto = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(proto)
    return proto


# --- (a) committed stubs are exactly what proto/ generates ------------------------------


def _tree(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def test_committed_stubs_match_regenerated(tmp_path: Path) -> None:
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.fail("grpcio-tools (a test dependency) is needed to regenerate stubs: pip install -e .[test]")
    from importlib.metadata import version

    recorded = re.search(
        rb"with grpcio-tools (\S+); do not edit", (STUBS / "generate/v3/generate_pb2.py").read_bytes()
    )
    assert recorded, "server/pb/generate/v3/generate_pb2.py lacks the generate_stubs.py header"
    installed = version("grpcio-tools")
    assert recorded.group(1).decode() == installed, (
        f"server/pb was generated with grpcio-tools {recorded.group(1).decode()} but {installed} is "
        "installed; install that version or rerun python proto/generate_stubs.py and commit the result"
    )

    out = tmp_path / "pb"
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    fresh, committed = _tree(out), _tree(STUBS)
    assert sorted(fresh) == sorted(committed), "server/pb holds different files than proto/ generates"
    drifted = [name for name in fresh if fresh[name] != committed[name]]
    assert not drifted, f"stubs drifted from proto/ (rerun python proto/generate_stubs.py): {drifted}"
    for name, data in fresh.items():
        assert data.startswith(b"# Generated by proto/generate_stubs.py"), name


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_stubs", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_write_tree_removes_stale_generated_files_only(tmp_path: Path) -> None:
    script = _load_script()
    (tmp_path / "old" / "v1").mkdir(parents=True)
    stale = tmp_path / "old" / "v1" / "gone_pb2.py"
    stale.write_text(f"{script.HEADER_PREFIX} from proto/old/v1/gone.proto; do not edit.\n")
    mine = tmp_path / "notes.txt"
    mine.write_text("hand-written\n")
    script.write_tree({"__init__.py": b"x\n", "a/b_pb2.py": b"y\n"}, tmp_path)
    assert not stale.exists() and not (tmp_path / "old").exists()
    assert mine.read_text() == "hand-written\n"
    assert (tmp_path / "a" / "b_pb2.py").read_bytes() == b"y\n"


def test_generation_rejects_bad_package_name() -> None:
    script = _load_script()
    with pytest.raises(ValueError, match="--package"):
        script.render(package="text-generation.pb")


def test_generated_imports_point_into_the_package() -> None:
    # The grpc module must import its messages from inside text_generation_server.pb,
    # and message classes must name a module that exists (pickle relies on it).
    assert generate_pb2_grpc.generate_dot_v3_dot_generate__pb2 is generate_pb2
    assert generate_pb2.Request.__module__ == generate_pb2.__name__
    assert tg_pb2.GenerateRequest.__module__ == tg_pb2.__name__


# --- (b) the shard protocol matches the spec table --------------------------------------


def test_shard_messages_match_spec() -> None:
    expected, _ = _parse_spec(SHARD_MESSAGES)
    actual = {m.name: m for m in _file_proto(generate_pb2).message_type}
    assert _file_proto(generate_pb2).package == "generate.v3"
    assert set(actual) == set(expected) | set(SHARD_OWN_MESSAGES), "messages differ from the spec table"
    for name, fields in expected.items():
        want = fields | SHARD_EXTRAS.get(name, set())
        assert _actual_fields(actual[name]) == want, f"generate.v3.{name} differs from the spec"
    for name, fields in SHARD_OWN_MESSAGES.items():
        assert _actual_fields(actual[name]) == fields, f"generate.v3.{name} changed"


def test_shard_enums_match_spec() -> None:
    _, expected = _parse_spec(SHARD_MESSAGES)
    actual = {e.name: {v.name: v.number for v in e.value} for e in _file_proto(generate_pb2).enum_type}
    assert actual == expected


def test_logit_bias_is_a_string_to_int32_map() -> None:
    params = generate_pb2.NextTokenChooserParameters(logit_bias={"42": -100, "7": 5})
    decoded = generate_pb2.NextTokenChooserParameters.FromString(params.SerializeToString())
    assert dict(decoded.logit_bias) == {"42": -100, "7": 5}


def test_shard_optional_fields_have_presence() -> None:
    request = generate_pb2.Request(id=1)
    assert not request.HasField("adapter_id") and not request.HasField("chunk_len")
    request.chunk_len = 0
    decoded = generate_pb2.Request.FromString(request.SerializeToString())
    assert decoded.HasField("chunk_len") and decoded.chunk_len == 0
    assert not decoded.HasField("adapter_id")
    assert not generate_pb2.ClearCacheRequest().HasField("id")
    assert generate_pb2.ClearCacheRequest(id=0).HasField("id")


# --- (c) the client API round-trips and keeps "unset" apart from 0 ----------------------

PARAMETER_ZEROS = {
    "max_new_tokens": 0,
    "temperature": 0.0,
    "top_k": 0,
    "top_p": 0.0,
    "typical_p": 0.0,
    "repetition_penalty": 0.0,
    "frequency_penalty": 0.0,
    "do_sample": False,
    "seed": 0,
    "truncate": 0,
    "details": False,
    "decoder_input_details": False,
    "top_n_tokens": 0,
    "ignore_eos_token": False,
    "adapter_id": "",
}


def test_every_generate_parameter_scalar_is_optional() -> None:
    fields = tg_pb2.GenerateParameters.DESCRIPTOR.fields
    scalars = {f.name for f in fields if not f.is_repeated and f.message_type is None}
    assert scalars == set(PARAMETER_ZEROS)
    assert {f.name for f in fields if f.message_type is not None} == {"grammar"}  # messages have presence anyway
    assert [f.name for f in fields if f.is_repeated] == ["stop"]
    assert all(f.has_presence for f in fields if not f.is_repeated)


@pytest.mark.parametrize("name", sorted(PARAMETER_ZEROS))
def test_has_field_tells_unset_from_zero(name: str) -> None:
    unset = tg_pb2.GenerateParameters.FromString(tg_pb2.GenerateParameters().SerializeToString())
    assert not unset.HasField(name)
    zero = tg_pb2.GenerateParameters(**{name: PARAMETER_ZEROS[name]})
    decoded = tg_pb2.GenerateParameters.FromString(zero.SerializeToString())
    assert decoded.HasField(name)
    assert getattr(decoded, name) == PARAMETER_ZEROS[name]
    decoded.ClearField(name)
    assert not decoded.HasField(name)


def test_generate_request_round_trips() -> None:
    request = tg_pb2.GenerateRequest(
        inputs="What is Deep Learning?",
        parameters=tg_pb2.GenerateParameters(
            max_new_tokens=20, temperature=0.5, top_k=10, top_p=0.9, typical_p=0.95,
            repetition_penalty=1.2, frequency_penalty=0.1, do_sample=True, seed=2**64 - 1,
            stop=["\n\n", "###"], truncate=512, details=True, decoder_input_details=True,
            top_n_tokens=3,
        ),
    )
    decoded = tg_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert decoded == request
    assert decoded.parameters.seed == 2**64 - 1
    assert list(decoded.parameters.stop) == ["\n\n", "###"]


def _token(i: int, logprob: float = -0.5) -> tg_pb2.Token:
    return tg_pb2.Token(id=i, text=f"t{i}", logprob=logprob, special=i == 2)


def test_generate_response_round_trips_with_details() -> None:
    details = tg_pb2.Details(
        finish_reason=tg_pb2.FINISH_REASON_EOS_TOKEN,
        generated_tokens=2,
        seed=0,
        prefill=[tg_pb2.PrefillToken(id=1, text="<s>"), tg_pb2.PrefillToken(id=5, text="Hi", logprob=-1.5)],
        tokens=[_token(9), _token(2)],
        top_tokens=[tg_pb2.TopTokens(tokens=[_token(9), _token(8, -2.0)]), tg_pb2.TopTokens(tokens=[_token(2)])],
    )
    response = tg_pb2.GenerateResponse(generated_text="t9", details=details)
    decoded = tg_pb2.GenerateResponse.FromString(response.SerializeToString())
    assert decoded == response
    # The first prompt token has no logprob; a real logprob of 0.0 would still be set.
    assert not decoded.details.prefill[0].HasField("logprob")
    assert decoded.details.prefill[1].HasField("logprob")
    assert tg_pb2.PrefillToken(logprob=0.0).HasField("logprob")
    assert decoded.details.HasField("seed") and decoded.details.seed == 0
    assert not tg_pb2.Details().HasField("seed")
    assert not tg_pb2.GenerateResponse(generated_text="x").HasField("details")


def test_finish_reason_zero_is_unspecified() -> None:
    assert tg_pb2.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"
    assert {tg_pb2.FinishReason.Name(v) for v in (1, 2, 3)} == {
        "FINISH_REASON_LENGTH", "FINISH_REASON_EOS_TOKEN", "FINISH_REASON_STOP_SEQUENCE",
    }


def test_stream_response_final_fields_are_optional() -> None:
    middle = tg_pb2.GenerateStreamResponse(token=_token(4), top_tokens=[_token(4), _token(6)])
    decoded = tg_pb2.GenerateStreamResponse.FromString(middle.SerializeToString())
    assert not decoded.HasField("generated_text") and not decoded.HasField("details")
    last = tg_pb2.GenerateStreamResponse(token=_token(2), generated_text="", details=tg_pb2.Details())
    decoded = tg_pb2.GenerateStreamResponse.FromString(last.SerializeToString())
    assert decoded.HasField("generated_text") and decoded.generated_text == ""
    assert decoded.HasField("details")


def test_tokenize_and_info_messages() -> None:
    request = tg_pb2.TokenizeRequest(inputs="héllo", add_special_tokens=False)
    decoded = tg_pb2.TokenizeRequest.FromString(request.SerializeToString())
    assert decoded.HasField("add_special_tokens") and not decoded.add_special_tokens
    assert not tg_pb2.TokenizeRequest(inputs="x").HasField("add_special_tokens")
    tokens = tg_pb2.TokenizeResponse(tokens=[tg_pb2.SimpleToken(id=3, text="hé", start=0, stop=2)])
    assert tg_pb2.TokenizeResponse.FromString(tokens.SerializeToString()) == tokens

    info_fields = [f.name for f in tg_pb2.InfoResponse.DESCRIPTOR.fields]
    assert info_fields == [
        "model_id", "model_dtype", "model_device_type", "max_input_tokens", "max_total_tokens",
        "max_concurrent_requests", "max_stop_sequences", "max_batch_total_tokens",
        "max_batch_prefill_tokens", "num_shard", "quantize", "version", "block_size", "kernels",
        "attention_backend", "prefix_caching", "chunked_prefill", "model_impl", "adapters", "adapter_loading",
    ]
    info = tg_pb2.InfoResponse(model_id="m", kernels=["marlin", "torch_dense"], num_shard=2)
    assert tg_pb2.InfoResponse.FromString(info.SerializeToString()) == info


# --- (d) services have exactly the named methods ----------------------------------------


def test_shard_service_methods() -> None:
    assert [s.name for s in generate_pb2.DESCRIPTOR.services_by_name.values()] == ["TextGenerationService"]
    service = generate_pb2.DESCRIPTOR.services_by_name["TextGenerationService"]
    assert service.full_name == "generate.v3.TextGenerationService"
    methods = {m.name: m for m in service.methods}
    assert set(methods) == set(SHARD_RPCS) | set(SHARD_OWN_STREAMS) | set(SHARD_OWN_RPCS)
    for name, (request, response) in {**SHARD_RPCS, **SHARD_OWN_RPCS}.items():
        method = methods[name]
        assert (method.input_type.name, method.output_type.name) == (request, response), name
        assert not method.client_streaming and not method.server_streaming, name
    for name, (request, response) in SHARD_OWN_STREAMS.items():
        method = methods[name]
        assert (method.input_type.name, method.output_type.name) == (request, response), name
        assert method.client_streaming and method.server_streaming, name


def test_client_service_methods() -> None:
    assert list(tg_pb2.DESCRIPTOR.services_by_name) == ["TextGeneration"]
    service = tg_pb2.DESCRIPTOR.services_by_name["TextGeneration"]
    assert service.full_name == "text_generation.v1.TextGeneration"
    shapes = {
        m.name: (m.input_type.name, m.output_type.name, m.client_streaming, m.server_streaming)
        for m in service.methods
    }
    assert shapes == {
        "Generate": ("GenerateRequest", "GenerateResponse", False, False),
        "GenerateStream": ("GenerateRequest", "GenerateStreamResponse", False, True),
        "Tokenize": ("TokenizeRequest", "TokenizeResponse", False, False),
        "Info": ("InfoRequest", "InfoResponse", False, False),
        "Chat": ("ChatRequest", "GenerateResponse", False, False),
        "ChatStream": ("ChatRequest", "GenerateStreamResponse", False, True),
        "LoadAdapter": ("LoadAdapterRequest", "LoadAdapterResponse", False, False),
        "UnloadAdapter": ("UnloadAdapterRequest", "UnloadAdapterResponse", False, False),
        "ListAdapters": ("ListAdaptersRequest", "ListAdaptersResponse", False, False),
    }


class _EchoServicer(tg_pb2_grpc.TextGenerationServicer):
    """Answers from the request alone, to exercise the generated plumbing."""

    def Generate(self, request: tg_pb2.GenerateRequest, context: grpc.ServicerContext) -> tg_pb2.GenerateResponse:
        return tg_pb2.GenerateResponse(generated_text=request.inputs[::-1])

    def GenerateStream(
        self, request: tg_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[tg_pb2.GenerateStreamResponse]:
        for i, char in enumerate(request.inputs):
            last = i == len(request.inputs) - 1
            message = tg_pb2.GenerateStreamResponse(token=tg_pb2.Token(id=ord(char), text=char))
            if last:
                message.generated_text = request.inputs
            yield message


class _HealthyShard(generate_pb2_grpc.TextGenerationServiceServicer):
    def Health(self, request: generate_pb2.HealthRequest, context: grpc.ServicerContext) -> generate_pb2.HealthResponse:
        return generate_pb2.HealthResponse()


def test_stubs_serve_over_a_real_channel(tmp_path: Path) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    tg_pb2_grpc.add_TextGenerationServicer_to_server(_EchoServicer(), server)
    generate_pb2_grpc.add_TextGenerationServiceServicer_to_server(_HealthyShard(), server)
    address = f"unix://{tmp_path}/s.sock"
    server.add_insecure_port(address)
    server.start()
    try:
        with grpc.insecure_channel(address) as channel:
            client = tg_pb2_grpc.TextGenerationStub(channel)
            assert client.Generate(tg_pb2.GenerateRequest(inputs="abc"), timeout=10).generated_text == "cba"
            stream = list(client.GenerateStream(tg_pb2.GenerateRequest(inputs="abc"), timeout=10))
            assert [m.token.text for m in stream] == ["a", "b", "c"]
            assert [m.HasField("generated_text") for m in stream] == [False, False, True]
            with pytest.raises(grpc.RpcError) as err:
                client.Tokenize(tg_pb2.TokenizeRequest(inputs="x"), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
            shard = generate_pb2_grpc.TextGenerationServiceStub(channel)
            assert shard.Health(generate_pb2.HealthRequest(), timeout=10) == generate_pb2.HealthResponse()
    finally:
        server.stop(grace=None)
