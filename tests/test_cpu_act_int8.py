"""int8 activations for int4 layers (kernels/cpu_act_int8.py, `--cpu-int8-activations`): the native kernel
equals a torch reference of the same arithmetic within a stated float32 bound on odd shapes at 1-8 rows
(and more), its builds give the same bits (generic loops, AVX512-VNNI here; AVX2 in test_cpu_isa.py), a
row's bits do not depend on the rows beside it; the policy chooses the kernel through the CPU table,
says why not where it does not; a model's greedy tokens with the policy off are the exact path's, with
it on its logits stay within a stated bound of the exact ones, and a sequence's tokens do not depend on
its batch or on how its prompt is chunked.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_weight

from text_generation_server.kernels import cpu, cpu_act_int8, cpu_native
from text_generation_server.kernels.base import dequantize
from text_generation_server.kernels.phase import forward_phase
from text_generation_server.kernels.select import choose_kernel
from text_generation_server.settings import serve_args

torch.set_num_threads(2)


@pytest.fixture
def native():
    module = cpu_native.native()
    if module is None or cpu_native.int4_block() is None:
        pytest.skip(f"no native int4 kernels here: {cpu_native.unavailable_reason() or 'int4 layout'}")
    return module


def pack(codes: torch.Tensor, block: int) -> torch.Tensor:
    """Codes [N, K] in torch's CPU int4 layout with `block` outputs per block (cpu_act_int8.unpack's inverse)."""
    n, k = codes.shape
    parts = codes.t().reshape(k, n // block, block).permute(1, 0, 2).to(torch.uint8)  # [N / B, K, B]
    return (parts[..., : block // 2] | (parts[..., block // 2:] << 4)).reshape(n, k // 2).contiguous()


def layout(module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A q8 layer's codes in torch's layout with its float32 scales and offsets (cpu_act_int8.untile of
    its tiled bytes where it has them)."""
    if module.tiled is not None:
        assert module.packed is None and module.scales_f32 is None  # torch's layout let go
        return cpu_act_int8.untile(module.tiled, module.group_size, module.block)
    return module.packed, module.scales_f32, module.offsets_f32


SHAPES = [  # (K, N, group size): K of 3, 5, 9, 13 blocks of 32, uneven group counts, N of 1-5 blocks
    (96, 64, 32), (160, 192, 32), (288, 128, 96), (416, 320, 32), (512, 64, 256), (384, 128, 128)]


@pytest.mark.parametrize("block", [64, 32])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_kernel_is_the_reference_arithmetic_within_its_float_bound(native, shape, block):
    k, n, gs = shape
    g = torch.Generator().manual_seed(k + n)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    packed = pack(codes, block)
    assert torch.equal(cpu_act_int8.unpack(packed, block).t().int(), codes)
    s = torch.rand(k // gs, n, generator=g) * 0.05
    c = torch.randn(k // gs, n, generator=g) * 0.05
    x = (torch.randn(13, k, generator=g) * torch.rand(13, k, generator=g) * 4).bfloat16().float()
    x[0, 32:64] = 0  # an all-zero block: scale 0
    x[1, :] = 0
    x[2, 5] = 300.0  # one large value: the rest of its block rounds to few levels
    want = cpu_act_int8.reference(x, packed, s, c, gs, block)
    bound = cpu_act_int8.error_bound(x, packed, s, c, gs, block)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 13):
        for variant in cpu_act_int8.VARIANTS:
            got = cpu_act_int8.int4_q8_mm(native, x[:rows], packed, s, c, gs, block, variant)
            assert bool(((got.double() - want[:rows]).abs() <= bound[:rows]).all()), (rows, variant)
    whole = cpu_act_int8.int4_q8_mm(native, x, packed, s, c, gs, block)
    # the generic loops (aarch64, x86-64 without AVX2) give this build's bits: exact integer sums, one FMA chain
    assert torch.equal(native.int4_q8_mm_generic(x, packed, s, c, gs, block), whole)
    # a row's bits do not depend on the rows beside it, the rows per pass, prefetch or thread split
    for rows in ([0], [3, 1], [12, 4, 2, 0], list(range(1, 9))):
        assert torch.equal(cpu_act_int8.int4_q8_mm(native, x[rows], packed, s, c, gs, block), whole[rows])
    torch.set_num_threads(1)
    try:
        assert torch.equal(cpu_act_int8.int4_q8_mm(native, x, packed, s, c, gs, block), whole)
    finally:
        torch.set_num_threads(2)
    # without the extension: the torch reference itself (rounded to float32)
    torch.testing.assert_close(cpu_act_int8.int4_q8_mm(None, x, packed, s, c, gs, block), whole, rtol=1e-5, atol=1e-5)


def test_activation_rounding_is_llama_cpps_q8_0_with_float32_scales():
    """Per 32-wide block d = max|x| / 127 (float32; llama.cpp stores it as float16), codes round(x / d)
    in -127..127, the block's largest magnitude at +-127; the group sums are sum of d * codes."""
    x = torch.tensor([[0.5, -1.0, 0.25] + [0.0] * 29 + [2.54, 1.27] + [0.0] * 30])
    q, d, sums = cpu_act_int8.quantize(x, 64)
    assert d[0].tolist() == [pytest.approx(1.0 / 127), pytest.approx(2.54 / 127)]
    assert q[0, 1] == -127 and q[0, 32] == 127 and abs(float(q[0, 0]) - 63.5) == 0.5 and q[0, 2] == 32
    assert float(q.abs().max()) == 127 and int((q[0, 3:32] != 0).sum()) == 0
    assert sums.shape == (1, 1)
    assert float(sums[0, 0]) == pytest.approx(float((d[0, 0] * q[0, :32].sum() + d[0, 1] * q[0, 32:].sum())))


def test_the_policy_is_one_flag_and_one_variable(monkeypatch):
    assert serve_args.CPU_INT8_ACTIVATIONS_ENV == cpu_act_int8.ENV
    assert serve_args.CPU_INT8_ACTIVATIONS_MODES == cpu_act_int8.MODES
    assert serve_args.ServeArgs().cpu_int8_activations == cpu_act_int8.DEFAULT == "auto"
    with pytest.raises(ValueError, match="--cpu-int8-activations must be one of auto, on, off"):
        serve_args.ServeArgs(cpu_int8_activations="yes").validate()
    from text_generation_server.launcher import rank

    assert rank.rank_environment(serve_args.ServeArgs(cpu_int8_activations="off"), {})[cpu_act_int8.ENV] == "off"
    # the flag given on the command line wins over a variable the launcher inherited
    assert rank.rank_environment(serve_args.ServeArgs(), {cpu_act_int8.ENV: "off"})[cpu_act_int8.ENV] == "auto"
    assert cpu_act_int8.ENV not in rank.rank_environment(serve_args.ServeArgs(), {})
    monkeypatch.setenv(cpu_act_int8.ENV, "bogus")
    assert cpu_act_int8.mode() == "auto"
    monkeypatch.setenv(cpu_act_int8.ENV, "off")
    assert cpu_act_int8.decision(None) == (False, "activations kept exact (--cpu-int8-activations off / "
                                                      "TGS_CPU_INT8_ACTIVATIONS=off)")

    class Build:
        def __init__(self, isa, bf16_dot=False):
            self.isa, self.bf16_dot = isa, bf16_dot

        def int4_q8_isa(self):
            return self.isa

        def int8_q8_isa(self):
            return self.isa

        def bf16_gemm_has_bf16_dot(self):
            return int(self.bf16_dot)

    monkeypatch.setenv(cpu_act_int8.ENV, "auto")
    assert cpu_act_int8.decision(Build(2))[0] and cpu_act_int8.decision(Build(1))[0]
    use, why = cpu_act_int8.decision(Build(0))
    assert not use and "no AVX2 or AVX512-VNNI" in why
    assert not cpu_act_int8.decision(None)[0]
    # int8 layers: int8 activations where the build has an integer kernel and no bfloat16 dot product
    assert cpu_act_int8.decision(Build(1), "int8")[0] and cpu_act_int8.decision(Build(2), "int8")[0]
    use, why = cpu_act_int8.decision(Build(2, bf16_dot=True), "int8")
    assert not use and "AVX512-BF16" in why and cpu_act_int8.decision(Build(2, bf16_dot=True))[0]
    assert not cpu_act_int8.decision(Build(0), "int8")[0] and not cpu_act_int8.decision(None, "int8")[0]
    assert "int4 and int8 layers round" in cpu_act_int8.describe(Build(1))
    line = cpu_act_int8.describe(Build(2, bf16_dot=True))
    assert "int4 layers round" in line and "int8 layers multiply exact bfloat16 activations" in line
    monkeypatch.setenv(cpu_act_int8.ENV, "on")
    assert cpu_act_int8.decision(Build(0))[0] and cpu_act_int8.decision(None)[0]
    assert "generic loops (slow)" in cpu_act_int8.describe(Build(0))


def test_the_cpu_table_chooses_the_kernel_by_the_policy(native, monkeypatch):
    w = make_weight(256, 128, 4, 64, False, False, seed=3)
    spec = w.spec(torch.bfloat16, "cpu")
    monkeypatch.setenv(cpu_act_int8.ENV, "off")
    kernel, rejected = choose_kernel(spec)
    assert kernel is cpu.CpuInt4PackKernel
    assert ("cpu-int4pack-q8", "activations kept exact (--cpu-int8-activations off / TGS_CPU_INT8_ACTIVATIONS=off)"
            ) in rejected
    monkeypatch.setenv(cpu_act_int8.ENV, "auto")
    kernel, _ = choose_kernel(spec)
    assert kernel is (cpu.CpuInt4PackQ8Kernel if native.int4_q8_isa() >= 1 else cpu.CpuInt4PackKernel)
    monkeypatch.setenv(cpu_act_int8.ENV, "on")
    assert choose_kernel(spec)[0] is cpu.CpuInt4PackQ8Kernel
    monkeypatch.setenv("TGS_DISABLE_KERNELS", "cpu-int4pack-q8")
    assert choose_kernel(spec)[0] is cpu.CpuInt4PackKernel
    # a layer torch's int4 layout does not tile (N = 80) stays exact, and says why
    ok, why = cpu.CpuInt4PackQ8Kernel.can_implement(make_weight(256, 80, 4, 64, False, False).spec(torch.bfloat16,
                                                                                                   "cpu"))
    assert not ok and "not whole" in why


@pytest.mark.parametrize("case", [(256, 192, 4, 64, False, False), (256, 128, 4, 128, True, True),
                                  (200, 64, 4, 100, False, True), (320, 128, 3, 64, False, False)], ids=str)
def test_a_layer_runs_every_row_count_and_phase_on_the_same_arithmetic(native, monkeypatch, case):
    """Act-order permutations and padded groups included: the layer equals the reference of its permuted
    input, prompts and decode alike, and each row's bits do not depend on its batch."""
    monkeypatch.setenv(cpu_act_int8.ENV, "on")
    k, n, bits, gs, sym, act = case
    w = make_weight(k, n, bits, gs, sym, act, seed=k + n)
    bias = torch.randn(n)
    module = cpu.CpuInt4PackQ8Kernel.build(w, bias, torch.bfloat16)
    assert module.int8_activations and module.prompt_variant() == "q8" and module.static_variant(1) == "q8"
    x = torch.randn(11, k).bfloat16()
    with torch.inference_mode():
        with forward_phase(prefill=True):
            prompt = module(x)
        with forward_phase(prefill=False):
            decode = [module(x[i:i + 1]) for i in range(11)]
            batch8 = module(x[:8])
    assert torch.equal(torch.cat(decode), prompt) and torch.equal(batch8, prompt[:8])
    xp = x.float()
    if module.padded:
        xp = torch.nn.functional.pad(xp, (0, 1))
    if module.perm is not None:
        xp = xp.index_select(1, module.perm)
    want = cpu_act_int8.reference(xp.bfloat16().float(), *layout(module), module.group_size, cpu_native.int4_block())
    torch.testing.assert_close(prompt.float(), (want.float().bfloat16().float() + bias.bfloat16().float()
                                                ).bfloat16().float(), rtol=2e-2, atol=2e-2)
    # against the exact weights: within the int8 step of the activations (stated: 2% relative, Frobenius)
    exact = x.float() @ dequantize(w).t() + bias
    assert float((prompt.float() - exact).norm() / exact.norm()) < 2e-2


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(256, 192, 64), (1536, 256, 128), (96, 64, 32)], ids=str)
def test_the_one_call_layer_path_has_the_bits_of_the_torch_ops_it_replaces(native, monkeypatch, shape, bias):
    """int4_q8_linear (bfloat16 in, bfloat16 out, the bias added) equals int4_q8_mm's float32 result
    rounded by torch and the bias added by torch, bit for bit; the layer's forward takes it where it can
    and gives the general path's bits at every row count and in both phases."""
    monkeypatch.setenv(cpu_act_int8.ENV, "on")
    k, n, gs = shape
    w = make_weight(k, n, 4, gs, False, False, seed=k + n + bias)
    b = torch.randn(n) * 4 if bias else None
    module = cpu.CpuInt4PackQ8Kernel.build(w, b, torch.bfloat16)
    assert module.direct_q8
    block = cpu_native.int4_block()
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(9, k, generator=g) * 3).bfloat16()
    x[1, :32] = 0  # a zero block
    packed, scales, offsets = layout(module)
    for rows in (1, 2, 3, 8, 9):
        for variant in cpu_act_int8.VARIANTS:
            want = cpu_act_int8.int4_q8_mm(native, x[:rows].float(), packed, scales, offsets, gs, block,
                                           variant).bfloat16()
            if b is not None:
                want = want + module.bias
            got = cpu_act_int8.int4_q8_linear(native, x[:rows], packed, scales, offsets, module.bias, gs, block, variant)
            assert got.dtype == torch.bfloat16 and torch.equal(got, want), (rows, variant)
            if module.tiled is not None:
                assert torch.equal(cpu_act_int8.int4_q8_tiled_linear(native, x[:rows], module.tiled, module.bias, gs,
                                                                     block, variant), want), (rows, variant)
    # bfloat16 x is read as it is: int4_q8_mm gives the bits of its float32 copy
    assert torch.equal(cpu_act_int8.int4_q8_mm(native, x, packed, scales, offsets, gs, block),
                       cpu_act_int8.int4_q8_mm(native, x.float(), packed, scales, offsets, gs, block))
    general = cpu.CpuInt4PackQ8Kernel.build(w, b, torch.bfloat16)
    general.direct_q8 = False
    with torch.inference_mode():
        for prefill in (True, False):
            with forward_phase(prefill=prefill):
                assert torch.equal(module(x), general(x))
                assert torch.equal(module(x[:1].reshape(1, 1, k)), general(x[:1]).reshape(1, 1, n))
    with pytest.raises(RuntimeError, match="bias must be empty or bfloat16"):
        native.int4_q8_linear(x, packed, scales, offsets, torch.zeros(n + 1).bfloat16(), gs, block, 2, 0, 1)
    if module.tiled is not None:
        with pytest.raises(RuntimeError, match="bias must be empty or bfloat16"):
            native.int4_q8_tiled_linear(x, module.tiled, torch.zeros(n + 1).bfloat16(), gs, block, 2, 0, 1)


def _model(tmp_path, monkeypatch, mode: str):
    from helpers import write_checkpoint
    from test_quant_e2e import VARIANTS, write_variant

    from text_generation_server.models.loader import get_model

    if not (tmp_path / "q").exists():
        shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
        write_checkpoint(tmp_path / "dense", "llama", seed=3, **shape)
        write_variant(tmp_path / "dense", tmp_path / "q", tmp_path / "ref", VARIANTS["gptq-v1-4bit-g64-asym"], seed=1)
    monkeypatch.setenv(cpu_act_int8.ENV, mode)
    lm = get_model(str(tmp_path / "q"), dtype="bfloat16", block_size=4, quantize_lm_head="none")
    lm.allocate_kv_cache(160)
    kernels = {m.kernel_name for m in lm.model.modules() if isinstance(getattr(m, "kernel_name", None), str)}
    return lm, kernels


def test_a_model_off_is_the_exact_path_and_on_stays_within_its_bound(native, tmp_path, monkeypatch):
    from helpers import ids_request, random_ids, run_to_end

    prompt = random_ids(30, 11)
    results = {}
    for mode in ("off", "on"):
        lm, kernels = _model(tmp_path, monkeypatch, mode)
        assert kernels == {"on": {"cpu-int4pack-q8"}, "off": {"cpu-int4pack"}}[mode]
        blocks = lm.allocator.allocate(lm.blocks_for(len(prompt) + 6))
        results[mode] = run_to_end(lm, lm.make_batch(0, [ids_request(1, prompt, 6, blocks=blocks,
                                                                     prefill_logprobs=True)]))[1]
    # With the policy off the layers are the exact path's (test_cpu_int4_native holds it against the
    # dequantized reference); on, the prompt's logprobs move by the int8 step only: stated bound 0.1 nats.
    on, off = (torch.tensor(results[m]["prompt"][1:]) for m in ("on", "off"))
    assert 0 < float((on - off).abs().max()) < 0.1, (on - off).abs().max()
    assert results["on"]["ids"][:2] == results["off"]["ids"][:2]


def test_a_sequences_tokens_do_not_depend_on_its_batch_or_its_prompts_chunks(native, tmp_path, monkeypatch):
    from helpers import ids_request, random_ids, run_to_end

    lm, kernels = _model(tmp_path, monkeypatch, "on")
    assert kernels == {"cpu-int4pack-q8"}
    prompts = [random_ids(37, 5), random_ids(20, 6), random_ids(9, 7)]

    def request(rid, prompt, **kw):
        blocks = lm.allocator.allocate(lm.blocks_for(len(prompt) + 8))
        return ids_request(rid, prompt, 8, blocks=blocks, **kw)

    alone = run_to_end(lm, lm.make_batch(0, [request(1, prompts[0])]))[1]
    together = run_to_end(lm, lm.make_batch(1, [request(i + 1, p) for i, p in enumerate(prompts)]))[1]
    assert together["ids"] == alone["ids"] and together["lps"] == alone["lps"]
    lm.max_prefill_tokens = 8
    chunked = run_to_end(lm, lm.make_batch(2, [request(1, prompts[0], chunk_len=8)]))[1]
    assert chunked["ids"] == alone["ids"]


# -- int8 weights (per-channel: EETQ, the int8 head) ---------------------------------------------------------
@pytest.mark.parametrize("shape", [(32, 1), (96, 3), (160, 67), (1568, 130), (2048, 9)], ids=str)
def test_the_int8_kernel_is_the_reference_arithmetic_within_its_float_bound(native, shape):
    """K of 1, 3, 5, 49 and 64 blocks (a 32-wide tail chunk where K is no multiple of 64), N with tails of 1-3."""
    k, n = shape
    g = torch.Generator().manual_seed(k * n)
    w = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, generator=g) * 0.01
    x = (torch.randn(13, k, generator=g) * torch.rand(13, k, generator=g) * 4).bfloat16().float()
    x[1, :] = 0
    want, bound = cpu_act_int8.reference_int8(x, w, s), cpu_act_int8.error_bound_int8(x, w, s)
    for rows in (1, 2, 3, 4, 5, 8, 13):
        for variant in cpu_act_int8.INT8_VARIANTS:
            got = cpu_act_int8.int8_q8_gemv(native, x[:rows], w, s, variant)
            assert bool(((got.double() - want[:rows]).abs() <= bound[:rows]).all()), (rows, variant)
    whole = cpu_act_int8.int8_q8_gemv(native, x, w, s)
    assert torch.equal(native.int8_q8_gemv(x, w, s, 0, 2, True), whole)  # the generic loops: the same bits
    for rows in ([0], [3, 1], [12, 4, 2, 0]):
        assert torch.equal(cpu_act_int8.int8_q8_gemv(native, x[rows], w, s), whole[rows])
    # without the extension: the torch reference rounded to float32, within the same bound
    assert bool(((cpu_act_int8.int8_q8_gemv(None, x, w, s).double() - whole.double()).abs() <= 2 * bound).all())


def test_int8_layers_and_the_int8_head_take_the_policy(native, monkeypatch):
    w = make_weight(256, 96, 8, 256, True, False, seed=4)
    spec = w.spec(torch.bfloat16, "cpu")
    monkeypatch.setenv(cpu_act_int8.ENV, "off")
    assert choose_kernel(spec)[0] is cpu.CpuInt8Kernel
    monkeypatch.setenv(cpu_act_int8.ENV, "auto")  # int8 layers: exact where the build has AVX512-BF16
    kernel, rejected = choose_kernel(spec)
    if cpu_act_int8.has_bf16_dot(native):
        assert kernel is cpu.CpuInt8Kernel and rejected[-1][0] == "cpu-int8-q8" and "AVX512-BF16" in rejected[-1][1]
    else:
        assert kernel is cpu.CpuInt8Q8Kernel
    monkeypatch.setenv(cpu_act_int8.ENV, "on")
    assert choose_kernel(spec)[0] is cpu.CpuInt8Q8Kernel
    module = cpu.CpuInt8Q8Kernel.build(w, None, torch.bfloat16)
    assert module.int8_activations and module.keep_rows_invariant() and module.prompt_variant() == "q8"
    x = torch.randn(11, 256).bfloat16()
    with torch.inference_mode():
        with forward_phase(prefill=True):
            prompt = module(x)
        with forward_phase(prefill=False):
            decode = torch.cat([module(x[i:i + 1]) for i in range(11)])
    assert torch.equal(decode, prompt)
    exact = x.float() @ dequantize(w).t()
    assert float((prompt.float() - exact).norm() / exact.norm()) < 2e-2
    ok, why = cpu.CpuInt8Q8Kernel.can_implement(make_weight(272, 64, 8, 272, True, False).spec(torch.bfloat16, "cpu"))
    assert not ok and "not a multiple of 32" in why


def test_an_int4_model_with_the_int8_head_runs_both_on_int8_activations(native, tmp_path, monkeypatch):
    from helpers import ids_request, random_ids, run_to_end, write_checkpoint
    from test_quant_e2e import VARIANTS, write_variant

    from text_generation_server.models.loader import get_model

    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    write_checkpoint(tmp_path / "dense", "llama", seed=3, **shape)
    write_variant(tmp_path / "dense", tmp_path / "q", tmp_path / "ref", VARIANTS["gptq-v1-4bit-g64-asym"], seed=1)
    out = {}
    for mode in ("off", "on"):
        monkeypatch.setenv(cpu_act_int8.ENV, mode)
        lm = get_model(str(tmp_path / "q"), dtype="bfloat16", block_size=4, quantize_lm_head="int8")
        lm.allocate_kv_cache(96)
        assert lm.model.head.projection.linear.kernel_name == {"on": "cpu-int8-q8", "off": "cpu-int8"}[mode]
        prompt = random_ids(25, 3)
        blocks = lm.allocator.allocate(lm.blocks_for(len(prompt) + 4))
        out[mode] = run_to_end(lm, lm.make_batch(0, [ids_request(1, prompt, 4, blocks=blocks,
                                                                 prefill_logprobs=True)]))[1]
    on, off = (torch.tensor(out[m]["prompt"][1:]) for m in ("on", "off"))
    assert 0 < float((on - off).abs().max()) < 0.1
