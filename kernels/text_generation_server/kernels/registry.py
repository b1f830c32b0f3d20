"""Imports every kernel module so each registers itself in base.KERNELS, in priority order.

Order matters: within a device list, earlier registration means preferred. A module that
cannot run on this machine (no Triton, no CUDA) still imports; its kernels then refuse
every spec through can_implement, with the reason, rather than failing the import.
"""

from text_generation_server.kernels import triton_gemm  # noqa: F401  (CUDA first choice: fused Triton)
from text_generation_server.kernels import tinygemm  # noqa: F401  (CUDA: torch's int4 matmul, bf16 only)
from text_generation_server.kernels import cpu  # noqa: F401
from text_generation_server.kernels.base import ReferenceKernel, register

# On CPU the dense reference (dequantized once, torch's matmul) outruns kernels that keep the
# codes packed and dequantize every forward (marlin-layout: ~10x slower at 4096x4096). They
# rank after it: chosen when `reference` is disabled (TGS_DISABLE_KERNELS=reference) to trade
# speed for 4-8x less weight memory.
register("cpu", ReferenceKernel)
from text_generation_server.kernels import marlin  # noqa: F401,E402
from text_generation_server.kernels import fp8  # noqa: F401,E402
