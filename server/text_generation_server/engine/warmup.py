"""Warmup: the largest forwards the limits allow run first (on a CPU: small ones, measured and
scaled), then the KV cache gets what is left.

Nothing is measured twice and nothing measured is given away: the memory the prefill and the
largest decode took stays reserved in the CUDA caching allocator (no empty_cache), the CUDA
graphs' pool stays with its capturer, and the KV cache is sized from the driver's free memory
after a stated margin and the attention backend's decode transient.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from typing import Any, Protocol, Sequence

import torch
from loguru import logger

from text_generation_server.engine.batch import Batch
from text_generation_server.engine.batch_builder import BatchBuilder
from text_generation_server.engine.cuda_graphs import DecodeGraphs
from text_generation_server.engine.types import Generation, GenerationRequest, StepTimings
from text_generation_server.engine import memory, resident
from text_generation_server.engine.memory import is_out_of_memory
from text_generation_server.engine.warmup_probe import (
    DECODE_PROBE_ROWS,
    PREFILL_PROBE_TOKENS,
    ActivationEstimate,
    PeakTracker,
    probing_layers,
    estimate_activations,
)
from text_generation_server.kernels.tuning import tune_kernels
from text_generation_server.layers.attention import AttentionBackend
from text_generation_server.utils.progress import finish_startup, startup_phase


class WarmupTarget(Protocol):
    """What warmup drives: the engine's model (engine.causal_lm.CausalLM, whose `warmup` calls
    run_warmup with itself). Stated here, so that warmup depends on what it uses and not on the
    module that calls it."""

    model: torch.nn.Module
    config: Any  # the model's DecoderConfig: max_context, context_name, num_hidden_layers
    device: torch.device
    attention: AttentionBackend
    builder: BatchBuilder
    graphs: DecodeGraphs | None
    graph_buckets: list[int]
    max_batch_size: int | None
    max_prefill_tokens: int | None

    @property
    def block_size(self) -> int: ...

    @property
    def kv_bytes_per_token(self) -> int: ...

    @property
    def kv_bytes_per_block(self) -> int: ...

    def graphs_off_reason(self) -> str | None: ...

    def blocks_for(self, tokens: int) -> int: ...

    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    def drop_kv_cache(self) -> None: ...

    def make_batch(self, batch_id: int, requests: list[GenerationRequest]) -> Batch: ...

    def generate_token(self, batch: Batch) -> tuple[list[Generation], Batch | None, StepTimings]: ...

    def release(self, batch: Batch) -> None: ...

    def capture_decode_graphs(self, max_total_tokens: int, buckets: Sequence[int] | None = None) -> int: ...


class WarmupError(RuntimeError):
    """Warmup cannot honour the requested limits; the message says which to lower."""


@torch.inference_mode()
def run_warmup(
    lm: WarmupTarget,
    requests: list[GenerationRequest],
    max_input_tokens: int,
    max_prefill_tokens: int,
    max_total_tokens: int,
    memory_fraction: float,
    max_batch_total_tokens: int | None = None,
    max_batch_size: int | None = None,
) -> int:
    """Runs the largest forwards the limits allow, then gives the KV cache what is left.

    Returns the number of tokens the KV cache holds (max_supported_total_tokens). In order:
    0. where two kernels can run a layer (CUDA), both timed at the graphs' batch sizes and the
       faster kept per size (`tune_kernels`: once per layer shape, cached per device);
    1. kernel scratch (`prepare_scratch`, sized for max_prefill_tokens);
    2. a temporary KV cache just large enough for the two forwards below;
    3. the prefill of the warmup batch (the router's: max_prefill_tokens prompt tokens);
    4. CUDA graphs captured for every bucket, then a decode step at the largest batch
       (`decode_batch_limit`), from its graph when one serves it;
    5. the temporary cache and graphs dropped, WITHOUT emptying the CUDA caching allocator:
       the memory steps 3-4 took stays reserved for the forwards that will need it again,
       and the graphs' pool stays with the capturer for the new capture;
    6. memory read (on CUDA the driver's free memory, within --cuda-memory-fraction), and
       KV blocks = (available - margin - decode transient) x memory_fraction / block bytes
       (`engine.memory.plan_kv_cache`; margin max(256 MiB, 2% of the device) on CUDA, none
       on CPU), at most max_batch_total_tokens' worth;
    7. the KV cache allocated and the graphs captured again against it;
    8. what is neither weights nor cache let go (engine/resident.py: checkpoint pages no tensor
       uses, the C allocator's freed heap), and the rank's resident memory logged.
    On a CPU without graphs, steps 3-4 are small forwards instead when the limits are larger
    (`probes_suffice`): prefills of a few dozen tokens and decode steps of a few rows run every
    kernel path, their peaks are measured and scaled to the largest prefill and decode
    (engine/warmup_probe.py), and that estimate is kept out of the KV cache's share in step 6;
    the largest prefill would take tens of seconds there and teach nothing more. Each phase's
    time is logged.
    After a successful warmup, no request within the limits needs memory that was not
    either measured here or kept free by the margin.
    """
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory fraction must be in (0, 1], got {memory_fraction}")
    if max_total_tokens > lm.config.max_context:
        raise ValueError(
            f"max_total_tokens {max_total_tokens} exceeds the model's {lm.config.context_name}; "
            "lower --max-total-tokens"
        )
    # TGI's router sends every warmup request with id 0: ids are the shard's to give here. One
    # new token each: the prefill is what is measured, and fewer blocks stay idle in the
    # allocator after the temporary cache is dropped.
    requests = [dataclasses.replace(r, id=i, blocks=[], slots=[], cache_len=0, chunk_len=None, max_new_tokens=1)
                for i, r in enumerate(requests)]
    if not requests:
        raise ValueError("warmup needs at least one request")
    startup_phase("warmup")
    lm.drop_kv_cache()  # a previous warmup's cache would crowd out the scratch sized next
    decode_rows, decode_why = decode_batch_limit(
        max_batch_size or lm.max_batch_size, lm.graph_buckets, max_batch_total_tokens, lm.block_size,
        max_prefill_tokens,
    )
    graphs_off = lm.graphs_off_reason()
    buckets = [] if graphs_off else graph_buckets_within(lm.graph_buckets, decode_rows)
    # 0: where two kernels can run a layer, the faster per graph batch size (kernels/tuning.py), before
    # the scratch is sized and the graphs capture; on CPU no layer has two.
    started = time.monotonic()
    tune_kernels(lm.model, buckets, keep_free_bytes=max_total_tokens * lm.kv_bytes_per_token)
    tuned_s = time.monotonic() - started
    started = time.monotonic()
    limits = f"max_batch_prefill_tokens={max_prefill_tokens}, max_input_tokens={max_input_tokens}"
    scratch_bytes = 0
    with _phase(lm, f"the kernels' scratch space for {limits} does not fit in memory",
                            "; lower --max-batch-prefill-tokens (it sizes the split-K and dequantized-weight "
                            "buffers) or --max-input-tokens"):
        for module in lm.model.modules():
            prepare = getattr(module, "prepare_scratch", None)
            if prepare is not None:
                scratch_bytes += int(prepare(max_tokens=max_prefill_tokens, max_input_tokens=max_input_tokens) or 0)
    scratch_note = f" with {scratch_bytes / 2**20:.1f} MiB of kernel scratch reserved" if scratch_bytes else ""
    lm.attention.reserve_decode(max([decode_rows, *buckets]), max_total_tokens, lm.device)

    timings: dict[str, float] = {"kernel tuning": tuned_s, "kernel scratch": time.monotonic() - started}
    started = time.monotonic()
    estimate = None
    if probes_suffice(lm.device, buckets, max_prefill_tokens, decode_rows):
        # 2-4 on a CPU: small forwards, measured and scaled (engine/warmup_probe.py).
        estimate, batch, prefill_timings, decode_timings = _probe(lm, requests, decode_rows)
        prefill_tokens = sum(len(lm.builder.tokenize(r)) for r in requests)
        timings["probe forwards"] = time.monotonic() - started
    else:
        batch, prefill_tokens, prefill_timings = _full_prefill(lm, requests, max_prefill_tokens, scratch_note)
        timings["prefill"] = time.monotonic() - started
        started = time.monotonic()
    graph_bytes = 0
    after_prefill = f"after the prefill of max_batch_prefill_tokens={max_prefill_tokens}"
    if estimate is None:
        # 4: graphs, then a decode step at the largest batch.
        if buckets:
            with _phase(lm, f"capturing CUDA graphs for batch sizes {buckets} does not fit in memory "
                                    f"{after_prefill}",
                                    "; lower --cuda-graphs (0 turns them off) or --max-batch-prefill-tokens"):
                graph_bytes = lm.capture_decode_graphs(max_total_tokens, buckets)
            timings["graph capture"] = time.monotonic() - started
            started = time.monotonic()
        with _phase(lm, f"a decode step at the largest batch, {decode_rows} requests ({decode_why}), does "
                                f"not fit in memory {after_prefill}",
                                "; lower --max-batch-size or --max-batch-prefill-tokens"):
            decode_batch = _decode_batch(lm, decode_rows, batch.states[0].prompt_ids[0])
            _, next_batch, decode_timings = lm.generate_token(decode_batch)
            if next_batch is not None:
                lm.release(next_batch)
        timings["decode"] = time.monotonic() - started
    decode_path = "eager"
    if lm.graphs is not None and sum(lm.graphs.stats.replays.values()):
        decode_path = f"graph {next(b for b in lm.graphs.buckets if b >= decode_rows)}"
    started = time.monotonic()

    # 5-6: drop the temporary cache (the allocator keeps what the forwards used), size the real one.
    lm.drop_kv_cache()
    reading = memory.read_memory(lm.device)
    layers = lm.config.num_hidden_layers
    activations = estimate.peak_bytes if estimate is not None else 0
    plan = memory.plan_kv_cache(
        reading, bytes_per_block=lm.kv_bytes_per_block, block_size=lm.block_size,
        memory_fraction=memory_fraction, max_batch_total_tokens=max_batch_total_tokens,
        transient_bytes=lambda kv_bytes: lm.attention.decode_transient_bytes(kv_bytes, layers),
        activation_bytes=activations,
    )
    usable = plan.usable_tokens(lm.block_size)
    mib = 2**20
    estimated = f" - {activations / mib:.1f} MiB activation peak (estimated)" if estimate is not None else ""
    figures = (f"{reading.available_bytes / mib:.1f} MiB available - {plan.margin_bytes / mib:.1f} MiB margin"
               f"{estimated} - {plan.transient_bytes / mib:.1f} MiB decode transient, x {memory_fraction}")
    if usable < max_total_tokens:
        raise WarmupError(
            f"the KV cache fits {usable} tokens ({figures}), fewer than max_total_tokens {max_total_tokens}; "
            "lower --max-total-tokens, --max-batch-prefill-tokens or --max-batch-size (their forwards' memory "
            "is kept), or raise --memory-fraction / --cuda-memory-fraction"
        )
    # 7: the real cache, and the graphs against it.
    with _phase(lm, f"allocating {plan.num_blocks} KV blocks and capturing the graphs again failed",
                            "; lower --memory-fraction"):
        lm.allocate_kv_cache(plan.num_blocks)
        if buckets:
            lm.capture_decode_graphs(max_total_tokens, buckets)
    lm.max_prefill_tokens = max_prefill_tokens
    timings["KV cache"] = time.monotonic() - started
    graphs_note = (f"CUDA graphs {buckets} ({graph_bytes / mib:.1f} MiB)" if buckets
                   else f"CUDA graphs off ({graphs_off or 'no bucket within the largest batch'})")
    capped = ", capped by max_batch_total_tokens" if plan.capped_by_max_batch_total_tokens else ""
    kv_bytes = plan.num_blocks * lm.kv_bytes_per_block
    if estimate is None:
        forwards = (f"prefill of {prefill_tokens} tokens {prefill_timings.forward_ns / 1e6:.1f} ms; decode of "
                    f"{decode_rows} requests ({decode_why}) {decode_timings.forward_ns / 1e6:.1f} ms ({decode_path})")
    else:
        forwards = (f"{estimate.describe(prefill_tokens, decode_rows)} ({decode_why}); probe prefills "
                    f"{prefill_timings.forward_ns / 1e6:.1f} ms, decode steps {decode_timings.forward_ns / 1e6:.1f} ms "
                    f"({decode_path})")
    logger.info(
        "warmup: {}; {}; KV cache {} blocks x {} tokens = {} tokens at {} bytes per token, {:.1f} MiB ({}{})",
        forwards, graphs_note, plan.num_blocks, lm.block_size, usable, lm.kv_bytes_per_token,
        kv_bytes / mib, figures, capped,
    )
    started = time.monotonic()
    cache = getattr(lm, "kv_cache", None)
    kv_tensors = [t for t in (*getattr(cache, "keys", ()), *getattr(cache, "values", ())) if isinstance(t, torch.Tensor)]
    resident.settle(lm.model, kv_bytes, lm.device, kv_tensors)
    timings["releasing memory"] = time.monotonic() - started
    logger.info("warmup phases: {}", ", ".join(f"{name} {seconds:.2f} s" for name, seconds in timings.items()))
    finish_startup(f"ready, {usable} tokens of KV cache")
    return usable


def probes_suffice(device: torch.device, buckets: Sequence[int], max_prefill_tokens: int, decode_rows: int) -> bool:
    """Whether warmup measures small forwards and scales them (engine/warmup_probe.py) instead of
    running the largest ones: on a CPU (no allocator to keep their memory, no graph to capture),
    when the largest forwards are larger than the probes."""
    return device.type == "cpu" and not buckets and (
        max_prefill_tokens > PREFILL_PROBE_TOKENS[-1] or decode_rows > DECODE_PROBE_ROWS[-1])


def _full_prefill(lm: WarmupTarget, requests: list[GenerationRequest], max_prefill_tokens: int,
                  scratch_note: str) -> tuple[Batch, int, StepTimings]:
    """2-3: the warmup batch's prefill, over a temporary cache just large enough."""
    with _phase(lm, f"a forward pass over max_batch_prefill_tokens={max_prefill_tokens}{scratch_note} "
                            "does not fit in memory", "; lower --max-batch-prefill-tokens"):
        prompt_blocks = sum(lm.blocks_for(len(lm.builder.tokenize(r)) + 1) for r in requests)
        lm.allocate_kv_cache(1 + max(prompt_blocks, lm.blocks_for(2)))
        batch = lm.make_batch(0, requests)
        prefill_tokens = sum(s.input_length for s in batch.states)
        _, next_batch, prefill_timings = lm.generate_token(batch)
        if next_batch is not None:
            lm.release(next_batch)
    return batch, prefill_tokens, prefill_timings


def _probe(lm: WarmupTarget, requests: list[GenerationRequest], decode_rows: int
           ) -> tuple[ActivationEstimate, Batch, StepTimings, StepTimings]:
    """2-4 on a CPU: the probe prefills and decode steps over a temporary cache, measured."""
    last: dict[str, Batch] = {}
    spent = {"prefill": StepTimings(0, 0, 0), "decode": StepTimings(0, 0, 0)}

    def run(batch: Batch, kind: str) -> int:
        with PeakTracker() as tracker:
            _, next_batch, timings = lm.generate_token(batch)
        if next_batch is not None:
            lm.release(next_batch)
        spent[kind] = spent[kind] + timings
        return tracker.peak

    def run_prefill(probe: list[GenerationRequest]) -> int:
        last["batch"] = batch = lm.make_batch(0, probe)
        return run(batch, "prefill")

    def run_decode(rows: int) -> int:
        return run(_decode_batch(lm, rows, last["batch"].states[0].prompt_ids[0]), "decode")

    longest = max(len(lm.builder.tokenize(r)) for r in requests)
    with _phase(lm, "a probe forward does not fit in memory", "; lower --max-batch-prefill-tokens"):
        lm.allocate_kv_cache(1 + max(lm.blocks_for(min(longest, PREFILL_PROBE_TOKENS[-1]) + 1), lm.blocks_for(2)))
        # Prompt logprobs are computed a bounded number of rows at a time (CausalLM.PROMPT_LOGIT_ELEMENTS).
        elements = getattr(lm, "PROMPT_LOGIT_ELEMENTS", None)
        at_once = max(1, elements // max(lm.config.vocab_size, 1)) if elements else None
        with probing_layers(lm.model) as (kept, layers):
            estimate = estimate_activations(lm.builder.tokenize, requests, decode_rows, run_prefill, run_decode,
                                            at_once)
        logger.info("warmup: probe forwards ran {} of {} layers (one of each kind, a second where layers chain their "
                    "residual adds: the peak is a layer's, not the depth's)", kept, layers)
    return estimate, last["batch"], spent["prefill"], spent["decode"]


@contextmanager
def _phase(lm: WarmupTarget, failure: str, advice: str):
    """Out of memory inside the block is a WarmupError: "{failure} ({the error}){advice}".
    Any failure drops the KV cache warmup was building."""
    try:
        yield
    except Exception as exc:
        lm.drop_kv_cache()
        if is_out_of_memory(exc):
            raise WarmupError(f"{failure} ({exc}){advice}") from exc
        raise

def _decode_batch(lm: WarmupTarget, rows: int, token: int) -> Batch:
    """`rows` requests past their one-token prompt, all reading and writing block 1: a decode
    step's activations do not depend on the context, so one block serves the whole batch
    (rows write the same slot; block 1 exists only in warmup's temporary cache)."""
    blocks = [1] * lm.blocks_for(2)
    slots = lm.builder.slots(blocks, 2)
    requests = [GenerationRequest(id=i, inputs="", input_ids=[token], max_new_tokens=1, ignore_eos_token=True,
                                  blocks=blocks, slots=slots) for i in range(rows)]
    batch = lm.make_batch(1, requests)
    for state in batch.states:
        state.prefilled, state.chunk = state.input_length, 0
    return batch


def decode_batch_limit(max_batch_size: int | None, graph_buckets: Sequence[int], max_batch_total_tokens: int | None,
                       block_size: int, max_prefill_tokens: int) -> tuple[int, str]:
    """The largest decode batch warmup runs, and where the figure comes from:
    - max_batch_size when set (the router never batches more; the launcher passes
      min(--max-batch-size, --max-concurrent-requests));
    - else the largest CUDA graph bucket (no smaller bound is known, and the graphs run it);
    - else every sequence holding its minimum, two tokens (one prompt, one new) in whole
      blocks, within max_batch_total_tokens;
    - else max_prefill_tokens: no bound is known, and a decode step of that many rows takes
      less activation memory than the prefill warmup measures anyway.
    """
    if max_batch_size:
        return max_batch_size, "max_batch_size"
    if graph_buckets:
        return max(graph_buckets), "the largest CUDA graph"
    if max_batch_total_tokens:
        per_sequence = -(-2 // block_size)
        return max(1, -(-max_batch_total_tokens // block_size) // per_sequence), \
            "max_batch_total_tokens at two tokens per request"
    return max_prefill_tokens, "max_batch_prefill_tokens, no batch limit known"


def graph_buckets_within(buckets: Sequence[int], max_batch: int) -> list[int]:
    """The buckets a batch of at most max_batch rows can use: those below it and the first at
    or above it (a batch of 6 replays the 8 graph; 16 and 32 would never run)."""
    kept = []
    for bucket in sorted(set(buckets)):
        kept.append(bucket)
        if bucket >= max_batch:
            break
    return kept
