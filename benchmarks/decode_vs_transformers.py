"""Decode throughput of our engine against Hugging Face transformers `generate()`, side by side.

Both run the same float32 weights, the same greedy prompts and exactly the same
number of new tokens in one process, interleaved (ours, transformers, ours, ...),
so machine noise hits both alike and the ratio is what matters. Prefill is timed
apart: the decode clock starts when the first new token has been chosen, on both
sides, and stops when the last one has. The token ids of both are compared,
because a fast engine that computes something else is no result.

    python benchmarks/decode_vs_transformers.py --model tiny-pycoder --batch-sizes 1,8,32 --new-tokens 128
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch
from loguru import logger

# Code prompts of varied length, so a batch really needs padding (transformers) and
# per-request lengths (ours). Batch b uses PROMPTS[i % len(PROMPTS)] for row i.
from bench_common import (  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
    command_line, load_line, machine_line, md_table, now_iso, parse_ints,
)
from prompts import CODE_PROMPTS  # noqa: E402

PROMPTS = CODE_PROMPTS


WARMUP_TOKENS = 8


@dataclass
class Run:
    """One timed generation of a whole batch."""

    prefill_s: float
    decode_s: float
    decode_tokens: int
    token_ids: list[list[int]]
    cpu_s: float = 0.0  # process CPU time of the decode part: robust to other load, not to spinning threads
    forward_s: float = 0.0  # ours only: model forward time inside the decode steps

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.decode_tokens / self.cpu_s if self.cpu_s > 0 else float("nan")


@dataclass
class Row:
    batch: int
    ours: list[Run] = field(default_factory=list)
    theirs: list[Run] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)


def parse_batch_sizes(text: str) -> list[int]:
    return parse_ints(text, "--batch-sizes")


class OursRunner:
    """Drives `CausalLM.generate_token` the way the shard does: one prefill, then decode steps."""

    def __init__(self, model: str | None, max_batch: int, prompt_tokens: list[int], new_tokens: int):
        from text_generation_server.models.loader import get_model

        self.lm = get_model(model, dtype="float32")
        self.new_tokens = new_tokens
        self.lm.allocate_kv_cache(
            1 + max_batch * self.lm.blocks_for(max(prompt_tokens) + new_tokens)
        )

    def run(self, batch_size: int, new_tokens: int | None = None) -> Run:
        from text_generation_server.engine.types import GenerationRequest

        new_tokens = new_tokens or self.new_tokens
        requests = [
            GenerationRequest(id=i, inputs=PROMPTS[i % len(PROMPTS)], max_new_tokens=new_tokens,
                              ignore_eos_token=True)
            for i in range(batch_size)
        ]
        ids: dict[int, list[int]] = {r.id: [] for r in requests}
        start = time.perf_counter()
        batch = self.lm.make_batch(0, requests)
        generations, batch, _ = self.lm.generate_token(batch)
        prefilled = time.perf_counter()
        cpu_start = time.process_time()
        for gen in generations:
            ids[gen.request_id].extend(gen.tokens.ids)
        forward_ns = 0
        while batch is not None:
            generations, batch, timings = self.lm.generate_token(batch)
            forward_ns += timings.forward_ns
            for gen in generations:
                ids[gen.request_id].extend(gen.tokens.ids)
        done = time.perf_counter()
        cpu = time.process_time() - cpu_start
        return Run(
            prefill_s=prefilled - start,
            decode_s=done - prefilled,
            decode_tokens=batch_size * (new_tokens - 1),
            token_ids=[ids[r.id] for r in requests],
            cpu_s=cpu,
            forward_s=forward_ns / 1e9,
        )


class TransformersRunner:
    """transformers `generate()` with left padding; a stopping criterion stamps the first token's time."""

    def __init__(self, folder: str, tokenizer, pad_id: int, new_tokens: int):
        import transformers

        self.transformers = transformers
        self.model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.tokenizer = tokenizer
        self.pad_id = pad_id
        self.new_tokens = new_tokens
        # EOS off entirely (not min_new_tokens, which masks the EOS logit and could change the greedy
        # choice), so both sides pick the plain argmax and run exactly new_tokens steps. generate()
        # fills an eos_token_id of None from the model's own generation config, so clear it there too.
        self.model.generation_config.eos_token_id = None
        self.config = transformers.GenerationConfig(
            max_new_tokens=new_tokens, do_sample=False, num_beams=1, eos_token_id=None,
            pad_token_id=pad_id, bos_token_id=None,
        )

    def inputs(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        encoded = [self.tokenizer.encode(PROMPTS[i % len(PROMPTS)], add_special_tokens=True).ids
                   for i in range(batch_size)]
        width = max(len(e) for e in encoded)
        input_ids = torch.full((batch_size, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((batch_size, width), dtype=torch.long)
        for row, ids in enumerate(encoded):
            input_ids[row, width - len(ids):] = torch.tensor(ids)
            mask[row, width - len(ids):] = 1
        return input_ids, mask

    def run(self, batch_size: int, new_tokens: int | None = None) -> Run:
        transformers = self.transformers
        new_tokens = new_tokens or self.new_tokens
        config = transformers.GenerationConfig(**{**self.config.to_dict(), "max_new_tokens": new_tokens})
        stamps: list[float] = []
        cpu_stamps: list[float] = []

        class Stamp(transformers.StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):
                stamps.append(time.perf_counter())
                cpu_stamps.append(time.process_time())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        input_ids, mask = self.inputs(batch_size)
        with torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(
                input_ids=input_ids, attention_mask=mask, generation_config=config,
                stopping_criteria=transformers.StoppingCriteriaList([Stamp()]),
            )
            done = time.perf_counter()
            cpu_done = time.process_time()
        new = out[:, input_ids.shape[1]:]
        if new.shape[1] != new_tokens or len(stamps) != new_tokens:
            raise RuntimeError(
                f"transformers generated {new.shape[1]} tokens in {len(stamps)} steps, expected {new_tokens}"
            )
        return Run(
            prefill_s=stamps[0] - start,
            decode_s=done - stamps[0],
            decode_tokens=batch_size * (new_tokens - 1),
            token_ids=new.tolist(),
            cpu_s=cpu_done - cpu_stamps[0],
        )


def profile_ours(ours: OursRunner, batch_size: int, steps: int = 20, top: int = 12) -> str:
    """Where one of our decode steps goes, by aten op (torch.profiler over `steps` decode steps).

    The profiler adds a few microseconds per op, so small ops look larger than they are; the
    ranking is what matters.
    """
    from torch.profiler import ProfilerActivity, profile

    from text_generation_server.engine.types import GenerationRequest

    requests = [
        GenerationRequest(id=i, inputs=PROMPTS[i % len(PROMPTS)], max_new_tokens=steps + 8, ignore_eos_token=True)
        for i in range(batch_size)
    ]
    lm = ours.lm
    batch = lm.make_batch(0, requests)
    for _ in range(4):  # prefill and a few steps outside the window
        _, batch, _ = lm.generate_token(batch)
    forward_ns = total_ns = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            _, batch, timings = lm.generate_token(batch)
            forward_ns += timings.forward_ns
            total_ns += timings.total_ns
    if batch is not None:
        lm.release(batch)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    lines = [
        f"### Profile of our decode step at batch {batch_size} ({steps} steps under torch.profiler)",
        "",
        f"- per step: generate_token {total_ns / steps / 1e6:.2f} ms = model forward {forward_ns / steps / 1e6:.2f} ms "
        f"+ token choice, stopping, detokenisation {(total_ns - forward_ns) / steps / 1e6:.2f} ms",
        "",
        *md_table(["aten op", "self ms / step", "calls / step"], [
            [e.key, f"{e.self_cpu_time_total / 1e3 / steps:.3f}", f"{e.count / steps:.0f}"] for e in events[:top]
        ], "lrr"),
    ]
    return "\n".join(lines)


def parse_targets(text: str) -> dict[int, float]:
    """"1:2.0,32:1.5" -> {1: 2.0, 32: 1.5}."""
    targets = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        batch, _, ratio = part.partition(":")
        try:
            targets[int(batch)] = float(ratio)
        except ValueError:
            raise ValueError(f"--targets wants batch:ratio pairs like 8:1.5, got {part!r}") from None
    return targets


def compare(ours: Run, theirs: Run) -> list[str]:
    """Rows whose greedy ids differ, with the first differing position (never hidden)."""
    problems = []
    for row, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)):
        if a != b:
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            problems.append(
                f"row {row}: first difference at new token {first} (ours {a[first:first + 4]}, "
                f"transformers {b[first:first + 4]}), lengths {len(a)}/{len(b)}"
            )
    return problems


def best(runs: list[Run]) -> Run:
    return max(runs, key=lambda r: r.tokens_per_s)


def paired_ratios(row: Row, cpu: bool = False) -> list[float]:
    """ours/transformers per interleaved pair: neighbours in time share the machine's state, so the
    median of these ratios resists other load better than a ratio of two best-of figures."""
    if cpu:
        return [o.tokens_per_cpu_s / t.tokens_per_cpu_s for o, t in zip(row.ours, row.theirs)]
    return [o.tokens_per_s / t.tokens_per_s for o, t in zip(row.ours, row.theirs)]


def report(rows: list[Row], args: argparse.Namespace, model_id: str) -> str:
    import transformers

    lines = [
        "## Decode throughput: text-generation-server engine vs transformers generate()",
        "",
        f"- command: `{command_line(sys.executable.rsplit('/', 1)[-1])}`",
        f"- model: {model_id}, float32, greedy, {args.new_tokens} new tokens per request (EOS ignored on both sides)",
        f"- machine: {machine_line(f'torch threads {torch.get_num_threads()}')}; "
        f"{load_line(start=args.load_at_start[0], hint='--threads 1 suffers least')}",
        f"- torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}",
        f"- date: {now_iso()}",
        f"- decode tok/s = batch x (new tokens - 1) / time from the first chosen token to the last; best of "
        f"up to {args.repeats} interleaved runs after a short warm-up (median in brackets); ratio = median over "
        f"the interleaved pairs of ours/transformers (range in brackets), also by process CPU time, which other "
        f"load disturbs less (but spinning threads count); ids compared on the first timed run",
        "",
    ]
    cells = []
    for row in rows:
        o, t = best(row.ours), best(row.theirs)
        om = statistics.median(r.tokens_per_s for r in row.ours)
        tm = statistics.median(r.tokens_per_s for r in row.theirs)
        ratios = paired_ratios(row)
        cpu_ratio = statistics.median(paired_ratios(row, cpu=True))
        steps = args.new_tokens - 1
        step_ms = 1e3 * o.decode_s / steps
        fwd_ms = 1e3 * o.forward_s / steps
        same = "yes" if not row.mismatches else f"NO ({len(row.mismatches)}/{row.batch} rows differ)"
        cells.append([
            row.batch, f"{o.tokens_per_s:.0f} ({om:.0f})", f"{t.tokens_per_s:.0f} ({tm:.0f})",
            f"**{statistics.median(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f})", f"{cpu_ratio:.2f}x",
            f"{1e3 * min(r.prefill_s for r in row.ours):.1f}", f"{1e3 * min(r.prefill_s for r in row.theirs):.1f}",
            f"{step_ms:.2f} ({fwd_ms:.2f} + {step_ms - fwd_ms:.2f})", same,
        ])
    lines += md_table(["batch", "ours tok/s", "transformers tok/s", "ratio (range)", "ratio by CPU time",
                       "ours prefill ms", "transformers prefill ms", "ours ms/step (forward + rest)", "identical ids"],
                      cells, "r" * 8 + "l")
    lines.append("")
    targets = args.targets
    for row in rows:
        if row.batch in targets:
            ratio = statistics.median(paired_ratios(row))
            verdict = "met" if ratio >= targets[row.batch] else "MISSED"
            lines.append(f"- target batch {row.batch}: >= {targets[row.batch]}x transformers: {ratio:.2f}x, {verdict}")
    for row in rows:
        for problem in row.mismatches:
            lines.append(f"- token mismatch at batch {row.batch}: {problem}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-pycoder", help="checkpoint folder or the embedded model id")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request (>= 2)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side and batch size (>= 1)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch threads (default: all cores; 1 is steadier on a machine others are using)")
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="after this many seconds, remaining batch sizes get a single timed run")
    parser.add_argument("--targets", default="1:2.0,32:1.5",
                        help="batch:ratio pairs the report checks (ours / transformers at least ratio)")
    parser.add_argument("--profile", action="store_true",
                        help="after the table, print where our decode step spends its time, per batch size")
    args = parser.parse_args(argv)
    args.load_at_start = os.getloadavg()
    try:
        sizes = parse_batch_sizes(args.batch_sizes)
        if args.new_tokens < 2:
            raise ValueError(f"--new-tokens must be >= 2 (one prefill token plus decode), got {args.new_tokens}")
        if args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        if args.budget_s <= 0:
            raise ValueError(f"--budget-s must be > 0, got {args.budget_s}")
        args.targets = parse_targets(args.targets)
    except ValueError as exc:
        parser.error(str(exc))
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    torch.set_num_threads(args.threads)

    from text_generation_server.utils.locate import open_checkpoint

    checkpoint = open_checkpoint(args.model)
    pad_id = checkpoint.config.get("pad_token_id")
    if pad_id is None:
        pad_id = min(checkpoint.eos_token_ids) if checkpoint.eos_token_ids else 0
    prompt_tokens = [len(checkpoint.tokenizer.encode(p, add_special_tokens=True).ids) for p in PROMPTS]
    max_position = int(checkpoint.config.get("max_position_embeddings", 2048))
    if max(prompt_tokens) + args.new_tokens > max_position:
        parser.error(f"--new-tokens {args.new_tokens} + prompts of up to {max(prompt_tokens)} tokens exceed the "
                     f"model's max_position_embeddings ({max_position})")

    ours = OursRunner(args.model, max(sizes), prompt_tokens, args.new_tokens)
    theirs = TransformersRunner(str(checkpoint.folder), checkpoint.tokenizer, pad_id, args.new_tokens)
    rows = []
    deadline = time.monotonic() + args.budget_s
    for size in sizes:
        row = Row(size)
        ours.run(size, WARMUP_TOKENS)  # allocator, thread pool and code paths warm; not timed
        theirs.run(size, WARMUP_TOKENS)
        for repeat in range(args.repeats):
            if repeat and time.monotonic() > deadline:
                logger.warning("time budget spent: batch {} gets {} timed runs", size, repeat)
                break
            row.ours.append(ours.run(size))
            row.theirs.append(theirs.run(size))
        row.mismatches = compare(row.ours[0], row.theirs[0])
        logger.warning("batch {}: ours {:.0f} tok/s, transformers {:.0f} tok/s", size,
                       best(row.ours).tokens_per_s, best(row.theirs).tokens_per_s)
        rows.append(row)
    print(report(rows, args, checkpoint.model_id))
    if args.profile:
        for size in sizes:
            print()
            print(profile_ours(ours, size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
