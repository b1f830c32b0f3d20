"""The AVX2 switch (serve --cpu-isa avx2, TGS_CPU_ISA=avx2): the ranks start with torch's and oneDNN's
variables set before they import torch, our kernels are compiled without AVX-512 under their own
build name, and the AVX2 build computes what the native one does."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from text_generation_server.kernels import cpu_native
from text_generation_server.launcher import rank, shard_procs
from text_generation_server.settings.serve_args import ServeArgs
from text_generation_server.settings.serve_flags import CPU_ISA_ENV, cpu_isa_environment

AVX2_ENV = {CPU_ISA_ENV: "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_the_switch_and_what_the_ranks_start_with(monkeypatch):
    assert CPU_ISA_ENV == cpu_native.ISA_ENV
    ServeArgs(cpu_isa="avx2").validate()
    with pytest.raises(ValueError, match="--cpu-isa must be one of native, avx2"):
        ServeArgs(cpu_isa="avx512").validate()
    assert cpu_isa_environment("native") == {} and cpu_isa_environment("avx2") == AVX2_ENV
    assert rank.rank_environment(ServeArgs(cpu_isa="avx2"), {}) == AVX2_ENV
    started: list[dict] = []

    class Popen:
        def __init__(self, cmd, env, stdin):
            started.append(env)
            self.pid = 1

    monkeypatch.setattr(shard_procs.subprocess, "Popen", Popen)
    shard_procs.ShardProcesses(ServeArgs(cpu_isa="avx2", num_shard=2), 29500)._spawn("{}")
    assert len(started) == 2 and all(env.items() >= AVX2_ENV.items() for env in started)
    started.clear()
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    shard_procs.ShardProcesses(ServeArgs(num_shard=1), 29500)._spawn("{}")
    assert "ATEN_CPU_CAPABILITY" not in started[0]


def test_avx2_flags_and_build_name(monkeypatch):
    native_name = cpu_native.build_name()
    monkeypatch.setenv(cpu_native.ISA_ENV, "avx2")
    if X86:
        assert cpu_native.isa() == "avx2" and "-mno-avx512f" in cpu_native.cflags()
        assert cpu_native.build_name() != native_name
    else:
        assert cpu_native.isa() == "native" and cpu_native.build_name() == native_name
    monkeypatch.setenv(cpu_native.ISA_ENV, "native")
    assert cpu_native.cflags() == cpu_native.CFLAGS


CHILD = r"""
import json, sys, torch
from text_generation_server.kernels import cpu_native
sys.path.insert(0, "tests")
from test_cpu_isa import case, silu_case
module = cpu_native.native()
x, packed, s, c, gs, q8, s8 = case()
out = {"capability": torch.backends.cpu.get_cpu_capability(), "built": module is not None,
       "reason": cpu_native.unavailable_reason()}
if module is not None:
    whole = cpu_native.int4pack_mm(module, x, packed, s, c, gs)
    out["int4"] = whole.tolist()
    out["int8"] = cpu_native.int8_gemv(module, x[:3], q8, s8, torch.float32).tolist()
    out["int4_fast"] = bool(module.int4_native_isa())
    # the AVX2 build's own bits: the same for a row whatever shares the call, its rows per pass, prefetch
    same = [torch.equal(cpu_native.int4pack_mm(module, x[rows], packed, s, c, gs), whole[rows])
            for rows in ([0], [3, 1], [4, 2, 0])]
    same += [torch.equal(cpu_native.int4pack_mm(module, x, packed, s, c, gs, *params), whole)
             for params in cpu_native.INT4_NATIVE_VARIANTS.values()]
    out["int4_row_invariant"] = all(same)
    # int4 codes x int8 activations: the AVX2 build's integer dot products (torch's 32-output layout here)
    from text_generation_server.kernels import cpu_act_int8
    block = cpu_native.int4_block()
    y8 = cpu_act_int8.int4_q8_mm(module, x, packed, s, c, gs, block)
    out["q8"], out["q8_isa"], out["block"] = y8.tolist(), int(module.int4_q8_isa()), block
    out["q8_row_invariant"] = all(torch.equal(cpu_act_int8.int4_q8_mm(module, x[rows], packed, s, c, gs, block, v),
                                              y8[rows]) for rows in ([0], [3, 1], [4, 2, 0])
                                  for v in cpu_act_int8.VARIANTS)
    out["i8q8"] = cpu_act_int8.int8_q8_gemv(module, x[:3], q8, s8).tolist()
    out["i8q8_isa"] = int(module.int8_q8_isa())
    # the bfloat16 GEMM: float32 FMAs in one order in every build; on AVX2 the dense layers take it (auto)
    from text_generation_server.kernels.dense import DenseLinear
    w16 = (q8.float() / 128).bfloat16()
    out["bf16_gemm"] = cpu_native.bf16_gemm(module, x, w16, s8).float().tolist()
    out["bf16_gemm_prompt"] = DenseLinear(w16, None).prompt_variant()
    # silu * up and the RMSNorm: exp, the bfloat16 roundings and the NaN test in 8-lane AVX2 code
    gu = silu_case()
    out["silu_bits"] = module.silu_mul_bf16(gu, gu.shape[1] // 2).view(torch.int16).tolist()
    out["norm_bits"] = module.rms_norm_bf16(gu, torch.ones(gu.shape[1], dtype=torch.bfloat16), 1e-6, None)[0].view(
        torch.int16).tolist()
print("RESULT" + json.dumps(out))
"""


def case():
    """One int4 and one int8 product's inputs, the same in every process."""
    g = torch.Generator().manual_seed(0)
    k, n, gs = 256, 128, 64
    packed = torch._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32), 2)
    s = torch.rand(k // gs, n, generator=g) * 0.1
    c = torch.randn(k // gs, n, generator=g) * 0.1
    q8 = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    s8 = torch.rand(n, generator=g)
    x = torch.randn(5, k, generator=g).bfloat16()
    return x, packed, s, c, gs, q8, s8


def silu_case() -> torch.Tensor:
    """gate_up [3, 2 * 200] bfloat16: values across exp's range and past it (+-100, inf, NaN), 200 % 16 != 0."""
    g = torch.Generator().manual_seed(1)
    gu = torch.randn(3, 400, generator=g) * torch.tensor([1.0, 8.0, 40.0]).unsqueeze(1)
    gu[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 100.0, -100.0, 88.5])
    return gu.bfloat16()


@pytest.mark.skipif(not X86, reason="the AVX2 switch applies to x86-64 CPUs only (tested above: ignored elsewhere)")
def test_the_avx2_build_computes_what_the_native_one_does():
    module = cpu_native.native()
    if module is None:
        pytest.skip(f"native CPU kernels unavailable: {cpu_native.unavailable_reason()}")
    x, packed, s, c, gs, q8, s8 = case()
    want4 = cpu_native.int4pack_mm(module, x, packed, s, c, gs)
    want8 = cpu_native.int8_gemv(module, x[:3], q8, s8, torch.float32)
    env = dict(os.environ) | AVX2_ENV
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")]
    assert done.returncode == 0 and line, done.stderr[-3000:]
    got = json.loads(line[0].removeprefix("RESULT"))
    assert got["capability"] == "AVX2"  # torch's kernels followed the switch
    assert got["built"], got["reason"]
    # float sums either way (AVX-512-BF16 builds take two products per instruction): within rounding
    torch.testing.assert_close(torch.tensor(got["int4"]), want4, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(torch.tensor(got["int8"]), want8, rtol=1e-5, atol=1e-5)
    # the 8-float int4 kernel runs on AVX2 builds (it is what an AVX2 machine's int4 layers use)
    assert got["int4_fast"] and got["int4_row_invariant"]
    # int8 activations: exact integer sums and one FMA chain per output in every build, so the AVX2
    # build (vpmaddubsw + vpmaddwd, or AVX-VNNI) gives this build's bits, whatever the layout's block
    from text_generation_server.kernels import cpu_act_int8

    want_q8 = cpu_act_int8.int4_q8_mm(module, x, packed, s, c, gs, cpu_native.int4_block())
    assert got["q8_isa"] == 1 and got["block"] == 32 and got["q8_row_invariant"]
    assert torch.equal(torch.tensor(got["q8"]), want_q8)
    assert got["i8q8_isa"] == 1
    assert torch.equal(torch.tensor(got["i8q8"]), cpu_act_int8.int8_q8_gemv(module, x[:3], q8, s8))
    # the bfloat16 GEMM gives this build's bits, and AVX2 builds' dense layers run their prompts on it
    w16 = (q8.float() / 128).bfloat16()
    assert torch.equal(torch.tensor(got["bf16_gemm"]), cpu_native.bf16_gemm(module, x, w16, s8).float())
    assert got["bf16_gemm_prompt"] == "native-gemm"
    # the pointwise ops' AVX2 code (exp, roundings, NaN test by 8-lane intrinsics) gives this build's bits
    gu = silu_case()
    assert got["silu_bits"] == module.silu_mul_bf16(gu, gu.shape[1] // 2).view(torch.int16).tolist()
    norm = module.rms_norm_bf16(gu, torch.ones(gu.shape[1], dtype=torch.bfloat16), 1e-6, None)[0]
    assert got["norm_bits"] == norm.view(torch.int16).tolist()
