"""A CPU warmup's activation peaks, from small forwards scaled by the model's per-token costs.

Warmup must learn two things: that every kernel runs (the prompt path, the decode paths of
small and larger batches), and how much memory the largest forwards the limits allow take on
top of the weights and the KV cache. On a GPU it runs those forwards (the caching allocator then
keeps what they took, and the graphs need them anyway). On a CPU the largest prefill is the
costly part of a start (a 4k-token prefill of a 1.5B model: 35 s on two cores) and teaches
nothing the small ones do not: a forward's memory is a fixed part, a part per token (hidden
states, the MLP's intermediate, a row of logits per prompt-logprob row) and, in attention, a
part per token and per token of its sequence. So the CPU warmup runs three or four prefills of a
few dozen tokens and three decode steps of a few rows, measures each one's peak of live tensor
bytes exactly (`PeakTracker`), and fits:

- prefill(n) = a + b n + c n^2 over one sequence of n tokens, then for the warmup batch (k
  prompts, N tokens in all, the longest L) a + b N + c N L + (k - 1) d: the quadratic part of a
  prompt of length l is at most c l L, whichever way attention splits the batch, and each prompt
  beyond the first costs at most a decode row's d;
- prompt logprobs, where the batch asks for them (the router's warmup batch does): their cost
  per row, from one more small prefill with them, times the rows of logits computed at once;
- decode(r) = e + d r over the rows of a step whose sequences hold one block (the attention
  backend states what a long context adds: `decode_transient_bytes`, sized with the cache).

The fit never passes below a measured point, and tests/test_warmup_probe.py checks the estimate
against a forward of the full size measured the same way.

The probes run one layer of each kind (`representative_layers`), not the whole stack: layers run
one after another, each freeing its activations before the next starts, so a forward's peak is
the peak of its most demanding layer on top of what every layer shares (the hidden states, the
logits), whatever the depth; and a layer of the same kind (same modules, shapes, dtypes, kernels
and settings such as a sliding window) runs the same kernels. A 28-layer model probes in about a
tenth of the time, every kernel still runs once, and the peak is the same bytes.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from text_generation_server.engine.types import GenerationRequest

# One prompt of each of these lengths (tokens) is prefilled; limits within the largest run whole.
PREFILL_PROBE_TOKENS = (32, 64, 128)
# Decode steps of these many rows (1: the matrix-vector paths; the others: the GEMM paths).
DECODE_PROBE_ROWS = (1, 4, 16)


# Attributes that differ between layers of one kind without changing what they run.
_POSITION_ATTRIBUTES = frozenset({"layer_id", "layer_idx", "index"})
_POSITION = re.compile(r"\.\d+\.")  # "model.layers.7.self_attn" names the same kind as layer 3's


def layer_kind(layer: torch.nn.Module) -> tuple:
    """What decides a layer's kernels and activation memory: every submodule's type, its
    parameters' and buffers' shapes and dtypes, and its plain settings (numbers, strings, flags:
    a sliding window, a soft cap, a kernel's name), its position in the stack aside."""
    kind = []
    for path, module in layer.named_modules():
        tensors = tuple((name, tuple(t.shape), str(t.dtype))
                        for name, t in (*module.named_parameters(recurse=False), *module.named_buffers(recurse=False))
                        if t is not None)
        settings = tuple(sorted((k, _POSITION.sub(".#.", v) if isinstance(v, str) else v) for k, v in vars(module).items()
                                if not k.startswith("_") and k not in _POSITION_ATTRIBUTES and k != "training"
                                and (v is None or isinstance(v, (bool, int, float, str)))))
        tensor_fields = tuple(sorted((k, tuple(v.shape), str(v.dtype)) for k, v in vars(module).items()
                                     if isinstance(v, torch.Tensor) and not k.startswith("_")))
        kind.append((path, type(module).__qualname__, tensors, settings, tensor_fields))
    return tuple(kind)


def representative_layers(layers: Sequence[torch.nn.Module]) -> list[int]:
    """The index of the first layer of each kind (`layer_kind`), in order."""
    seen: set[tuple] = set()
    picked = []
    for i, layer in enumerate(layers):
        kind = layer_kind(layer)
        if kind not in seen:
            seen.add(kind)
            picked.append(i)
    return picked


@contextmanager
def probing_layers(model: torch.nn.Module) -> Iterator[tuple[int, int]]:
    """Inside: `model.layers` holds one layer of each kind (they keep their own KV cache layer
    ids), and a second of the first kind where layers chain their residual adds; yields (layers
    kept, layers in all). A model without a `layers` list runs whole."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) < 2:
        yield (len(layers) if layers is not None else 0,) * 2
        return
    keep = representative_layers(layers)
    chains = getattr(model, "chains_residuals", None)
    if chains is not None and chains() and keep[0] + 1 < len(layers) and keep[0] + 1 not in keep:
        # Chained layers (models/decoder.py): the first has no pending add, the others do and hold
        # one more hidden-sized tensor; the second shows that peak.
        keep = sorted({*keep, keep[0] + 1})
    model.layers = torch.nn.ModuleList([layers[i] for i in keep])
    try:
        yield len(keep), len(layers)
    finally:
        model.layers = layers


class PeakTracker(TorchDispatchMode):
    """The peak of bytes held by CPU tensors that torch ops allocate while it is active.

    Every op's outputs are seen (kernels called from C++ extensions included); an output whose
    storage is new (not one of the op's inputs', not one already counted) adds its storage's
    bytes, and the bytes leave when the last tensor seen on that storage is freed. Memory that
    existed before (weights, the KV cache) is not counted, nor is what a kernel allocates and
    frees inside itself without a tensor (a few per-thread tiles).
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's handler to keep torch.compile out of it, importing torch._dynamo on
        # the first op: 3-4 s of a CPU start, for a mode that never runs under compile.
        return False

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [bytes, tensors alive]

    def _release(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._storages[key]
            self.live -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = None
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key == 0:
                continue
            entry = self._storages.get(key)
            if entry is None:
                if inputs is None:
                    inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                              if isinstance(t, torch.Tensor) and t.device.type == "cpu"}
                if key in inputs:  # a view or an in-place result: nothing new
                    continue
                entry = self._storages[key] = [storage.nbytes(), 0]
                self.live += entry[0]
                self.peak = max(self.peak, self.live)
            entry[1] += 1
            weakref.finalize(tensor, self._release, key)
        return out


def measure_peak(run: Callable[[], object]) -> int:
    """Peak bytes of CPU tensors `run` allocates (its result freed before returning)."""
    with PeakTracker() as tracker:
        result = run()
    del result
    return tracker.peak


@dataclass(frozen=True)
class PrefillFit:
    """peak(n) = fixed + per_token n + per_token_pair n^2 for one prompt of n tokens (bytes)."""

    fixed: float
    per_token: float
    per_token_pair: float

    def batch(self, tokens: int, longest: int, prompts: int, per_prompt: float) -> int:
        """The peak of a prefill of `prompts` prompts, `tokens` in all, the longest `longest`."""
        return int(self.fixed + self.per_token * tokens + self.per_token_pair * tokens * longest
                   + max(prompts - 1, 0) * per_prompt)


def fit_prefill(points: Sequence[tuple[int, int]]) -> PrefillFit:
    """The quadratic through three (tokens, peak) points with a non-negative n^2 term, its fixed part
    raised so the curve passes on or above every point. Fewer points: a line through the last two
    (one point: everything per token)."""
    pts = sorted(points)
    if not pts:
        raise ValueError("fitting a prefill peak needs at least one measured point")
    c = 0.0
    if len(pts) >= 3:
        (x1, y1), (x2, y2), (x3, y3) = pts[-3:]
        c = ((y3 - y2) / (x3 - x2) - (y2 - y1) / (x2 - x1)) / (x3 - x1)
    if c > 0:
        (x1, y1), (x2, y2) = pts[-3], pts[-2]
        b = (y2 - y1) / (x2 - x1) - c * (x1 + x2)
    else:
        c = 0.0
        slopes = [(y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in zip(pts, pts[1:]) if x2 > x1]
        b = max([s for s in slopes if s > 0], default=pts[-1][1] / max(pts[-1][0], 1))
    b = max(b, 0.0)
    a = max(y - b * x - c * x * x for x, y in pts)
    return PrefillFit(a, b, c)


def fit_decode(points: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """(fixed, per_row) of a line on or above every (rows, peak) point, its slope the largest
    between neighbours (a decode step's memory grows with its rows, never faster than that)."""
    pts = sorted(points)
    if not pts:
        raise ValueError("fitting a decode peak needs at least one measured point")
    slopes = [(y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in zip(pts, pts[1:]) if x2 > x1]
    d = max([0.0, *slopes]) if slopes else pts[0][1] / max(pts[0][0], 1)
    e = max(y - d * x for x, y in pts)
    return e, d


@dataclass(frozen=True)
class ActivationEstimate:
    """What the largest forwards take beyond weights and cache, and the measurements behind it."""

    prefill_bytes: int
    decode_bytes: int
    prefill_points: tuple[tuple[int, int], ...]
    decode_points: tuple[tuple[int, int], ...]
    prompt_logprob_bytes: int = 0  # of prefill_bytes: the prompt logprobs' logits

    @property
    def peak_bytes(self) -> int:
        return max(self.prefill_bytes, self.decode_bytes)

    def describe(self, prefill_tokens: int, decode_rows: int) -> str:
        mib = 2**20
        probes = "/".join(str(n) for n, _ in self.prefill_points)
        rows = "/".join(str(r) for r, _ in self.decode_points)
        logprobs = (f" ({self.prompt_logprob_bytes / mib:.1f} MiB of it prompt logprobs)"
                    if self.prompt_logprob_bytes else "")
        return (f"activation peak estimated from prefills of {probes} tokens and decode steps of {rows} rows: "
                f"{self.prefill_bytes / mib:.1f} MiB for the prefill of {prefill_tokens} tokens{logprobs}, "
                f"{self.decode_bytes / mib:.1f} MiB for a decode step of {decode_rows} rows")


def probe_request(request: GenerationRequest, tokens: int, logprobs: bool) -> GenerationRequest:
    """The warmup request cut to its last `tokens` prompt tokens (same sampling and top-n tokens),
    with or without prompt logprobs."""
    return dataclasses.replace(request, id=0, truncate=tokens, blocks=[], slots=[], cache_len=0, chunk_len=None,
                               max_new_tokens=1, prefill_logprobs=logprobs)


def estimate_activations(
    tokenize: Callable[[GenerationRequest], list[int]],
    requests: Sequence[GenerationRequest],
    decode_rows: int,
    run_prefill: Callable[[list[GenerationRequest]], int],
    run_decode: Callable[[int], int],
    logit_rows_at_once: int | None = None,
) -> ActivationEstimate:
    """Runs the probe forwards through `run_prefill` (requests -> measured peak) and `run_decode`
    (rows -> measured peak), then scales them to the warmup batch (its prompts as `tokenize`,
    the batch builder's, cuts them) and `decode_rows`.

    Prompt logprobs (the router's warmup batch asks for them) cost a vocabulary-wide row of logits
    per prompt token, computed `logit_rows_at_once` rows at a time (None: all at once): the probes
    measure the model without them, and one more prefill of the smallest size with them gives
    their cost per row, counted for at most that many rows.
    """
    lengths = [len(tokenize(r)) for r in requests]
    longest = max(lengths)
    source = requests[lengths.index(longest)]
    logprob_tokens = sum(n for n, r in zip(lengths, requests) if r.prefill_logprobs)
    prefill_points: list[tuple[int, int]] = []
    for n in PREFILL_PROBE_TOKENS:
        n = min(n, longest)
        if prefill_points and n <= prefill_points[-1][0]:
            break
        prefill_points.append((n, run_prefill([probe_request(source, n, logprobs=False)])))
    logprobs = 0
    if logprob_tokens:
        n, without = prefill_points[0]
        per_row = max(run_prefill([probe_request(source, n, logprobs=True)]) - without, 0) / n
        rows = logprob_tokens if logit_rows_at_once is None else min(logprob_tokens, logit_rows_at_once)
        logprobs = int(per_row * rows)
    decode_points: list[tuple[int, int]] = []
    for rows in DECODE_PROBE_ROWS:
        rows = min(rows, decode_rows)
        if decode_points and rows <= decode_points[-1][0]:
            break
        decode_points.append((rows, run_decode(rows)))
    fixed, per_row = fit_decode(decode_points)
    prefill = fit_prefill(prefill_points).batch(sum(lengths), longest, len(lengths), per_row) + logprobs
    decode = int(fixed + per_row * decode_rows)
    return ActivationEstimate(max(prefill, max(p for _, p in prefill_points)), decode, tuple(prefill_points),
                              tuple(decode_points), logprobs)
