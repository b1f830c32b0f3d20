"""The step socket: a rank's state-changing calls from our router as frames on a unix socket.

The same StepCall/StepAnswer messages and the same handler as the gRPC `Steps` stream
(`TextGenerationService.step`), without gRPC: length-prefixed frames (utils/step_frames.py) read
on the rank's event loop. Calls on one connection run one at a time, in order, as on the stream;
each gets its answer (its failure as a StepError) and the connection goes on. Bytes that are not
frames of ours drop that connection alone (logged); the rank keeps serving its other connections
and the gRPC socket. The socket sits beside the rank's gRPC socket (`<uds>-<rank>.steps`), owner
only like it, and the rank names it in Info's trailing metadata (`tgs-steps-socket`), so only a
router that read Info uses it.
"""

from __future__ import annotations

import asyncio
import os
from typing import Protocol

from loguru import logger

from text_generation_server.pb.generate.v3 import generate_pb2 as pb
from text_generation_server.utils.step_frames import FrameError, FrameProtocol

STEP_SOCKET_SUFFIX = ".steps"


class StepService(Protocol):
    """What the socket needs of the shard service (shard/service.py imports this module)."""

    step_socket: str | None

    async def step(self, call: pb.StepCall) -> pb.StepAnswer: ...


class _Connection:
    """One router connection: frames in, calls run in arrival order, answers out."""

    def __init__(self, service: StepService):
        self.service = service
        self.protocol = FrameProtocol(self._on_frame, self._on_lost)
        self._calls: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._serve(), name="step-socket connection")

    def _on_frame(self, payload: bytes) -> None:
        self._calls.put_nowait(payload)

    def _on_lost(self, exc: BaseException | None) -> None:
        if isinstance(exc, FrameError):
            logger.error("step socket: dropped a connection: {}", exc)
        self._calls.put_nowait(None)

    async def _serve(self) -> None:
        while True:
            payload = await self._calls.get()
            if payload is None:
                return  # (a call running when the peer left finishes on the model thread; its answer has nowhere to go)
            try:
                call = pb.StepCall.FromString(payload)
            except Exception as exc:  # noqa: BLE001: a payload that is no StepCall; the seq is unknown
                self.protocol.fail(FrameError(f"a frame of {len(payload)} bytes is not a StepCall ({exc})"))
                return
            answer = await self.service.step(call)
            try:
                self.protocol.send(answer.SerializeToString())
            except ConnectionError:
                return  # the router went away; a new connection starts afresh


async def serve_step_socket(service: StepService, path: str) -> asyncio.AbstractServer:
    """Listens on `path` (owner-only, replacing a stale socket file) and tells `service`, whose
    Info then names it."""
    if os.path.exists(path):
        os.unlink(path)
    loop = asyncio.get_running_loop()
    old_umask = os.umask(0o077)  # the socket exists from bind on: no moment where others may connect
    try:
        server = await loop.create_unix_server(lambda: _Connection(service).protocol, path)
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    service.step_socket = path
    return server
