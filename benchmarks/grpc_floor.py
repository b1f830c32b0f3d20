"""The streaming floor of the client API on this machine: a server that does nothing but stream.

`benchmarks/host_overhead.py` starts it beside `serve` and runs the same clients against it, so
every run says what one token per stream costs when the server adds no work of its own: no model,
no scheduler, no metrics, no detokenizer. It implements the client API's GenerateStream with the
router's own stack (grpc.aio on the event loop `serve` uses, one asyncio queue per request) and
its shape of work: a central loop hands every open stream its next token, then waits until every
stream has handed that token to gRPC before the next step, as the router's scheduler hands a
step's Generations to the request streams. Each message is the router's (a Token with id, text and
logprob; the last one with the generated text).

At a batch of B streams the floor is B messages a step through gRPC on the server and B message
reads in the clients, which share this machine's cores with it. Where the floor is above a
target, no server on this stack and these clients can meet the target on this machine; what a
server adds above the floor is its own.

    python benchmarks/grpc_floor.py --port 50070      # prints "serving gRPC on <target>" when ready
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc

from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc
from text_generation_server.utils import event_loop

READY_LINE = "serving gRPC on"
# How long a step waits for its streams at most: a client that went away mid-step leaves its stream
# blocked in gRPC's flow control, and the other streams go on.
STEP_TIMEOUT_S = 0.5
# The tokens a stream carries (any ids: the floor's clients do not check them against a model).
TOKEN_TEXT = "ab"
TOKEN_LOGPROB = -0.25


class Pacer:
    """The central loop: one step hands each open stream one token and waits for all of them."""

    def __init__(self) -> None:
        self.streams: set[asyncio.Queue[int]] = set()
        self.pending = 0
        self.step_done = asyncio.Event()
        self.opened = asyncio.Event()
        self.steps = 0

    def add(self, queue: asyncio.Queue[int]) -> None:
        self.streams.add(queue)
        self.opened.set()

    def remove(self, queue: asyncio.Queue[int]) -> None:
        self.streams.discard(queue)
        if queue.qsize():  # its token of this step will never be sent
            self.sent()

    def sent(self) -> None:
        self.pending -= 1
        if self.pending <= 0:
            self.step_done.set()

    async def run(self) -> None:
        while True:
            if not self.streams:
                self.opened.clear()
                await self.opened.wait()
            self.step_done.clear()
            self.pending = len(self.streams)
            for queue in self.streams:
                queue.put_nowait(self.steps % 1000)
            self.steps += 1
            try:
                await asyncio.wait_for(self.step_done.wait(), STEP_TIMEOUT_S)
            except asyncio.TimeoutError:
                pass


class FloorService(cpb_grpc.TextGenerationServicer):
    def __init__(self, pacer: Pacer) -> None:
        self.pacer = pacer

    async def GenerateStream(self, request, context):
        n = request.parameters.max_new_tokens if request.parameters.HasField("max_new_tokens") else 20
        queue: asyncio.Queue[int] = asyncio.Queue()
        self.pacer.add(queue)
        try:
            for i in range(n):
                token = await queue.get()
                msg = cpb.GenerateStreamResponse(token=cpb.Token(id=token, text=TOKEN_TEXT, logprob=TOKEN_LOGPROB))
                if i == n - 1:
                    msg.generated_text = TOKEN_TEXT * n
                yield msg
                self.pacer.sent()
        finally:
            self.pacer.remove(queue)


async def serve(host: str, port: int) -> None:
    pacer = Pacer()
    server = grpc.aio.server()
    cpb_grpc.add_TextGenerationServicer_to_server(FloorService(pacer), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    ticker = asyncio.get_running_loop().create_task(pacer.run())
    sys.stdout.write(f"{READY_LINE} {host}:{bound}\n")
    sys.stdout.flush()
    try:
        await server.wait_for_termination()
    finally:
        ticker.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (the ready line names it)")
    args = parser.parse_args(argv)
    if not 0 <= args.port < 65536:
        parser.error(f"--port must be 0..65535, got {args.port}")
    try:
        event_loop.run(serve(args.host, args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
