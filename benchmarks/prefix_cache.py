"""Prefix caching and chunked prefill, measured through `serve` on CPU.

Prefix caching only pays when prompts repeat what the server has already computed (a chat's
earlier turns, a system prompt every request carries), and it must not cost anything when
they do not; chunked prefill must keep decoding streams moving while a long prompt is
computed. So one run starts the same model with caching off and on (and, for the long
cases, a random 8k-position Llama built here with the whole prompt in one forward and in
small chunks), drives the same workloads through the client gRPC API, and prints every
comparison as a ratio with the targets of the issue:

- multi-turn conversations (each turn appends the previous answer and a new user message),
  TTFT of the follow-up turn that fills the context (embedded model: 1,024 tokens; random
  model: ~4,000), measured one request at a time after the earlier turns were served;
- a shared system prompt: TTFT one at a time, throughput at a concurrency;
- unrelated prompts (all distinct): throughput with caching on vs off;
- 16 streams decoding while a ~4,000-token prompt arrives (random model): ITL p99 of the
  streams during its prefill vs just before it, with the prompt in one forward vs chunks.

Servers of one model are up together and workloads alternate between them, so load from
other jobs on a shared machine falls on both sides alike. A server failure (an RPC error,
a server exit) exits non-zero; a missed target is reported, not an error.

    python benchmarks/prefix_cache.py
    python benchmarks/prefix_cache.py --parts embedded --repeats 4
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench_common import (  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
    StartedServer, StreamedReply, command_line, load_line, machine_line, md_table, metrics_text, pct, stream_generate,
)
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc
from text_generation_server.quantizers.checkpoint import load_tokenizer
from text_generation_server.utils.locate import embedded_model_path

USER, ASSISTANT = "\n### User:\n", "\n### Assistant:\n"
COUNTERS = ("tgs_prefix_cache_query_tokens", "tgs_prefix_cache_hit_tokens", "tgs_prefill_chunks")


# -- prompts ------------------------------------------------------------------------------
class TextPool:
    """Distinct windows of real code (the standard library's sources), cut at token boundaries,
    never handed out twice: a prompt shares a prefix with another only where a workload says so."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        self._files = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size > 20_000)
        if not self._files:
            raise RuntimeError(f"no standard library sources under {stdlib} to build prompts from")
        self._file, self._pos, self._enc, self._text = -1, 0, None, ""

    def tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text).ids)

    def take(self, n: int) -> str:
        while self._enc is None or self._pos + n + 1 > len(self._enc.ids):
            self._file += 1
            if self._file >= len(self._files):
                raise RuntimeError("the standard library ran out of text for distinct prompts")
            self._text = self._files[self._file].read_text(errors="replace")
            self._enc, self._pos = self.tokenizer.encode(self._text), 0
        offsets = self._enc.offsets
        text = self._text[offsets[self._pos][0]:offsets[self._pos + n - 1][1]]
        self._pos += n + 64  # a gap, so that no two windows overlap
        return text


def plan_conversation(pool: TextPool, fill: int, followup: int, earlier_turns: int, answer: int) -> list[int]:
    """User message sizes (tokens) of a conversation whose last turn brings it to about `fill`
    tokens: the earlier turns share the room equally, the follow-up adds `followup` tokens."""
    framing = pool.tokens(USER + ASSISTANT)
    room = fill - followup - framing - earlier_turns * (answer + framing)
    if room < earlier_turns * 16:
        raise ValueError(f"a conversation of {fill} tokens has no room for {earlier_turns} earlier turns")
    return [room // earlier_turns] * earlier_turns + [followup]


# -- client ----------------------------------------------------------------------------------
class ServerFailed(RuntimeError):
    """The server failed a request or went away: the run is not a measurement."""


async def generate(stub, prompt: str, max_new_tokens: int) -> StreamedReply:
    params = cpb.GenerateParameters(max_new_tokens=max_new_tokens, ignore_eos_token=True)
    reply = await stream_generate(stub, cpb.GenerateRequest(inputs=prompt, parameters=params))
    if reply.error is not None:
        raise ServerFailed(reply.error)
    if not reply.stamps:
        raise ServerFailed("a stream ended without a token")
    return reply


def counters(url: str) -> dict[str, float]:
    """The prefix-cache and chunking counters on /metrics (the `_total` samples)."""
    found: dict[str, float] = {}
    for line in metrics_text(url).splitlines():
        if line.startswith("#") or " " not in line:
            continue
        sample, value = line.rsplit(" ", 1)
        name = sample.split("{", 1)[0]
        if name.endswith("_total") and name[:-6] in COUNTERS:
            found[name[:-6]] = found.get(name[:-6], 0.0) + float(value)
    return found


class Server:
    """One started `serve` (its exact command in `proc.command`) and a channel to it."""

    def __init__(self, label: str, model: str, flags: list[str], threads: int, timeout_s: float):
        self.label = label
        self.proc = StartedServer(model, flags, timeout_s, env={"OMP_NUM_THREADS": str(threads)})
        self.channel = None
        self.stub = None

    async def open(self) -> None:
        await self.proc.wait_ready()
        self.channel = grpc.aio.insecure_channel(self.proc.target)
        self.stub = cpb_grpc.TextGenerationStub(self.channel)
        self.info = await self.stub.Info(cpb.InfoRequest(), timeout=30)
        await generate(self.stub, "def warm_up(x):\n", 8)

    def check(self) -> None:
        if self.proc.returncode is not None:
            raise ServerFailed(f"server {self.label} exited ({self.proc.returncode}):\n{self.proc.log_tail()}")

    def counters(self) -> dict[str, float]:
        return counters(self.proc.metrics_url)

    def cpu_s(self) -> float:
        """CPU time of the server's processes (launcher, router, ranks: one session): unlike wall
        time, barely moved by other jobs on the machine, so it shows what caching costs per request."""
        return self.proc.cpu_s()

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        self.proc.stop()


async def start_all(specs: list[tuple[str, str, list[str]]], args) -> list[Server]:
    servers = [Server(label, model, flags, args.threads, args.startup_timeout_s) for label, model, flags in specs]
    try:
        await asyncio.gather(*(s.open() for s in servers))
    except BaseException:
        await asyncio.gather(*(s.close() for s in servers))
        raise
    return servers


# -- workloads -----------------------------------------------------------------------------------
@dataclass
class Phase:
    """Requests of one workload on one server: TTFTs (s), generated tokens, wall time, cache counters."""

    ttfts: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)  # of the requests whose TTFT is kept
    tokens: int = 0
    requests: int = 0
    wall_s: float = 0.0
    hit_tokens: float = 0.0
    query_tokens: float = 0.0
    cpu_s: float = 0.0  # the server's CPU time
    round_tok_s: list[float] = field(default_factory=list)  # generated tok/s of each round added

    def add(self, other: "Phase") -> None:
        self.round_tok_s.append(other.tok_s)
        self.cpu_s += other.cpu_s
        self.ttfts += other.ttfts
        self.prompt_tokens += other.prompt_tokens
        self.tokens += other.tokens
        self.requests += other.requests
        self.wall_s += other.wall_s
        self.hit_tokens += other.hit_tokens
        self.query_tokens += other.query_tokens

    def p(self, q: float) -> float:
        return 1e3 * pct(self.ttfts, q)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else float("nan")


async def run_conversation(stub, pool: TextPool, messages: list[str], new_tokens: int, phase: Phase,
                           last_only: bool) -> None:
    """One conversation, turn after turn; TTFT of the follow-up (last) turn, or of every turn."""
    history = ""
    for i, message in enumerate(messages):
        history += USER + message + ASSISTANT
        kept = not last_only or i == len(messages) - 1
        length = pool.tokens(history) if kept else 0
        reply = await generate(stub, history, new_tokens)
        history += reply.text
        phase.tokens += len(reply.stamps)
        phase.requests += 1
        if kept:
            phase.ttfts.append(reply.ttft)
            phase.prompt_tokens.append(length)


async def measured(server: Server, body) -> Phase:
    """Runs `body(stub, phase)`; fills in the wall time and the prefix-cache counters it moved."""
    phase = Phase()
    before, cpu = server.counters(), server.cpu_s()
    start = time.perf_counter()
    await body(server.stub, phase)
    phase.wall_s = time.perf_counter() - start
    phase.cpu_s = server.cpu_s() - cpu
    after = server.counters()
    for key, name in (("hit_tokens", "tgs_prefix_cache_hit_tokens"), ("query_tokens", "tgs_prefix_cache_query_tokens")):
        setattr(phase, key, after.get(name, 0.0) - before.get(name, 0.0))
    server.check()
    return phase


async def alternate(servers: list[Server], rounds: int, make_body) -> list[Phase]:
    """`rounds` rounds on every server, the order flipped each round (A B, B A, ...), so drifting
    load from other jobs falls on both; `make_body(r)` is round r's workload, the same texts for all."""
    phases = [Phase() for _ in servers]
    for r in range(rounds):
        body = make_body(r)
        for i in (range(len(servers)) if r % 2 == 0 else reversed(range(len(servers)))):
            phases[i].add(await measured(servers[i], body))
    return phases


def at_concurrency(jobs: list, concurrency: int):
    """A body running `jobs` (each `job(stub, phase)`) from `concurrency` clients."""
    async def body(stub, phase: Phase) -> None:
        queue = iter(jobs)

        async def worker() -> None:
            for job in queue:  # shared iterator: each job runs once
                await job(stub, phase)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return body


def one_request(pool: TextPool, prompt: str, new_tokens: int):
    async def job(stub, phase: Phase) -> None:
        reply = await generate(stub, prompt, new_tokens)
        phase.ttfts.append(reply.ttft)
        phase.prompt_tokens.append(pool.tokens(prompt))
        phase.tokens += len(reply.stamps)
        phase.requests += 1
    return job


def conversation_workload(pool: TextPool, args, fill: int, count: int) -> list[list[str]]:
    sizes = plan_conversation(pool, fill, args.followup_tokens, args.earlier_turns, args.new_tokens)
    return [[pool.take(n) for n in sizes] for _ in range(count)]


def one_conversation(pool: TextPool, messages: list[str], new_tokens: int, last_only: bool):
    return lambda stub, phase: run_conversation(stub, pool, messages, new_tokens, phase, last_only)


# -- the random long-context model ------------------------------------------------------------
def write_random_llama(folder: Path, seed: int, kv_heads: int) -> Path:
    """A Llama with the embedded model's tokenizer (so text prompts tokenize) and random weights:
    hidden 512, 4 layers, 8 heads, 8,192 positions. Its answers are noise; its costs are real."""
    import torch
    from safetensors.torch import save_file

    hidden, inter, layers, heads, positions = 512, 1376, 4, 8, 8192
    head_dim = hidden // heads
    source = embedded_model_path()
    vocab = load_tokenizer(source).get_vocab_size(with_added_tokens=True)
    gen = torch.Generator().manual_seed(seed)

    def weight(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) * 0.02

    tensors = {"model.embed_tokens.weight": weight(vocab, hidden), "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": weight(vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": weight(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": weight(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": weight(inter, hidden),
            p + "mlp.up_proj.weight": weight(inter, hidden),
            p + "mlp.down_proj.weight": weight(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        })
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "max_position_embeddings": positions,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, folder / name)
    return folder


# -- decoding streams while a long prompt arrives ------------------------------------------------------
@dataclass
class ItlResult:
    baseline: list[float]  # ITLs (s) of the streams in the `baseline_s` before each long prompt
    during: list[float]  # ITLs overlapping a long prompt's prefill (sent -> its first token)
    long_ttfts: list[float]
    chunks: float = 0.0  # tgs_prefill_chunks over the long prompts (forwards carrying a piece of a chunked prompt)

    @property
    def ratio(self) -> float:
        return pct(self.during, 99) / pct(self.baseline, 99)


async def itl_under_long_prompt(server: Server, shorts: list[str], longs: list[str], baseline_s: float,
                                stream_tokens: int) -> ItlResult:
    stamps: list[list[float]] = [[] for _ in shorts]

    async def stream(i: int) -> None:
        params = cpb.GenerateParameters(max_new_tokens=stream_tokens, ignore_eos_token=True)
        try:
            async for _ in server.stub.GenerateStream(cpb.GenerateRequest(inputs=shorts[i], parameters=params)):
                stamps[i].append(time.perf_counter())
        except grpc.aio.AioRpcError as exc:
            raise ServerFailed(f"decoding stream {i}: {exc.code().name}: {exc.details()}") from exc

    tasks = [asyncio.create_task(stream(i)) for i in range(len(shorts))]
    events = []
    try:
        while min(len(s) for s in stamps) < 8:  # every stream decoding
            await asyncio.sleep(0.02)
            for task in tasks:
                if task.done():
                    task.result()  # raises the stream's failure
                    raise RuntimeError("a decoding stream ended before the long prompts were sent")
        before = await asyncio.to_thread(server.counters)  # the streams' tokens keep arriving meanwhile
        for text in longs:
            await asyncio.sleep(baseline_s)
            reply = await generate(server.stub, text, 1)
            events.append((reply.sent, reply.stamps[0]))
            await asyncio.sleep(0.2)  # the streams' next tokens, before the next baseline window
        for task in tasks:
            if task.done():
                task.result()
                raise RuntimeError(f"a decoding stream finished its {stream_tokens} tokens before the last long "
                                   "prompt was answered: raise --stream-tokens")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    server.check()
    chunks = server.counters().get("tgs_prefill_chunks", 0.0) - before.get("tgs_prefill_chunks", 0.0)
    result = ItlResult([], [], [b - a for a, b in events], chunks)
    for s in stamps:
        for a, b in zip(s, s[1:]):
            for sent, first in events:
                if b > sent and a < first:
                    result.during.append(b - a)
                    break
                if sent - baseline_s <= a and b <= sent:
                    result.baseline.append(b - a)
                    break
    return result


# -- the comparisons -----------------------------------------------------------------------------------
@dataclass
class Report:
    caching: list[list[str]] = field(default_factory=list)
    chunking: list[list[str]] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    servers: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def target(self, text: str, value: float, met: bool) -> str:
        verdict = "MET" if met else "MISSED"
        self.targets.append(f"- {text}: {value:.2f}x, **{verdict}**")
        return verdict


def ms(x: float) -> str:
    return f"{1e3 * x:.0f}" if x >= 0.1 else f"{1e3 * x:.1f}"


def ttft_rows(report: Report, workload: str, model: str, off: Phase, on: Phase) -> tuple[float, float]:
    r50, r90 = off.p(50) / on.p(50), off.p(90) / on.p(90)
    share = f"{100 * on.hit_tokens / on.query_tokens:.0f}%" if on.query_tokens else "n/a"
    sizes = f"{min(on.prompt_tokens)}-{max(on.prompt_tokens)}"
    report.caching.append([workload, model, f"TTFT p50 / p90 ms ({len(on.ttfts)} requests of {sizes} tokens)",
                           f"{off.p(50):.1f} / {off.p(90):.1f}", f"{on.p(50):.1f} / {on.p(90):.1f}",
                           f"**{r50:.2f}x** / {r90:.2f}x", share])
    return r50, r90


def tput_row(report: Report, workload: str, model: str, off: Phase, on: Phase, concurrency: int) -> float:
    """Throughput on/off: the median of the rounds' paired ratios (a burst of other load hits one
    round of one side; the median of pairs shrugs it off), the whole phase's ratio beside it."""
    paired = sorted(b / a for a, b in zip(off.round_tok_s, on.round_tok_s))
    median = pct(paired, 50)
    share = f"{100 * on.hit_tokens / on.query_tokens:.0f}%" if on.query_tokens else "n/a"
    cell = lambda p: (f"{p.tok_s:.0f} ({p.requests / p.wall_s:.1f}); {p.p(50):.0f} / {p.p(90):.0f}; "  # noqa: E731
                      f"{1e3 * p.cpu_s / p.requests:.0f}")
    report.caching.append([
        workload, model, f"c={concurrency}, {len(paired)} rounds: generated tok/s (req/s); TTFT p50 / p90 ms; "
        "server CPU ms / request", cell(off), cell(on),
        f"on/off **{median:.3f}x** (rounds {paired[0]:.2f}-{paired[-1]:.2f}, all {on.tok_s / off.tok_s:.3f}x); "
        f"CPU/request off/on {(off.cpu_s / off.requests) / (on.cpu_s / on.requests):.3f}x", share])
    return median


async def embedded_part(args, pool: TextPool, report: Report) -> None:
    cap = ["--max-batch-total-tokens", "65536"]  # KV cache capped: other jobs share the machine's memory
    specs = [("emb-off", "tiny-pycoder", [*cap, "--no-prefix-caching"]),
             ("emb-on", "tiny-pycoder", [*cap, "--prefix-caching"])]
    servers = await start_all(specs, args)
    try:
        report.servers += [f"{s.label}: `{shlex.join(s.proc.command)}`" for s in servers]
        info = servers[0].info
        c, n = args.concurrency, args.new_tokens
        fill = info.max_total_tokens - n - 8
        report.notes.append(f"embedded model: {info.model_id}, max_total_tokens {info.max_total_tokens}, "
                            f"max_batch_prefill_tokens {info.max_batch_prefill_tokens} (whole prompts), "
                            f"conversations of {args.earlier_turns} turns + a {args.followup_tokens}-token "
                            f"follow-up filling ~{fill} tokens")
        convs = conversation_workload(pool, args, fill, args.repeats)
        off, on = await alternate(servers, len(convs), lambda r: one_conversation(pool, convs[r], n, True))
        r50, _ = ttft_rows(report, "conversation follow-up", "embedded", off, on)
        report.target("follow-up turn filling the embedded model's context: TTFT p50 off/on >= 4x", r50, r50 >= 4)

        rounds = [conversation_workload(pool, args, fill, 2 * c) for _ in range(args.rounds)]
        off, on = await alternate(servers, args.rounds, lambda r: at_concurrency(
            [one_conversation(pool, m, n, False) for m in rounds[r]], c))
        tput_row(report, "conversations (every turn)", "embedded", off, on, c)

        system = "### System:\n" + pool.take(args.system_tokens) + "\n"
        ask = lambda: system + USER + pool.take(args.question_tokens) + ASSISTANT  # noqa: E731
        await alternate(servers, 1, lambda r: one_request(pool, ask(), n))  # the caching server holds the prompt now
        singles = [[ask(), ask()] for _ in range(args.repeats)]
        off, on = await alternate(servers, args.repeats, lambda r: at_concurrency(
            [one_request(pool, p, n) for p in singles[r]], 1))
        ttft_rows(report, f"shared system prompt ({args.system_tokens} tokens)", "embedded", off, on)
        batches = [[ask() for _ in range(4 * c)] for _ in range(args.rounds)]
        off, on = await alternate(servers, args.rounds, lambda r: at_concurrency(
            [one_request(pool, p, n) for p in batches[r]], c))
        tput_row(report, "shared system prompt", "embedded", off, on, c)

        batches = [[pool.take(args.unrelated_tokens) for _ in range(4 * c)] for _ in range(4 * args.rounds)]
        off, on = await alternate(servers, 4 * args.rounds, lambda r: at_concurrency(
            [one_request(pool, p, n) for p in batches[r]], c))
        ratio = tput_row(report, f"unrelated prompts ({args.unrelated_tokens} tokens)", "embedded", off, on, c)
        report.target("unrelated prompts: throughput with caching on / off (median of paired rounds) >= 0.97",
                      ratio, ratio >= 0.97)
    finally:
        await asyncio.gather(*(s.close() for s in servers))


async def random_part(args, pool: TextPool, report: Report, folder: Path) -> None:
    whole = str(args.long_fill + 192)  # every prompt of this part in one forward
    # The KV cache is capped (not 10% of free memory): several servers share the machine.
    common = ["--max-total-tokens", "8192", "--max-input-tokens", str(8192 - 64), "--max-batch-total-tokens", "65536"]
    specs = [("rnd-off", str(folder), [*common, "--no-prefix-caching", "--max-batch-prefill-tokens", whole]),
             ("rnd-on", str(folder), [*common, "--prefix-caching", "--max-batch-prefill-tokens", whole])]
    specs += [(f"rnd-chunk{b}", str(folder), [*common, "--prefix-caching", "--max-batch-prefill-tokens", str(b)])
              for b in args.chunk_tokens]
    servers = await start_all(specs, args)
    try:
        report.servers += [f"{s.label}: `{shlex.join(s.proc.command)}`" for s in servers]
        report.notes.append(f"random model: Llama hidden 512, 4 layers, 8 heads / {args.kv_heads} KV heads, "
                            f"intermediate 1376, 8,192 positions, float32, seed {args.seed}")
        n = args.new_tokens
        convs = conversation_workload(pool, args, args.long_fill, args.long_repeats)
        off, on = await alternate(servers[:2], len(convs), lambda r: one_conversation(pool, convs[r], n, True))
        r50, _ = ttft_rows(report, f"conversation follow-up (~{args.long_fill} tokens)", "random 8k", off, on)
        report.target(f"follow-up turn on a ~{args.long_fill}-token conversation (random model): TTFT p50 off/on "
                      ">= 10x", r50, r50 >= 10)

        # Chunking off = rnd-on (the whole prompt in one forward); on = one server per budget.
        shorts = [pool.take(64) for _ in range(args.streams)]
        longs = [pool.take(args.long_prompt_tokens) for _ in range(args.itl_events)]
        results = [await itl_under_long_prompt(server, shorts, longs, args.baseline_s, args.stream_tokens)
                   for server in servers[1:]]
        rows = [
            ("ITL p50 without the long prompt, ms", lambda r: ms(pct(r.baseline, 50))),
            ("ITL p99 without the long prompt, ms", lambda r: ms(pct(r.baseline, 99))),
            ("ITL p99 during its prefill, ms", lambda r: ms(pct(r.during, 99))),
            ("ITL max during its prefill, ms", lambda r: ms(max(r.during))),
            ("**ITL p99 during / without**", lambda r: f"**{r.ratio:.1f}x**"),
            ("ITL p99 during / p50 without", lambda r: f"{pct(r.during, 99) / pct(r.baseline, 50):.1f}x"),
            (f"long prompt TTFT p50, ms ({args.itl_events} prompts)", lambda r: ms(pct(r.long_ttfts, 50))),
            ("forwards computing a long prompt, per prompt",
             lambda r: f"{r.chunks / len(longs):.0f}" if r.chunks else "1"),
            ("ITL samples (without / during)", lambda r: f"{len(r.baseline)} / {len(r.during)}"),
        ]
        report.chunking += [[label, *(get(r) for r in results)] for label, get in rows]
        for budget, r in zip(args.chunk_tokens, results[1:]):
            report.target(f"ITL p99 of {args.streams} decoding streams while a {args.long_prompt_tokens}-token "
                          f"prompt is prefilled, chunking on (budget {budget}): during / without < 3x",
                          r.ratio, r.ratio < 3)
        report.target("the same with chunking off (the whole prompt in one forward): during / without > 10x",
                      results[0].ratio, results[0].ratio > 10)
    finally:
        await asyncio.gather(*(s.close() for s in servers))


def render(report: Report, args, loads: tuple, started: datetime.datetime, wall_s: float) -> str:
    lines = ["## Prefix caching and chunked prefill (CPU)", "",
             f"- command: `{command_line()}`",
             f"- machine: {machine_line(cores_note='(client and servers on the same machine)')}; "
             f"{load_line(loads[1], start=loads[0])}",
             f"- date: {started.isoformat(timespec='seconds')}, {wall_s:.0f} s in all",
             f"- every server rank with OMP_NUM_THREADS={args.threads}; greedy, EOS ignored, {args.new_tokens} new "
             "tokens per request; TTFT measured by the client (request sent -> first streamed token)",
             *(f"- {note}" for note in report.notes), "- servers:", *(f"  - {s}" for s in report.servers)]
    if report.caching:
        lines += ["", "Caching off vs on (hit share: the share of the workload's prompt tokens, every turn "
                  "counted, that the caching server took from its cache)", "",
                  *md_table(["workload", "model", "measure", "caching off", "caching on", "ratio", "hit share"],
                            report.caching, "lllrrrr")]
    if report.chunking:
        lines += ["", f"Chunking off vs on (random model, {args.streams} streams decoding, "
                  f"{args.long_prompt_tokens}-token prompts arriving; ITL from the streams' token timestamps, "
                  f"'without' = the {args.baseline_s:g} s before each prompt)", "",
                  *md_table(["measure", "chunking off (whole prompt)",
                             *(f"chunking on (budget {b})" for b in args.chunk_tokens)],
                            report.chunking, "l" + "r" * (1 + len(args.chunk_tokens)))]
    lines += ["", "Targets:", *report.targets]
    return "\n".join(lines)


async def amain(args) -> int:
    started = datetime.datetime.now(datetime.timezone.utc)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    pool = TextPool(load_tokenizer(embedded_model_path()))
    report = Report()
    with tempfile.TemporaryDirectory(prefix="prefix-cache-") as tmp:
        if "embedded" in args.parts:
            await embedded_part(args, pool, report)
        if "random" in args.parts:
            folder = write_random_llama(Path(tmp) / "random-llama", args.seed, args.kv_heads)
            await random_part(args, pool, report, folder)
    print(render(report, args, (load0, os.getloadavg()[0]), started, time.perf_counter() - t0))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="embedded,random", help="embedded, random or both (comma-separated)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every server rank")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=8, help="conversations (and system-prompt pairs) for TTFT")
    parser.add_argument("--rounds", type=int, default=2,
                        help="throughput rounds per server (unrelated prompts: 4x as many)")
    parser.add_argument("--concurrency", type=int, default=8, help="clients of the throughput phases")
    parser.add_argument("--earlier-turns", type=int, default=3, help="turns before the measured follow-up")
    parser.add_argument("--followup-tokens", type=int, default=64, help="new user tokens of the follow-up turn")
    parser.add_argument("--system-tokens", type=int, default=768)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--unrelated-tokens", type=int, default=256)
    parser.add_argument("--long-fill", type=int, default=4000, help="tokens of the long conversation (random model)")
    parser.add_argument("--long-repeats", type=int, default=4)
    parser.add_argument("--long-prompt-tokens", type=int, default=4000)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-tokens", type=int, default=2000, help="max_new_tokens of the decoding streams")
    parser.add_argument("--itl-events", type=int, default=2, help="long prompts sent per server")
    parser.add_argument("--baseline-s", type=float, default=2.0)
    parser.add_argument("--chunk-tokens", default="256,64",
                        help="max_batch_prefill_tokens with chunking on: one server per comma-separated budget")
    parser.add_argument("--kv-heads", type=int, default=4, choices=(4, 8))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    args.parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    try:
        args.chunk_tokens = [int(b) for b in args.chunk_tokens.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--chunk-tokens takes comma-separated integers, got {args.chunk_tokens!r}")
    if not args.chunk_tokens or min(args.chunk_tokens) <= args.streams:
        parser.error(f"--chunk-tokens budgets must exceed --streams ({args.streams}): the decoding rows count in them")
    if not args.parts or not args.parts <= {"embedded", "random"}:
        parser.error(f"--parts takes embedded and/or random, got {args.parts}")
    if min(args.threads, args.new_tokens, args.repeats, args.rounds, args.concurrency, args.earlier_turns,
           args.long_repeats, args.streams, args.itl_events) < 1 or args.new_tokens < 2:
        parser.error("counts must be >= 1 (--new-tokens >= 2)")
    if args.long_fill > 8192 - 64 - args.new_tokens or args.long_prompt_tokens > 8192 - 64:
        parser.error("--long-fill and --long-prompt-tokens must fit the random model's 8,192 positions")
    try:
        return asyncio.run(amain(args))
    except (ServerFailed, RuntimeError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
