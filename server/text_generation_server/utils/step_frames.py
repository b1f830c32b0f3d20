"""Length-prefixed protobuf frames over a unix socket: how our router and its ranks exchange steps.

Why not the gRPC `Steps` stream: at one stream and a small model, a rank's core spent ~0.4 ms of
each token inside gRPC's Python and C machinery (the event-engine threads' hops, HTTP/2 framing,
the servicer's async generator), more than a tenth of the token (BENCHMARKS.md, issue #31 session
9). Both ends are ours and on one machine, so the same StepCall/StepAnswer messages travel as
`<4-byte little-endian length><serialized message>` on a plain socket, read by an asyncio
Protocol on the event loop's own thread (uvloop's where installed): one socket read and one
write per call on each side, nothing else. A TGI router never sees this socket; it keeps the
unary calls on the gRPC socket.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Callable

_HEADER = struct.Struct("<I")
HEADER_BYTES = _HEADER.size
# The gRPC channels' own message limit (router/client.py, shard/service.py): a frame longer than
# this is a broken peer or a stray writer, not a step, and the connection is closed.
MAX_FRAME_BYTES = 256 * 2**20


class FrameError(ConnectionError):
    """The byte stream is not frames of ours (a length over the limit); the connection is dropped."""


def frame(payload: bytes) -> bytes:
    """`payload` with its length in front, ready for one transport write."""
    if len(payload) > MAX_FRAME_BYTES:
        raise FrameError(f"a step message of {len(payload)} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return _HEADER.pack(len(payload)) + payload


class FrameProtocol(asyncio.Protocol):
    """Cuts the byte stream into frames and hands each payload to `on_frame`, in order, on the
    loop's thread. `on_lost(exc)` runs once when the connection ends: exc is None for an orderly
    close by the peer, the error otherwise (a FrameError for bytes that are not frames)."""

    def __init__(self, on_frame: Callable[[bytes], None], on_lost: Callable[[BaseException | None], None]):
        self._on_frame = on_frame
        self._on_lost = on_lost
        self._buffer = bytearray()
        self._need = -1  # the current frame's payload length; -1 while its header is incomplete
        self.transport: asyncio.Transport | None = None
        self._lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        if not buffer and self._need < 0 and len(data) >= HEADER_BYTES:
            # The common case: whole frames in one read, nothing left over from the last one.
            (size,) = _HEADER.unpack_from(data)
            if len(data) == HEADER_BYTES + size and size <= MAX_FRAME_BYTES:
                self._on_frame(data[HEADER_BYTES:])
                return
        buffer += data
        while True:
            if self._need < 0:
                if len(buffer) < HEADER_BYTES:
                    return
                (self._need,) = _HEADER.unpack_from(buffer)
                del buffer[:HEADER_BYTES]
                if self._need > MAX_FRAME_BYTES:
                    self.fail(FrameError(f"a frame announces {self._need} bytes, over the {MAX_FRAME_BYTES}-byte "
                                          "limit: the peer does not speak step frames"))
                    return
            if len(buffer) < self._need:
                return
            payload = bytes(buffer[:self._need])
            del buffer[:self._need]
            self._need = -1
            self._on_frame(payload)
            if self._lost:
                return

    def fail(self, exc: BaseException) -> None:
        """Drops the connection for `exc` (bytes that are not ours, a payload that does not parse)."""
        self._buffer.clear()
        self._need = -1
        if self.transport is not None:
            self.transport.abort()  # connection_lost follows; ours is the error that counts
        self._report(exc)

    def _report(self, exc: BaseException | None) -> None:
        if not self._lost:
            self._lost = True
            self._on_lost(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._buffer or self._need >= 0:
            exc = exc or ConnectionError("the connection closed in the middle of a step message")
        self._report(exc)

    def send(self, payload: bytes) -> None:
        """Writes one frame; raises ConnectionError once the connection is closing or gone."""
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionError("the step socket is closed")
        transport.write(frame(payload))
