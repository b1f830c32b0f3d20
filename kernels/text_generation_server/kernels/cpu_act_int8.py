"""int8 activations for int4 layers on CPUs: the policy, the native kernel's wrapper and its torch reference.

Why: at one decode row an int4 layer is bound by how fast its codes become products. Multiplying them
by exact bfloat16 activations (`cpu_native.int4pack_mm`) reads the weights at 51-59% of this VM's
measured bandwidth, where llama.cpp, which rounds the activations to int8 per 32-wide block (Q8_0) and
multiplies in integers, reaches 86-97% (BENCHMARKS.md). Rounding activations changes the numbers (an
int8 step of max|x| / 127 per block of 32: about 0.2-0.5% relative error per dot product, on top of
the 4-bit weights' own), so it is a policy, switched with `serve --cpu-int8-activations` (ENV):
- auto (the default): int4 layers on CPUs take int8 activations where this build has an integer dot
  product kernel (AVX512-VNNI, or AVX2), as llama.cpp's users get for quantized weights; exact
  activations elsewhere (the generic loops are correct but not faster than the exact path). Per-channel
  int8 layers (EETQ, the int8 head) take them too where the build has no bfloat16 dot product
  (AVX512-BF16): there exact activations cost a widening and a float FMA per weight per row (AVX2
  build, Qwen2.5-1.5B EETQ against llama.cpp's Q8_0 in the same runs: ~0.65x / ~0.53x single stream /
  8 streams exact, 0.94x / 1.19x with int8 activations; BENCHMARKS.md #32 session 13); with it they
  stream near the bandwidth exactly and the integer kernel measured no faster, so they stay exact;
- on: int8 activations wherever an int4 or per-channel int8 layer runs on the CPU (the generic loops,
  or the torch reference below when the native kernels cannot be built: slow, for checking numerics);
- off: exact activations (the path the exactness tests against transformers take; tests/conftest.py
  pins it for the suite).
The layers (kernels/cpu.py: `CpuInt4PackQ8Kernel` "cpu-int4pack-q8", `CpuInt8Q8Kernel` "cpu-int8-q8")
are entries of the CPU kernel table, each just ahead of the exact kernel it refuses to take over
from with the policy's reason in the startup kernel lines; Info.kernels names them. It runs every row count and both phases (prompts and decode) on
the same arithmetic, so a row's result does not depend on its batch or on how its prompt was chunked.
"""

from __future__ import annotations

import os

import torch
from loguru import logger

from text_generation_server.kernels import cpu_native

ENV = "TGS_CPU_INT8_ACTIVATIONS"
MODES = ("auto", "on", "off")
DEFAULT = "auto"
FLAG = "--cpu-int8-activations"
BLOCK = 32  # activation values per int8 scale (llama.cpp's Q8_0 block)
# Names of the kernel's ways to run (rows per pass, prefetch bytes, blocks per task; 0 / -1: defaults):
# the same bits under each, so warmup's measurement may pick any per shape and row bucket.
Q8 = "q8"
# The preference scope the layers keep these names' measurements under (kernels/cpu_tuning.py).
SCOPE = "q8"
VARIANTS: dict[str, tuple[int, int, int]] = {Q8: (2, -1, 0), "q8-r1": (1, -1, 0), "q8-r4": (4, -1, 0),
                                             "q8-pf0": (2, 0, 0), "q8-pf16k": (2, 16384, 0)}
# Bytes the int4 x int8 kernel prefetches ahead of its reads under the names above that say -1. One
# row, cold weights, Qwen2.5-1.5B's qkv / gate_up / down shapes, one thread (2-core EPYC shared with
# other jobs, load ~2, 2026-12-06, median of 7): 20.5-22.2 GB/s at 1 KiB and 20.6-21.4 with none,
# against 17.2-18.1 at cpu_native.PREFETCH_BYTES (16 KiB, the bfloat16/int8 kernels' distance) and 16-17.5
# at 64 KiB: this kernel's lines come 128 bytes a step, and a far prefetch only evicts them.
PREFETCH_BYTES = 1024
_warned: set[str] = set()


def mode() -> str:
    """The policy in force: ENV's value, DEFAULT when unset or unknown (an unknown one is logged once)."""
    value = os.environ.get(ENV, "").strip().lower() or DEFAULT
    if value not in MODES:
        if value not in _warned:
            _warned.add(value)
            logger.warning("{}={!r} is not one of {}: using {}", ENV, value, ", ".join(MODES), DEFAULT)
        return DEFAULT
    return value


def native_isa(module: cpu_native.Extension | None, codes: str = "int4") -> int:
    """The integer dot product this build has for `codes` ("int4" or "int8" weights): 2 AVX512-VNNI,
    1 AVX2, 0 generic loops, -1 no extension."""
    if module is None:
        return -1
    return int(module.int4_q8_isa() if codes == "int4" else module.int8_q8_isa())


def has_bf16_dot(module: cpu_native.Extension | None) -> bool:
    """Whether `module` multiplies bfloat16 pairs (AVX512-BF16 `vdpbf16ps`), which makes exact
    activations cheap for per-channel int8 weights."""
    probe = getattr(module, "bf16_gemm_has_bf16_dot", None)
    return bool(probe()) if probe is not None else False


def decision(module: cpu_native.Extension | None, codes: str = "int4") -> tuple[bool, str]:
    """Whether `codes` layers take int8 activations in this process, and why (for the kernel log)."""
    chosen, isa = mode(), native_isa(module, codes)
    if chosen == "off":
        return False, f"activations kept exact ({FLAG} off / {ENV}=off)"
    if chosen == "auto" and codes == "int8" and has_bf16_dot(module):
        # Measured (BENCHMARKS.md, issue #32 third round): with AVX512-BF16 per-channel int8 weights
        # already stream near the bandwidth with exact activations at 1-2 rows, and the integer kernel
        # was 0.7x at 8 rows. Without it (AVX2) the exact form is the slower one (module docstring).
        return False, (f"auto keeps int8 layers' activations exact where the build has AVX512-BF16 "
                       f"({FLAG} on for int8 activations there too)")
    if chosen == "auto" and isa < 1:
        why = "no native CPU extension" if isa < 0 else "no AVX2 or AVX512-VNNI integer dot product in this build"
        return False, f"{why}: activations kept exact ({FLAG} auto; 'on' forces the slow form)"
    return True, ""


def describe(module: cpu_native.Extension | None) -> str:
    """One line for the startup log: the policy and what it does here."""
    use, why = decision(module)
    if not use:
        return f"{FLAG} {mode()}: int4 and int8 layers multiply exact bfloat16 activations ({why})"
    how = {2: "AVX512-VNNI vpdpbusd", 1: "AVX2 integer dot products", 0: "generic loops (slow)",
           -1: "the torch reference (slow)"}[native_isa(module)]
    int8_use, int8_why = decision(module, "int8")
    which = "int4 and int8 layers" if int8_use else "int4 layers"
    exact = "" if int8_use else f"; int8 layers multiply exact bfloat16 activations ({int8_why})"
    return (f"{FLAG} {mode()}: {which} round activations to int8 per {BLOCK}-wide block (llama.cpp's Q8_0) "
            f"and multiply in integers ({how}){exact}; '{FLAG} off' keeps them exact")


def announce(module: cpu_native.Extension | None) -> None:
    """Logs the policy once per process and policy value (the first int4 layer asks)."""
    key = f"announced:{mode()}"
    if key not in _warned:
        _warned.add(key)
        logger.info("{}", describe(module))


def int4_q8_mm(module: cpu_native.Extension | None, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
               offsets: torch.Tensor, group_size: int, block: int, variant: str = Q8) -> torch.Tensor:
    """x [M, K] @ W^T for torch's CPU int4 layout with x rounded to int8 per 32-wide block (float32 [M, N]).

    W = q * scales + offsets per group (float32 [K / group_size, N]); the native kernel where there is
    one, else `reference` (the same arithmetic in torch)."""
    if module is None:
        return reference(x.float(), packed, scales, offsets, group_size, block).float()
    if x.dtype != torch.bfloat16:  # bfloat16 is read as it is (its float32 values, exactly)
        x = x.float()
    rows, prefetch, grain = VARIANTS.get(variant, VARIANTS[Q8])
    return module.int4_q8_mm(x.contiguous(), packed, scales, offsets, group_size, block, rows,
                             PREFETCH_BYTES if prefetch < 0 else prefetch,
                             grain or cpu_native.INT4_BLOCK_GRAIN)


_NO_BIAS = torch.empty(0, dtype=torch.bfloat16)


def int4_q8_linear(module: cpu_native.Extension, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                   offsets: torch.Tensor, bias: torch.Tensor | None, group_size: int, block: int,
                   variant: str = Q8) -> torch.Tensor:
    """The layer's whole product for bfloat16 x [M, K]: int4_q8_mm's result rounded to bfloat16 (+ bias,
    bfloat16 [N] or None), in one native call, with the bits of `int4_q8_mm(...).to(bfloat16) + bias`.

    Why one call: at one decode row the q/k/v and o projections read 1-2 MiB each, and the float32 copy
    of x, the rounding of y and the bias add were each a torch op of a few microseconds around them."""
    rows, prefetch, grain = VARIANTS.get(variant, VARIANTS[Q8])
    return module.int4_q8_linear(x.contiguous(), packed, scales, offsets, _NO_BIAS if bias is None else bias,
                                 group_size, block, rows, PREFETCH_BYTES if prefetch < 0 else prefetch,
                                 grain or cpu_native.INT4_BLOCK_GRAIN)


# The tiled layout (`tile`) for the layers that take int8 activations: on by default where the native
# kernels are built; "off" keeps torch's layout read in place (the same bits: for A/B runs).
TILED_ENV = "TGS_CPU_INT4_TILED"


def tiled_enabled(module: cpu_native.Extension | None) -> bool:
    """Whether int4 layers with int8 activations get the tiled layout: a native build that has its kernel,
    and TILED_ENV not 0/false/no/off."""
    if module is None or not hasattr(module, "int4_q8_tiled_linear"):
        return False
    return os.environ.get(TILED_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def tile_for_layer(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
                   block: int) -> torch.Tensor:
    """`tile`'s bytes in a buffer of the packed layers' huge-page arena (kernels/cpu_kquant.py PackArena),
    torch's allocator when TGS_CPU_KQUANT_HUGEPAGES is off.

    Why huge pages: a one-row call streams the layer once, and on 4 KiB pages (torch's buffers on a
    machine whose transparent huge pages are "madvise") every 4 KiB is a TLB miss and a boundary the
    hardware prefetchers stop at (BENCHMARKS.md, issue #32 session 11: the tiled kernel one thread,
    cold, 1536 x 17920: 25 GB/s on 4 KiB pages, 32 on huge ones)."""
    from text_generation_server.kernels import cpu_kquant  # its arena; imported here: it imports this module's peers

    return cpu_kquant.in_arena(tile(packed, scales, offsets, group_size, block))


def int4_q8_tiled_linear(module: cpu_native.Extension, x: torch.Tensor, tiled: torch.Tensor,
                         bias: torch.Tensor | None, group_size: int, block: int, variant: str = Q8) -> torch.Tensor:
    """`int4_q8_linear` over the tiled layout (`tile`): the same bits."""
    rows, prefetch, grain = VARIANTS.get(variant, VARIANTS[Q8])
    return module.int4_q8_tiled_linear(x.contiguous(), tiled, _NO_BIAS if bias is None else bias, group_size, block,
                                       rows, PREFETCH_BYTES if prefetch < 0 else prefetch,
                                       grain or cpu_native.INT4_BLOCK_GRAIN)


def int4_q8_tiled_mm(module: cpu_native.Extension, x: torch.Tensor, tiled: torch.Tensor, group_size: int,
                     block: int, variant: str = Q8) -> torch.Tensor:
    """`int4_q8_mm` over the tiled layout (float32 [M, N]): the same bits."""
    if x.dtype != torch.bfloat16:
        x = x.float()
    rows, prefetch, grain = VARIANTS.get(variant, VARIANTS[Q8])
    return module.int4_q8_tiled_mm(x.contiguous(), tiled, group_size, block, rows,
                                   PREFETCH_BYTES if prefetch < 0 else prefetch, grain or cpu_native.INT4_BLOCK_GRAIN,
                                   False)


# The int8 kernel's names (rows per pass, prefetch bytes; -1: cpu_native.PREFETCH_BYTES): the same bits.
INT8_VARIANTS: dict[str, tuple[int, int]] = {Q8: (2, -1), "q8-r1": (1, -1), "q8-r4": (4, -1), "q8-pf0": (2, 0)}


def int8_q8_gemv(module: cpu_native.Extension | None, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                 variant: str = Q8) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] int8 * scales [N] float32)^T with x rounded to int8 per 32-wide block
    (float32 [M, N]); the native kernel where there is one, else `reference_int8`."""
    x = x.float().contiguous()
    if module is None:
        return reference_int8(x, weight, scales).float()
    rows, prefetch = INT8_VARIANTS.get(variant, INT8_VARIANTS[Q8])
    return module.int8_q8_gemv(x, weight, scales, cpu_native.PREFETCH_BYTES if prefetch < 0 else prefetch, rows,
                               False)


def reference_int8(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8_q8_gemv's arithmetic in float64 (float64 [M, N]): per 32-wide block the integer sum of codes
    times int8 activations, times the block's scale, summed, times the output's scale."""
    xq, d, _ = quantize(x, x.shape[1])
    m, k = xq.shape
    per_block = torch.einsum("mbj,nbj->mbn", xq.reshape(m, k // BLOCK, BLOCK),
                             weight.double().reshape(-1, k // BLOCK, BLOCK))
    return (per_block * d.double()[..., None]).sum(dim=1) * scales.double()[None]


def error_bound_int8(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """How far int8_q8_gemv's float32 result may lie from `reference_int8`: K / 4 fused multiply-adds over
    16 lanes, a 16-term sum and the scale, each at most 2^-24 relative of the magnitudes they add."""
    xq, d, _ = quantize(x, x.shape[1])
    m, k = xq.shape
    per_block = torch.einsum("mbj,nbj->mbn", xq.abs().reshape(m, k // BLOCK, BLOCK),
                             weight.double().abs().reshape(-1, k // BLOCK, BLOCK))
    magnitude = (per_block * d.double()[..., None]).sum(dim=1) * scales.double().abs()[None]
    return magnitude * (k // 64 + 1 + 16 + 1) * 2.0 ** -24 + 1e-30


def quantize(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 as the kernel rounds it: (codes [M, K] as float64, block scales float32
    [M, K / 32], each group's sum of scale * code sums [M, K / group_size] float64).

    d = max|x| / 127 and q = round-half-to-even(x * (1 / d)), both in float32 as the kernel computes
    them, so the codes are the kernel's exactly."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(dim=-1) / 127.0
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inverse[..., None])
    sums = (d.double() * q.double().sum(dim=-1)).reshape(m, k // group_size, group_size // BLOCK).sum(dim=-1)
    return q.reshape(m, k).double(), d, sums


def unpack(packed: torch.Tensor, block: int) -> torch.Tensor:
    """Codes [K, N] (0..15) of torch's CPU int4 layout with `block` outputs per block (cpu_native.int4_block)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    parts = packed.reshape(n // block, k, block // 2)
    return torch.cat([parts & 15, parts >> 4], dim=2).permute(1, 0, 2).reshape(k, n)


def tile(packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int, block: int) -> torch.Tensor:
    """torch's CPU int4 layout (`block` outputs per block) with its float32 scales and offsets [K / group_size, N]
    rearranged for the int8-activation kernel (cpu_native_q8_src.py "tiled"): uint8 [N / block, K / group_size,
    group_size * block / 2 + 8 * block].

    Why at load: in torch's layout a kernel step gathers each output's four input rows with a byte permute and
    reads the scales from two more strided streams; tiled, each block is one contiguous stream whose quads are
    a load and two masks away from the dot product's operands. The codes and scales are the same bytes, so
    the results are the same bits."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if block not in (32, 64) or n % block or group_size % BLOCK or k % group_size:
        raise ValueError(f"cannot tile int4 codes [{n}, {k}] in {block}-output blocks with group size {group_size}")
    groups = k // group_size
    if scales.shape != (groups, n) or offsets.shape != (groups, n):
        raise ValueError(f"scales and offsets must be [{groups}, {n}], got {list(scales.shape)} and {list(offsets.shape)}")
    # torch's bytes as [block, group, quad, row in quad, vector, lane] -> [block, group, quad, vector, lane, row]
    codes = packed.reshape(n // block, groups, group_size // 4, 4, block // 32, 16).permute(0, 1, 2, 4, 5, 3)
    codes = codes.reshape(n // block, groups, group_size * block // 2)

    def per_block(t: torch.Tensor) -> torch.Tensor:  # float32 [G, N] -> bytes [N / block, G, 4 block]
        t = t.float().reshape(groups, n // block, block).permute(1, 0, 2).contiguous()
        return t.view(torch.uint8).reshape(n // block, groups, 4 * block)

    return torch.cat([codes, per_block(scales), per_block(offsets)], dim=2).contiguous()


def untile(tiled: torch.Tensor, group_size: int, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`tile`'s inverse: (torch's packed codes uint8 [N, K / 2], scales, offsets float32 [K / group_size, N])."""
    nb, groups, part = tiled.shape
    code_bytes = group_size * block // 2
    if part != code_bytes + 8 * block:
        raise ValueError(f"tiled parts of {part} bytes are not group size {group_size} x {block}-output blocks")
    n, k = nb * block, groups * group_size
    codes = tiled[..., :code_bytes].reshape(nb, groups, group_size // 4, block // 32, 16, 4).permute(0, 1, 2, 5, 3, 4)
    packed = codes.reshape(n, k // 2).contiguous()

    def per_group(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view(torch.float32).reshape(nb, groups, block).permute(1, 0, 2).reshape(groups, n)

    return (packed, per_group(tiled[..., code_bytes:code_bytes + 4 * block]),
            per_group(tiled[..., code_bytes + 4 * block:]).contiguous())


def reference(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group_size: int,
              block: int) -> torch.Tensor:
    """The kernel's arithmetic in float64 torch ops (float64 [M, N]): per 32-wide block the integer sum
    of codes times int8 activations, times the block's scale, summed per group, then scale and offset."""
    xq, d, sums = quantize(x, group_size)
    m, k = xq.shape
    q = unpack(packed, block).double()
    n = q.shape[1]
    per_block = torch.einsum("mbj,bjn->mbn", xq.reshape(m, k // BLOCK, BLOCK), q.reshape(k // BLOCK, BLOCK, n))
    t = (per_block * d.double()[..., None]).reshape(m, k // group_size, group_size // BLOCK, n).sum(dim=2)
    return (t * scales.double()[None]).sum(dim=1) + (sums[..., None] * offsets.double()[None]).sum(dim=1)


def error_bound(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                group_size: int, block: int) -> torch.Tensor:
    """How far the kernel's float32 result may lie from `reference` [M, N]: each output is a chain of
    K / 32 + 2 K / group_size fused multiply-adds (the integer sums are exact), so at most that many
    float32 roundings of 2^-24 relative, of the magnitudes the chain adds (float32 products of |terms|)."""
    xq, d, sums = quantize(x, group_size)
    m, k = xq.shape
    q = unpack(packed, block).double()
    n = q.shape[1]
    per_block = torch.einsum("mbj,bjn->mbn", xq.abs().reshape(m, k // BLOCK, BLOCK), q.reshape(k // BLOCK, BLOCK, n))
    t = (per_block * d.double()[..., None]).reshape(m, k // group_size, group_size // BLOCK, n).sum(dim=2)
    magnitude = (t * scales.double().abs()[None]).sum(dim=1) + (sums.abs()[..., None] * offsets.double().abs()[None]
                                                               ).sum(dim=1)
    steps = k // BLOCK + 2 * (k // group_size)
    return magnitude * steps * 2.0 ** -24 + 1e-30
