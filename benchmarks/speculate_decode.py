"""N-gram speculation (`--speculate N`) against plain decoding, on code continuation, in process.

The embedded model (a small code model trained on the standard library) continues windows of
held-out standard-library sources (files it never saw in training), greedy, a fixed number of
tokens each (EOS ignored, so both sides do the same work). The same requests run with
speculate 0 and speculate N, alternating round by round so load from other work on the
machine hits both alike; the tokens of both must be identical (checked: a mismatch exits
non-zero). Reported per batch size (1: one request at a time; 8: eight decoding together):

- tokens per step: generated tokens / Generations a request received (decode steps only, so
  1.00 without speculation; a step that accepts k proposed tokens gives k + 1);
- acceptance: accepted / proposed tokens;
- decode throughput: generated tokens per second over the decode steps (prefill excluded),
  the median of the rounds, and the ratio speculate N / speculate 0.

Run: python benchmarks/speculate_decode.py [--speculate 2] [--batch-sizes 1,8] [--new-tokens 128]
     [--prompt-tokens 256] [--rounds 3] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from bench_common import (  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
    command_line, load_averages, load_line, machine_line, md_table, now_iso, parse_ints, ratio,
)


@dataclass
class Measure:
    """One side (a speculate value) at one batch size, over every round."""

    rates: list[float] = field(default_factory=list)  # decode tokens/s per round
    tokens: int = 0  # decode tokens (after each request's first), all rounds
    steps: int = 0  # Generations those tokens came in
    proposed: int = 0
    accepted: int = 0
    outputs: list[list[int]] | None = None


def code_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` windows of `length` tokens from held-out standard-library files, one per file,
    each starting at a line that opens a `def` (a continuation the model can make sense of)."""
    from text_generation_server.jobs import corpus

    prompts: list[list[int]] = []
    for path in corpus.corpus_files("heldout"):
        text = corpus.read_document(path)
        if not text:
            continue
        start = text.find("\ndef ")
        start = text.find("\n    def ") if start < 0 else start
        if start < 0:
            continue
        ids = tokenizer.encode(text[start + 1:]).ids
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == count:
            return prompts
    raise SystemExit(f"only {len(prompts)} held-out files give a {length}-token window (need {count})")


def decode(lm, prompts: list[list[int]], new_tokens: int, batch_id: int) -> tuple[float, int, int, list[list[int]]]:
    """Runs one batch to the end; returns decode seconds (after the prefill step), decode tokens,
    the Generations they came in, and every request's tokens."""
    from text_generation_server.engine.types import GenerationRequest

    requests = [GenerationRequest(id=i, inputs="", input_ids=p, max_new_tokens=new_tokens, ignore_eos_token=True)
                for i, p in enumerate(prompts)]
    batch = lm.make_batch(batch_id, requests)
    out: dict[int, list[int]] = {}
    generations, batch, _ = lm.generate_token(batch)  # the prefill: each request's first token
    for g in generations:
        out.setdefault(g.request_id, []).extend(g.tokens.ids)
    tokens = steps = 0
    start = time.perf_counter()
    while batch is not None:
        generations, batch, _ = lm.generate_token(batch)
        done = []
        for g in generations:
            out[g.request_id].extend(g.tokens.ids)
            tokens += len(g.tokens.ids)
            steps += 1
            if g.generated_text is not None:
                done.append(g.request_id)
        if batch is not None and done:
            batch = lm.filter(batch, [r for r in batch.request_ids if r not in done])
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)
    return time.perf_counter() - start, tokens, steps, [out[i] for i in range(len(prompts))]


def run_side(lm, speculate: int, prompts: list[list[int]], batch_size: int, new_tokens: int, into: Measure) -> None:
    """One round of one side: the prompts in batches of `batch_size`."""
    lm.speculate = speculate
    before = lm.speculated_tokens, lm.accepted_tokens
    seconds = tokens = steps = 0
    outputs: list[list[int]] = []
    for first in range(0, len(prompts), batch_size):
        s, t, n, outs = decode(lm, prompts[first:first + batch_size], new_tokens, first)
        seconds, tokens, steps = seconds + s, tokens + t, steps + n
        outputs += outs
    into.rates.append(tokens / seconds)
    into.tokens += tokens
    into.steps += steps
    into.proposed += lm.speculated_tokens - before[0]
    into.accepted += lm.accepted_tokens - before[1]
    if into.outputs is None:
        into.outputs = outputs
    elif into.outputs != outputs:
        raise SystemExit("the same side gave different tokens in two rounds")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--speculate", type=int, default=2)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    batch_sizes = parse_ints(args.batch_sizes, "--batch-sizes")
    if args.threads:
        torch.set_num_threads(args.threads)

    from text_generation_server.models.loader import get_model

    device = torch.device(args.device)
    lm = get_model(None, device=device)
    count = max(batch_sizes)
    prompts = code_prompts(lm.tokenizer, count, args.prompt_tokens)
    lm.allocate_kv_cache(count * lm.blocks_for(args.prompt_tokens + args.new_tokens) + 2)
    start_load = __import__("os").getloadavg()[0]
    results: dict[tuple[int, int], Measure] = {}
    decode(lm, prompts[:1], 8, 0)  # warm the kernels
    for batch_size in batch_sizes:
        sides = {s: Measure() for s in (0, args.speculate)}
        for _ in range(args.rounds):
            for speculate, measure in sides.items():
                run_side(lm, speculate, prompts, batch_size, args.new_tokens, measure)
        if sides[0].outputs != sides[args.speculate].outputs:
            print(f"batch {batch_size}: speculate {args.speculate} changed the tokens", file=sys.stderr)
            return 1
        for speculate, measure in sides.items():
            results[(batch_size, speculate)] = measure
    lm.speculate = 0

    rows = []
    for batch_size in batch_sizes:
        plain, spec = results[(batch_size, 0)], results[(batch_size, args.speculate)]
        for speculate, m in ((0, plain), (args.speculate, spec)):
            acceptance = f"{m.accepted / m.proposed:.0%}" if m.proposed else "-"
            rows.append([batch_size, speculate, f"{m.tokens / m.steps:.2f}", acceptance,
                         f"{statistics.median(m.rates):.0f}",
                         ratio(statistics.median(m.rates), statistics.median(plain.rates)) if speculate else "1.00"])
    threads = torch.get_num_threads() if device.type == "cpu" else None
    print(f"## N-gram speculation: --speculate {args.speculate} vs none, code continuation ({now_iso()})")
    print()
    print(f"Command: `{command_line(script='benchmarks/speculate_decode.py')}`")
    print(f"Machine: {machine_line(str(device) if device.type == 'cuda' else f'{threads} torch threads')}; "
          f"{load_line(start=start_load)} (1/5/15: {load_averages()})")
    print(f"Model: embedded tiny-pycoder ({lm.config.num_hidden_layers} layers, hidden {lm.config.hidden_size}, "
          f"{str(lm.dtype).removeprefix('torch.')}); {count} held-out standard-library windows of "
          f"{args.prompt_tokens} tokens, {args.new_tokens} greedy tokens each (EOS ignored); {args.rounds} rounds, "
          "sides alternating; identical tokens checked.")
    print()
    print("\n".join(md_table(["batch", "speculate", "tokens per step", "accepted", "decode tok/s (median)",
                              "vs none"], rows, "rrrrrr")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
