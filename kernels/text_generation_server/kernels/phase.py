"""The forward phase kernels see, and the rule that makes a prompt's rows independent of its chunking.

A prompt may run whole, in chunks (chunked prefill), or as the remainder after a cached prefix
(prefix caching), and each row must come out with the same bits every way: otherwise a greedy
near-tie answers differently with and without prefix caching (d05298c). The CPU layers compute
one product several ways, chosen by row count (a matrix-vector kernel for decode-sized inputs,
torch's weight-only op, a dequantized bfloat16 GEMM for prompts), and the ways round differently.
A row-count threshold therefore put a 32-row chunk and the 5-row remainder of the same prompt on
different paths. Moving thresholds only moves the problem, so the choice now depends on the phase:

- prefill (a forward with prompt rows): every prompt row count of a layer takes ONE path, the
  layer's prompt path. engine/causal_lm.py runs decoding rows (and their speculative checks) in
  that same forward; the forward names them (`decode_rows`), and a layer whose input has the
  forward's rows runs them on its decode path, apart from the prompt rows, so a decoding row
  gets the bits it gets in a plain decode step of the same batch size whether or not a prompt
  rides along (greedy output with prefix caching on equals it off, at any concurrency). A
  forward of decoding rows only (speculation) is a decode forward. Layers whose rows are not
  the forward's (experts of a mixture see their tokens regrouped) run all rows on the prompt
  path. torch's CPU GEMM itself takes other code paths for the smallest row
  counts (measured on an AVX512 EPYC, torch 2.13: bfloat16 at 1 row, float32 below 12 rows give
  other bits than the same rows inside a larger call), so prompt inputs under PROMPT_MIN_ROWS rows
  are zero-padded to it (`prompt_linear`): a 1-row remainder then matches the row of a 40-row chunk.
- decode (one row per sequence): the variant may depend on the batch's row count, through a
  measured preference for its row bucket (kernels/select.py) or the layer's static thresholds.
- no phase (outside a model's forward: the head's logits, tests, benchmarks): as decode.

The phase is a ContextVar set around a model's forward (`forward_phase`, layers/context.py), so
kernels need no argument threaded through every layer, and nested or concurrent forwards (threads,
tasks) each see their own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch
import torch.nn.functional as F

PREFILL = "prefill"
DECODE = "decode"
# Prompt inputs of fewer rows are zero-padded to this many before torch's CPU GEMM (module docstring).
PROMPT_MIN_ROWS = 16

_PHASE: ContextVar[str | None] = ContextVar("tgs_forward_phase", default=None)


class RowSplit:
    """The rows of a prefill forward that decode, and the ones that are prompt tokens."""

    def __init__(self, total: int, decode_rows: Sequence[int]):
        self.total = total
        self.decode_rows = list(decode_rows)
        chosen = set(self.decode_rows)
        self.prompt_rows = [r for r in range(total) if r not in chosen]
        self._index: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def indices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt rows, decode rows) as index tensors on `device`, made once per forward."""
        found = self._index.get(device)
        if found is None:
            found = self._index[device] = (torch.tensor(self.prompt_rows, dtype=torch.long, device=device),
                                           torch.tensor(self.decode_rows, dtype=torch.long, device=device))
        return found


_SPLIT: ContextVar[RowSplit | None] = ContextVar("tgs_forward_rows", default=None)


@contextmanager
def forward_phase(prefill: bool, decode_rows: Sequence[int] | None = None, total: int = 0) -> Iterator[None]:
    """Marks the forward inside the block as prefill (True) or decode (False). In a prefill,
    `decode_rows` names the rows (of `total`) that decode rather than carry prompt tokens."""
    split = None
    if prefill and decode_rows:
        if len(decode_rows) >= total:
            prefill = False  # decoding rows only: a decode forward
        else:
            split = RowSplit(total, decode_rows)
    token = _PHASE.set(PREFILL if prefill else DECODE)
    split_token = _SPLIT.set(split)
    try:
        yield
    finally:
        _SPLIT.reset(split_token)
        _PHASE.reset(token)


def current_phase() -> str | None:
    """PREFILL, DECODE, or None outside a model's forward."""
    return _PHASE.get()


def in_prefill() -> bool:
    return _PHASE.get() == PREFILL


def row_bucket(rows: int) -> int:
    """The bucket measured preferences are kept per: the smallest power of two holding `rows`
    (1, 2, 4, 8, ...), the batch sizes CUDA graphs capture."""
    return 1 << max(rows - 1, 0).bit_length()


def pad_prompt_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with zero rows appended up to PROMPT_MIN_ROWS on the CPU (the caller slices M rows back)."""
    if x.device.type != "cpu" or x.shape[0] >= PROMPT_MIN_ROWS or x.shape[0] == 0:
        return x
    return F.pad(x, (0, 0, 0, PROMPT_MIN_ROWS - x.shape[0]))


def prompt_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear as the prompt path runs it: every row the bits it has inside a larger call."""
    # x: [..., K] -> [..., N]
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    y = F.linear(pad_prompt_rows(flat), weight, bias)[:flat.shape[0]]
    return y.reshape(*lead, weight.shape[0])


class RowVariantLayer(Protocol):
    """A layer that computes one product several ways and picks one per forward by phase and rows.

    `measured` maps a row bucket to the variant a measurement chose (kernels/select.py fills it
    from the machine's preferences); variants a bucket cannot run are ignored.
    """

    measured: dict[int, str]

    def variants(self, rows: int) -> tuple[str, ...]:
        """The variants that can run `rows` rows here (the native extension may be missing)."""

    def prompt_variant(self) -> str:
        """The one variant every prefill forward runs, whatever its row count."""

    def static_variant(self, rows: int) -> str:
        """The variant for `rows` decode rows when nothing was measured (the static thresholds)."""

    def run(self, x: torch.Tensor, variant: str) -> torch.Tensor:
        """x [M, K] -> [M, N] through `variant`."""


def choose_variant(layer: RowVariantLayer, rows: int) -> str:
    """The variant `layer` runs `rows` rows with in the current phase (module docstring)."""
    if _PHASE.get() == PREFILL:
        return layer.prompt_variant()
    return decode_variant(layer, rows)


def decode_variant(layer: RowVariantLayer, rows: int) -> str:
    """The variant for `rows` decoding rows: measured for its bucket, else the static thresholds."""
    if layer.measured:
        name = layer.measured.get(row_bucket(rows))
        if name is not None and name in layer.variants(rows):
            return name
    return layer.static_variant(rows)


def by_phase(x: torch.Tensor, prompt: Callable[[torch.Tensor], torch.Tensor],
             decode: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [M, K] -> [M, N] through `prompt` in a prefill and `decode` otherwise; in a prefill whose
    forward names decoding rows, an input holding the forward's rows is split: prompt rows through
    `prompt`, decoding rows through `decode` (module docstring)."""
    if _PHASE.get() != PREFILL:
        return decode(x)
    split = _SPLIT.get()
    if split is None or x.shape[0] != split.total:
        return prompt(x)
    prompt_rows, decode_rows = split.indices(x.device)
    yp = prompt(x.index_select(0, prompt_rows))
    yd = decode(x.index_select(0, decode_rows))
    y = yp.new_empty((x.shape[0], *yp.shape[1:]))
    y.index_copy_(0, prompt_rows, yp)
    y.index_copy_(0, decode_rows, yd.to(yp.dtype))
    return y


def run_rows(layer: RowVariantLayer, x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> [M, N] through the variants `layer` runs in the current phase (`by_phase`)."""
    return by_phase(x, lambda t: layer.run(t, layer.prompt_variant()),
                    lambda t: layer.run(t, decode_variant(layer, t.shape[0])))
