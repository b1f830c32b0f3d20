"""The native CPU kernels fitted to the machine they run on: a short measurement per layer shape.

The kernels' best settings depend on the machine, not the model: a prefetch distance, rows per pass
or thread split that streamed a 22 GB/s Xeon VM at its limit left a third of a 76 GB/s EPYC's
bandwidth unused, and whether the native kernel, torch's weight-only op or the dequantized oneDNN
GEMM is fastest for a decode batch moves with the row count, the shape and the instruction set. So
at warmup, once per layer shape (kernels/select.shape_key) and row bucket, `tune_cpu_layers` times
every variant a built CPU layer offers (phase.RowVariantLayer.variants: for int4 the native kernel
under each name in cpu_native.INT4_NATIVE_VARIANTS, torch's op and the dequantized GEMM; for int8
the matrix-vector kernel at each prefetch distance, torch's op and the dequantized GEMM) through
select.tune_rows, which checks each result against the static choice's, logs what it measured and
what it chose, and keeps the winner per bucket in the machine's preferences file (per CPU model and
flags and torch version, TGS_KERNEL_CACHE). A later start reads the file and measures nothing.
Each timed call runs on another layer of the shape (select.tune_rows' peers): a decode step reads
each layer's weights once, cold, and a small matrix timed back to back on one layer sits in the
caches, where the variants that reuse cached weights win buckets they lose in a step.

- Decode buckets (DECODE_ROWS) choose among all variants: decode rows may take any path.
- The prompt bucket (cpu_native.INT4_PROMPT_BUCKET rows) chooses the int4 prompt path's name among
  the native ones only: those give the same bits, so prompts stay on one path whatever their row
  count or chunking (kernels/phase.py); int8 and dense prompts keep their one path.
- A measurement that fails (the static choice raised) leaves that bucket on torch's op where the
  layer has one: never a wrong result, never a server down.
- Overrides: TGS_CPU_TUNING=0 measures nothing (the static thresholds, and what the file holds);
  the file is JSON and may be edited (a name a bucket cannot run is ignored); TGS_KERNEL_CACHE=off
  keeps measurements for this process only.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from loguru import logger

from text_generation_server.kernels import cpu_act_int8, cpu_native
from text_generation_server.kernels.base import LinearSpec
from text_generation_server.kernels.phase import row_bucket
from text_generation_server.kernels.select import Preferences, Timer, preferences, shape_key, tune_rows, wall_timer

TUNING_ENV = "TGS_CPU_TUNING"
# Decode batch sizes measured (rows 3, 5-7 share the buckets of 4 and 8), and the prompt bucket.
DECODE_ROWS = (1, 2, 4, 8)
TUNED_ROWS = (*DECODE_ROWS, cpu_native.INT4_PROMPT_BUCKET)
# The CPU kernels whose layers offer variants worth timing. Dense bfloat16 layers (kernel "dense",
# bf16 weights only: DENSE_DTYPES) choose between the native matrix-vector product and torch's GEMM
# per decode bucket: with AVX512-BF16 the product wins at 1-8 rows on the 2-core EPYC, but oneDNN with
# AMX (or another machine's memory) may win at 4-8 rows, so the static bound (cpu_native.BF16_GEMV_MAX_ROWS)
# is only the default; their prompts keep one path (padded-gemm or native-gemm) and are not timed.
# Dense float32 layers are not timed per machine: a float32 decode row's bits would then depend on
# the machine's timings, where the exactness tests pin one path. The dense bf16 GEMM
# (cpu_native.bf16_gemm, dense.py "native-gemm") is chosen for prompts by the build's instruction set
# (no AVX512-BF16: torch's bf16 GEMM is 2-3x slower there, BENCHMARKS.md session 9), not by a timing.
# The head (layers/tensor_parallel.py) is not built through the kernel table and keeps the static bound.
# The int8-activation layers (kernels/cpu_act_int8.py) offer their own names (rows per pass, prefetch
# distance: the same bits under each) and keep their choices under their own scope in the file
# (Int4PackLinear/Int8Linear.preference_scope "q8"), so a machine that ran the exact layers of a shape
# before does not hand their names to these, nor these theirs back.
TUNED_KERNELS = ("cpu-int4pack", "cpu-int8", "cpu-int4pack-q8", "cpu-int8-q8", "dense")
DENSE_DTYPES = (torch.bfloat16,)  # the dense layers' weight dtypes worth timing (above)
DENSE_GEMMS = ("gemm", "native-gemm")  # a dense layer's GEMM variants (kernels/dense.py)
FALLBACK = "op"  # torch's weight-only op: where a failed measurement leaves a bucket
# Shapes whose weights take more than this many bytes (a vocabulary-sized head) are measured at the
# decode buckets only: at 64 rows each of their variants costs tenths of a second a call.
LARGE_BYTES = 64 * 2**20
REPEAT = 3  # timed calls per variant (after one warm-up call and one checked against the static choice)


def not_worth_timing(bucket: int, variant: str) -> bool:
    """Variants a bucket leaves untimed, to keep a first start short: the dequantized GEMM for decode
    batches of up to 8 rows (it dequantizes the whole layer per call: 10-30x slower there), and at
    the prompt bucket the native kernels' names but their default and their longest passes (int4:
    6 rows, int8 activations: 4; the names give the same bits; at 64 rows each costs tens of
    milliseconds a call, and the prefetch distance matters least there). A dense layer's GEMMs are
    not timed against its static choice at 1-2 rows: at 1-2 rows the matrix-vector product reads each
    weight once, which is all a cold step can do. (They were left out when timings still ran warm on
    one layer, where the GEMMs' passes gained: the AVX2 build's warmup chose the native GEMM at one
    row on three of Qwen2.5-1.5B's four shapes, 0.41 against 1.06 ms warm on the down projection,
    level cold; issue #32 session 12. Timings now go round a shape's layers, cold; the rule stays,
    and keeps a first start shorter.)"""
    if bucket <= 2 and variant in DENSE_GEMMS:
        return True
    if bucket <= max(DECODE_ROWS):
        return variant in ("dequant", "padded-gemm")  # padded-gemm: torch's GEMM as "gemm", for prompts
    if variant in cpu_act_int8.VARIANTS or variant in cpu_act_int8.INT8_VARIANTS:
        return variant not in (cpu_act_int8.Q8, "q8-r4")
    return variant in cpu_native.INT4_NATIVE_VARIANTS and variant not in (cpu_native.INT4_NATIVE, "native-r6")


def cpu_timer(fn) -> float:
    """select.wall_timer with fewer calls: a first start measures every layer shape once."""
    return wall_timer(fn, repeat=REPEAT)


def _weight_bytes(layer: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()])


def tuning_enabled() -> bool:
    """False when TGS_CPU_TUNING is 0/false/no/off."""
    return os.environ.get(TUNING_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _scope(layer: Any) -> str:
    return getattr(layer, "preference_scope", "")


def _worth_timing(module: Any) -> bool:
    """A CPU layer whose kernel offers measured variants (TUNED_KERNELS; dense: bf16 weights only)."""
    name = getattr(module, "kernel_name", None)
    if name not in TUNED_KERNELS or not isinstance(getattr(module, "measured", None), dict):
        return False
    return name != "dense" or getattr(getattr(module, "weight", None), "dtype", None) in DENSE_DTYPES


def _decode_only(layer: Any) -> bool:
    """Layers measured at the decode buckets only: a vocabulary-sized weight (LARGE_BYTES), or a
    dense one (its prompts keep one path, and decode batches past 8 rows stay on torch's GEMM)."""
    return _weight_bytes(layer) > LARGE_BYTES or getattr(layer, "kernel_name", None) == "dense"


def _tuned_layers(model: torch.nn.Module) -> dict[str, list[tuple[LinearSpec, Any]]]:
    """Key -> (spec, layer) for the model's CPU layers of one shape and preference scope whose kernel
    offers measured variants (phase.RowVariantLayer); the key is the shape key, followed by the
    scope where the layer has one ("q8": int8 activations)."""
    groups: dict[str, list[tuple[LinearSpec, Any]]] = {}
    for module in model.modules():
        spec = getattr(module, "linear_spec", None)
        if isinstance(spec, LinearSpec) and spec.device_type == "cpu" and _worth_timing(module):
            key = shape_key(spec) + (f" {_scope(module)}" if _scope(module) else "")
            groups.setdefault(key, []).append((spec, module))
    return groups


def tune_cpu_layers(model: torch.nn.Module, rows: Sequence[int] = TUNED_ROWS, timer: Timer | None = None,
                    prefs: Preferences | None = None) -> dict[str, dict[int, str]]:
    """Chooses each CPU layer shape's variant per row bucket (module docstring) and puts the choices
    into every layer of that shape; returns them per shape key (with the layers' preference scope
    after it where they have one: "KEY q8"). Never raises for a kernel's sake."""
    buckets = sorted({row_bucket(r) for r in rows if r > 0})
    result: dict[str, dict[int, str]] = {}
    enabled = tuning_enabled()
    with torch.inference_mode():
        for key, found in _tuned_layers(model).items():
            spec, layers = found[0][0], [layer for _, layer in found]
            store = prefs or preferences("cpu")
            # a name this layer cannot run (the file edited, or another kernel's) counts as unmeasured
            known = {b: c for b, c in store.row_choices(spec, _scope(layers[0])).items()
                     if b in buckets and c in layers[0].variants(b)}
            decode_only = _decode_only(layers[0])
            missing = [b for b in buckets if b not in known and not (decode_only and b > max(DECODE_ROWS))] \
                if enabled else []
            failed: list[int] = []
            cached = bool(known)
            if missing:
                try:
                    measured = tune_rows(layers[0], spec, missing, timer or cpu_timer, store, not_worth_timing,
                                         peers=layers)
                except Exception as exc:  # noqa: BLE001 - a measurement must never take a server down
                    logger.warning("CPU kernels for {}: not measured ({}: {})", key, type(exc).__name__, exc)
                    measured = {}
                known |= measured
                failed = [b for b in missing if b not in measured]
                for b in failed:
                    if FALLBACK in layers[0].variants(b):
                        known[b] = FALLBACK
            for layer in layers:
                layer.measured.update(known)
            if known:
                source = ("from this machine's kernel cache" if not missing else
                          "measured" if not cached else "measured and from the cache")
                logger.info("CPU kernels for {} ({} layer{}, {}): {}; prompts {}{}", key, len(layers),
                            "" if len(layers) == 1 else "s", source,
                            ", ".join(f"rows<={b} {name}" for b, name in sorted(known.items())),
                            layers[0].prompt_variant(),
                            f"; measurement failed for rows<={failed}: torch's op there" if failed else "")
            result[key] = dict(known)
    return result
