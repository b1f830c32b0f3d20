"""Kernels against the reference dequantize, kernel selection, packing round trips, validation.

The reference is `base.dequantize` followed by a float64 matmul; every kernel's output must
sit within a bound relative to the output norm. The bounds are set by the activation and
scale rounding of the dtype in use (bf16: ~2^-9 per element), far below what a wrong zero
point, group or permutation produces (errors of order one).
"""

from __future__ import annotations

import random

import pytest
import torch
from helpers import make_weight

from text_generation_server.kernels import cpu, packing
from text_generation_server.kernels.base import (
    DenseFallbackError,
    LinearSpec,
    NoKernelError,
    QuantizedWeight,
    ReferenceKernel,
    dequantize,
)
from text_generation_server.kernels.select import (
    ALLOW_DENSE_ENV,
    DISABLE_ENV,
    build_linear,
    check_dense_fallback,
    choose_kernel,
    dense_fallback_allowed,
)
from text_generation_server.kernels.table import TABLES

# The kernels of quantized weights per device, in table order; on CUDA those ranked above the dense reference.
QUANTIZED = {device: [k for k in kernels if k.family == "quantized"] for device, kernels in TABLES.items()}
CUDA_COMPACT = [k for k in QUANTIZED["cuda"] if k is not ReferenceKernel]

torch.set_num_threads(1)


def rel_err(w: QuantizedWeight, module: torch.nn.Module, dtype: torch.dtype, bias: torch.Tensor | None,
            lead: tuple[int, ...] = (5,)) -> float:
    x = torch.randn(*lead, w.in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = x.double() @ dequantize(w, torch.float64).t()
    if bias is not None:
        ref = ref + bias.to(dtype).double()
    y = module(x)
    assert y.dtype == dtype and y.shape == (*lead, w.out_features)
    return ((y.double() - ref).norm() / ref.norm()).item()


BOUND = {torch.float32: 1.5e-2, torch.float16: 1.5e-2, torch.bfloat16: 2e-2}  # all run via bf16 (cpu.VIA_BF16)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


# ---------------------------------------------------------------------------------------------
# Kernels against the reference

INT4_CASES = [
    # (K, N, bits, group_size, sym, act_order)
    (256, 64, 4, 128, True, False),
    (256, 64, 4, 128, False, False),
    (256, 64, 4, 128, False, True),
    (256, 64, 4, 128, True, True),
    (384, 32, 4, 32, False, True),
    (512, 48, 4, 64, True, False),
    (512, 80, 4, 256, False, False),
    (512, 16, 4, 512, False, False),  # g512 runs as g256 with repeated scales
    (320, 32, 4, 320, True, False),  # per-channel, K=320 -> kernel group 64
    (256, 64, 3, 64, False, True),
    (256, 64, 3, 128, True, False),
    (256, 32, 2, 32, False, False),
    (256, 32, 2, 256, True, True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", INT4_CASES, ids=lambda c: "K{}N{}b{}g{}{}{}".format(
    c[0], c[1], c[2], c[3], "sym" if c[4] else "asym", "-act" if c[5] else ""))
def test_int4pack_matches_reference(case, dtype):
    k, n, bits, gs, sym, act = case
    w = make_weight(k, n, bits, gs, sym, act, seed=k + n + bits)
    spec = w.spec(dtype, "cpu")
    assert cpu.CpuInt4PackKernel.can_implement(spec) == (True, "")
    bias = torch.randn(n)
    module = cpu.CpuInt4PackKernel.build(w, bias, dtype)
    assert module.compute_dtype == torch.bfloat16  # cpu.VIA_BF16: the fast op path for every dtype
    assert rel_err(w, module, dtype, bias) < BOUND[dtype]
    assert rel_err(w, module, dtype, bias, lead=(2, 3)) < BOUND[dtype]


@pytest.mark.parametrize("case", INT4_CASES[:6] + INT4_CASES[8:10], ids=str)
def test_int4pack_native_float32_is_exact(case, monkeypatch):
    """Without the bf16 cast the fp32 op path shows the repack itself loses nothing."""
    monkeypatch.setattr(cpu, "VIA_BF16", False)
    k, n, bits, gs, sym, act = case
    w = make_weight(k, n, bits, gs, sym, act, seed=3)
    module = cpu.CpuInt4PackKernel.build(w, None, torch.float32)
    assert module.scales_and_zeros.dtype == torch.float32
    assert rel_err(w, module, torch.float32, None) < 1e-5


def test_int4pack_shard_with_misaligned_groups():
    """A row shard starting mid-group: groups of 64 then 128 rows run exactly with kernel group 64."""
    g_idx = torch.tensor([0] * 64 + [1] * 128 + [2] * 64, dtype=torch.int32)
    w = make_weight(256, 32, 4, 128, False, False, g_idx=g_idx)
    spec = w.spec(torch.float32, "cpu")
    assert spec.group_rows_gcd == 64
    assert cpu.int4_group_size(spec) == 64
    kernel, _ = choose_kernel(spec)
    assert kernel is cpu.CpuInt4PackKernel
    assert rel_err(w, kernel.build(w, None, torch.float32), torch.float32, None) < BOUND[torch.float32]


def test_int4pack_act_order_sorts_once_and_permutes_input():
    w = make_weight(256, 32, 4, 64, False, True, seed=7)
    module = cpu.CpuInt4PackKernel.build(w, None, torch.bfloat16)
    assert module.perm is not None and torch.equal(module.perm, torch.argsort(w.g_idx.long(), stable=True))
    natural = make_weight(256, 32, 4, 64, False, False, seed=7)
    assert cpu.CpuInt4PackKernel.build(natural, None, torch.bfloat16).perm is None


INT8_CASES = [
    # (K, N, bits, sym): one group spanning K
    (256, 64, 8, True),
    (256, 64, 8, False),
    (208, 24, 8, False),  # shapes the int4 op refuses are fine here
    (96, 5, 8, True),
    (128, 40, 6, False),
    (128, 40, 5, True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", INT8_CASES, ids=str)
def test_int8_matches_reference(case, dtype):
    k, n, bits, sym = case
    w = make_weight(k, n, bits, k, sym, False, seed=k + n)
    assert cpu.CpuInt8Kernel.can_implement(w.spec(dtype, "cpu")) == (True, "")
    bias = torch.randn(n)
    module = cpu.CpuInt8Kernel.build(w, bias, dtype)
    assert module.weight.dtype == torch.int8
    assert (module.offset is None) == sym
    assert rel_err(w, module, dtype, bias) < BOUND[dtype]
    assert rel_err(w, module, dtype, bias, lead=(3, 2)) < BOUND[dtype]


def test_int8_asymmetric_extreme_zero_points(monkeypatch):
    """q - z spans [-255, 255]: out of int8, so the zero point must go through the row-sum term."""
    monkeypatch.setattr(cpu, "VIA_BF16", False)
    k, n = 128, 16
    q = torch.zeros(k, n, dtype=torch.uint8)
    q[:, ::2] = 255
    zeros = torch.where(torch.arange(n) % 2 == 0, 0.0, 255.0).unsqueeze(0)
    w = QuantizedWeight(q, torch.full((1, n), 0.01), zeros, torch.zeros(k, dtype=torch.int32), 8, k)
    assert rel_err(w, cpu.CpuInt8Kernel.build(w, None, torch.float32), torch.float32, None) < 1e-5


def test_int8_act_order_single_group():
    """Per-channel with a scrambled (but single-valued) g_idx needs no permutation."""
    g_idx = torch.full((128,), 2, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    w = QuantizedWeight(torch.randint(0, 256, (128, 16), generator=gen).to(torch.uint8),
                        torch.rand(3, 16, generator=gen), None, g_idx, 8, 128)
    module = cpu.CpuInt8Kernel.build(w, None, torch.bfloat16)
    assert rel_err(w, module, torch.bfloat16, None) < BOUND[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bits,gs,sym,act", [(8, 128, False, False), (5, 32, True, True), (4, 48, False, False)])
def test_every_weight_runs_through_build_linear(bits, gs, sym, act, dtype):
    w = make_weight(192, 24, bits, gs, sym, act, seed=bits)
    module = build_linear(w, None, dtype, "cpu", layer="test")
    assert module.kernel_name == "reference"
    assert rel_err(w, module, dtype, None) < BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_int4pack_pads_groups_of_unequal_size(dtype):
    """Groups of 100 and 156 rows (an act-order row shard): no op group size tiles them, so each is
    padded to whole 32-row blocks (128 + 160 rows) by rows that read a zero input column."""
    g_idx = torch.tensor([0] * 100 + [1] * 156, dtype=torch.int32)[torch.randperm(256, generator=torch.Generator()
                                                                                  .manual_seed(0))]
    w = make_weight(256, 32, 4, 128, False, True, g_idx=g_idx)
    spec = w.spec(dtype, "cpu")
    assert spec.group_rows == (100, 156) and cpu.int4_group_size(spec) is None
    assert cpu.int4_layout(spec) == (32, 288)
    assert cpu.CpuInt4PackKernel.can_implement(spec) == (True, "")
    assert choose_kernel(spec)[0] is cpu.CpuInt4PackKernel
    bias = torch.randn(32)
    module = cpu.CpuInt4PackKernel.build(w, bias, dtype)
    assert module.padded and module.in_features == 256 and module.packed.shape == (32, 144)
    assert int((module.perm == 256).sum()) == 32  # 28 + 4 padding rows
    assert rel_err(w, module, dtype, bias) < BOUND[dtype]
    assert rel_err(w, module, dtype, bias, lead=(2, 3)) < BOUND[dtype]


def test_int4pack_padding_is_exact(monkeypatch):
    monkeypatch.setattr(cpu, "VIA_BF16", False)
    g_idx = torch.tensor([2] * 40 + [0] * 72 + [1] * 16, dtype=torch.int32)[torch.randperm(128)]
    w = make_weight(128, 16, 3, 64, True, True, g_idx=g_idx)
    module = cpu.CpuInt4PackKernel.build(w, None, torch.float32)
    assert module.padded and cpu.int4_layout(w.spec(torch.float32, "cpu")) == (32, 192)
    assert rel_err(w, module, torch.float32, None) < 1e-5


def test_build_refuses_groups_that_would_need_too_much_padding():
    # 32 groups of 8 rows: whole 32-row blocks would quadruple K.
    g_idx = (torch.arange(256, dtype=torch.int32) // 8)[torch.randperm(256)]
    w = make_weight(256, 32, 4, 8, False, True, g_idx=g_idx)
    ok, reason = cpu.CpuInt4PackKernel.can_implement(w.spec(torch.bfloat16, "cpu"))
    assert not ok and reason == ("act-order groups too small or uneven for its 32-256-row blocks: padding each group "
                                 "to whole 32-row blocks would add 768 rows to 256 (300%, over the 100% allowed)")
    with pytest.raises(ValueError, match="cpu-int4pack cannot run this weight: act-order groups too small"):
        cpu.CpuInt4PackKernel.build(w, None, torch.bfloat16)
    with pytest.raises(ValueError, match="cpu-int8 cannot run this weight: needs one group"):
        cpu.CpuInt8Kernel.build(w, None, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# Selection


def spec(k=4096, n=4096, bits=4, gs=128, zeros=False, act=False, dtype=torch.bfloat16, dev="cpu", rows=None):
    return LinearSpec(in_features=k, out_features=n, bits=bits, group_size=gs, has_zeros=zeros, act_order=act,
                      act_dtype=dtype, device_type=dev, group_rows_gcd=rows)


SELECTION = [
    # spec, chosen kernel, rejected (name, reason) in order
    (spec(), "cpu-int4pack", []),
    (spec(zeros=True, act=True), "cpu-int4pack", []),
    (spec(bits=3, gs=64), "cpu-int4pack", []),
    (spec(gs=4096, dtype=torch.float32), "cpu-int4pack", []),
    (spec(bits=8, gs=4096), "cpu-int8", [("cpu-int4pack", "needs at most 4-bit codes, got 8-bit")]),
    (spec(bits=8, gs=128), "reference", [
        ("cpu-int4pack", "needs at most 4-bit codes, got 8-bit"),
        ("cpu-int8", "needs one group spanning K=4096 (per-channel), got group size 128"),
        ("cpu-int8-group-native", "group size 128 not in (16, 32) (ggml's block groups)"),
        ("cpu-int8-group", "group size 128 not in (16, 32) (ggml's block groups)")]),
    (spec(gs=48, k=4800), "reference", [
        ("cpu-int4pack", "group size 48 not in {32,64,128,256} or a multiple of 32"),
        ("cpu-int8", "needs one group spanning K=4800 (per-channel), got group size 48"),
        ("cpu-int8-group-native", "4-bit codes are the int4 kernels' (this one takes 5 to 8 bits)"),
        ("cpu-int8-group", "4-bit codes are the int4 kernels' (this one takes 5 to 8 bits)")]),
    (spec(n=100), "reference", [
        ("cpu-int4pack", "out_features 100 not a multiple of 16"),
        ("cpu-int8", "needs one group spanning K=4096 (per-channel), got group size 128"),
        ("cpu-int8-group-native", "4-bit codes are the int4 kernels' (this one takes 5 to 8 bits)"),
        ("cpu-int8-group", "4-bit codes are the int4 kernels' (this one takes 5 to 8 bits)")]),
    (spec(n=100, gs=4096), "cpu-int8", [("cpu-int4pack", "out_features 100 not a multiple of 16")]),
    (spec(k=4112, gs=4112), "cpu-int8", [("cpu-int4pack", "in_features 4112 not a multiple of 32")]),
    (spec(k=4100, gs=4100, bits=8), "reference", [
        ("cpu-int4pack", "needs at most 4-bit codes, got 8-bit"),
        ("cpu-int8", "in_features 4100 not a multiple of 16"),
        ("cpu-int8-group-native", "group size 4100 not in (16, 32) (ggml's block groups)"),
        ("cpu-int8-group", "group size 4100 not in (16, 32) (ggml's block groups)")]),
    (spec(act=True, rows=16), "reference", [
        ("cpu-int4pack", "act-order groups of unequal size (row counts share at most 16 rows, need a multiple of 32)"),
        ("cpu-int8", "needs one group spanning K=4096 (per-channel), got group size 128"),
        ("cpu-int8-group-native", "4-bit codes are the int4 kernels' (this one takes 5 to 8 bits)"),
        ("cpu-int8-group", "4-bit codes are the int4 kernels' (this one takes 5 to 8 bits)")]),
    (spec(dtype=torch.float64), "reference", [
        ("cpu-int4pack", "activation dtype torch.float64 not in bfloat16/float16/float32"),
        ("cpu-int8", "activation dtype torch.float64 not in bfloat16/float16/float32"),
        ("cpu-int8-group-native", "activation dtype torch.float64 not in bfloat16/float16/float32"),
        ("cpu-int8-group", "activation dtype torch.float64 not in bfloat16/float16/float32")]),
]


# int4 layers with int8 activations (kernels/cpu_act_int8.py) rank first on the CPU; these tests pin
# the exact path (--cpu-int8-activations off), where that kernel refuses with this reason.
Q8_OFF = ("cpu-int4pack-q8", "activations kept exact (--cpu-int8-activations off / TGS_CPU_INT8_ACTIVATIONS=off)")


@pytest.fixture(autouse=True)
def exact_activations(monkeypatch):
    monkeypatch.setenv("TGS_CPU_INT8_ACTIVATIONS", "off")


def with_q8(rejected: list[tuple[str, str]], chosen: str) -> list[tuple[str, str]]:
    """The rejections with the int8-activation twins (they rank just before cpu-int4pack and cpu-int8 and
    run the same layers): a twin refuses with its base kernel's reason, or with Q8_OFF where its base runs
    the layer (or was switched off by name)."""
    twins = {"cpu-int4pack": "cpu-int4pack-q8", "cpu-int8": "cpu-int8-q8"}
    out = []
    for name, reason in rejected:
        if name in twins:
            out.append((twins[name], Q8_OFF[1] if reason.startswith("disabled by") else reason))
        out.append((name, reason))
    if chosen in twins:
        out.append((twins[chosen], Q8_OFF[1]))
    return out


@pytest.mark.parametrize("s,chosen,rejected", SELECTION, ids=range(len(SELECTION)))
def test_selection_and_reasons(s, chosen, rejected, monkeypatch):
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    kernel, why = choose_kernel(s)
    assert kernel.name == chosen
    assert why == with_q8(rejected, chosen)


def test_cpu_kernels_refuse_other_devices():
    for kernel in QUANTIZED["cpu"]:
        if kernel.name in ("reference", "fp8-dequant"):
            continue  # device-agnostic, or a different weight format (refused for that reason first)
        assert kernel.can_implement(spec(dev="cuda")) == (False, "device cuda")


def test_cuda_candidates_without_a_gpu_give_reasons(monkeypatch):
    """Every registered CUDA kernel says why it cannot run here; the reference takes the layer."""
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    kernel, why = choose_kernel(spec(dev="cuda"))
    if torch.cuda.is_available():
        assert kernel.name != "reference"
        return
    assert kernel.name == "reference"
    assert [name for name, _ in why] == [k.name for k in CUDA_COMPACT]
    assert all(reason for _, reason in why)


def test_reference_outranks_packed_cpu_kernels_unless_disabled(monkeypatch):
    """marlin-layout keeps 8-bit grouped weights packed but dequantizes every forward: slower than
    the dense reference, so it serves only when the reference is switched off (less memory)."""
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    assert choose_kernel(spec(bits=8, gs=128))[0].name == "reference"
    monkeypatch.setenv(DISABLE_ENV, "reference")
    assert choose_kernel(spec(bits=8, gs=128))[0].name == "marlin-layout"


def test_cpu_kernel_order():
    assert [k.name for k in QUANTIZED["cpu"][:4]] == ["cpu-int4pack-q8", "cpu-int4pack", "cpu-int8-q8", "cpu-int8"]


def test_disable_falls_through(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "cpu-int4pack")
    kernel, why = choose_kernel(spec(gs=4096))
    assert kernel.name == "cpu-int8"
    assert why == [Q8_OFF, ("cpu-int4pack", f"disabled by {DISABLE_ENV}"), ("cpu-int8-q8", Q8_OFF[1])]
    monkeypatch.setenv(DISABLE_ENV, " cpu-int4pack , cpu-int8")
    kernel, why = choose_kernel(spec(gs=4096))
    assert kernel is ReferenceKernel
    assert [n for n, _ in why] == ["cpu-int4pack-q8", "cpu-int4pack", "cpu-int8-q8", "cpu-int8",
                                   "cpu-int8-group-native", "cpu-int8-group"]
    w = make_weight(256, 32, 4, 256, True, False)
    module = build_linear(w, None, torch.bfloat16, "cpu")
    assert module.kernel_name == "reference"


def test_no_kernel_lists_every_reason(monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "reference")
    with pytest.raises(NoKernelError) as err:
        choose_kernel(spec(bits=8, gs=128, zeros=True))
    msg = str(err.value)
    assert "cpu-int4pack: needs at most 4-bit codes, got 8-bit" in msg
    assert "cpu-int8: needs one group spanning K=4096" in msg
    assert f"reference: disabled by {DISABLE_ENV}" in msg
    assert "marlin-layout: " in msg and "asymmetric" in msg


def test_build_linear_logs_choice_once(monkeypatch):
    from loguru import logger

    monkeypatch.delenv(DISABLE_ENV, raising=False)
    lines: list[str] = []
    sink = logger.add(lines.append, level="INFO", format="{message}")
    try:
        w = make_weight(256, 32, 8, 64, True, False)
        for _ in range(3):
            build_linear(w, None, torch.bfloat16, "cpu", layer="selftest.mlp.down_proj")
    finally:
        logger.remove(sink)
    chosen = [ln for ln in lines if ln.startswith("selftest.mlp.down_proj")]
    assert len(chosen) == 1
    assert "kernel reference" in chosen[0] and "cpu-int4pack: needs at most 4-bit codes, got 8-bit" in chosen[0]


# ---------------------------------------------------------------------------------------------
# CUDA: no silent fallback to dense weights


@pytest.fixture
def no_gpu(monkeypatch):
    """Whatever this machine has: every CUDA kernel sees no device, nothing disabled or allowed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv(DISABLE_ENV, raising=False)
    monkeypatch.delenv(ALLOW_DENSE_ENV, raising=False)


def test_cuda_refuses_the_dense_reference_with_every_reason(no_gpu):
    w = make_weight(256, 64, 4, 128, True, False)
    kernel, rejected = choose_kernel(w.spec(torch.float16, "cuda"))  # selection still answers
    assert kernel is ReferenceKernel and [n for n, _ in rejected] == [k.name for k in CUDA_COMPACT]
    with pytest.raises(DenseFallbackError) as err:
        build_linear(w, None, torch.float16, "cuda", layer="layers.0.mlp.down_proj")
    msg = str(err.value)
    assert msg.startswith("layers.0.mlp.down_proj: no compact kernel can run this 4-bit integer layer [64x256] on "
                          "CUDA, and the 'reference' kernel that is left would keep a dense float16 copy of the "
                          "weights (4x the memory of the quantized ones, at dense speed). Kernels passed over: ")
    for name, reason in rejected:
        assert f"{name}: {reason}" in msg
    assert msg.endswith("To accept dense weights for such layers, pass --allow-dense-fallback "
                        "(TGS_ALLOW_DENSE_FALLBACK=1).")


def test_cuda_refusal_names_disabled_kernels(no_gpu, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, ",".join(k.name for k in CUDA_COMPACT))
    with pytest.raises(DenseFallbackError, match=r"8x the memory .* Kernels passed over: triton-gemm: disabled by "
                                                 r"TGS_DISABLE_KERNELS; tinygemm: disabled by TGS_DISABLE_KERNELS; "):
        build_linear(make_weight(128, 32, 4, 32, False, True), None, torch.float32, "cuda")


def test_cuda_dense_fallback_when_allowed_warns_once(no_gpu, monkeypatch):
    from loguru import logger

    monkeypatch.setenv(ALLOW_DENSE_ENV, "1")
    w = make_weight(256, 64, 4, 128, True, False)
    lines: list[str] = []
    sink = logger.add(lines.append, level="WARNING", format="{level} {message}")
    try:
        modules = [build_linear(w, None, torch.float32, "cuda", layer="selftest.guard") for _ in range(2)]
    finally:
        logger.remove(sink)
    assert [m.kernel_name for m in modules] == ["reference", "reference"]
    assert rel_err(w, modules[0], torch.float32, None) < 1e-6
    assert len(lines) == 1 and lines[0].startswith("WARNING selftest.guard: 4-bit integer layer [64x256] on CUDA runs "
                                                   "on 'reference', a dense float32 copy")
    assert "allowed by TGS_ALLOW_DENSE_FALLBACK" in lines[0] and "triton-gemm: " in lines[0]


def test_cpu_keeps_the_dense_reference(no_gpu):
    """On CPU the reference is a ranked choice (the fast path for 8-bit groups), never refused."""
    module = build_linear(make_weight(256, 32, 8, 64, True, False), None, torch.bfloat16, "cpu")
    assert module.kernel_name == "reference"


def test_compact_cuda_kernels_pass_the_guard(no_gpu):
    from text_generation_server.kernels import tinygemm, triton_gemm

    s = spec(dev="cuda")
    for kernel in (triton_gemm.TritonGemmKernel, tinygemm.TinyGemmKernel):
        assert check_dense_fallback(s, kernel, []) is None


def test_which_kernels_keep_a_dense_copy():
    """The integer reference, bitsandbytes' 4-bit reference and fp8-dense dequantize once into the
    activation dtype. sparse-2:4 keeps a dequantized copy too, but half the values in the 2:4 sparse
    form it is chosen for, so it is not a fallback."""
    every = {k for kernels in TABLES.values() for k in kernels}
    assert sorted({(k.__module__.rsplit(".", 1)[-1], k.name) for k in every if k.dense_copy}) == [
        ("base", "reference"), ("bitsandbytes", "reference"), ("fp8", "fp8-dense")]


@pytest.mark.parametrize("value,allowed", [("1", True), ("true", True), ("YES", True), (" on ", True), ("0", False),
                                           ("", False), ("no", False), ("2", False)])
def test_allow_dense_fallback_values(value, allowed, monkeypatch):
    monkeypatch.setenv(ALLOW_DENSE_ENV, value)
    assert dense_fallback_allowed() is allowed


def test_spec_group_rows_gcd_default():
    assert spec(k=4096, gs=128).rows_per_group_gcd() == 128
    assert spec(k=320, gs=128).rows_per_group_gcd() == 64  # 128, 128, 64
    assert spec(k=2048, gs=4096).rows_per_group_gcd() == 2048  # row shard of a per-channel weight
    assert spec(rows=96).rows_per_group_gcd() == 96


# ---------------------------------------------------------------------------------------------
# Packing


def ref_bitstream(codes: list[int], bits: int) -> list[int]:
    """An independent, one-integer-per-row dense LSB-first bitstream."""
    acc = 0
    for i, c in enumerate(codes):
        acc |= c << (bits * i)
    n_words = -(-len(codes) * bits // 32)
    return [(acc >> (32 * j)) & 0xFFFFFFFF for j in range(n_words)]


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("length", [1, 7, 32, 33, 96, 101])
def test_pack_bits_matches_bitstream_and_round_trips(bits, length):
    rnd = random.Random(bits * 1000 + length)
    codes = torch.tensor([[rnd.randrange(2**bits) for _ in range(length)] for _ in range(3)])
    packed = packing.pack_bits(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (3, packing.packed_len(length, bits))
    for row in range(3):
        assert [w & 0xFFFFFFFF for w in packed[row].tolist()] == ref_bitstream(codes[row].tolist(), bits)
    assert torch.equal(packing.unpack_bits(packed, bits, length), codes.to(torch.uint8))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("k", [32, 64, 96, 40, 24])
def test_gptq_qweight_round_trip(bits, k):
    gen = torch.Generator().manual_seed(bits + k)
    codes = torch.randint(0, 2**bits, (k, 24), generator=gen)
    qweight = packing.pack_gptq_qweight(codes, bits)
    assert qweight.shape == (-(-k * bits // 32), 24)
    assert torch.equal(packing.unpack_gptq_qweight(qweight, bits, k), codes.to(torch.uint8))
    if k * bits % 32 == 0:
        assert torch.equal(packing.unpack_gptq_qweight(qweight, bits), codes.to(torch.uint8))


def test_gptq_qweight_layout_facts():
    # 4-bit: row k sits in word-row k // 8 at bit 4 * (k % 8).
    codes = torch.arange(16).remainder(16).reshape(16, 1)
    assert [w & 0xFFFFFFFF for w in packing.pack_gptq_qweight(codes, 4).flatten().tolist()] == [0x76543210, 0xFEDCBA98]
    # 3-bit: code 10 straddles words 0 and 1 (bits 30-31, then bit 0).
    codes = torch.zeros(32, 1, dtype=torch.int64)
    codes[10] = 0b111
    assert [w & 0xFFFFFFFF for w in packing.pack_gptq_qweight(codes, 3).flatten().tolist()] == [0xC0000000, 0x1, 0x0]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptq_qzeros_round_trip_and_v1_words(bits):
    gen = torch.Generator().manual_seed(bits)
    zeros = torch.randint(0, 2**bits, (3, 64), generator=gen)
    qzeros = packing.pack_gptq_qzeros(zeros, bits)
    assert qzeros.shape == (3, 64 * bits // 32)
    assert torch.equal(packing.unpack_gptq_qzeros(qzeros, bits), zeros.to(torch.uint8))
    if bits == 4:  # symmetric 4-bit: v1 stores 7 (z - 1), v2 stores 8
        assert packing.pack_gptq_qzeros(torch.full((1, 8), 7), 4).item() == 0x77777777
        assert packing.pack_gptq_qzeros(torch.full((1, 8), 8), 4).item() & 0xFFFFFFFF == 0x88888888


def test_awq_interleave_and_round_trip():
    word = packing.pack_awq(torch.arange(8).reshape(1, 8)).item() & 0xFFFFFFFF
    assert word == 0x75316420  # nibble i holds column [0,2,4,6,1,3,5,7][i]
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (40, 64), generator=gen)
    packed = packing.pack_awq(codes)
    assert packed.shape == (40, 8)
    assert torch.equal(packing.unpack_awq(packed), codes.to(torch.uint8))
    # Reading without the interleave scrambles columns: the interleave is real.
    assert not torch.equal(packing.unpack_bits(packed, 4, 64), codes.to(torch.uint8))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [64, 100, 7])
def test_pack_quantized_round_trip(bits, k):
    gen = torch.Generator().manual_seed(k)
    signed = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (16, k), generator=gen)
    codes = signed + 2 ** (bits - 1)
    packed = packing.pack_pack_quantized(codes, bits)
    assert packed.shape == (16, -(-k // (32 // bits)))
    assert torch.equal(packing.unpack_pack_quantized(packed, bits, k), codes.to(torch.uint8))
    assert (packed[0, 0].item() & ((1 << bits) - 1)) == codes[0, 0].item()  # least significant first along K


def test_packing_errors():
    with pytest.raises(ValueError, match=r"codes must be in \[0, 16\) for 4-bit packing, got \[0, 16\]"):
        packing.pack_gptq_qweight(torch.tensor([[0, 16]] * 8), 4)
    with pytest.raises(ValueError, match="codes must be in"):
        packing.pack_bits(torch.tensor([[-1, 0]]), 2)
    with pytest.raises(ValueError, match="integer tensor"):
        packing.pack_bits(torch.zeros(2, 8), 4)
    with pytest.raises(ValueError, match="bits must be an integer in"):
        packing.pack_bits(torch.zeros(2, 8, dtype=torch.int64), 9)
    with pytest.raises(ValueError, match="100 codes of 4 bits pack into 13 int32 words, got 12"):
        packing.unpack_pack_quantized(torch.zeros(2, 12, dtype=torch.int32), 4, 100)
    with pytest.raises(ValueError, match="must be int32"):
        packing.unpack_bits(torch.zeros(2, 12, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="multiple of 8, got 12"):
        packing.pack_awq(torch.zeros(4, 12, dtype=torch.int64))
    with pytest.raises(ValueError, match="4-bit codes only, got 8-bit"):
        packing.unpack_awq(torch.zeros(4, 2, dtype=torch.int32), 8)
    with pytest.raises(ValueError, match="qweight must be 2-D"):
        packing.unpack_gptq_qweight(torch.zeros(4, dtype=torch.int32), 4)


# ---------------------------------------------------------------------------------------------
# QuantizedWeight validation


def parts(k=64, n=16, groups=2):
    return dict(qweight=torch.zeros(k, n, dtype=torch.uint8), scales=torch.ones(groups, n), zeros=None,
                g_idx=torch.arange(k, dtype=torch.int32) // (k // groups), bits=4, group_size=k // groups)


@pytest.mark.parametrize("change,message", [
    (dict(bits=7), "unsupported bits 7"),
    (dict(bits=16), "unsupported bits 16"),
    (dict(group_size=0), "group_size must be positive"),
    (dict(qweight=torch.zeros(2, 64, 16, dtype=torch.uint8)), r"qweight must be 2-D \[K, N\], got shape \[2, 64, 16\]"),
    (dict(scales=torch.ones(2, 15)), r"scales must be \[groups, 16\], got \[2, 15\]"),
    (dict(zeros=torch.ones(3, 16)), r"zeros must match scales \[2, 16\], got \[3, 16\]"),
    (dict(g_idx=torch.zeros(63, dtype=torch.int32)), r"g_idx must be \[64\], got \[63\]"),
    (dict(g_idx=torch.full((64,), 2, dtype=torch.int32)), r"g_idx values must be in \[0, 2\)"),
    (dict(g_idx=torch.full((64,), -1, dtype=torch.int32)), r"g_idx values must be in \[0, 2\)"),
    (dict(qweight=torch.full((64, 16), 16, dtype=torch.uint8)), r"qweight codes must be in \[0, 16\) for 4-bit"),
])
def test_quantized_weight_validation(change, message):
    kwargs = parts()
    kwargs.update(change)
    with pytest.raises(ValueError, match=message):
        QuantizedWeight(**kwargs)


def test_quantized_weight_shape_and_reference():
    w = make_weight(64, 16, 4, 32, False, False)
    assert w.shape == (16, 64)
    dense = dequantize(w)
    k, n = 37, 5
    g = int(w.g_idx[k])
    expected = w.scales[g, n] * (w.qweight[k, n].float() - w.zeros[g, n])
    assert dense.shape == (16, 64) and torch.isclose(dense[n, k], expected)
