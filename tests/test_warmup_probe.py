"""The CPU warmup's estimate of the largest forwards' memory (engine/warmup_probe.py), and the
resident memory a rank keeps after warmup (engine/resident.py).

The estimate is checked against the same forwards run at full size and measured the same way,
on the embedded model with the router's warmup batch; the tracker itself against allocations of
known size. The resident bound runs a fresh process (the embedded model, loaded and warmed up as
a rank does) and holds its RSS to 1.15 x (weights + KV cache) + RESIDENT_MARGIN_MIB, loose
enough for any machine and tight enough that a regression of a gigabyte cannot land.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from text_generation_server.engine import memory, resident
from text_generation_server.engine.memory import MemoryReading
from text_generation_server.engine.types import GenerationRequest
from text_generation_server.engine.warmup import _decode_batch, probes_suffice
from text_generation_server.engine.warmup_probe import (
    PeakTracker,
    estimate_activations,
    fit_decode,
    fit_prefill,
    measure_peak,
)
from text_generation_server.generation.sampling import SamplingParams
from text_generation_server.models.loader import get_model

MIB = 2**20
# The interpreter, torch, tokenizers, grpc and loguru, resident in a rank before any model: about
# 320 MiB on Linux x86-64 with torch 2.13; the rest is slack for other machines and allocators.
RESIDENT_MARGIN_MIB = 600


# -- the tracker -------------------------------------------------------------------------------
@torch.inference_mode()
def test_the_tracker_counts_new_storages_until_their_last_tensor_dies():
    x = torch.randn(256, 1024)
    w = torch.randn(4096, 1024)  # existed before: its transposed view is not an allocation

    def forward():
        a = x @ w.T  # 4 MiB
        b = torch.nn.functional.silu(a)  # 4 MiB
        b.mul_(2)  # in place: nothing new
        c = b.view(-1) * a.view(-1)  # 4 MiB; a view of b keeps nothing alive past b
        del a, b
        d = c[:10]  # a view of c: c's 4 MiB stay until d dies too
        del c
        return d.sum()

    assert measure_peak(forward) == 12 * MIB
    with PeakTracker() as tracker:
        kept = torch.ones(1024, 256)
        dropped = torch.ones(1024, 256)
        del dropped
    assert tracker.peak == 2 * MIB and tracker.live == MIB
    del kept
    assert tracker.live == 0


# -- the fits ----------------------------------------------------------------------------------
def test_a_quadratic_is_recovered_and_never_undershoots():
    def f(n):
        return 1000 + 300 * n + 2 * n * n

    fit = fit_prefill([(32, f(32)), (64, f(64)), (128, f(128))])
    assert fit.fixed == pytest.approx(1000) and fit.per_token == pytest.approx(300)
    assert fit.per_token_pair == pytest.approx(2)
    # A batch of 4 prompts of 256 tokens: the n^2 part is bounded by tokens x longest.
    assert fit.batch(1024, 256, 4, per_prompt=50) == pytest.approx(1000 + 300 * 1024 + 2 * 1024 * 256 + 150, abs=1)


def test_a_concave_curve_is_bounded_by_a_line_above_every_point():
    points = [(32, 10_000), (64, 16_000), (128, 20_000)]  # saturating (chunked logits)
    fit = fit_prefill(points)
    assert fit.per_token_pair == 0
    assert all(fit.batch(n, n, 1, 0) >= p for n, p in points)
    assert fit.batch(512, 512, 1, 0) >= 20_000


def test_decode_line_and_bad_input():
    fixed, per_row = fit_decode([(1, 110), (4, 400), (16, 1600)])
    assert per_row == pytest.approx(100) and fixed == pytest.approx(10)
    assert fit_decode([(8, 800)]) == (0.0, 100.0)
    with pytest.raises(ValueError, match="at least one"):
        fit_prefill([])


def test_probes_run_on_a_cpu_only_past_their_size_and_without_graphs():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert probes_suffice(cpu, [], 4096, 1)
    assert probes_suffice(cpu, [], 64, 128)
    assert not probes_suffice(cpu, [], 128, 16)  # the real forwards are no larger than the probes
    assert not probes_suffice(cuda, [], 4096, 128)
    assert not probes_suffice(cpu, [1, 2], 4096, 128)  # graphs (emulated on CPU in tests) need the real ones


def test_the_plan_keeps_the_estimated_activations_out_of_the_share():
    reading = MemoryReading("cpu", 1000 * MIB, 2000 * MIB)
    plain = memory.plan_kv_cache(reading, bytes_per_block=MIB, block_size=16, memory_fraction=0.5)
    kept = memory.plan_kv_cache(reading, bytes_per_block=MIB, block_size=16, memory_fraction=0.5,
                                activation_bytes=200 * MIB)
    assert (plain.num_blocks, kept.num_blocks) == (500, 400)
    assert kept.activation_bytes == 200 * MIB and kept.available_bytes == 1000 * MIB
    with pytest.raises(ValueError, match="activation_bytes"):
        memory.plan_kv_cache(reading, bytes_per_block=MIB, block_size=16, memory_fraction=0.5, activation_bytes=-1)


# -- the estimate against the real forwards -----------------------------------------------------
def router_batch(max_prefill: int, max_input: int) -> list[GenerationRequest]:
    """The router's warmup batch (router/main.py warmup_batch): "_test " prompts with prompt
    logprobs and top-n tokens, max_input tokens each, max_prefill in all."""
    out, tokens = [], 0
    while tokens < max_prefill:
        cut = min(max_input, max_prefill - tokens)
        out.append(GenerationRequest(
            id=len(out), inputs="_test " * max_input, truncate=cut, prefill_logprobs=True, top_n_tokens=20,
            max_new_tokens=1, ignore_eos_token=True,
            sampling=SamplingParams(temperature=0.9, top_k=10, top_p=0.9, typical_p=0.9, repetition_penalty=1.2,
                                    frequency_penalty=0.1, seed=0)))
        tokens += cut
    return out


@torch.inference_mode()
def test_the_estimate_bounds_the_largest_forwards_measured(monkeypatch):
    lm = get_model(None)
    max_prefill, max_input, rows = 1024, 512, 64
    lm.allocate_kv_cache(1 + 2 * lm.blocks_for(max_input + 1))
    first: list[int] = []

    def run_prefill(requests):
        batch = lm.make_batch(0, requests)
        with PeakTracker() as tracker:
            _, next_batch, _ = lm.generate_token(batch)
        first.append(batch.states[0].prompt_ids[0])
        if next_batch is not None:
            lm.release(next_batch)
        return tracker.peak

    def run_decode(n):
        batch = _decode_batch(lm, n, first[0])
        with PeakTracker() as tracker:
            _, next_batch, _ = lm.generate_token(batch)
        if next_batch is not None:
            lm.release(next_batch)
        return tracker.peak

    at_once = lm.PROMPT_LOGIT_ELEMENTS // lm.config.vocab_size
    assert at_once > max_prefill  # the embedded model's 4k vocabulary: every row at once
    estimate = estimate_activations(lm.builder.tokenize, router_batch(max_prefill, max_input), rows, run_prefill,
                                    run_decode, at_once)
    assert [n for n, _ in estimate.prefill_points] == [32, 64, 128]
    assert estimate.prompt_logprob_bytes > 0
    assert [r for r, _ in estimate.decode_points] == [1, 4, 16]
    prefill = run_prefill(router_batch(max_prefill, max_input))
    decode = run_decode(rows)
    # Measured on torch 2.13: 1.02x and 1.001x (1.035x and 1.00003x on a Qwen2.5-0.5B-shaped bf16
    # model); an estimate below the real peak would let the KV cache crowd out the largest prefill.
    assert prefill <= estimate.prefill_bytes <= 1.5 * prefill
    assert decode <= estimate.decode_bytes <= 1.5 * decode


def test_a_cpu_warmup_past_the_probes_runs_only_small_forwards(monkeypatch):
    from loguru import logger

    lm = get_model(None, max_batch_size=64)
    sizes = []
    inner = lm.generate_token

    def step(batch):
        sizes.append(("prefill" if batch.prefilling else "decode",
                      sum(s.input_length for s in batch.states) if batch.prefilling else len(batch)))
        return inner(batch)

    monkeypatch.setattr(lm, "generate_token", step)
    monkeypatch.setattr(memory, "read_memory", lambda device: MemoryReading("cpu", 4096 * MIB, 8192 * MIB))
    lines = []
    sink = logger.add(lambda m: lines.append(m.record["message"]), level="INFO")
    try:
        supported = lm.warmup(router_batch(1024, 512), 512, 1024, 1024, 0.1)
    finally:
        logger.remove(sink)
    assert sizes == [("prefill", 32), ("prefill", 64), ("prefill", 128), ("prefill", 32), ("decode", 1),
                     ("decode", 4), ("decode", 16)]
    line = next(x for x in lines if x.startswith("warmup: activation peak estimated"))
    assert "for the prefill of 1024 tokens (" in line and "MiB of it prompt logprobs)" in line
    assert "for a decode step of 64 rows (max_batch_size)" in line
    assert "MiB activation peak (estimated)" in line
    assert f"= {supported} tokens at {lm.kv_bytes_per_token} bytes per token" in line
    assert any(x.startswith("warmup phases: ") and "probe forwards" in x for x in lines)
    assert any(x.startswith("resident memory after warmup: ") for x in lines)
    # The KV cache's share is taken after the estimate: 0.1 x (4096 MiB - activations - transient).
    assert supported < 0.1 * 4096 * MIB / lm.kv_bytes_per_token
    assert lm.max_prefill_tokens == 1024


# -- resident memory ---------------------------------------------------------------------------
def _resident_file() -> int:
    return resident.read_resident().file


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_unused_checkpoint_pages_are_released_and_written_pages_kept(tmp_path):
    from safetensors import safe_open

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.randn(8 * MIB // 4), "b": torch.randn(8 * MIB // 4), "c": torch.randn(8 * MIB // 4)},
              str(path))
    with safe_open(str(path), framework="pt") as f:
        a, b, c = f.get_tensor("a"), f.get_tensor("b"), f.get_tensor("c")
    expected_b = b.clone()
    copy = a * 1  # a copy: a's pages are no longer needed
    float(a.sum() + b.sum() + c.sum())  # every page resident
    c[:1024] = 7.0  # privately written: must survive
    address = c.data_ptr()
    del a, c
    before = _resident_file()
    released = resident.release_checkpoint_pages()
    after = _resident_file()
    assert released >= 8 * MIB and before - after >= 7 * MIB
    assert torch.equal(b, expected_b)  # used pages kept (or read back from the file)
    assert ctypes.c_float.from_address(address).value == 7.0
    del copy


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_a_warmed_up_rank_holds_weights_cache_and_a_margin(tmp_path):
    script = textwrap.dedent("""
        import json, sys, torch
        sys.path.insert(0, {tests!r})
        from test_warmup_probe import router_batch
        from text_generation_server.engine.resident import read_resident, weight_bytes
        from text_generation_server.models.loader import get_model
        lm = get_model(None, max_batch_size=32)
        supported = lm.warmup(router_batch(1024, 512), 512, 1024, 1024, 0.1, max_batch_total_tokens=65536)
        print(json.dumps(dict(rss=read_resident().rss, weights=weight_bytes(lm.model),
                              kv=lm.kv_cache.num_blocks * lm.kv_bytes_per_block, tokens=supported)))
    """).format(tests=str(__import__("pathlib").Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["tokens"] == 65536
    bound = 1.15 * (figures["weights"] + figures["kv"]) + RESIDENT_MARGIN_MIB * MIB
    assert figures["rss"] <= bound, figures


def test_prompt_logprobs_count_only_the_rows_computed_at_once():
    body = {32: 1000, 64: 2000, 128: 4000}
    calls = []

    def run_prefill(requests):
        (request,) = requests
        calls.append((request.truncate, request.prefill_logprobs))
        return body[request.truncate] + (request.prefill_logprobs and 500 * request.truncate)

    batch = [GenerationRequest(id=0, inputs="", input_ids=list(range(1, 513)), prefill_logprobs=True)] * 2
    estimate = estimate_activations(lambda r: r.input_ids, batch, 8, run_prefill, lambda rows: 10 * rows,
                                    logit_rows_at_once=100)
    assert calls == [(32, False), (64, False), (128, False), (32, True)]
    assert estimate.prompt_logprob_bytes == 500 * 100  # not 500 x 1024
    unbounded = estimate_activations(lambda r: r.input_ids, batch, 8, run_prefill, lambda rows: 10 * rows)
    assert unbounded.prompt_logprob_bytes == 500 * 1024
    plain = [GenerationRequest(id=0, inputs="", input_ids=list(range(1, 513)))]
    assert estimate_activations(lambda r: r.input_ids, plain, 8, run_prefill, lambda rows: 10 * rows
                                ).prompt_logprob_bytes == 0


# -- one layer of each kind ----------------------------------------------------------------------
def test_one_layer_of_each_kind_is_probed(tmp_path):
    from family_cases import write_family_checkpoint

    from text_generation_server.engine.warmup_probe import probing_layers, representative_layers

    lm = get_model(None, max_batch_size=4)
    assert representative_layers(lm.model.layers) == [0]  # four identical llama layers
    # gemma3: sliding, full, sliding -> the sliding and the full kind
    write_family_checkpoint(tmp_path / "gemma3", "gemma3_text")
    gemma = get_model(str(tmp_path / "gemma3"), max_batch_size=4)
    assert representative_layers(gemma.model.layers) == [0, 1]
    layers = gemma.model.layers
    with probing_layers(gemma.model) as (kept, total):
        assert (kept, total) == (2, 3) and list(gemma.model.layers) == [layers[0], layers[1]]
    assert gemma.model.layers is layers


@torch.inference_mode()
def test_probing_one_layer_of_each_kind_measures_the_whole_stacks_peaks():
    from text_generation_server.engine.warmup import _probe
    from text_generation_server.engine import warmup_probe

    lm = get_model(None, max_batch_size=32)
    requests = router_batch(1024, 512)
    _probe(lm, requests, 32)  # first calls allocate a few hundred bytes once (lazily built state)
    few, *_ = _probe(lm, requests, 32)
    real = warmup_probe.probing_layers
    try:
        warmup_probe.probing_layers = lambda model: real(torch.nn.Module())  # the whole stack
        import text_generation_server.engine.warmup as warmup_module

        saved, warmup_module.probing_layers = warmup_module.probing_layers, warmup_probe.probing_layers
        whole, *_ = _probe(lm, requests, 32)
    finally:
        warmup_probe.probing_layers = real
        warmup_module.probing_layers = saved
    assert few.prefill_points == whole.prefill_points
    assert few.decode_points == whole.decode_points
    assert few.prompt_logprob_bytes == whole.prompt_logprob_bytes
