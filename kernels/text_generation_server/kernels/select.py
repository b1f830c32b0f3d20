"""Kernel selection: the one place that decides which kernel, and which variant of it, runs a linear.

Every weight format goes through `build_linear(weight, bias, act_dtype, device_type, layer)`:
the weight describes itself (`spec()`: a frozen LinearSpec whose weight_format says "int",
"int-2:4", "fp8", "bnb-nf4"/"bnb-fp4" or "dense"), `choose_kernel` picks from the device's table
(kernels/table.py), a kernel that would keep a dense copy of a quantized layer on CUDA is refused
unless allowed (`check_dense_fallback`), the choice is logged once per kind of layer, the kernel
builds the module, and the module is stamped with the kernel's name (Info.kernels reads it).

What decides, strongest first:
1. TGS_DISABLE_KERNELS=name1,name2 (--disable-kernels, --disable-custom-kernels): those kernels
   never run.
2. TGS_PREFER_KERNELS=name1,name2: the operator's override. A named kernel that can run a layer
   takes it, ahead of the static order, in the order named (e.g. TGS_PREFER_KERNELS=tinygemm on a
   GPU where triton-gemm ranks first, or cpu-int8 to put per-channel int4 codes on the int8
   kernel). A named kernel that cannot run a layer is passed over for that layer, silently.
3. Measured preferences (`Preferences`): per machine, per layer shape (weight format, bits, group,
   K, N, activation dtype) and per row bucket, the kernel or variant that measured fastest here.
   A whole-layer entry chooses the kernel; row-bucket entries choose among a built module's
   variants for decode batches (kernels/phase.py). They live in a JSON file per machine signature
   (CPU model and flags, or GPU name, capability and CUDA version, with torch's version) under
   TGS_KERNEL_CACHE (default ~/.cache/text-generation-server/; TGS_KERNEL_CACHE=off ignores them).
   `measure` times candidates with an injectable timer, checks each result against the static
   choice's, logs what it measured and chose, and falls back to the static order when a
   measurement fails or a candidate raises or disagrees: never to a wrong result. `tune_rows`
   measures a built module's variants at given row counts and records the winners.
   Where the table pairs two kernels that can both run a layer (table.TIMED_PAIRS: triton-gemm and
   tinygemm on CUDA), warmup times them at the CUDA graphs' batch sizes, once per layer shape, and
   layers of that shape run the faster one per decode row bucket (kernels/tuning.py,
   kernels/dispatch.py; "kernel rows<=B" entries in the file).
4. The static order of kernels/table.py, and each module's static row thresholds.

A prompt's rows never depend on how it is chunked: in a prefill forward every layer takes its one
prompt path, whatever the row count (kernels/phase.py).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import torch
from loguru import logger

from text_generation_server.kernels import cpu_native
from text_generation_server.kernels.base import DenseFallbackError, LinearSpec, NoKernelError, QuantKernel
from text_generation_server.kernels.phase import forward_phase, row_bucket
from text_generation_server.kernels.table import FAMILY_OF_FORMAT, TABLES, TIMED_PAIRS

DISABLE_ENV = "TGS_DISABLE_KERNELS"
PREFER_ENV = "TGS_PREFER_KERNELS"
CACHE_ENV = "TGS_KERNEL_CACHE"
ALLOW_DENSE_ENV = "TGS_ALLOW_DENSE_FALLBACK"
ALLOW_DENSE_FLAG = f"--allow-dense-fallback ({ALLOW_DENSE_ENV}=1)"
# A measured candidate whose output differs from the static choice's by more than this (relative
# Frobenius norm) is wrong, not faster: variants differ by bf16 rounding, ~1e-3.
MEASURE_RTOL = 2e-2


def _names(env: str) -> list[str]:
    return [n.strip() for n in os.environ.get(env, "").split(",") if n.strip()]


def disabled_kernels() -> set[str]:
    """Kernel names switched off with TGS_DISABLE_KERNELS=name1,name2 (or --disable-kernels)."""
    return set(_names(DISABLE_ENV))


def preferred_kernels() -> list[str]:
    """Kernel names TGS_PREFER_KERNELS=name1,name2 puts first where they can run a layer, in that order."""
    return _names(PREFER_ENV)


def dense_fallback_allowed() -> bool:
    """Whether the operator accepts dense copies of quantized weights on CUDA (--allow-dense-fallback)."""
    return os.environ.get(ALLOW_DENSE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# -- measured preferences ------------------------------------------------------------------------
def device_signature(device_type: str) -> str:
    """What a measurement holds for: the processor and torch's version; on a CPU also the native kernels'
    build (their source and instruction set: cpu_native.build_name), so a new release of the kernels or
    an `--cpu-isa avx2` process measures afresh instead of reading the choices another build's timings
    made (a faster GEMM, or variants that build does not have)."""
    if device_type == "cuda":
        try:
            major, minor = torch.cuda.get_device_capability()
            what = f"{torch.cuda.get_device_name()} sm{major}{minor} cuda {torch.version.cuda}"
        except (RuntimeError, AssertionError, ValueError) as exc:  # no usable GPU: nothing measured applies
            what = f"cuda (no device: {type(exc).__name__})"
    elif device_type == "cpu":
        what = f"{cpu_native.cpu_signature()}native kernels {cpu_native.build_name()}"
    else:
        what = f"{device_type} (no device)"
    return f"{what}\ntorch {torch.__version__}"


def shape_key(spec: LinearSpec) -> str:
    """A layer shape as preferences key it: format, bits, group (with zero points, act-order), K x N,
    activation dtype."""
    dtype = str(spec.act_dtype).removeprefix("torch.")
    group = f"g{spec.group_size}{'-asym' if spec.has_zeros else ''}{'-act' if spec.act_order else ''}"
    return f"{spec.weight_format}/{spec.bits}-bit/{group}/{spec.in_features}x{spec.out_features}/{dtype}"


LAYER = "layer"  # the bucket of a whole-layer (kernel) preference


def _bucket_key(bucket: int | None, scope: str = "") -> str:
    """"layer", "rows<=B" (a module's variant) or "SCOPE rows<=B" (e.g. "kernel rows<=B": the kernel a
    KernelDispatch runs for decode batches of up to B rows, kernels/dispatch.py)."""
    if bucket is None:
        return LAYER
    return f"{scope} rows<={bucket}" if scope else f"rows<={bucket}"


class Preferences:
    """Measured choices of one machine: shape key -> bucket ("layer" or "rows<=B") -> name, in a JSON file."""

    def __init__(self, path: Path | None, signature: str):
        self.path = path  # None: not kept on disk (TGS_KERNEL_CACHE=off)
        self.signature = signature
        self.choices: dict[str, dict[str, dict]] = {}
        if path is not None and path.is_file():
            try:
                data = json.loads(path.read_text())
                if data.get("signature") != signature:
                    raise ValueError("measured on another machine signature")
                self.choices = {k: dict(v) for k, v in data["choices"].items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                logger.warning("kernel preferences {} ignored ({}): the static order applies", path, exc)
                self.choices = {}

    def get(self, spec: LinearSpec, bucket: int | None = None, scope: str = "") -> str | None:
        entry = self.choices.get(shape_key(spec), {}).get(_bucket_key(bucket, scope))
        return entry.get("choice") if isinstance(entry, dict) else None

    def row_choices(self, spec: LinearSpec, scope: str = "") -> dict[int, str]:
        """Row bucket -> variant (scope "kernel": kernel) measured for decode batches of this layer shape."""
        prefix = _bucket_key(0, scope).removesuffix("0")
        out = {}
        for key, entry in self.choices.get(shape_key(spec), {}).items():
            if key.startswith(prefix) and isinstance(entry, dict) and isinstance(entry.get("choice"), str):
                try:
                    out[int(key.removeprefix(prefix))] = entry["choice"]
                except ValueError:
                    continue
        return out

    def record(self, spec: LinearSpec, bucket: int | None, choice: str, timings: Mapping[str, float],
               scope: str = "") -> None:
        """Keeps a choice (and the timings it came from, in ms) and writes the file."""
        self.choices.setdefault(shape_key(spec), {})[_bucket_key(bucket, scope)] = {
            "choice": choice, "ms": {name: round(seconds * 1e3, 4) for name, seconds in timings.items()}}
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"signature": self.signature, "choices": self.choices}, indent=1,
                                      sort_keys=True))
            tmp.replace(self.path)
        except OSError as exc:
            logger.warning("kernel preferences not saved to {} ({}): kept for this process only", self.path, exc)


_PREFERENCES: dict[tuple[str, str], Preferences] = {}


def preferences(device_type: str) -> Preferences:
    """This machine's preferences for `device_type`, read once per process and cache folder."""
    folder = os.environ.get(CACHE_ENV, "").strip()
    key = (device_type, folder)
    found = _PREFERENCES.get(key)
    if found is None:
        signature = device_signature(device_type)
        path = None
        if folder.lower() not in ("off", "0", "none"):
            root = Path(folder).expanduser() if folder else Path.home() / ".cache" / "text-generation-server"
            digest = hashlib.sha256(signature.encode()).hexdigest()[:16]
            path = root / f"kernels-{device_type}-{digest}.json"
        found = _PREFERENCES[key] = Preferences(path, signature)
    return found


Timer = Callable[[Callable[[], object]], float]


def wall_timer(fn: Callable[[], object], repeat: int = 5) -> float:
    """Median wall time of `fn` in seconds, after one warm-up call (CUDA work waited for)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() and torch.cuda.is_initialized() else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.double()
    return float((got.double() - want).norm() / want.norm().clamp(min=1e-30))


def measure(candidates: Mapping[str, Callable[[], torch.Tensor]], timer: Timer | None = None,
            what: str = "") -> tuple[str | None, dict[str, float]]:
    """The fastest candidate that computes what the first one (the static choice) does, and the
    seconds of each one timed; (None, {}) when the first one fails, so the caller keeps the static
    order. A candidate that raises, or whose result differs by more than MEASURE_RTOL, is dropped."""
    timer = timer or wall_timer
    names = list(candidates)
    if not names:
        return None, {}
    try:
        want = candidates[names[0]]()
    except Exception as exc:  # a measurement must never take a server down: the static order stands
        logger.warning("kernel tuning {}: the static choice {} failed ({}: {}); nothing measured",
                       what, names[0], type(exc).__name__, exc)
        return None, {}
    timings: dict[str, float] = {}
    for name in names:
        try:
            if name != names[0]:
                error = _relative_error(candidates[name](), want)
                if not error <= MEASURE_RTOL:
                    logger.warning("kernel tuning {}: {} left out, its result differs from {}'s by {:.2g}",
                                   what, name, names[0], error)
                    continue
            timings[name] = float(timer(candidates[name]))
        except Exception as exc:
            logger.warning("kernel tuning {}: {} left out ({}: {})", what, name, type(exc).__name__, exc)
    if names[0] not in timings:
        return None, {}
    choice = min(timings, key=timings.__getitem__)
    logger.info("kernel tuning {}: {} -> {}", what,
                ", ".join(f"{name} {seconds * 1e3:.3f} ms" for name, seconds in timings.items()), choice)
    return choice, timings


def page_in(modules: Sequence[torch.nn.Module]) -> None:
    """Reads one element of every 4 KiB page of the modules' CPU tensors. Why: weights the loader left
    mapped from the checkpoint file (bfloat16 ones, in place) come into memory on their first read, and
    the timings that go round a shape's layers (tune_rows' peers) would otherwise time those page-ins:
    in a quiet run on the 2-core EPYC, 47 ms for a 55 MB gate_up at one row that reads in 1.5 ms, and
    torch's bf16 GEMM chosen for 8 rows on the AVX2 build (0.66x llama.cpp's 8 streams)."""
    with torch.inference_mode():
        for module in modules:
            for t in [*module.parameters(), *module.buffers()]:
                if t.device.type == "cpu" and t.numel() and t.is_contiguous():
                    t.reshape(-1).view(torch.uint8)[::4096].sum()  # any dtype (fp8 has no sum of its own)


def tune_rows(module: torch.nn.Module, spec: LinearSpec, rows: Sequence[int], timer: Timer | None = None,
              prefs: Preferences | None = None, skip: Callable[[int, str], bool] | None = None,
              peers: Sequence[torch.nn.Module] = ()) -> dict[int, str]:
    """Measures a built module's variants (kernels/phase.py) for decode batches of each row count in
    `rows`, keeps the winner per row bucket in the module and in the preferences, and returns them.
    `skip(bucket, variant)`: variants not worth timing there (the static choice is always timed).

    `peers`: other built layers of the same shape and kernel (a model's 28 o_proj). The timed calls go
    round them and the module, each call on weights the previous ones did not touch, so a shape that
    fits the caches is timed as a decode step reads it: cold, once per step. Timed back to back on one
    layer, a 2.4 MB int8 matrix sat in L2/L3 and torch's op won its one-row bucket at 0.16 ms, where
    in a step the layer then took 0.46 ms (5 GB/s; the AVX2 build on the 2-core EPYC, issue #32
    session 13). The check of each variant's result against the static choice's runs on the module."""
    measured = getattr(module, "measured", None)
    if not isinstance(measured, dict):
        return {}
    prefs = prefs or preferences(spec.device_type)
    scope = getattr(module, "preference_scope", "")
    tensors = [*module.parameters(), *module.buffers()]
    device = tensors[0].device if tensors else torch.device(spec.device_type)
    layers = [module, *(p for p in peers if p is not module and isinstance(getattr(p, "measured", None), dict))]
    turn = itertools.count(1)  # one rotation for every variant's timed calls
    if len(layers) > 1:
        page_in(layers)
    chosen: dict[int, str] = {}
    for count in rows:
        bucket = row_bucket(count)
        x = torch.randn(bucket, spec.in_features, dtype=spec.act_dtype, device=device)

        def forced(variant: str, layer: torch.nn.Module) -> torch.Tensor:
            choices = layer.measured
            saved = choices.get(bucket)
            choices[bucket] = variant
            try:
                with forward_phase(prefill=False):
                    return layer(x)
            finally:
                if saved is None:
                    choices.pop(bucket, None)
                else:
                    choices[bucket] = saved

        def rotating(variant: str) -> Callable[[], torch.Tensor]:
            calls = itertools.count()  # this variant's first call (measure's check) runs on the module

            def call() -> torch.Tensor:
                layer = layers[0] if next(calls) == 0 else layers[next(turn) % len(layers)]
                return forced(variant, layer)
            return call

        static = module.static_variant(bucket)  # type: ignore[operator]
        names = [static] + [v for v in module.variants(bucket)  # type: ignore[operator]
                            if v != static and not (skip is not None and skip(bucket, v))]
        choice, timings = measure({v: rotating(v) for v in names}, timer,
                                  f"{shape_key(spec)} {_bucket_key(bucket, scope)}")
        if choice is not None:
            measured[bucket] = chosen[bucket] = choice
            prefs.record(spec, bucket, choice, timings, scope)
    return chosen


# -- choosing and building -----------------------------------------------------------------------
def choose_kernel(spec: LinearSpec, table: Mapping[str, Sequence[type[QuantKernel]]] | None = None
                  ) -> tuple[type[QuantKernel], list[tuple[str, str]]]:
    """The kernel that runs `spec`, with the kernels passed over before it and why.

    Among the kernels of the layer's family in the device's table: a preferred one (TGS_PREFER_KERNELS,
    then a measured whole-layer preference) that can run it, else the first in table order that can.
    """
    device_kernels = (TABLES if table is None else table).get(spec.device_type)
    if device_kernels is None:
        raise NoKernelError(f"no kernel table for device {spec.device_type!r}")
    family = FAMILY_OF_FORMAT.get(spec.weight_format, "quantized")
    candidates = [k for k in device_kernels if k.family == family]
    disabled = disabled_kernels()
    tables = TABLES if table is None else table
    known = {k.name for kernels in tables.values() for k in kernels}
    unknown = [name for name in preferred_kernels() if name not in known]
    if unknown:
        raise NoKernelError(f"{PREFER_ENV} names no kernel of this build: {', '.join(unknown)} "
                            f"(kernels: {', '.join(sorted(known))})")
    wanted = [(name, f"{name} preferred by {PREFER_ENV}") for name in preferred_kernels()]
    measured = preferences(spec.device_type).get(spec) if table is None else None
    if measured is not None:
        wanted.append((measured, f"{measured} measured faster on this machine"))
    for name, why in wanted:
        for i, kernel in enumerate(candidates):
            if kernel.name == name and name not in disabled and kernel.can_implement(spec)[0]:
                return kernel, [(k.name, f"disabled by {DISABLE_ENV}" if k.name in disabled else why)
                                for k in candidates[:i]]
    rejected: list[tuple[str, str]] = []
    for kernel in candidates:
        if kernel.name in disabled:
            rejected.append((kernel.name, f"disabled by {DISABLE_ENV}"))
            continue
        ok, reason = kernel.can_implement(spec)
        if ok:
            return kernel, rejected
        rejected.append((kernel.name, reason))
    raise NoKernelError("no kernel can run this layer: " + "; ".join(f"{n}: {r}" for n, r in rejected))


def rival_kernel(spec: LinearSpec, kernel_name: str,
                 pairs: Mapping[str, Sequence[tuple[type[QuantKernel], type[QuantKernel]]]] | None = None
                 ) -> type[QuantKernel] | None:
    """The kernel warmup times against `kernel_name` on this layer (table.TIMED_PAIRS), or None when
    no kernel is paired with it, its rival is disabled or cannot run the layer, or the choice is
    not the table's to make: a kernel the operator prefers (TGS_PREFER_KERNELS) runs the layer, or
    a whole-layer measurement chose it."""
    for first, rival in (TIMED_PAIRS if pairs is None else pairs).get(spec.device_type, ()):
        if first.name != kernel_name or rival.name in disabled_kernels() or not rival.can_implement(spec)[0]:
            continue
        preferred = set(preferred_kernels())
        if any(k.name in preferred and k.can_implement(spec)[0] for k in (first, rival)):
            return None
        if preferences(spec.device_type).get(spec) is not None:
            return None
        return rival
    return None


_LOGGED: set[tuple] = set()  # every message logged once per kind of layer (choices, fallbacks, warnings)


def _once(key: tuple) -> bool:
    if key in _LOGGED:
        return False
    _LOGGED.add(key)
    return True


def check_dense_fallback(spec: LinearSpec, kernel: type[QuantKernel], rejected: list[tuple[str, str]],
                         layer: str = "") -> None:
    """On CUDA, refuses a kernel that keeps a dense dequantized copy unless the operator allows it.

    A GPU serving a quantized checkpoint is sized for the quantized weights: a dense copy takes
    2-8x their memory and runs at dense speed, so a layer that no compact kernel could take
    (an unusual shape, a disabled or missing kernel, an old GPU) must not pass unnoticed. The
    check runs when a layer is built, not in choose_kernel, which also answers "what would run"
    for logs and tests. CPUs keep their order (the dense reference is the fast path there).
    """
    if spec.device_type != "cuda" or not kernel.dense_copy:
        return
    where = f"{layer}: " if layer else ""
    bytes_per_value = torch.empty((), dtype=spec.act_dtype).element_size()
    what = (f"{spec.bits}-bit {'integer' if spec.weight_format == 'int' else spec.weight_format} layer "
            f"[{spec.out_features}x{spec.in_features}]")
    reasons = "; ".join(f"{name}: {reason}" for name, reason in rejected) or "no other kernel is registered"
    cost = (f"a dense {str(spec.act_dtype).removeprefix('torch.')} copy of the weights "
            f"({8 * bytes_per_value / spec.bits:.0f}x the memory of the quantized ones, at dense speed)")
    if not dense_fallback_allowed():
        raise DenseFallbackError(
            f"{where}no compact kernel can run this {what} on CUDA, and the '{kernel.name}' kernel that is left "
            f"would keep {cost}. Kernels passed over: {reasons}. To accept dense weights for such layers, pass "
            f"{ALLOW_DENSE_FLAG}."
        )
    if _once(("dense fallback", layer, spec.bits, spec.group_size, spec.weight_format, kernel.name, reasons)):
        logger.warning("{}{} on CUDA runs on '{}', {}, allowed by {}. Kernels passed over: {}", where, what,
                       kernel.name, cost, ALLOW_DENSE_ENV, reasons)


class LinearWeight(Protocol):
    """What build_linear asks of a weight type (QuantizedWeight, Fp8Weight, Sparse24Weight, the
    bitsandbytes and unquantized weights of quantizers/)."""

    def spec(self, act_dtype: torch.dtype, device_type: str) -> LinearSpec:
        """The layer as kernels see it."""

    def describe_layer(self, spec: LinearSpec, kernel: type[QuantKernel]) -> str:
        """The layer as the startup log names it beside its kernel ("": not logged)."""


def build_linear(weight: LinearWeight, bias: torch.Tensor | None, act_dtype: torch.dtype, device_type: str,
                 layer: str = "") -> torch.nn.Module:
    """Chooses the kernel for this weight, logs the choice once per kind of layer, builds it.

    A weight with a structure only some kernels use (a 2:4 weight: `plain` and `structure`) is
    built as its plain form when no kernel takes the structure.
    """
    spec = weight.spec(act_dtype, device_type)
    where = f"{layer}: " if layer else ""
    try:
        kernel, rejected = choose_kernel(spec)
    except NoKernelError as exc:
        plain = getattr(weight, "plain", None)
        if plain is None:
            raise
        if _once(("plain", layer, spec.weight_format, spec.bits, spec.group_size)):
            # The plain form: dense for a 2:4 weight, the decoded blocks for a GGUF K-quant kept as stored.
            logger.info("{}{} not used, its plain form instead ({})", where, weight.structure,  # type: ignore[attr-defined]
                        exc)
        return build_linear(plain, bias, act_dtype, device_type, layer)
    check_dense_fallback(spec, kernel, rejected, layer)
    subject = weight.describe_layer(spec, kernel)
    if subject and _once(("choice", layer, subject, spec.group_size, kernel.name)):
        why = "; ".join(f"{n}: {r}" for n, r in rejected) or "first choice"
        logger.info("{}{}: kernel {} ({})", where, subject, kernel.name, why)
    module = kernel.build(weight, bias, act_dtype)
    module.kernel_name = kernel.name
    module.linear_spec = spec  # how warmup's kernel timing finds and groups layers (kernels/tuning.py)
    if subject:
        module.computes = subject  # what the layer computes, as logged (the kernel names alone do not say)
    measured = getattr(module, "measured", None)
    if isinstance(measured, dict):
        measured.update(preferences(device_type).row_choices(spec))
    return module

