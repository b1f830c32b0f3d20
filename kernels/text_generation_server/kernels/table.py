"""Every linear kernel, one table per device, fastest first: read top to bottom to know what runs.

kernels/select.py walks a device's table for each layer, asking the kernels of the layer's family
(QuantKernel.family) in this order whether they can run it (`can_implement`), and takes the first
that can and is not switched off (TGS_DISABLE_KERNELS), unless the operator names a kernel to
prefer (TGS_PREFER_KERNELS) or a measurement on this machine chose one (select.py; TIMED_PAIRS
below: kernels timed against each other per decode batch size at warmup). A kernel that
cannot run here (no Triton, no GPU, no bitsandbytes) stays listed and refuses with its reason, so
the log says why each layer runs where it does.

Only select.py imports this module: kernel modules never see the table, so none of them imports
another to rank before it.
"""

from __future__ import annotations

from text_generation_server.kernels.base import QuantKernel, ReferenceKernel
from text_generation_server.kernels.bitsandbytes import (
    Bnb4bitReferenceKernel,
    BnbCpu4bitKernel,
    BnbMatmul4bitKernel,
)
from text_generation_server.kernels.cpu import CpuInt4PackKernel, CpuInt4PackQ8Kernel, CpuInt8Kernel, CpuInt8Q8Kernel
from text_generation_server.kernels.cpu_group_int8 import CpuGroupInt8Kernel, CpuGroupInt8NativeKernel
from text_generation_server.kernels.cpu_kquant import CpuKQuantKernel
from text_generation_server.kernels.dense import DenseKernel
from text_generation_server.kernels.fp8 import (
    Fp8DenseKernel,
    Fp8DequantCudaKernel,
    Fp8DequantKernel,
    Fp8ScaledMMKernel,
)
from text_generation_server.kernels.marlin import SPARSE_24_FORMAT, MarlinLayoutKernel, Sparse24Kernel
from text_generation_server.kernels.tinygemm import TinyGemmKernel
from text_generation_server.kernels.triton_gemm import TritonGemmKernel

CPU: tuple[type[QuantKernel], ...] = (
    # -- quantized: integer codes (GPTQ, AWQ, EXL2, compressed-tensors, EETQ, bnb int8, Marlin), fp8
    # int4 codes x int8 activations (llama.cpp's Q8_0 scheme): only where --cpu-int8-activations allows
    CpuInt4PackQ8Kernel,
    CpuInt4PackKernel,  # torch's int4 op; prompts through the native dequantized bf16 GEMM
    CpuInt8Q8Kernel,  # the same with int8 activations (llama.cpp's Q8_0 x Q8_0): as --cpu-int8-activations allows
    CpuInt8Kernel,  # per-channel codes of any width: native matrix-vector kernel, torch's op, bf16 GEMM
    CpuGroupInt8NativeKernel,  # the same, codes read in place for decode rows (native AVX-512 build)
    CpuGroupInt8Kernel,  # group scales, codes up to 8 bits (GGUF Q8_0, Q6_K, Q5_*): int8 in memory
    # The dense reference (dequantized once, torch's matmul) outruns kernels that keep the codes
    # packed and dequantize every forward (marlin-layout: ~10x slower at 4096x4096). They rank after
    # it: chosen when `reference` is disabled (TGS_DISABLE_KERNELS=reference) to trade speed for
    # 4-8x less weight memory.
    ReferenceKernel,
    MarlinLayoutKernel,
    Fp8DenseKernel,  # CPUs have no fp8 arithmetic: dense speed first, as the reference
    Fp8DequantKernel,  # fp8-resident, dequantized per forward
    # GGUF Q4_K/Q6_K blocks read in place: their own weight format, which every kernel above refuses
    # (ranked last so no other layer's log lists it); decoded to "int" when it cannot run (select.py)
    CpuKQuantKernel,
    # -- bitsandbytes 4-bit, in its own layout
    BnbCpu4bitKernel,
    Bnb4bitReferenceKernel,
    BnbMatmul4bitKernel,
    # -- unquantized
    DenseKernel,
)

CUDA: tuple[type[QuantKernel], ...] = (
    # -- quantized
    TritonGemmKernel,  # fused Triton dequantize+GEMM: every integer layer
    TinyGemmKernel,  # torch's int4 matmul: serves when triton-gemm is missing or disabled
    Sparse24Kernel,  # 2:4 weights on the sparse tensor cores
    Fp8ScaledMMKernel,  # fp8 tensor cores (sm89+)
    Fp8DequantCudaKernel,
    ReferenceKernel,  # last: a dense copy, refused unless --allow-dense-fallback (select.check_dense_fallback)
    # -- bitsandbytes 4-bit
    BnbMatmul4bitKernel,
    Bnb4bitReferenceKernel,
    # -- unquantized
    DenseKernel,
)

TABLES: dict[str, tuple[type[QuantKernel], ...]] = {"cpu": CPU, "cuda": CUDA}

# Kernels warmup times against each other where both can run a layer (kernels/select.py,
# `tune_kernels`), per device: (the one the table ranks first, its rival). The first is built at
# load and keeps every prompt; warmup builds the rival from the first one's weights, times both at
# the CUDA graphs' batch sizes, and keeps the rival's copy only where it ran a decode batch faster.
# On an H100, tinygemm ran the 4096x4096 4-bit batch-1 product in 10.8 us to triton-gemm's 16.3,
# and triton-gemm the batch-16 one in 15.3 us to tinygemm's 24.5 (BENCHMARKS.md, "First GPU run").
TIMED_PAIRS: dict[str, tuple[tuple[type[QuantKernel], type[QuantKernel]], ...]] = {
    "cpu": (),
    "cuda": ((TritonGemmKernel, TinyGemmKernel),),
}

# The family of kernels each LinearSpec.weight_format is ranked among (QuantKernel.family).
FAMILY_OF_FORMAT: dict[str, str] = {
    "int": "quantized",
    SPARSE_24_FORMAT: "quantized",
    "fp8": "quantized",
    "bnb-nf4": "bnb-4bit",
    "bnb-fp4": "bnb-4bit",
    "dense": "dense",
}
