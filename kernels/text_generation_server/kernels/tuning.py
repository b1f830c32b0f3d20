"""Warmup's kernel timing: where two kernels can run a layer, the faster one per decode batch size.

The kernel table ranks one kernel per layer (kernels/table.py), but the fastest kernel can depend
on the batch: on an H100, tinygemm ran the 4096x4096 4-bit product at batch 1 in 10.8 us to
triton-gemm's 16.3, and triton-gemm the batch-16 one in 15.3 us to tinygemm's 24.5. So warmup,
before it captures the CUDA graphs, calls `tune_kernels` with the graphs' batch sizes:

1. It finds the layers whose kernel the table pairs with a rival that can also run them
   (select.rival_kernel: not where the operator prefers a kernel by name, disabled the rival, or
   a whole-layer measurement chose), and groups them by shape (select.shape_key).
2. Per shape, once: the decode row buckets the machine's preferences already hold are read from
   them (no timing: the next start reads what this one measured); the others are timed on one
   layer of that shape. The rival is built from that layer's own weights (its `canonical_weight()`),
   both run in a KernelDispatch (kernels/dispatch.py), and select.tune_rows times them per bucket
   with the timer (on CUDA `cuda_timer`: CUDA graphs between CUDA events, the L2 cache flushed),
   checks each result against the first kernel's and records the winners in the preferences.
3. If the rival won a bucket, every layer of that shape becomes a KernelDispatch over both builds,
   unless the copies would leave less free memory than the KV cache needs (then the first kernel
   stays, said in the log); if it won none, its copy is dropped. Prompts always run the first
   kernel (kernels/phase.py: one path whatever the row count). One log line per shape says which
   kernel runs each bucket and what became of the copies.
Nothing is paired on CPU (TIMED_PAIRS["cpu"] is empty); there each layer's own variants (native
kernels, torch's ops, dequantized GEMMs) are timed per shape and row bucket instead, first
(kernels/cpu_tuning.py). Tests pair two stand-in kernels on CPU and inject the timings.
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from loguru import logger

from text_generation_server.kernels.base import LinearSpec, QuantKernel
from text_generation_server.kernels.cpu_tuning import tune_cpu_layers
from text_generation_server.kernels.dispatch import KernelDispatch, held_bytes
from text_generation_server.kernels.phase import row_bucket
from text_generation_server.kernels.select import (
    Preferences,
    Timer,
    preferences,
    rival_kernel,
    shape_key,
    tune_rows,
    wall_timer,
)

# Copies of a rival's weights must leave free, beyond what the caller keeps (the KV cache's
# minimum), this share of the device: the forwards warmup has yet to measure need it.
COPY_HEADROOM_SHARE = 0.10
MIB = 2**20


def cuda_timer(fn: Callable[[], object], repeat: int = 10, rounds: int = 5) -> float:
    """Device seconds per call of `fn`, as a CUDA graph replays it in a decode step.

    `repeat` calls are captured in one graph, each after a write over twice the L2 cache (a decode
    step reads every weight once, from memory, not from cache), and timed with CUDA events; a graph
    of the writes alone is timed the same way and subtracted. Graph replay keeps the host's launch
    time out of the figure, as in the decode graphs. The median of `rounds` replays; without a
    capturable `fn`, the wall time of eager calls (select.wall_timer).
    """
    device = torch.device("cuda", torch.cuda.current_device())
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 * MIB)
    flush = torch.empty(2 * l2, dtype=torch.uint8, device=device)
    fn()  # compiles, and sizes any scratch outside the capture
    torch.cuda.synchronize()
    graphs = {}
    try:
        for name, body in (("both", True), ("flush", False)):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(repeat):
                    flush.zero_()
                    if body:
                        fn()
            graphs[name] = graph
    except Exception as exc:  # noqa: BLE001 - any capture failure: time eagerly instead
        logger.debug("kernel timing: CUDA graph capture failed ({}: {}); timing eager calls", type(exc).__name__, exc)
        torch.cuda.synchronize()
        return wall_timer(fn)
    times: dict[str, list[float]] = {name: [] for name in graphs}
    for _ in range(rounds):
        for name, graph in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / 1e3)
    per_call = (statistics.median(times["both"]) - statistics.median(times["flush"])) / repeat
    return max(per_call, 1e-9)


def _device_memory(device: torch.device) -> tuple[int, int] | None:
    """(bytes new tensors may take, device total) on CUDA: the driver's free memory plus what the
    caching allocator holds unused; None elsewhere (no guard)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)), int(total)


@dataclass
class _Layer:
    parent: torch.nn.Module
    attr: str
    module: torch.nn.Module  # the first kernel's build, or a KernelDispatch of an earlier warmup
    spec: LinearSpec
    first: str
    rival: type[QuantKernel]

    def first_build(self) -> torch.nn.Module:
        return self.module.builds[self.first] if isinstance(self.module, KernelDispatch) else self.module

    def rival_build(self) -> torch.nn.Module | None:
        if isinstance(self.module, KernelDispatch) and self.rival.name in self.module.builds:
            return self.module.builds[self.rival.name]
        return None

    def device(self) -> torch.device:
        tensors = [*self.first_build().buffers(), *self.first_build().parameters()]
        return tensors[0].device if tensors else torch.device(self.spec.device_type)

    def replace(self, module: torch.nn.Module) -> None:
        if module is not self.module:
            setattr(self.parent, self.attr, module)
            self.module = module


def _timed_layers(model: torch.nn.Module, pairs: Mapping | None) -> dict[tuple[str, str, str], list[_Layer]]:
    """(shape key, first kernel, rival) -> the layers of that shape the rival can also run."""
    groups: dict[tuple[str, str, str], list[_Layer]] = {}
    dispatches: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(prefix + ".") for prefix in dispatches):
            continue  # the model itself; a dispatch's own builds
        first = module
        if isinstance(module, KernelDispatch):
            dispatches.append(name)
            first = next(iter(module.builds.values()))
        spec = getattr(first, "linear_spec", None)
        kernel_name = getattr(first, "kernel_name", None)
        if not isinstance(spec, LinearSpec) or not isinstance(kernel_name, str):
            continue
        rival = rival_kernel(spec, kernel_name, pairs)
        if rival is None:
            continue
        parent_name, _, attr = name.rpartition(".")
        groups.setdefault((shape_key(spec), kernel_name, rival.name), []).append(
            _Layer(model.get_submodule(parent_name), attr, module, spec, kernel_name, rival))
    return groups


def _build_rival(layer: _Layer) -> torch.nn.Module:
    """The rival kernel built from the layer's own weights (its first kernel's `canonical_weight()`)."""
    held = layer.rival_build()
    if held is not None:
        return held
    first = layer.first_build()
    canonical = getattr(first, "canonical_weight", None)
    if canonical is None:
        raise TypeError(f"{layer.first} cannot give its weights back to build {layer.rival.name} from")
    module = layer.rival.build(canonical(), getattr(first, "bias", None), layer.spec.act_dtype)
    module.kernel_name = layer.rival.name
    module.linear_spec = layer.spec
    if hasattr(first, "computes"):
        module.computes = first.computes
    return module


def tune_kernels(model: torch.nn.Module, rows: Sequence[int], timer: Timer | None = None,
                 keep_free_bytes: int = 0, memory: Callable[[torch.device], tuple[int, int] | None] | None = None,
                 pairs: Mapping | None = None, prefs: Preferences | None = None) -> dict[str, dict[int, str]]:
    """Times paired kernels at the decode row counts `rows` (the CUDA graphs' batch sizes) and puts
    the faster one per row bucket into every layer of each shape (module docstring); returns, per
    shape key, the kernel each bucket runs. keep_free_bytes: memory the rival's copies must leave
    free (warmup: the KV cache for max_total_tokens). For tests: `timer` (select.Timer), `memory`
    (a device's free and total bytes; None from it: no guard), `pairs` (table.TIMED_PAIRS), `prefs`.
    Never raises for a kernel's sake: a shape whose timing or copies fail keeps the table's choice."""
    # CPU layers: each shape's variants timed at the CPU's own buckets (kernels/cpu_tuning.py).
    result: dict[str, dict[int, str]] = tune_cpu_layers(model, prefs=prefs)
    buckets = sorted({row_bucket(r) for r in rows if r > 0})
    if not buckets:
        return result
    on_cuda = False
    with torch.inference_mode():
        for (key, first, rival), layers in _timed_layers(model, pairs).items():
            on_cuda |= layers[0].spec.device_type == "cuda"
            try:
                choices, source, note = _tune_shape(key, layers, buckets, timer, keep_free_bytes,
                                                    memory or _device_memory, prefs)
            except Exception as exc:  # noqa: BLE001 - a measurement must never take a server down
                _install(layers, {}, {b: first for b in buckets})
                logger.warning("kernels for {}: {} not timed ({}: {}); {} runs every batch", key, rival,
                               type(exc).__name__, exc, first)
                continue
            logger.info("kernels for {} ({} layer{}, {}): decode {}; prompts {}; {}", key, len(layers),
                        "" if len(layers) == 1 else "s", source,
                        ", ".join(f"rows<={b} {name}" for b, name in choices.items()), first, note)
            result[key] = choices
    if on_cuda:
        gc.collect()
        torch.cuda.empty_cache()  # dropped copies and timing graphs: nothing warmup measured is in there yet
    return result


def _tune_shape(key: str, layers: list[_Layer], buckets: list[int], timer: Timer | None, keep_free_bytes: int,
                memory: Callable[[torch.device], tuple[int, int] | None], prefs: Preferences | None
                ) -> tuple[dict[int, str], str, str]:
    """One shape: the choices per bucket (from the cache, else timed on its first layer), installed in
    every layer of it; returns (choices, where they came from, what became of the rival's copies)."""
    spec, first, rival = layers[0].spec, layers[0].first, layers[0].rival.name
    store = prefs or preferences(spec.device_type)
    known = {b: c for b, c in store.row_choices(spec, KernelDispatch.preference_scope).items()
             if b in buckets and c in (first, rival)}
    missing = [b for b in buckets if b not in known]
    copies: dict[int, torch.nn.Module] = {}  # layer index -> its rival build
    if missing:
        copies[0] = _build_rival(layers[0])
        probe = KernelDispatch({first: layers[0].first_build(), rival: copies[0]})
        device_timer = timer or (cuda_timer if spec.device_type == "cuda" else wall_timer)
        known |= tune_rows(probe, spec, missing, device_timer, store)
    # A bucket whose measurement failed runs the first kernel (the static order).
    choices = {b: known.get(b, first) for b in buckets}
    note = ""
    if rival in choices.values():
        kept, note = _make_copies(layers, copies, keep_free_bytes, memory)
        if not kept:
            choices = {b: first for b in buckets}
    dropped = _install(layers, copies, choices)
    if rival not in choices.values():
        note = note or (f"{rival}'s copy dropped ({first} measured faster at every decode batch size)"
                        if copies or dropped else f"{first} measured faster: no {rival} copy made")
    source = ("from this machine's kernel cache" if not missing else
              "measured" if len(missing) == len(buckets) else "measured and from the cache")
    return choices, source, note


def _make_copies(layers: list[_Layer], copies: dict[int, torch.nn.Module], keep_free_bytes: int,
                 memory: Callable[[torch.device], tuple[int, int] | None]) -> tuple[bool, str]:
    """Builds the rival for every layer of a shape that lacks it, if the copies fit; (done, what happened)."""
    rival, first = layers[0].rival.name, layers[0].first
    todo = [i for i, layer in enumerate(layers) if i not in copies and layer.rival_build() is None]
    try:
        reading = memory(layers[0].device())
        if reading is not None and todo and not copies:  # choices from the cache: one copy tells each one's size
            index = todo.pop(0)
            copies[index] = _build_rival(layers[index])
            reading = memory(layers[0].device())
        if reading is not None:  # the copies made so far are in the reading, those still to make are not
            per_copy = held_bytes(next(iter(copies.values()))) if copies else 0
            need = per_copy * len(todo)
            free, total = reading
            floor = keep_free_bytes + int(COPY_HEADROOM_SHARE * total)
            if free - need < floor:
                return False, (f"{rival}'s copies ({per_copy * len(layers) / MIB:.1f} MiB for {len(layers)} layers) "
                               f"would leave {(free - need) / MIB:.1f} MiB free, under the {floor / MIB:.1f} MiB kept "
                               f"for the KV cache and the forwards: {first} runs every batch")
        for i in todo:
            copies[i] = _build_rival(layers[i])
    except Exception as exc:  # noqa: BLE001 - out of memory or a refusal: the table's choice stands
        return False, f"{rival} copies not built ({type(exc).__name__}: {exc}): {first} runs every batch"
    held = 0
    for i, layer in enumerate(layers):
        build = copies[i] if i in copies else layer.rival_build()
        held += 0 if build is None else held_bytes(build)
    return True, f"{rival} copies kept for {len(layers)} layer{'' if len(layers) == 1 else 's'} (+{held / MIB:.1f} MiB)"


def _install(layers: list[_Layer], copies: dict[int, torch.nn.Module], choices: Mapping[int, str]) -> bool:
    """Puts each layer's builds and choices in place: a KernelDispatch where the rival runs a bucket,
    the first kernel's module alone where it runs none. Returns whether a held rival build was dropped."""
    dropped = False
    for i, layer in enumerate(layers):
        rival = layer.rival.name
        if rival in choices.values():
            if isinstance(layer.module, KernelDispatch):
                if layer.rival_build() is None:
                    layer.module.builds[rival] = copies[i]
                layer.module.measured = dict(choices)
            else:
                layer.replace(KernelDispatch({layer.first: layer.module, rival: copies[i]}, choices))
        elif isinstance(layer.module, KernelDispatch):
            dropped |= layer.rival_build() is not None
            layer.replace(layer.first_build())
    return dropped
