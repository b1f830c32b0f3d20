"""Ours and llama.cpp on the SAME GGUF file (issue #34): `python benchmarks/vs_llamacpp.py --same-gguf`.

Both sides load the registry's Qwen2.5-Coder-1.5B-Instruct Q4_K_M file: ours through
`serve file.gguf` with serve's defaults, as a user gets it (Q4_K on the int4 kernel, Q6_K on the
group-int8 one; the head, the file's Q6_K output.weight, read dequantized and run as per-row int8
by the CPU default for quantized checkpoints: the one tensor not kept in the file's own blocks),
llama.cpp through llama-server and llama-bench. Both servers stay up
and every round measures each side in turn (the order alternating by round), so a change in what
else runs on the machine falls on both alike; the figures are medians over the rounds:

- prefill: a fresh prompt of `prompt_tokens` tokens (never the same twice: no prefix-cache hits),
  one new token; prompt tokens / time to that token.
- decode c=1: one stream of `decode_tokens` tokens; tokens after the first / time after the first.
- decode c=8: eight clients, one request each of `new_tokens` tokens; all tokens / wall time.
- llama-bench pp / tg (one repetition a round): llama.cpp without its server, for reference.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shlex
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

import llamacpp_build as lb
from bench_common import StartedServer, cli_entry, load_line, machine_line, md_table, now_iso

C8 = 8


@dataclass
class Figures:
    """One side's samples per metric (tok/s), one per round."""

    samples: dict[str, list[float]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    def add(self, metric: str, value: float | None, error: str = "") -> None:
        if value is None:
            self.errors.append(f"{metric}: {error or 'no figure'}")
        else:
            self.samples.setdefault(metric, []).append(value)

    def median(self, metric: str) -> float | None:
        found = self.samples.get(metric)
        return statistics.median(found) if found else None


def ratio_rows(ours: Figures, theirs: Figures, metrics: list[tuple[str, str, float]]) -> list[list[str]]:
    """[metric, ours, llama.cpp, ours / llama.cpp, target, met] for each (metric, label, target)."""
    rows = []
    for metric, label, target in metrics:
        o, t = ours.median(metric), theirs.median(metric)
        r = o / t if o and t else None
        rows.append([label, f"{o:.1f}" if o else "n/a", f"{t:.1f}" if t else "n/a",
                     f"{r:.2f}x" if r else "n/a", f">= {target:.1f}x" if target else "",
                     ("yes" if r >= target else "NO") if (r and target) else ""])
    return rows


class _GGUFTokenizer:
    """The file's own tokenizer (converted once, then cached: quantizers/gguf_cache.py) with the two
    calls vs_llamacpp.prompt_of_tokens makes of a transformers tokenizer."""

    def __init__(self, gguf: Path):
        from text_generation_server.quantizers.gguf_arch import tokenizer
        from text_generation_server.quantizers.gguf_file import open_gguf

        self._tok = tokenizer(open_gguf([gguf]))[0]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


async def _round(vs, plan, r: int, name: str, figures: Figures, prompt: str, prompt_tokens: int,
                 decode_prompt: str, send: Callable[[str, int], Awaitable]) -> None:
    reply = await send(prompt, 1)
    figures.add("prefill", prompt_tokens / (reply.stamps[0] - reply.sent) if reply.ok else None, reply.error or "")
    reply = await send(decode_prompt, plan.decode_tokens)
    figures.add("decode c=1", vs.decode_rate(reply), reply.error or "too few tokens")

    async def level_send(index: int):
        prompt = vs.unique_prompt(index + 1000 * (r + 1), vs.CODE_PROMPTS[index % len(vs.CODE_PROMPTS)])
        return await send(prompt, plan.new_tokens)

    level = await vs.run_level(level_send, C8, C8, plan.level_budget_s)
    problems = vs.level_problems(level, plan.new_tokens)
    figures.add(f"decode c={C8}", level.tok_s if not problems else None, "; ".join(problems[:1]))
    logger.info("round {} {}: {}", r + 1, name, {k: round(v[-1], 1) for k, v in figures.samples.items()})


async def run(vs, llama: lb.LlamaCpp, plan, threads: int, rounds: int, startup_timeout_s: float,
              root: Path | None = None) -> str:
    """The interleaved same-file run; `vs` is the vs_llamacpp module (its clients and helpers).
    Returns the markdown report."""
    import grpc

    from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc

    load_start = os.getloadavg()[0]
    gguf = lb.ensure_qwen_gguf(root)
    tokenizer = _GGUFTokenizer(gguf)
    text = vs.corpus_text()
    # A fresh prompt for every (round, side): nothing a prefix cache could reuse.
    prompts = [vs.prompt_of_tokens(tokenizer, text, plan.prompt_tokens, 20_000 * (i + 1)) for i in range(2 * rounds)]
    ours_fig, theirs_fig = Figures(), Figures()
    top = max(plan.concurrency + (C8,))
    server = StartedServer(str(gguf), vs.ours_server_args("bf16", plan), startup_timeout_s)
    llama_server = None
    ours_cmd = shlex.join(["text-generation-server", *server.command[len(cli_entry()):]])
    try:
        started = time.monotonic()
        await vs.wait_listening(server.port, server.proc, startup_timeout_s)
        await server.wait_ready()
        logger.info("ours serving {} ready in {:.0f} s", gguf.name, time.monotonic() - started)
        # Each slot's context holds the prefill's prompt and a decode's tokens (llama-server refuses a
        # prompt that fills its slot: with 512 a slot, every 512-token prefill came back 400).
        per_slot = max(512, plan.prompt_tokens + max(plan.new_tokens, 128) + 64)
        llama_server = vs.LlamaServer(llama.bin("llama-server"), gguf, threads, top, per_slot, startup_timeout_s)
        logger.info("llama-server ready in {:.0f} s", await llama_server.wait_ready())
        port = llama_server.port
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = cpb_grpc.TextGenerationStub(channel)

            async def ours(prompt: str, n: int):
                return await vs.ours_stream(stub, prompt, n)

            async def theirs(prompt: str, n: int):
                return await vs.llama_stream(port, {"prompt": prompt, "n_predict": n, "temperature": 0.0,
                                                    "ignore_eos": True, "cache_prompt": False})

            await ours(vs.unique_prompt(-1, vs.CODE_PROMPTS[0]), 8)  # warm-ups
            await theirs(vs.unique_prompt(-1, vs.CODE_PROMPTS[0]), 8)
            for r in range(rounds):
                sides = [("ours", ours_fig, ours), ("llama.cpp", theirs_fig, theirs)]
                for i, (name, figures, send) in enumerate(sides if r % 2 == 0 else sides[::-1]):
                    prompt, count = prompts[2 * r + i]
                    decode_prompt = vs.unique_prompt(-2 - 2 * r - i, vs.CODE_PROMPTS[1])
                    await _round(vs, plan, r, name, figures, prompt, count, decode_prompt, send)
                try:
                    bench = await asyncio.to_thread(vs.run_llama_bench, llama, gguf,
                                                    dataclasses.replace(plan, repeats=1), threads)
                    theirs_fig.add("llama-bench pp", bench["pp"].tok_s if "pp" in bench else None)
                    theirs_fig.add("llama-bench tg", bench["tg"].tok_s if "tg" in bench else None)
                except (RuntimeError, ValueError) as exc:
                    theirs_fig.errors.append(f"llama-bench: {str(exc).splitlines()[0]}")
    except RuntimeError as exc:
        ours_fig.errors.append(str(exc).splitlines()[0])
        logger.error("same-GGUF run failed: {}", exc)
    finally:
        server.stop()
        if llama_server is not None:
            llama_server.stop()
    metrics = [("prefill", f"prefill ({plan.prompt_tokens}-token prompt), tok/s", 1.2),
               ("decode c=1", f"decode c=1 ({plan.decode_tokens} tokens), tok/s", 1.0),
               (f"decode c={C8}", f"decode c={C8} ({C8} x {plan.new_tokens} tokens), total tok/s", 1.3)]
    lines = [f"# Ours vs llama.cpp on the same GGUF file ({now_iso()})", "",
             machine_line(f"llama.cpp threads {threads}"), "",
             f"File: `{gguf}` ({gguf.stat().st_size / 2**20:.0f} MiB, Q4_K_M). Median of {rounds} interleaved rounds "
             "(order alternating), both servers up throughout.", ""]
    lines += md_table(["metric", "ours", "llama.cpp (llama-server)", "ours / llama.cpp", "target", "met"],
                      ratio_rows(ours_fig, theirs_fig, metrics), "lrrrrl")
    bench_pp, bench_tg = theirs_fig.median("llama-bench pp"), theirs_fig.median("llama-bench tg")
    o_pp, o_tg = ours_fig.median("prefill"), ours_fig.median("decode c=1")
    lines += ["", f"llama-bench on the same file (no server; one repetition a round): pp{plan.prompt_tokens} "
              f"{bench_pp or 0:.1f} tok/s (ours / it: {(o_pp / bench_pp) if o_pp and bench_pp else 0:.2f}x), "
              f"tg{plan.decode_tokens} {bench_tg or 0:.1f} tok/s (ours / it: "
              f"{(o_tg / bench_tg) if o_tg and bench_tg else 0:.2f}x)", "",
              "Samples per round (tok/s):", ""]
    for name, figures in (("ours", ours_fig), ("llama.cpp", theirs_fig)):
        for metric, values in figures.samples.items():
            lines.append(f"- {name} {metric}: " + ", ".join(f"{v:.1f}" for v in values))
        for err in figures.errors[:5]:
            lines.append(f"- error, {name}: {err}")
    lines += ["", f"- ours: `{ours_cmd}`",
              f"- llama.cpp: `{shlex.join(['llama-server', *(llama_server.command[1:] if llama_server else [])])}`",
              "", load_line(start=load_start)]
    return "\n".join(lines)
