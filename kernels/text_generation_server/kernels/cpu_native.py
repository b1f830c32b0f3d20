"""Native CPU kernels, compiled on this machine on first use, with torch's ops as the fallback.

Why compile at all: torch's weight-only ops are the CPU path for int8 and int4 weights, and two
of their costs dominate CPU serving (benchmarks/kernels_cpu.py, BENCHMARKS.md):
- `_weight_int8pack_mm` streams the weights once per activation row, so a decode batch of 8
  reads them 8 times, and a single row reads them at ~2/3 of what this kernel reaches;
- both ops run prompt-sized inputs 5-8x slower than dequantizing row blocks to bfloat16 and
  calling torch's bfloat16 GEMM (oneDNN, AMX where the CPU has it).

The extension is built by torch.utils.cpp_extension with `-O3 -march=native` into torch's
extension cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), under a name that
hashes the source, the compiler flags, torch's version and this CPU's model and flags, so a cache
shared between machines never hands one CPU another's instructions. Building takes about 40 s
once per machine and needs a C++ compiler; without one, or with TGS_CPU_NATIVE_KERNELS=0, every
layer keeps torch's ops and the log says why, once.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import threading
import time
from collections.abc import Iterator
from types import ModuleType

import torch
from loguru import logger

from text_generation_server.kernels.cpu_native_decode_src import with_decode_kernels
from text_generation_server.kernels.cpu_native_gemm_src import with_gemm_kernels
from text_generation_server.kernels.cpu_native_group_src import with_group_kernels
from text_generation_server.kernels.cpu_native_kquant_src import with_kquant_kernels
from text_generation_server.kernels.cpu_native_pointwise_src import with_pointwise_kernels
from text_generation_server.kernels.cpu_native_src import FUNCTIONS, SOURCE
from text_generation_server.kernels.phase import pad_prompt_rows

SOURCE, FUNCTIONS = with_gemm_kernels(SOURCE, FUNCTIONS)  # bf16 GEMM through float32 FMAs (dense.py)
SOURCE, FUNCTIONS = with_group_kernels(SOURCE, FUNCTIONS)  # the group-int8 kernels (cpu_group_int8.py)
SOURCE, FUNCTIONS = with_kquant_kernels(SOURCE, FUNCTIONS)  # GGUF Q4_K/Q6_K blocks in place (cpu_kquant.py)
SOURCE, FUNCTIONS = with_pointwise_kernels(SOURCE, FUNCTIONS)  # a bf16 layer's norms, rotary, silu * up (layers/)
SOURCE, FUNCTIONS = with_decode_kernels(SOURCE, FUNCTIONS)  # decode attention over the paged cache (layers/attention.py)

ENV = "TGS_CPU_NATIVE_KERNELS"
CFLAGS = ("-O3", "-march=native", "-fopenmp")
# TGS_CPU_ISA=avx2 (serve --cpu-isa avx2): compiled without AVX-512 (GCC's -mno-avx512f turns off
# every AVX-512 extension with it), as on an AVX2-only machine; torch and oneDNN follow only if
# ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 were set before torch was imported (the
# launcher starts ranks so). The source picks its AVX-512, AVX2 or generic code at compile time from
# the flags, so the same source serves every x86-64 and aarch64 CPU.
ISA_ENV = "TGS_CPU_ISA"
AVX2_CFLAGS = ("-mno-avx512f",)
# torch ships its own libgomp.so.1; the extension links against the same soname, so at run time
# it shares torch's OpenMP runtime (one thread pool, torch.set_num_threads applies) rather than
# bringing a second one whose idle threads would spin against torch's.
LDFLAGS = ("-fopenmp",)

# Row thresholds of decode batches (a prefill takes its layer's prompt path at every row count, the
# dequantized bfloat16 GEMM where the layer has one: kernels/phase.py). Rows up to which the int8
# matrix-vector kernel runs (it keeps one accumulator per row in registers); rows from which a layer
# dequantizes row blocks and calls the bfloat16 GEMM.
INT8_GEMV_MAX_ROWS = 8
# ... and inner sizes up to which it does. With the non-temporal prefetch it lost to torch's op at
# K = 8960 (an MLP's down projection at 1.5B); prefetching into L2 it streams 18-22 GB/s there at
# 1-2 rows against torch's 15-17 and ties at 8 (BENCHMARKS.md). The bound stays for activation rows
# far past L2 (8 rows of 64K float32 = 2 MiB).
INT8_GEMV_MAX_K = 65536
INT8_DEQUANT_MIN_ROWS = 32
# bfloat16 weights (dense layers and the head): rows up to which the matrix-vector product runs
# instead of torch's GEMM (oneDNN). With AVX512-BF16 the product multiplies bf16 x by the weights as
# they lie (vdpbf16ps) and reads each weight once for up to 8 rows: cold Qwen2.5-1.5B shapes on the
# 2-core EPYC (no AMX), 1.7-2.6x oneDNN's speed at 3-8 rows on qkv, o_proj and gate_up, level on down
# (BENCHMARKS.md, issue #32 session 12; 0.55-0.8x at 8 rows before x was taken as bfloat16). On a
# build without it (x widened to float32 FMAs) 2 rows: 1.4-1.5x oneDNN at one row, 1.2-1.4x at two,
# and the native GEMM takes 3+ rows there (BF16_GEMM_ENV). A machine's measurement may move either
# bound per layer shape and row bucket (kernels/cpu_tuning.py).
BF16_GEMV_MAX_ROWS = 8
BF16_GEMV_MAX_ROWS_FLOAT = 2
# bfloat16 weights on a build without AVX512-BF16 (an AVX2 machine, TGS_CPU_ISA=avx2): prompts and decode
# batches past BF16_GEMV_MAX_ROWS_FLOAT run the native GEMM (`bf16_gemm`: weights widened to float32 in
# registers, FMA) instead of torch's bfloat16 GEMM, which has no fast path there (3x slower than
# llama.cpp's AVX2 build; 2.1-3.1x slower than this kernel at 8-128 rows on Qwen2.5-1.5B's shapes,
# one thread: BENCHMARKS.md, issue #32 session 9). With AVX512-BF16 torch's GEMM was 2-4x faster and stays.
# TGS_CPU_BF16_GEMM=on/off forces the choice either way (the same bits on every build).
BF16_GEMM_ENV = "TGS_CPU_BF16_GEMM"
# float32 weights (serve's CPU default dtype): rows up to which the matrix-vector product runs instead
# of torch's GEMM, and the weight bytes from which it splits the outputs over the threads (below, a
# fork/join of the pool costs more than the second core saves). On the embedded model's shapes
# (K = 256..768, 0.25-4 MiB, weights hot, one thread, 2-core EPYC) the product took 0.8x torch's
# time at 1 row, 0.45-0.8x at 2-4, the same at 8 and 1.2x at 16 (BENCHMARKS.md, session 7).
F32_GEMV_MAX_ROWS = 8
F32_PARALLEL_MIN_BYTES = 262144
# int4: dequantizing was already 1.5x torch's op at 32 rows on Qwen2.5-1.5B's MLP shapes. The bound
# was moved to 64 when prompts still followed it (d05298c: a 32-row chunk and a shorter cached
# remainder took differently rounded paths); prompts now take one path whatever their chunking (the
# native kernel, `int4pack_mm`), and decode batches keep 64 until a measurement says otherwise
# (kernels/cpu_tuning.py).
INT4_DEQUANT_MIN_ROWS = 64
# Bytes the matrix-vector kernels prefetch ahead of their reads (0: none), unless this machine
# measured another distance (kernels/cpu_tuning.py). 16 KiB won on the 2-core Sapphire Rapids VM.
PREFETCH_BYTES = 16384
# ... but the bfloat16 matrix-vector product on a build without AVX512-BF16 (an AVX2 machine, or AVX-512
# without the bf16 dot product) reads 4-8 weight streams a thread at 1-2 rows (cpu_native_src.py,
# gemv_impl_streams), and with that many the hardware prefetchers cover most of the distance: 4 KiB
# ahead read the cold Qwen2.5-1.5B shapes 1.04-1.2x faster than 16 KiB at one row on the 2-core Ice
# Lake VM, both builds (BENCHMARKS.md, issue #32 session 14). With AVX512-BF16 (vdpbf16ps tiles of
# adjacent outputs, untouched and not measurable there) PREFETCH_BYTES stays.
BF16_STREAMS_PREFETCH_BYTES = 4096
# int4 read in place (`int4pack_mm`): rows sharing one pass over a 64-output block, and blocks per
# thread task. Neither changes a bit of the result (the kernel's lanes are outputs, each summed in
# one fixed order), so a measurement may pick them per layer shape and phase freely.
INT4_ROWS_PER_PASS = 4
INT4_BLOCK_GRAIN = 4
# Its names, each (rows per pass, prefetch bytes, blocks per task); 0 or -1: the constants above.
# Measurements choose among them per layer shape and row bucket (kernels/cpu_tuning.py).
INT4_NATIVE = "native"
INT4_NATIVE_VARIANTS: dict[str, tuple[int, int, int]] = {
    INT4_NATIVE: (0, -1, 0),
    "native-r2": (2, -1, 0),
    "native-r6": (6, -1, 0),
    "native-pf0": (0, 0, 0),
    "native-g1": (0, -1, 1),
}
# The row bucket whose measured native name the prompt path takes (kernels/cpu.py): prompt-sized.
INT4_PROMPT_BUCKET = 64
# Weight rows dequantized at a time: bounds the scratch at DEQUANT_ROWS x K bfloat16 (3 MiB at
# K=1536) so a prompt never allocates a dense copy of a layer (the lm_head would be 0.5 GiB).
DEQUANT_ROWS = 1024

# How the kernels split a call over the threads (cpu_native_src.py, tgs::parallel_for): a persistent
# pool whose workers and the calling thread claim chunks of the output from one counter, so a thread
# another process keeps off its core delays a call by the chunks it claimed, not by a scheduler time
# slice as at::parallel_for's fork/join did (BENCHMARKS.md, issue #32 session 8). TGS_CPU_POOL=off
# goes back to at::parallel_for (the same bits either way).
POOL_ENV = "TGS_CPU_POOL"


def pool_enabled() -> bool:
    """False when TGS_CPU_POOL is 0/false/no/off."""
    return os.environ.get(POOL_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def set_parallel_mode(module: Extension, pool: bool, spin_us: int = -1, wait_spin_us: int = -1,
                      chunks_per_thread: int = -1) -> bool:
    """Switches the loaded extension's split between the pool and at::parallel_for (benchmarks
    compare both in one process) and sets the pool's spins (microseconds) and chunks per thread
    (negative: unchanged); returns whether the pool was in use before."""
    return bool(module.set_parallel_mode(1 if pool else 0, spin_us, wait_spin_us, chunks_per_thread))


_lock = threading.Lock()
_state: dict[str, object] = {}


def cpu_signature() -> str:
    """What the compiled instructions depend on: the CPU's model name and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def isa() -> str:
    """"avx2" when TGS_CPU_ISA asks for it on an x86-64 CPU, else "native"."""
    asked = os.environ.get(ISA_ENV, "native").strip().lower()
    return "avx2" if asked == "avx2" and platform.machine().lower() in ("x86_64", "amd64") else "native"


def cflags() -> tuple[str, ...]:
    """The compiler flags for this process's instruction set (`isa`)."""
    return CFLAGS + (AVX2_CFLAGS if isa() == "avx2" else ())


def _check_torch_isa() -> None:
    """Warns when our kernels are forced to AVX2 but torch's were not (their variables came too late)."""
    asked = os.environ.get(ISA_ENV, "native").strip().lower()
    if asked not in ("", "native", "avx2"):
        logger.warning("{}={} is not native or avx2: the native instruction set is used", ISA_ENV, asked)
    elif asked == "avx2" and isa() != "avx2":
        logger.warning("{}=avx2 ignored: this CPU ({}) is not x86-64", ISA_ENV, platform.machine())
    elif isa() == "avx2":
        capability = torch.backends.cpu.get_cpu_capability()
        if capability.upper() not in ("AVX2", "DEFAULT", "NO AVX") or os.environ.get("ONEDNN_MAX_CPU_ISA") != "AVX2":
            logger.warning("{}=avx2: our kernels are compiled for AVX2, but torch's run {} (oneDNN max ISA {}): "
                           "set ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2 before torch is imported "
                           "(serve --cpu-isa avx2 starts its ranks so)", ISA_ENV, capability,
                           os.environ.get("ONEDNN_MAX_CPU_ISA", "unset"))


def build_name() -> str:
    """The extension's name for this process: a digest of its source, compiler flags (the instruction
    set), torch's version and the CPU. Kernel measurements are kept under it too (kernels/select.py)."""
    digest = hashlib.sha256()
    for part in (SOURCE, " ".join(cflags() + LDFLAGS), torch.__version__, cpu_signature()):
        digest.update(part.encode())
    return f"tgs_cpu_native_{digest.hexdigest()[:16]}"


class Extension:
    """The compiled module, shared by every layer and every copy of a layer (a deepcopy of a model,
    as benchmarks make for cold weights, would otherwise try to pickle a Python module)."""

    def __init__(self, module: ModuleType):
        self._module = module

    def __getattr__(self, name: str):
        return getattr(self._module, name)

    def __copy__(self) -> Extension:
        return self

    def __deepcopy__(self, memo: dict) -> Extension:
        return self


BATON = "lock"  # torch's build lock in the build directory (torch.utils.file_baton.FileBaton)
FLOCK = "tgs-build.flock"  # ours beside it, held across the whole build


@contextlib.contextmanager
def build_lock(build_dir: str) -> Iterator[None]:
    """Holds an fcntl lock on `build_dir` for a build; torch's own lock file left by a dead build is removed.

    torch's FileBaton is a file created with O_EXCL and removed when the build ends: a build killed
    midway (a test run's timeout, `kill -9`, a container stopped) leaves it, and every later process
    that loads the extension waits for it forever. An fcntl lock is let go by the kernel when its
    holder dies, so every process here builds under it; one that holds it and still finds torch's
    file removes it unless a live process has it open (a build by a version of this code without the
    fcntl lock, sharing the cache: torch's lock then waits for it, as before).
    """
    try:
        import fcntl
    except ImportError:  # not a POSIX system: torch's lock alone
        yield
        return
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, FLOCK), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("native CPU kernels: another process is building {}; waiting for it", build_dir)
            start = time.monotonic()
            fcntl.flock(handle, fcntl.LOCK_EX)
            logger.info("native CPU kernels: the other build ended after {:.0f} s", time.monotonic() - start)
        try:
            baton = os.path.join(build_dir, BATON)
            if os.path.exists(baton):
                if baton_in_use(baton):  # a builder without our lock (another version of this code)
                    logger.info("native CPU kernels: {} is held by a live build; waiting for it", baton)
                else:
                    logger.warning("native CPU kernels: removing {}, left by a build whose process is gone", baton)
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(baton)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def baton_in_use(path: str) -> bool:
    """Whether a live process holds torch's build lock file open (FileBaton keeps its descriptor open for
    the whole build); True where that cannot be told (no /proc), so the file is then left alone."""
    if not os.path.isdir("/proc/self/fd"):
        return True
    target = os.path.realpath(path)
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    return True
            except OSError:
                continue
    return False


def build_directory(name: str) -> str:
    """Where torch.utils.cpp_extension builds extension `name` (TORCH_EXTENSIONS_DIR or torch's default)."""
    from torch.utils import cpp_extension

    return cpp_extension._get_build_directory(name, verbose=False)


def native() -> Extension | None:
    """The compiled extension, building it on the first call; None (and why, in the log) if it cannot be."""
    with _lock:
        if "module" in _state:
            return _state["module"]  # type: ignore[return-value]
        module, reason = None, ""
        if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
            reason = f"disabled by {ENV}={os.environ[ENV]}"
        else:
            try:
                from torch.utils.cpp_extension import load_inline

                name = build_name()
                _check_torch_isa()
                logger.info("native CPU kernels: loading {} for the {} instruction set (built once per machine, "
                            "about a minute)", name, "AVX2" if isa() == "avx2" else "native")
                with build_lock(build_directory(name)):
                    module = Extension(load_inline(name, cpp_sources=[SOURCE], functions=FUNCTIONS,
                                                   extra_cflags=list(cflags()), extra_ldflags=list(LDFLAGS),
                                                   verbose=False))
            except Exception as exc:  # no compiler, no ninja, a compiler that rejects the flags...
                lines = str(exc).strip().splitlines()
                reason = f"could not be built: {type(exc).__name__}: {lines[-1] if lines else ''}"
        if module is not None:
            module.set_parallel_mode(1 if pool_enabled() else 0, -1, -1, -1)  # the library's state outlives reset()
            if not pool_enabled():
                logger.info("native CPU kernels: {}={}: threads split by at::parallel_for (OpenMP), not the pool",
                            POOL_ENV, os.environ.get(POOL_ENV))
            elif "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
                # Measured (BENCHMARKS.md, issue #32 session 8): torch's OpenMP threads spin for
                # milliseconds after each of torch's own parallel regions and take the pool's core.
                logger.info("native CPU kernels: OMP_WAIT_POLICY is unset, so torch's idle OpenMP threads spin "
                            "after torch's own ops and compete with the kernels' thread pool; OMP_WAIT_POLICY="
                            "passive, set before the process starts, avoids that (BENCHMARKS.md, issue #32 session 8)")
            _state["int4_native"] = bool(module.int4_native_isa())
            _state["bf16_dot"] = bool(module.bf16_gemm_has_bf16_dot())
            if not _state["int4_native"]:
                logger.info("native CPU kernels: built without AVX-512, int4 layers keep torch's op for decode "
                            "batches and the dequantized GEMM for prompts (int4_native_isa in the source says why)")
            logger.info("native CPU kernels ready: int4 layers read their packed codes in place for prompts of "
                        "any length and decode batches under {} rows (dequantized bf16 GEMMs from there); int8 "
                        "prompts through dequantized bf16 GEMMs; decode batches: int8 matrix-vector products up "
                        "to {} rows (K up to {}), bf16 ones up to {} rows (bf16 prompts and "
                        "larger batches: {}), float32 ones up to {} rows, int8 layers through dequantized bf16 GEMMs "
                        "from {} rows; torch's ops otherwise (each a default "
                        "this machine's measurements may change: kernels/cpu_tuning.py)", INT4_DEQUANT_MIN_ROWS,
                        INT8_GEMV_MAX_ROWS, INT8_GEMV_MAX_K,
                        BF16_GEMV_MAX_ROWS if _state["bf16_dot"] else BF16_GEMV_MAX_ROWS_FLOAT,
                        "the native GEMM" if _bf16_gemm_wanted(_state["bf16_dot"]) else
                        f"torch's GEMM, AVX512-BF16 here; {BF16_GEMM_ENV}=on: the native one", F32_GEMV_MAX_ROWS,
                        INT8_DEQUANT_MIN_ROWS)
        else:
            logger.warning("native CPU kernels unavailable ({}); int8/int4/bf16 layers use torch's ops only", reason)
        _state["module"], _state["reason"] = module, reason
        return module


def unavailable_reason() -> str:
    """Why native() returned None ("" when it did not, or was not called yet)."""
    return str(_state.get("reason", ""))


def reset() -> None:
    """Forgets the loaded extension, so the next native() decides again (tests switch ENV)."""
    with _lock:
        _state.clear()


# The int8 (and bf16) matrix-vector kernel's names: prefetch distances in bytes (-1: PREFETCH_BYTES).
# The distance changes no bit of the result, only how fast the weights stream on this machine.
INT8_GEMV_VARIANTS: dict[str, int] = {"gemv": -1, "gemv-pf0": 0, "gemv-pf64k": 65536}


def int8_variant(rows: int, k: int) -> str:
    """The static decode choice for an int8 layer of inner size `k` (native extension present,
    bfloat16 compute): "gemv" up to INT8_GEMV_MAX_ROWS rows, "dequant" from INT8_DEQUANT_MIN_ROWS,
    torch's op ("op") in between and wherever the matrix-vector kernel cannot run."""
    if rows <= INT8_GEMV_MAX_ROWS:
        # no rows (a head asked for no logits: a prompt chunk that does not end its prompt): torch's op
        return "gemv" if 0 < rows and k <= INT8_GEMV_MAX_K else "op"
    return "dequant" if rows >= INT8_DEQUANT_MIN_ROWS else "op"


def int8_variants(rows: int, k: int) -> tuple[str, ...]:
    """Every int8 variant that can run `rows` rows of inner size `k` (native extension present)."""
    gemv = tuple(INT8_GEMV_VARIANTS) if 0 < rows <= INT8_GEMV_MAX_ROWS and k <= INT8_GEMV_MAX_K else ()
    return gemv + ("op", "dequant")


def int8_row_invariant_fits(k: int) -> bool:
    """Whether an int8 layer of inner size `k` can run every row count on the matrix-vector kernel
    (chunks of INT8_GEMV_MAX_ROWS rows): what a row-invariant layer (the int8 head) needs."""
    return k <= INT8_GEMV_MAX_K


def _gemv_input(x: torch.Tensor) -> torch.Tensor:
    """x as the matrix-vector kernels take it: bfloat16 as it is (with AVX512-BF16 they multiply its
    pairs by vdpbf16ps, two products per lane and instruction), anything else as float32."""
    return x.contiguous() if x.dtype == torch.bfloat16 else x.float().contiguous()


def int8_gemv(module: Extension, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
              out_dtype: torch.dtype, prefetch: int = -1) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] int8 * scales [N] float32)^T, float32 sums (weights prefetched
    `prefetch` bytes ahead; -1: PREFETCH_BYTES). Rows run in chunks of INT8_GEMV_MAX_ROWS, each
    chunk reading the weights once; a row's bits do not depend on the rows beside it."""
    distance = PREFETCH_BYTES if prefetch < 0 else prefetch
    return module.int8_gemv(_gemv_input(x), weight, scales, distance).to(out_dtype)


# Byte p of a 64-code chunk in the table layout holds code TABLE_ORDER[p] (cpu_native_q8_src.py
# `int8_table_gemv`: the order its byte unpacks give back codes 0-31, then 32-63).
TABLE_ORDER = [8 * (p // 16) + p % 16 if p % 16 < 8 else 32 + 8 * (p // 16) + p % 16 - 8 for p in range(64)]
# TGS_CPU_INT8_TABLE=off keeps the plain layout for the layers that would take the table one (the same bits
# at 1-8 rows and in prompts; 9-31 rows then run torch's op instead of the matrix-vector kernel).
TABLE_ENV = "TGS_CPU_INT8_TABLE"


def int8_table_enabled(module: Extension | None) -> bool:
    """Whether int8 layers with exact activations take the table layout: a build with its kernel
    (AVX512-BF16 and AVX512-VBMI), TABLE_ENV not 0/false/no/off."""
    if module is None or not hasattr(module, "int8_table_isa") or not int(module.int8_table_isa()):
        return False
    return os.environ.get(TABLE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def int8_table_pack(codes: torch.Tensor, rows_per_piece: int = 8192, module: Extension | None = None) -> torch.Tensor:
    """int8 codes [N, K] (none -128) in the table layout int8_table_gemv reads: each full 64-code chunk of
    a row sign-magnitude (bit 7 the sign, bits 0-6 |v|) in TABLE_ORDER; the K % 64 tail as it is.

    Why at load: converting plain int8 codes to the bfloat16 that vdpbf16ps multiplies takes 10
    instructions per 64 (sign-extend, convert, pack), which bounds the one-row product below the
    memory's speed on a core; this layout takes 5 (two byte-table lookups, an OR, two unpacks).
    `module`: the extension packs (its `int8_table_pack_into`; these torch ops took 1.2 s for a
    151936 x 1536 head on 2 threads); the torch form otherwise (the same bytes)."""
    if codes.dtype != torch.int8 or codes.dim() != 2:
        raise ValueError(f"int8_table_pack takes int8 codes [N, K], got {codes.dtype} {list(codes.shape)}")
    n, k = codes.shape
    if n and int(codes.min()) == -128:
        raise ValueError("int8_table_pack: a code is -128, which sign-magnitude bytes cannot hold")
    out = torch.empty_like(codes, memory_format=torch.contiguous_format)
    if module is not None and hasattr(module, "int8_table_pack_into"):
        module.int8_table_pack_into(codes.contiguous(), out)
        return out
    full = k // 64 * 64
    order = torch.tensor(TABLE_ORDER, dtype=torch.long)
    for n0 in range(0, n, rows_per_piece):  # pieces: a 150k-row head without several full-size temporaries
        part = codes[n0:n0 + rows_per_piece]
        rows = part.shape[0]
        chunks = part[:, :full].reshape(rows, full // 64, 64).index_select(2, order).to(torch.int16)
        sm = torch.where(chunks < 0, 128 - chunks, chunks).to(torch.uint8)  # 0x80 | |v| for v < 0
        out[n0:n0 + rows, :full] = sm.view(torch.int8).reshape(rows, full)
        out[n0:n0 + rows, full:] = part[:, full:]
    return out


def int8_table_variant(rows: int) -> str:
    """The static choice for an int8 layer in the table layout: the matrix-vector kernel below
    INT8_DEQUANT_MIN_ROWS rows (in chunks of INT8_GEMV_MAX_ROWS: torch's op, which the plain layout
    takes at 9-31 rows, cannot read this one), the dequantized GEMM from there."""
    return "gemv" if rows < INT8_DEQUANT_MIN_ROWS else "dequant"


def int8_table_variants(rows: int) -> tuple[str, ...]:
    """Every variant that can run `rows` rows of an int8 layer in the table layout."""
    return tuple(INT8_GEMV_VARIANTS) + ("dequant",) if rows > 0 else ("gemv",)


def int8_table_gemv(module: Extension, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                    out_dtype: torch.dtype, prefetch: int = -1) -> torch.Tensor:
    """int8_gemv for codes in the table layout (int8_table_pack): the same bits."""
    distance = PREFETCH_BYTES if prefetch < 0 else prefetch
    return module.int8_table_gemv(_gemv_input(x), weight, scales, distance).to(out_dtype)


def int8_dequant_gemm(module: Extension, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                      out_dtype: torch.dtype, table: bool = False) -> torch.Tensor:
    """The same product through DEQUANT_ROWS-row blocks of the weight dequantized to bfloat16 and
    torch's bfloat16 GEMM (prompt inputs padded to PROMPT_MIN_ROWS rows, kernels/phase.py); `table`:
    the weight is in int8_table_pack's layout (the same bits)."""
    rows = x.shape[0]
    xb = pad_prompt_rows(x.to(torch.bfloat16).contiguous())
    n = weight.shape[0]
    dequant = module.int8_table_dequant if table else module.int8_dequant
    parts = [xb @ dequant(weight, scales, n0, min(n, n0 + DEQUANT_ROWS)).t() for n0 in range(0, n, DEQUANT_ROWS)]
    return torch.cat(parts, dim=1)[:rows].to(out_dtype)


def loaded() -> tuple[bool, Extension | None]:
    """(whether this process has decided on the extension yet, the extension or None); never builds."""
    with _lock:
        return "module" in _state, _state.get("module")  # type: ignore[return-value]


def for_dense_weight(weight: torch.Tensor) -> Extension | None:
    """The extension for a dense layer whose `weight` is bfloat16 or float32 on the CPU (built now,
    at load, not on the first request); None for any other weight or when it cannot be built."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32) or weight.dim() != 2:
        return None
    return native()


def dense_gemv_max_rows(module: Extension, weight: torch.Tensor, any_build: bool = False) -> int:
    """Rows up to which `module`'s native matrix-vector product (bfloat16 or float32 weights) runs
    `weight` by default (0: it cannot: another dtype or device, or a weight not contiguous); for
    bfloat16, by whether the build multiplies bfloat16 pairs (BF16_GEMV_MAX_ROWS' comment).
    `any_build`: the rows it can run on any build, where a measurement may choose it (cpu_tuning.py)."""
    if weight.dtype == torch.float32:
        return F32_GEMV_MAX_ROWS if f32_gemv_fits(1, weight) else 0
    if not bf16_gemv_fits(1, weight):
        return 0
    return BF16_GEMV_MAX_ROWS if any_build or _has_bf16_dot(module) else BF16_GEMV_MAX_ROWS_FLOAT


def dense_gemv(module: Extension, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The native matrix-vector product for `weight`'s dtype (`dense_gemv_max_rows` said it runs)."""
    if weight.dtype == torch.float32:
        if x.dtype != torch.float32:
            raise ValueError(f"the float32 matrix-vector product takes float32 inputs, got {x.dtype}")
        # f32_gemv's work without its Python layers (a small model makes tens of these calls a step)
        return module.f32_gemv(x.contiguous(), weight, bias, PREFETCH_BYTES, F32_PARALLEL_MIN_BYTES)
    return bf16_gemv(module, x, weight, bias)


def f32_gemv_fits(rows: int, weight: torch.Tensor) -> bool:
    """Whether the float32 matrix-vector product can run `rows` rows against `weight` [N, K]."""
    return (0 < rows <= F32_GEMV_MAX_ROWS and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.dim() == 2 and weight.is_contiguous())


def f32_gemv(module: Extension, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             prefetch: int = -1) -> torch.Tensor:
    """x [M, K] float32 @ weight [N, K] float32 ^T (+ bias) -> [M, N] float32, the weights read once
    per 8 rows; a row's bits do not depend on M (prefetched `prefetch` bytes ahead; -1: PREFETCH_BYTES)."""
    if x.dtype != torch.float32:
        raise ValueError(f"the float32 matrix-vector product takes float32 inputs, got {x.dtype}")
    b = None if bias is None else bias.float().contiguous()
    return module.f32_gemv(x.contiguous(), weight, b, PREFETCH_BYTES if prefetch < 0 else prefetch,
                           F32_PARALLEL_MIN_BYTES)


def bf16_gemv_fits(rows: int, weight: torch.Tensor) -> bool:
    """Whether the bfloat16 matrix-vector product can run `rows` rows against `weight` [N, K]."""
    return (0 < rows <= BF16_GEMV_MAX_ROWS and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and weight.is_contiguous())


def bf16_gemm_fits(module: Extension | None, weight: torch.Tensor) -> bool:
    """Whether the native bfloat16 GEMM runs `weight` [N, K] here: a contiguous bfloat16 CPU weight, the
    extension built, and either TGS_CPU_BF16_GEMM=on, or it unset/auto and this build without
    AVX512-BF16 (where torch's bfloat16 GEMM is slow; BF16_GEMM_ENV's comment)."""
    if module is None or not (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
                              and weight.is_contiguous()):
        return False
    return _bf16_gemm_wanted(_has_bf16_dot(module))


def _has_bf16_dot(module: Extension) -> bool:
    """Whether `module` was built with AVX512-BF16 (vdpbf16ps)."""
    if "bf16_dot" not in _state:  # read when the extension loads (native()); a reset() forgets it
        _state["bf16_dot"] = bool(module.bf16_gemm_has_bf16_dot())
    return bool(_state["bf16_dot"])


def _bf16_gemm_wanted(has_bf16_dot: bool) -> bool:
    """BF16_GEMM_ENV's answer (on/off/auto) for a build with or without AVX512-BF16."""
    asked = os.environ.get(BF16_GEMM_ENV, "auto").strip().lower()
    if asked in ("1", "on", "true", "yes"):
        return True
    if asked in ("0", "off", "false", "no"):
        return False
    if asked not in ("", "auto") and f"warned:{BF16_GEMM_ENV}" not in _state:
        _state[f"warned:{BF16_GEMM_ENV}"] = True
        logger.warning("{}={!r} is not on, off or auto: auto", BF16_GEMM_ENV, asked)
    return not has_bf16_dot


_NO_BIAS = torch.empty(0)


def bf16_gemm(module: Extension, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K] bfloat16 ^T (+ bias) in x's dtype, float32 sums: a row's bits do not depend
    on M or on the rows beside it (cpu_native_gemm_src.py), so prompts of any chunking take it as one path."""
    b = _NO_BIAS if bias is None else bias.float().contiguous()
    return module.bf16_gemm(x.contiguous(), weight, b, x.dtype == torch.bfloat16, PREFETCH_BYTES)


def bf16_gemv_prefetch(module: Extension) -> int:
    """The prefetch distance (bytes) of `module`'s bfloat16 matrix-vector product: BF16_STREAMS_PREFETCH_BYTES
    on a build without AVX512-BF16 (its several streams a thread), PREFETCH_BYTES with it. The distance
    changes no bit of the result."""
    return PREFETCH_BYTES if _has_bf16_dot(module) else BF16_STREAMS_PREFETCH_BYTES


def bf16_gemv(module: Extension, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight [N, K] bfloat16 ^T (+ bias) with float32 sums, in x's dtype (the weights read
    once per 8 rows)."""
    y = module.bf16_gemv(_gemv_input(x), weight, bf16_gemv_prefetch(module))
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def int4_block() -> int | None:
    """Outputs per block of torch's packed int4 layout in this process: 64 (torch at AVX-512), 32
    (AVX2), None for a layout the native kernels do not read (no AVX2: torch interleaves rows in
    a byte). torch chooses the layout by the CPU capability it runs at (ATEN_CPU_CAPABILITY), so it
    is found out once, by packing a probe weight, not assumed from the CPU."""
    with _lock:
        if "int4_block" not in _state:
            n, k = 128, 64
            # Codes that differ from row to row and from column to column: any other layout misreads them.
            codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
            packed = torch._convert_weight_to_int4pack_for_cpu(codes, 2)
            found = None
            for block in (64, 32):
                if packed.shape != (n, k // 2):
                    break
                parts = packed.reshape(n // block, k, block // 2)
                decoded = torch.cat([parts & 15, parts >> 4], dim=2).permute(1, 0, 2).reshape(k, n)
                if torch.equal(decoded.t().to(torch.int32), codes):
                    found = block
                    break
            if found is None:
                logger.info("native CPU kernels: torch's int4 layout at CPU capability {} is not one they read; "
                            "int4 layers keep torch's op", torch.backends.cpu.get_cpu_capability())
            _state["int4_block"] = found
        return _state["int4_block"]  # type: ignore[return-value]


def int4_dequant_fits(n: int) -> bool:
    """Whether int4 layers of `n` output features can run the native kernels (whole layout blocks)."""
    block = int4_block()
    return block is not None and n % block == 0


def int4_native_ok(module: Extension | None) -> bool:
    """Whether `module` (the extension, or a test's wrapper of it) runs the int4 kernel at speed:
    built with AVX-512 (`int4_native_isa` in the source says why not elsewhere)."""
    if module is None:
        return False
    if "int4_native" not in _state:  # read when the extension loads (native()); a reset() forgets it
        _state["int4_native"] = bool(module.int4_native_isa())
    return bool(_state["int4_native"])


def int4_variant(rows: int, native_kernel: bool = True) -> str:
    """The static decode choice for an int4 layer the native kernels can run: "dequant" from
    INT4_DEQUANT_MIN_ROWS rows, below it the packed bytes read in place (INT4_NATIVE), or torch's
    op ("op") where this build's int4 kernel is slow (`int4_native_ok`)."""
    if rows >= INT4_DEQUANT_MIN_ROWS:
        return "dequant"
    return INT4_NATIVE if native_kernel else "op"


def int4pack_dequant_gemm(module: Extension, x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                          group_size: int) -> torch.Tensor:
    """x [M, Kp] bfloat16 @ W^T for torch's CPU int4 layout (`int4_block`), through DEQUANT_ROWS-row
    blocks dequantized to bfloat16 (prompt inputs padded to PROMPT_MIN_ROWS rows, kernels/phase.py).

    W = (q - 8) * scale + zero, scales_and_zeros [Kp / group_size, N, 2] as torch's op takes them."""
    rows = x.shape[0]
    x = pad_prompt_rows(x)
    n = packed.shape[0]
    sz = scales_and_zeros.float()
    scales, zeros = sz[..., 0].contiguous(), sz[..., 1].contiguous()
    block = int4_block()
    if block is None:
        raise ValueError("torch's int4 layout in this process is not one the native kernels read (int4_block)")
    blocks, step = n // block, DEQUANT_ROWS // block
    parts = [x @ module.int4pack_dequant_t(packed, scales, zeros, group_size, block, b0, min(blocks, b0 + step))
             for b0 in range(0, blocks, step)]
    return torch.cat(parts, dim=1)[:rows]


def int4pack_mm(module: Extension, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                offsets: torch.Tensor, group_size: int, rows_per_pass: int = 0, prefetch: int = -1,
                block_grain: int = 0) -> torch.Tensor:
    """x [M, Kp] @ W^T for torch's CPU int4 layout, the packed bytes read in place (float32 [M, N]).

    W = q * scales + offsets per group (float32 [Kp / group_size, N]); each weight byte comes from
    memory once for all M rows, and a row's result has the same bits whatever M, the rows per pass,
    the prefetch distance or the thread split (the defaults: this module's constants)."""
    return module.int4pack_mm(x.float().contiguous(), packed, scales, offsets, group_size, int4_block() or 64,
                              rows_per_pass or INT4_ROWS_PER_PASS, PREFETCH_BYTES if prefetch < 0 else prefetch,
                              block_grain or INT4_BLOCK_GRAIN)
