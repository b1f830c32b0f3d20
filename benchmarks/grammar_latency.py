"""What a JSON grammar costs a decode step: inter-token latency with and without one, through `serve`.

One server runs the model; batches of B concurrent GenerateStream requests (B = 1 and 16 by
default) decode a fixed number of tokens (ignore_eos_token, and a schema whose documents are
longer than the run, so a constrained stream never ends early), first unconstrained, then with
the JSON schema, alternating round by round so load from other jobs falls on both alike. The
inter-token latency of a stream is the mean gap between its tokens after the first; a row
reports the median over streams and rounds, and the grammar / none ratio (target <= 1.15x).

A second table times the grammar machinery itself on the model's vocabulary, in this process:
compiling the schema (cold, and a cache hit), filling one row's mask, and applying the masks of
B rows to the logits.

    python benchmarks/grammar_latency.py
    python benchmarks/grammar_latency.py --model /models/Llama-3.1-8B --batches 1,16,64 --tokens 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from concurrent.futures import Future

from bench_common import (  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
    StartedServer, command_line, load_line, machine_line, md_table, now_iso, parse_ints, stream_generate,
)

# Documents of this schema are longer than any run here (40 items at least), and each item
# switches the grammar between keys, bounded strings, an enum and a boolean.
SCHEMA = {
    "type": "array",
    "minItems": 40,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 16},
            "kind": {"enum": ["function", "class", "module", "constant"]},
            "public": {"type": "boolean"},
        },
        "required": ["name", "kind", "public"],
        "additionalProperties": False,
    },
}
PROMPTS = ["def parse(", "import os\n", "class Stack:", "# Configuration\n", "x = ", "The quick brown fox",
           "def main():\n    args =", "for i in range("]
TARGET = 1.15


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-pycoder", help="model folder or the embedded model's id")
    parser.add_argument("--batches", default="1,16", help="concurrent streams per run, comma-separated")
    parser.add_argument("--tokens", type=int, default=48, help="tokens each stream decodes")
    parser.add_argument("--rounds", type=int, default=4, help="alternating rounds per batch size and mode")
    parser.add_argument("--serve-args", default="", help="extra `serve` flags, space-separated")
    return parser.parse_args()


async def one_run(stub, batch: int, tokens: int, grammar: bool) -> list[float]:
    """Inter-token latencies (s) of `batch` concurrent streams."""
    from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb

    requests = []
    for i in range(batch):
        params = cpb.GenerateParameters(max_new_tokens=tokens, ignore_eos_token=True)
        if grammar:
            params.grammar.CopyFrom(cpb.Grammar(type=cpb.GRAMMAR_TYPE_JSON, value=json.dumps(SCHEMA)))
        requests.append(cpb.GenerateRequest(inputs=PROMPTS[i % len(PROMPTS)], parameters=params))
    replies = await asyncio.gather(*(stream_generate(stub, r) for r in requests))
    itls = []
    for reply in replies:
        if reply.error is not None:
            raise RuntimeError(f"a {'constrained' if grammar else 'plain'} stream failed: {reply.error}")
        if reply.tokens != tokens:
            raise RuntimeError(f"a stream gave {reply.tokens} tokens, {tokens} were asked for")
        head = '[{"name":"'
        if grammar and not (reply.text.startswith(head) or head.startswith(reply.text)):
            raise RuntimeError(f"a constrained stream is not the schema's document: {reply.text[:40]!r}")
        itls.append((reply.stamps[-1] - reply.stamps[0]) / (reply.tokens - 1))
    return itls


async def serve_part(args: argparse.Namespace, batches: list[int]) -> list[list[str]]:
    import grpc

    from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc

    extra = ["--max-batch-size", str(max(batches)), *args.serve_args.split()]
    rows = []
    with StartedServer(args.model, extra) as server:
        await server.wait_ready()
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = cpb_grpc.TextGenerationStub(channel)
            await one_run(stub, 1, 4, True)  # compiles the schema, warms both paths
            await one_run(stub, 1, 4, False)
            for batch in batches:
                got: dict[bool, list[float]] = {False: [], True: []}
                for _ in range(args.rounds):
                    for grammar in (False, True):
                        got[grammar] += await one_run(stub, batch, args.tokens, grammar)
                plain, constrained = statistics.median(got[False]), statistics.median(got[True])
                verdict = "ok" if constrained / plain <= TARGET else "MISSED"
                rows.append([str(batch), f"{plain * 1e3:.1f}", f"{constrained * 1e3:.1f}",
                             f"{constrained / plain:.2f}x", f"<= {TARGET:.2f}x {verdict}"])
    return rows


def machinery_part(model: str, batches: list[int]) -> list[list[str]]:
    """The grammar pieces alone, on the model's vocabulary (medians of repeated calls)."""
    import torch

    from text_generation_server.generation.grammar import (
        GrammarCompiler, GrammarSpec, GrammarType, PendingMasks, apply_masks,
    )
    from text_generation_server.utils.locate import open_checkpoint

    torch.set_num_threads(1)  # as a rank of a small model runs (and a busy machine does not stall it)
    checkpoint = open_checkpoint(model)
    started = time.perf_counter()
    compiler = GrammarCompiler.for_tokenizer(checkpoint.tokenizer, checkpoint.eos_token_ids, mask_threads=1)
    tokenizer_ms = (time.perf_counter() - started) * 1e3
    spec = GrammarSpec(GrammarType.JSON, json.dumps(SCHEMA))
    started = time.perf_counter()
    matcher = compiler.matcher(spec)
    cold_ms = (time.perf_counter() - started) * 1e3
    started = time.perf_counter()
    for _ in range(100):
        compiler.matcher(spec)
    hit_us = (time.perf_counter() - started) / 100 * 1e6
    # One row's mask along a real document, token by token.
    document = json.dumps([{"name": f"item{i}", "kind": "class", "public": i % 2 == 0} for i in range(6)],
                          separators=(",", ":"))[:-1]  # open: the schema wants 40 items
    fills = []
    row = torch.empty(1, compiler.words, dtype=torch.int32)
    for token in checkpoint.tokenizer.encode(document, add_special_tokens=False).ids:
        started = time.perf_counter()
        matcher.fill_mask(row[0])
        fills.append(time.perf_counter() - started)
        matcher.accept(token)
    vocab = checkpoint.tokenizer.get_vocab_size(with_added_tokens=True)
    rows = [["load the vocabulary (once per tokenizer)", f"{tokenizer_ms:.1f} ms"],
            ["compile the schema (cold)", f"{cold_ms:.2f} ms"],
            ["compile the schema (cache hit: a matcher copy)", f"{hit_us:.1f} us"],
            [f"fill one row's mask (median / max over {len(fills)} tokens)",
             f"{statistics.median(fills) * 1e6:.0f} / {max(fills) * 1e6:.0f} us"]]
    for batch in batches:
        scores = torch.randn(batch, vocab)
        filled: Future = Future()
        filled.set_result(None)
        masks = PendingMasks(list(range(batch)), torch.full((batch, compiler.words), -1, dtype=torch.int32), filled)
        times = []
        for _ in range(50):
            started = time.perf_counter()
            apply_masks(scores, masks)
            times.append(time.perf_counter() - started)
        rows.append([f"apply the masks of {batch} rows to [{batch}, {vocab}] logits (CPU)",
                     f"{statistics.median(times) * 1e6:.0f} us"])
    compiler.close()
    return rows


def main() -> int:
    args = parse_args()
    batches = parse_ints(args.batches, "--batches")
    load_start = os.getloadavg()[0]
    try:
        serve_rows = asyncio.run(serve_part(args, batches))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    machinery = machinery_part(args.model, batches)
    print(f"# grammar latency ({now_iso()})\n")
    print(f"`{command_line()}`\n")
    print(machine_line(f"model {args.model}"))
    print(load_line(os.getloadavg()[0], load_start) + "\n")
    print(f"Inter-token latency, {args.tokens} tokens per stream, median over streams x {args.rounds} rounds:\n")
    print("\n".join(md_table(["batch", "none (ms)", "JSON grammar (ms)", "ratio", "target"], serve_rows, "rrrrl")))
    print("\nThe grammar machinery on this vocabulary (llguidance, one thread):\n")
    print("\n".join(md_table(["step", "time"], machinery, "lr")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
