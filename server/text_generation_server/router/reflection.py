"""gRPC server reflection under both protocol names: grpc.reflection.v1 and v1alpha.

grpcio-reflection only serves `grpc.reflection.v1alpha.ServerReflection`; grpcurl
(newer releases), `buf curl --reflect-protocol grpc-v1` and grpc-js-reflection-client's
"v1" speak `grpc.reflection.v1.ServerReflection` and fail against it. The v1 protocol is
v1alpha renamed: same messages, same field numbers, so one servicer answers both, and a
v1 client's bytes parse as v1alpha messages. So that a v1 client can also describe the v1
service itself, its file (grpc/reflection/v1/reflection.proto) is built from v1alpha's
descriptor under the v1 package and kept in a private pool; the default pool (where every
stub this process imported registered its files) is searched first.
"""

from __future__ import annotations

from typing import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection as v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from grpc_reflection.v1alpha import reflection_pb2_grpc as rpb_grpc

V1ALPHA_SERVICE_NAME = v1alpha.SERVICE_NAME
V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1_FILE = "grpc/reflection/v1/reflection.proto"


def _rename_types(message: descriptor_pb2.DescriptorProto, old: str, new: str) -> None:
    for f in message.field:
        if f.type_name.startswith(old):
            f.type_name = new + f.type_name[len(old):]
    for nested in message.nested_type:
        _rename_types(nested, old, new)


def v1_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto: v1alpha's messages and service under package grpc.reflection.v1."""
    proto = descriptor_pb2.FileDescriptorProto()
    rpb.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{rpb.DESCRIPTOR.package}.", f".{V1_PACKAGE}."
    proto.name = V1_FILE
    proto.package = V1_PACKAGE
    proto.ClearField("options")  # language options name v1alpha's packages
    for message in proto.message_type:
        _rename_types(message, old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old):]
            method.output_type = new + method.output_type[len(old):]
    return proto


class ChainedPool:
    """The lookups the reflection servicer makes, tried on each pool in turn."""

    def __init__(self, *pools: descriptor_pool.DescriptorPool):
        self._pools = pools

    def _first(self, method: str, name: str):
        for pool in self._pools:
            try:
                return getattr(pool, method)(name)
            except KeyError:
                continue
        raise KeyError(name)

    def FindFileByName(self, name: str):  # noqa: N802 (DescriptorPool's interface)
        return self._first("FindFileByName", name)

    def FindFileContainingSymbol(self, name: str):  # noqa: N802
        try:
            return self._first("FindFileContainingSymbol", name)
        except KeyError:
            pass
        # "<package>.<service>.<method>" is a valid symbol in the protocol; the pools only know
        # services and types, so a method resolves through its service.
        service_name, _, method = name.rpartition(".")
        try:
            service = self._first("FindServiceByName", service_name)
        except KeyError:
            raise KeyError(name) from None
        if method not in service.methods_by_name:
            raise KeyError(name)
        return service.file

    def FindMessageTypeByName(self, name: str):  # noqa: N802
        return self._first("FindMessageTypeByName", name)

    def FindExtensionByNumber(self, message_descriptor, number: int):  # noqa: N802
        return message_descriptor.file.pool.FindExtensionByNumber(message_descriptor, number)

    def FindAllExtensions(self, message_descriptor):  # noqa: N802
        return message_descriptor.file.pool.FindAllExtensions(message_descriptor)


_V1_POOL = descriptor_pool.DescriptorPool()
_V1_POOL.Add(v1_file_descriptor())
POOL = ChainedPool(descriptor_pool.Default(), _V1_POOL)


def enable_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> list[str]:
    """Serves reflection (v1 and v1alpha) listing service_names plus both reflection services."""
    names = sorted({*service_names, V1ALPHA_SERVICE_NAME, V1_SERVICE_NAME})
    servicer = v1alpha.aio.ReflectionServicer(names, pool=POOL)
    rpb_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    handlers = {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=rpb.ServerReflectionRequest.FromString,
            response_serializer=rpb.ServerReflectionResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE_NAME, handlers),))
    if hasattr(server, "add_registered_method_handlers"):  # grpcio >= 1.63: the fast path generated stubs use
        server.add_registered_method_handlers(V1_SERVICE_NAME, handlers)
    return names
