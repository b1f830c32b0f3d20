"""A grpc.reflection.v1 client built from the protocol's field table, not from the server's code.

The server answers v1 with grpcio-reflection's v1alpha messages (the protocols are
wire-identical); a client whose messages come from the same place would prove nothing,
so the v1 messages here are declared from the published v1 layout (field numbers and
types of grpc/reflection/v1/reflection.proto), in a private descriptor pool.
"""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.router.health import HEALTH_SERVICE_NAME
from text_generation_server.router.reflection import V1_FILE, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME

SERVICE_NAME = cpb.DESCRIPTOR.services_by_name["TextGeneration"].full_name

PACKAGE = "grpc.reflection.v1"
SERVICE = f"{PACKAGE}.ServerReflection"
METHOD = f"/{SERVICE}/ServerReflectionInfo"

_F = descriptor_pb2.FieldDescriptorProto
# message -> [(field, number, type, message type or None, repeated, in the oneof)]
V1_LAYOUT: dict[str, list[tuple[str, int, int, str | None, bool, bool]]] = {
    "ServerReflectionRequest": [
        ("host", 1, _F.TYPE_STRING, None, False, False),
        ("file_by_filename", 3, _F.TYPE_STRING, None, False, True),
        ("file_containing_symbol", 4, _F.TYPE_STRING, None, False, True),
        ("file_containing_extension", 5, _F.TYPE_MESSAGE, "ExtensionRequest", False, True),
        ("all_extension_numbers_of_type", 6, _F.TYPE_STRING, None, False, True),
        ("list_services", 7, _F.TYPE_STRING, None, False, True),
    ],
    "ExtensionRequest": [
        ("containing_type", 1, _F.TYPE_STRING, None, False, False),
        ("extension_number", 2, _F.TYPE_INT32, None, False, False),
    ],
    "ServerReflectionResponse": [
        ("valid_host", 1, _F.TYPE_STRING, None, False, False),
        ("original_request", 2, _F.TYPE_MESSAGE, "ServerReflectionRequest", False, False),
        ("file_descriptor_response", 4, _F.TYPE_MESSAGE, "FileDescriptorResponse", False, True),
        ("all_extension_numbers_response", 5, _F.TYPE_MESSAGE, "ExtensionNumberResponse", False, True),
        ("list_services_response", 6, _F.TYPE_MESSAGE, "ListServiceResponse", False, True),
        ("error_response", 7, _F.TYPE_MESSAGE, "ErrorResponse", False, True),
    ],
    "FileDescriptorResponse": [("file_descriptor_proto", 1, _F.TYPE_BYTES, None, True, False)],
    "ExtensionNumberResponse": [
        ("base_type_name", 1, _F.TYPE_STRING, None, False, False),
        ("extension_number", 2, _F.TYPE_INT32, None, True, False),
    ],
    "ListServiceResponse": [("service", 1, _F.TYPE_MESSAGE, "ServiceResponse", True, False)],
    "ServiceResponse": [("name", 1, _F.TYPE_STRING, None, False, False)],
    "ErrorResponse": [
        ("error_code", 1, _F.TYPE_INT32, None, False, False),
        ("error_message", 2, _F.TYPE_STRING, None, False, False),
    ],
}
_ONEOF = {"ServerReflectionRequest": "message_request", "ServerReflectionResponse": "message_response"}


def layout_of(file: descriptor_pb2.FileDescriptorProto) -> dict[str, list[tuple]]:
    """A served file's messages in V1_LAYOUT's form, to compare with it."""
    out = {}
    for m in file.message_type:
        out[m.name] = [
            (f.name, f.number, f.type, f.type_name.rsplit(".", 1)[-1] if f.type_name else None,
             f.label == _F.LABEL_REPEATED, f.HasField("oneof_index"))
            for f in m.field
        ]
    return out


def _file() -> descriptor_pb2.FileDescriptorProto:
    file = descriptor_pb2.FileDescriptorProto(name="test/reflection_v1.proto", package=PACKAGE, syntax="proto3")
    for name, fields in V1_LAYOUT.items():
        message = file.message_type.add(name=name)
        if name in _ONEOF:
            message.oneof_decl.add(name=_ONEOF[name])
        for field, number, typ, type_name, repeated, in_oneof in fields:
            f = message.field.add(name=field, number=number, type=typ,
                                  label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
            if type_name:
                f.type_name = f".{PACKAGE}.{type_name}"
            if in_oneof:
                f.oneof_index = 0
    return file


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())
Request = message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.ServerReflectionRequest"))
Response = message_factory.GetMessageClass(_POOL.FindMessageTypeByName(f"{PACKAGE}.ServerReflectionResponse"))


def ask(channel, requests: list) -> list:
    """One ServerReflectionInfo stream over a sync grpc channel: the answers, in order."""
    call = channel.stream_stream(METHOD, request_serializer=Request.SerializeToString,
                                 response_deserializer=Response.FromString)
    return list(call(iter(requests), timeout=10))


def files_of(response) -> list[descriptor_pb2.FileDescriptorProto]:
    return [descriptor_pb2.FileDescriptorProto.FromString(raw)
            for raw in response.file_descriptor_response.file_descriptor_proto]


ALL_SERVICES = sorted([SERVICE_NAME, HEALTH_SERVICE_NAME, V1ALPHA_SERVICE_NAME, V1_SERVICE_NAME])


def check_reflection(channel: grpc.Channel) -> None:
    """Both protocols: list services, file containing a symbol, file by name, unknown names."""
    answers = ask(channel, [
        Request(list_services=""),
        Request(file_containing_symbol=SERVICE_NAME),
        Request(file_by_filename=cpb.DESCRIPTOR.name),
        Request(file_containing_symbol=V1_SERVICE_NAME),
        Request(file_containing_symbol="no.such.Symbol"),
        Request(file_containing_symbol=f"{SERVICE_NAME}.NoSuchMethod"),
    ])
    listed, by_symbol, by_name, own, missing, no_method = answers
    assert sorted(s.name for s in listed.list_services_response.service) == ALL_SERVICES
    assert listed.original_request.HasField("list_services")
    for answer in (by_symbol, by_name):
        files = files_of(answer)
        assert [f.name for f in files] == [cpb.DESCRIPTOR.name]
        methods = {m.name for s in files[0].service for m in s.method}
        assert methods == {"Generate", "GenerateStream", "Tokenize", "Info", "Chat", "ChatStream", "LoadAdapter",
                           "UnloadAdapter", "ListAdapters"}
    assert by_symbol.original_request.file_containing_symbol == SERVICE_NAME
    # The v1 service describes itself with the published v1 layout.
    [v1_file] = files_of(own)
    assert (v1_file.name, v1_file.package) == (V1_FILE, "grpc.reflection.v1")
    assert layout_of(v1_file) == V1_LAYOUT
    pool = descriptor_pool.DescriptorPool()
    pool.Add(v1_file)  # a well-formed file: every type it names resolves
    method = pool.FindServiceByName(V1_SERVICE_NAME).methods_by_name["ServerReflectionInfo"]
    assert method.input_type.full_name == "grpc.reflection.v1.ServerReflectionRequest"
    for answer in (missing, no_method):
        assert answer.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    listed, by_symbol, by_name = list(stub.ServerReflectionInfo(iter([
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=f"{SERVICE_NAME}.Generate"),
        reflection_pb2.ServerReflectionRequest(file_by_filename="grpc_health/v1/health.proto"),
    ]), timeout=10))
    assert sorted(s.name for s in listed.list_services_response.service) == ALL_SERVICES
    files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
             for raw in by_symbol.file_descriptor_response.file_descriptor_proto]
    assert files[0].name == cpb.DESCRIPTOR.name
    [health_file] = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                     for raw in by_name.file_descriptor_response.file_descriptor_proto]
    assert {m.name for m in health_file.service[0].method} == {"Check", "List", "Watch"}
