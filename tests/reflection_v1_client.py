"""A grpc.reflection.v1 client built from the protocol's field table, not from the server's code.

The server answers v1 with grpcio-reflection's v1alpha messages (the protocols are
wire-identical); a client whose messages come from the same place would prove nothing,
so the v1 messages here are declared from the published v1 layout (field numbers and
types of grpc/reflection/v1/reflection.proto), in a private descriptor pool.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

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
