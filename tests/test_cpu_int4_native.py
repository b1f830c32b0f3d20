"""The int4 kernel that reads torch's packed CPU layout in place (cpu_native.int4pack_mm, kernels/cpu.py):
exact against the reference dequantize, a row's bits independent of the rows beside it, of its
tuning (rows per pass, prefetch, thread split) and of the thread count, so it serves prompts of every
length and decode batches alike; a prompt gives the same tokens whole, chunked or after a cached prefix.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_weight
from test_cpu_native import Recorder
from test_kernels import BOUND, rel_err

from text_generation_server.kernels import cpu, cpu_native
from text_generation_server.kernels.base import dequantize
from text_generation_server.kernels.phase import forward_phase

torch.set_num_threads(2)


@pytest.fixture
def native():
    if cpu_native.int4_block() is None:
        pytest.skip("torch's int4 layout at this CPU capability is not one the native kernels read "
                    "(test_the_layout_probe_follows_torchs_capability_and_unknown_layouts_keep_torchs_op covers it)")
    module = cpu_native.native()
    if module is None:  # test_cpu_native's build test fails on such a machine and says why
        pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")
    if not cpu_native.int4_native_ok(module):
        pytest.skip("the int4 kernel is not used on builds without AVX-512 or AVX2 "
                    "(test_builds_without_a_fast_int4_kernel_keep_the_earlier_int4_paths covers them)")
    return module


CASES = [
    # (K, N, bits, group_size, sym, act_order)
    (256, 192, 4, 64, False, False),
    (256, 128, 4, 128, True, True),  # act-order: permuted input
    (384, 64, 4, 32, False, True),
    (320, 128, 3, 64, False, False),  # 3-bit codes are a subset of 0..15
    (512, 64, 2, 256, True, False),
    (200, 64, 4, 100, False, True),  # groups padded to whole op groups (K=200 is no multiple of 32)
]


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13, 70])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_int4_native_rows_match_the_reference_dequantize(native, rows, case):
    k, n, bits, gs, sym, act = case
    w = make_weight(k, n, bits, gs, sym, act, seed=rows + k)
    bias = torch.randn(n)
    for dtype in (torch.bfloat16, torch.float32):
        module = cpu.CpuInt4PackKernel.build(w, bias, dtype)
        recorder = Recorder(native)
        module.native = recorder
        with forward_phase(prefill=True):
            assert rel_err(w, module, dtype, bias, lead=(rows,)) < BOUND[dtype]
        assert recorder.calls == {"int4pack_mm": 1}, (dtype, recorder.calls)
        if rows < cpu_native.INT4_DEQUANT_MIN_ROWS:  # decode batches under 64 rows: the same kernel
            assert rel_err(w, module, dtype, bias, lead=(rows,)) < BOUND[dtype]
            assert recorder.calls == {"int4pack_mm": 2}


def packed_case(k: int, n: int, gs: int, seed: int):
    """A packed weight and its float32 scales/offsets as the layer keeps them, and W [K, N] in float64."""
    w = make_weight(k, n, 4, gs, False, False, seed=seed)
    module = cpu.CpuInt4PackKernel.build(w, None, torch.bfloat16)
    return module, dequantize(w, torch.float64).t()


def test_the_kernel_is_exact_in_float32(native):
    """Against float64 arithmetic on the layer's own (bf16-stored) scales: only float32 sums differ."""
    module, _ = packed_case(384, 192, 64, seed=1)
    g = module.group_size
    s, c = module.scales_f32.double(), module.offsets_f32.double()
    q = module.packed  # decode the layout independently: block b, row k, byte j -> outputs Bb+j, Bb+B/2+j
    n, kp, block = q.shape[0], q.shape[1] * 2, cpu_native.int4_block()
    blocks = q.reshape(n // block, kp, block // 2)
    lo, hi = (blocks & 15).double(), (blocks >> 4).double()
    codes = torch.cat([lo, hi], dim=2).permute(1, 0, 2).reshape(kp, n)  # [K, N]
    weight = codes * s.repeat_interleave(g, 0) + c.repeat_interleave(g, 0)
    x = torch.randn(7, kp).bfloat16()
    got = cpu_native.int4pack_mm(native, x, q, module.scales_f32, module.offsets_f32, g)
    want = x.double() @ weight
    assert got.dtype == torch.float32 and got.shape == (7, n)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5


def test_a_rows_bits_do_not_depend_on_its_neighbours_its_tuning_or_the_threads(native):
    module, _ = packed_case(512, 256, 128, seed=2)
    args = (module.packed, module.scales_f32, module.offsets_f32, module.group_size)
    x = torch.randn(19, 512).bfloat16()
    whole = cpu_native.int4pack_mm(native, x, *args)
    for rows in ([0], [3, 4], list(range(8)), [18, 2, 7], list(range(5, 19))):
        assert torch.equal(cpu_native.int4pack_mm(native, x[rows], *args), whole[rows]), rows
    for name, params in cpu_native.INT4_NATIVE_VARIANTS.items():
        assert torch.equal(cpu_native.int4pack_mm(native, x, *args, *params), whole), name
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_native.int4pack_mm(native, x, *args), whole)
    finally:
        torch.set_num_threads(threads)


def test_prompts_take_one_path_at_every_length_and_chunking(native):
    """Whole, in chunks, or as a 1-row remainder: the same bits (kernels/phase.py's rule), because
    every prompt row count runs the native kernel (none of them dequantizes the whole weight)."""
    module, _ = packed_case(256, 128, 64, seed=3)
    recorder = Recorder(native)
    module.native = recorder
    x = torch.randn(45, 256).bfloat16()
    with forward_phase(prefill=True):
        whole = module(x)
        for cuts in ((40,), (44,), (1, 9), (8, 16, 30)):
            bounds = [0, *cuts, 45]
            assert torch.equal(torch.cat([module(x[a:b]) for a, b in zip(bounds, bounds[1:])]), whole), cuts
    assert set(recorder.calls) == {"int4pack_mm"}
    with forward_phase(prefill=False):  # decode batches under 64 rows: the same kernel, the same bits
        assert torch.equal(module(x[:5]), whole[:5])


def test_measured_names_choose_the_prompt_variant_without_changing_a_bit(native):
    module, _ = packed_case(256, 128, 64, seed=4)
    x = torch.randn(30, 256).bfloat16()
    with forward_phase(prefill=True):
        before = module(x)
        module.measured[cpu_native.INT4_PROMPT_BUCKET] = "native-r6"
        assert module.prompt_variant() == "native-r6"
        assert torch.equal(module(x), before)
        module.measured[cpu_native.INT4_PROMPT_BUCKET] = "dequant"  # not a native name: prompts keep the kernel
        assert module.prompt_variant() == cpu_native.INT4_NATIVE


def test_the_kernel_rejects_what_it_cannot_run(native):
    module, _ = packed_case(256, 128, 64, seed=5)
    args = (module.packed, module.scales_f32, module.offsets_f32)
    block = cpu_native.int4_block()
    with pytest.raises(RuntimeError, match="x must be contiguous float32"):
        native.int4pack_mm(torch.zeros(2, 128), *args, 64, block, 4, 0, 1)
    with pytest.raises(RuntimeError, match="group size 48 must be even and divide"):
        native.int4pack_mm(torch.zeros(2, 256), *args, 48, block, 4, 0, 1)
    with pytest.raises(RuntimeError, match="s and c must be"):
        native.int4pack_mm(torch.zeros(2, 256), *args, 128, block, 4, 0, 1)
    with pytest.raises(RuntimeError, match="prefetch must be"):
        native.int4pack_mm(torch.zeros(2, 256), *args, 64, block, 4, -1, 1)
    with pytest.raises(RuntimeError, match="block must be 64 or 32"):
        native.int4pack_mm(torch.zeros(2, 256), *args, 64, 16, 4, 0, 1)


def test_layers_the_kernel_cannot_run_keep_torchs_paths(native):
    w = make_weight(256, 80, 4, 128, False, False)  # N not a multiple of 64
    module = cpu.CpuInt4PackKernel.build(w, None, torch.bfloat16)
    assert module.variants(1) == ("op",) and module.prompt_variant() == "op" and module.scales_f32 is None
    with forward_phase(prefill=True):
        assert rel_err(w, module, torch.bfloat16, None, lead=(3,)) < BOUND[torch.bfloat16]


def test_a_cached_prefix_and_chunks_give_the_tokens_of_a_whole_prefill(native, tmp_path):
    """The engine end to end on a 4-bit GPTQ checkpoint in bfloat16: a 45-token prompt whole, then
    with 40 tokens from the cache and a 5-row remainder (the same tokens and logprobs, bit for bit),
    then in 8-token chunks (the same tokens)."""
    from helpers import ids_request, random_ids, run_to_end, write_checkpoint
    from test_quant_e2e import VARIANTS, write_variant

    from text_generation_server.models.loader import get_model

    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    write_checkpoint(tmp_path / "dense", "llama", seed=3, **shape)
    write_variant(tmp_path / "dense", tmp_path / "q", tmp_path / "ref", VARIANTS["gptq-v1-4bit-g64-asym"], seed=1)
    lm = get_model(str(tmp_path / "q"), dtype="bfloat16", block_size=4, quantize_lm_head="none")
    lm.allocate_kv_cache(96)
    kernels = {m.kernel_name for m in lm.model.modules() if isinstance(getattr(m, "kernel_name", None), str)}
    assert kernels == {"cpu-int4pack"}
    prompt = random_ids(45, 7)
    blocks = lm.allocator.allocate(lm.blocks_for(len(prompt) + 3))
    request = lambda **kw: ids_request(1, prompt, 3, blocks=blocks, prefill_logprobs=True, **kw)
    whole = run_to_end(lm, lm.make_batch(0, [request()]))[1]
    hit = run_to_end(lm, lm.make_batch(1, [request(cache_len=40)]))[1]
    assert hit["ids"] == whole["ids"] and hit["lps"] == whole["lps"]
    assert hit["prompt"][41:] == whole["prompt"][41:]
    # In chunks the linears give the same bits, attention over the cached chunks rounds differently
    # (a dense bfloat16 model moves its logprobs by ~1e-2 the same way): the same tokens.
    lm.max_prefill_tokens = 8
    chunked = run_to_end(lm, lm.make_batch(2, [request(chunk_len=8)]))[1]
    assert chunked["ids"] == whole["ids"]
    torch.testing.assert_close(torch.tensor(chunked["lps"]), torch.tensor(whole["lps"]), atol=3e-2, rtol=0)


def test_the_layout_probe_follows_torchs_capability_and_unknown_layouts_keep_torchs_op(monkeypatch):
    """torch packs int4 by the CPU capability it runs at (64-row blocks at AVX-512, 32 at AVX2, rows
    interleaved without AVX2): the probe says which, and a layout it cannot read leaves the layer on
    torch's op, exact."""
    capability = torch.backends.cpu.get_cpu_capability()
    assert cpu_native.int4_block() == {"AVX512": 64, "AVX2": 32}.get(capability)
    monkeypatch.setitem(cpu_native._state, "int4_block", None)
    w = make_weight(256, 128, 4, 64, False, False, seed=6)
    module = cpu.CpuInt4PackKernel.build(w, None, torch.bfloat16)
    assert module.variants(1) == ("op",) and module.prompt_variant() == "op"
    with forward_phase(prefill=True):
        assert rel_err(w, module, torch.bfloat16, None, lead=(3,)) < BOUND[torch.bfloat16]


def test_builds_without_a_fast_int4_kernel_keep_the_earlier_int4_paths(monkeypatch):
    """Where the int4 kernel would be slow (a build with neither AVX-512 nor AVX2: aarch64's NEON, an
    old x86-64), int4 layers keep torch's op for decode batches and the dequantized GEMM for every
    prompt, exact."""
    if cpu_native.native() is None or cpu_native.int4_block() is None:
        pytest.skip("no native int4 paths on this machine at all")
    monkeypatch.setitem(cpu_native._state, "int4_native", False)
    w = make_weight(256, 128, 4, 64, False, False, seed=8)
    module = cpu.CpuInt4PackKernel.build(w, None, torch.bfloat16)
    assert module.variants(1) == ("op", "dequant") and module.prompt_variant() == "dequant"
    assert module.static_variant(8) == "op" and module.static_variant(64) == "dequant"
    with forward_phase(prefill=True):
        assert rel_err(w, module, torch.bfloat16, None, lead=(3,)) < BOUND[torch.bfloat16]
    assert rel_err(w, module, torch.bfloat16, None, lead=(3,)) < BOUND[torch.bfloat16]
