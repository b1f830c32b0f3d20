"""HTTP streaming (OpenAI's /v1/completions, server-sent events) against gRPC streaming
(GenerateStream), side by side in one run, on one `serve --http-port` (issue #35).

The issue's target: inter-token time over HTTP within 1.1x of gRPC's, at concurrency 1 and 32.
Both doors run the same core and scheduler, so what differs is the transport: Starlette and
uvicorn framing each step as an SSE event versus grpc.aio writing a message. At each concurrency C,
rounds alternate (gRPC, HTTP, gRPC, HTTP, ...) so the machine's drift hits both; each round
sends C concurrent requests of --new-tokens tokens (EOS ignored: ignore_eos_token / vLLM's
ignore_eos) and stamps every streamed token on arrival. Reported per door: the median over
requests of the mean inter-token time (first to last token), time to first token, and the
ratio HTTP / gRPC; and the server's CPU time per token on each door (steadier than wall time on a
busy machine). The HTTP client is a bare asyncio socket reading SSE lines, as light as the
gRPC client, so the ratio measures the server side.

    python benchmarks/http_vs_grpc.py --model tiny-pycoder --new-tokens 64 --concurrency 1,32 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import sys
import time

import grpc

from text_generation_server.about import EMBEDDED_MODEL_ID
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc

# benchmarks/ is on sys.path when a script there runs: its siblings import by name.
from bench_common import (  # noqa: E402
    StartedServer, StreamedReply, command_line, free_port, load_line, machine_line, md_table, now_iso, parse_ints,
    ratio, stream_generate,
)
from prompts import CODE_PROMPTS  # noqa: E402


async def http_stream(port: int, body: dict) -> StreamedReply:
    """POST /v1/completions with stream true over a fresh connection, stamping each chunk that
    carries text (one per step) on arrival."""
    data = json.dumps(body).encode()
    reply = StreamedReply(sent=time.perf_counter())
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                     b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        status = await reader.readline()
        if b" 200 " not in status:
            reply.error = status.decode(errors="replace").strip()
            return reply
        while (line := await reader.readline()) not in (b"\r\n", b""):
            pass  # headers
        while line := await reader.readline():
            if not line.startswith(b"data: "):
                continue  # chunked-encoding sizes and the events' blank lines
            payload = line[6:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                reply.error = chunk["error"]["message"]
                break
            if chunk["choices"] and chunk["choices"][0]["text"]:
                reply.stamps.append(time.perf_counter())
                reply.text += chunk["choices"][0]["text"]
    finally:
        writer.close()
    return reply


def _itl(reply: StreamedReply) -> float | None:
    if reply.error is not None or reply.tokens < 2:
        return None
    return (reply.stamps[-1] - reply.stamps[0]) / (reply.tokens - 1)


async def one_round(door: str, server: StartedServer, http_port: int, concurrency: int, new_tokens: int,
                    stub: cpb_grpc.TextGenerationStub) -> list[StreamedReply]:
    prompts = [CODE_PROMPTS[i % len(CODE_PROMPTS)] for i in range(concurrency)]
    if door == "gRPC":
        calls = [stream_generate(stub, cpb.GenerateRequest(inputs=p, parameters=cpb.GenerateParameters(
            max_new_tokens=new_tokens, ignore_eos_token=True))) for p in prompts]
    else:
        calls = [http_stream(http_port, {"prompt": p, "max_tokens": new_tokens, "ignore_eos": True, "stream": True})
                 for p in prompts]
    return list(await asyncio.gather(*calls))


async def amain(args: argparse.Namespace) -> int:
    http_port = free_port()
    extra = ["--http-port", str(http_port), *shlex.split(args.server_args)]
    load_start = os.getloadavg()[0]
    with StartedServer(args.model, extra) as server:
        await server.wait_ready()
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = cpb_grpc.TextGenerationStub(channel)
            await one_round("gRPC", server, http_port, 2, 4, stub)  # warm both doors (connections, caches)
            await one_round("HTTP", server, http_port, 2, 4, stub)
            rows = []
            for concurrency in args.concurrency:
                itl: dict[str, list[float]] = {"gRPC": [], "HTTP": []}
                ttft: dict[str, list[float]] = {"gRPC": [], "HTTP": []}
                cpu = {"gRPC": 0.0, "HTTP": 0.0}  # the server's CPU seconds (router and ranks)
                tokens = {"gRPC": 0, "HTTP": 0}
                errors: list[str] = []
                for _ in range(args.rounds):
                    for door in ("gRPC", "HTTP"):
                        cpu_before = server.cpu_s()
                        replies = await one_round(door, server, http_port, concurrency, args.new_tokens, stub)
                        cpu[door] += server.cpu_s() - cpu_before
                        tokens[door] += sum(r.tokens for r in replies)
                        for reply in replies:
                            if reply.error is not None:
                                errors.append(f"{door}: {reply.error}")
                            elif (value := _itl(reply)) is not None:
                                itl[door].append(value)
                                ttft[door].append(reply.ttft)
                if errors:
                    print(f"http_vs_grpc: {len(errors)} request(s) failed, e.g. {errors[0]}", file=sys.stderr)
                    return 1
                med = {d: statistics.median(v) * 1e3 for d, v in itl.items()}
                first = {d: statistics.median(v) * 1e3 for d, v in ttft.items()}
                per_token = {d: cpu[d] / max(tokens[d], 1) * 1e3 for d in cpu}
                rows.append([concurrency, len(itl["gRPC"]), f"{med['gRPC']:.2f}", f"{med['HTTP']:.2f}",
                             ratio(med["HTTP"], med["gRPC"]), f"{first['gRPC']:.1f}", f"{first['HTTP']:.1f}",
                             ratio(first["HTTP"], first["gRPC"]), f"{per_token['gRPC']:.2f}", f"{per_token['HTTP']:.2f}",
                             ratio(per_token["HTTP"], per_token["gRPC"])])
    lines = [
        f"# HTTP (OpenAI SSE) vs gRPC streaming, {now_iso()}",
        "",
        f"`{command_line(script='benchmarks/http_vs_grpc.py', argv=[sys.argv[0], *args.argv])}`",
        "",
        f"model {args.model}, {args.new_tokens} tokens per request (EOS ignored), {args.rounds} rounds per door "
        "alternating; ITL = median over requests of (last - first token) / (tokens - 1)",
        "",
        *md_table(["concurrency", "requests/door", "gRPC ITL ms", "HTTP ITL ms", "HTTP/gRPC ITL", "gRPC TTFT ms",
                   "HTTP TTFT ms", "HTTP/gRPC TTFT", "gRPC server CPU ms/token", "HTTP server CPU ms/token",
                   "HTTP/gRPC CPU"], rows, align="rrrrrrrrrrr"),
        "",
        "Server CPU = user + system seconds of the whole `serve` session (router and ranks) over the door's rounds, "
        "per streamed token: unlike wall time, barely moved by other jobs on a shared machine.",
        "",
        machine_line(),
        load_line(start=load_start),
    ]
    print("\n".join(lines))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=EMBEDDED_MODEL_ID, help="checkpoint folder (default: the embedded model)")
    parser.add_argument("--server-args", default="", help="more `serve` flags, one string")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=lambda t: parse_ints(t, "--concurrency"), default=[1, 32])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
