"""Grammar-constrained generation: a JSON schema or a regex turned into a token mask per step.

Built on llguidance (README, "Structured output", says why it and not xgrammar or outlines-core):
its Earley parser with a lazily built lexer compiles a schema in milliseconds whatever the
vocabulary, so compiling a client's schema never stalls the batch, and it reads tokenizer.json
itself. Three pieces:

- `GrammarCompiler`, one per tokenizer: a request's grammar to a matcher. Compiled grammars are
  cached per (type, value) (the compiler is the tokenizer's, so the cache is per schema and
  tokenizer): a cache hit costs a matcher copy (microseconds). Invalid grammars raise
  `GrammarError` with llguidance's own description of the problem.
- `GrammarMatcher`: one request's position in its grammar. It consumes each chosen token and
  says when the grammar is complete (nothing more can follow): the request ends there, so the
  output parses. End-of-sequence is in the mask only where the output is complete.
- `PendingMasks`: the bitmasks of a step, filled on the compiler's worker thread (llguidance
  drops the GIL) while the model's forward runs (masks that take only microseconds are filled
  when needed instead: the hand-off would cost more), then applied to the logits on the device after
  the forward (after a CUDA graph's replay too) as one additive 0/-inf mask (`apply_masks`).

JSON is compact: no whitespace between tokens, `,` and `:` separators, so a weak model cannot
pad the output with whitespace forever.
"""

from __future__ import annotations

import enum
import functools
import json
import os
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import llguidance
import torch
from loguru import logger
from tokenizers import Tokenizer
from torch import Tensor

from text_generation_server.utils import bounded_json

# Compiled grammars kept per compiler; a hit skips the parse and lexer setup (milliseconds).
DEFAULT_CACHE_SIZE = 256
# mask_bias reads int32 words as bytes in memory order (x86, ARM and CUDA devices are little-endian).
if sys.byteorder != "little":
    raise ImportError("grammar bitmasks assume a little-endian host")
# Rows of a step filled by llguidance's thread pool rather than one after the other: below this
# the pool's hand-off costs more than it saves.
PARALLEL_ROWS = 4
# A step whose masks took less than this to fill (a moving average of recent steps) fills them
# on the model thread when the sampler needs them: waking the worker and sharing the GIL with it
# cost more than that on CPU, and on CUDA the forward is still running on the device by then.
INLINE_FILL_S = 150e-6
# Error text past this is cut: llguidance echoes the grammar, which may be a whole schema.
_MAX_ERROR_CHARS = 600


class GrammarType(enum.IntEnum):
    """The wire values of GrammarType in both generate.v3 and text_generation.v1."""

    JSON = 1
    REGEX = 2


@dataclass(frozen=True)
class GrammarSpec:
    """A request's grammar as the client sent it: a JSON schema (JSON text) or a regex."""

    type: GrammarType
    value: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "type", GrammarType(self.type))  # ValueError for a type with no meaning

    def describe(self) -> str:
        return "JSON schema" if self.type is GrammarType.JSON else "regex"


class GrammarError(ValueError):
    """The grammar itself is invalid: the caller's error (INVALID_ARGUMENT)."""


def _tidy(message: str) -> str:
    """llguidance's message without the grammar listing it appends after a regex error."""
    message = message.split("\n   1 | start:", 1)[0].strip()
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + "..."


def llguidance_grammar(spec: GrammarSpec) -> str:
    """The llguidance grammar text for `spec`; GrammarError for text that is not a schema at all."""
    if not spec.value:
        raise GrammarError(f"the {spec.describe()} is empty")
    if spec.type is GrammarType.REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    try:
        schema = bounded_json.loads(spec.value, "the JSON schema")
    except ValueError as exc:  # not JSON, or nested deeper than any schema needs
        raise GrammarError(str(exc)) from None
    if schema is True:
        schema = {}  # JSON Schema's `true`: any value; llguidance wants an object
    if not isinstance(schema, dict):
        raise GrammarError(f"a JSON schema must be an object (or true), got {json.dumps(schema)[:80]}")
    try:
        # No free whitespace anywhere, compact separators.
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema: {_tidy(str(exc))}") from None


class GrammarMatcher:
    """One request's state in its grammar; advanced with every token the request is given."""

    __slots__ = ("_matcher", "spec")

    def __init__(self, matcher: llguidance.LLMatcher, spec: GrammarSpec):
        self._matcher = matcher
        self.spec = spec

    def fork(self) -> "GrammarMatcher":
        """An independent copy, for a step computed ahead that may be thrown away."""
        return GrammarMatcher(self._matcher.deep_copy(), self.spec)

    def accept(self, token: int) -> bool:
        """Consumes the chosen token; True when the output is complete (the grammar allows nothing
        more), so the request must end here.

        A token outside the mask cannot be chosen, so a refusal means llguidance's state is broken
        (say, a lexer limit hit mid-way): the request ends too, with the reason logged, rather than
        generating unconstrained text under a grammar. A row already complete (finished, kept in
        the batch until the router filters it) stays complete.
        """
        if self._matcher.is_stopped():
            return True
        if not self._matcher.consume_token(token):
            logger.error("{} refused token {}: {}; the request ends here", self.spec.describe(), token,
                         _tidy(self._matcher.get_error()).splitlines()[0])
            return True
        return self._matcher.is_stopped()

    @property
    def complete(self) -> bool:
        return self._matcher.is_stopped()

    def fill_mask(self, row: Tensor) -> None:
        """Writes the allowed tokens of the next step, one bit each, into `row` (int32, contiguous, CPU)."""
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())


class _Deferred:
    """A fill run by the first caller that needs it (masks too cheap to hand to the worker)."""

    def __init__(self, fill: Callable[[], None]):
        self._fill: Callable[[], None] | None = fill

    def result(self) -> None:
        fill, self._fill = self._fill, None
        if fill is not None:
            fill()

    def cancel(self) -> bool:
        self._fill = None
        return True


class PendingMasks:
    """The next-token bitmasks of some rows of a batch, being filled on the compiler's worker
    (or, when they are cheap, filled by `wait`).

    `rows` are the batch rows (in the chooser's order) that carry a grammar; the bitmask row i
    belongs to rows[i]. `select` follows a chooser's `filter` without waiting.
    """

    def __init__(self, rows: list[int], bitmask: Tensor, future: Future | _Deferred, picked: list[int] | None = None):
        self.rows = rows
        self._bitmask = bitmask  # [G, ceil(V / 32)] int32 on the host (pinned for CUDA)
        self._future = future
        self._picked = picked  # bitmask rows to use, when a filter dropped some

    def select(self, indices: Sequence[int]) -> "PendingMasks | None":
        """The masks of a chooser filtered to `indices` (batch rows), renumbered; None if no row keeps one."""
        where = {row: i for i, row in enumerate(self.rows)}
        rows, picked = [], []
        for new_row, old_row in enumerate(indices):
            if old_row in where:
                rows.append(new_row)
                picked.append(where[old_row] if self._picked is None else self._picked[where[old_row]])
        if not rows:
            return None
        return PendingMasks(rows, self._bitmask, self._future, picked)

    def wait(self) -> Tensor:
        """The bitmask rows of `rows`, once filled (re-raises the worker's failure)."""
        self._future.result()
        if self._picked is None:
            return self._bitmask
        return self._bitmask.index_select(0, torch.tensor(self._picked, dtype=torch.long))

    def done(self) -> None:
        """Waits for the worker without using the masks (a step that failed must not leave the
        worker touching matchers the next step will advance)."""
        if isinstance(self._future, _Deferred):
            self._future.cancel()
            return
        try:
            self._future.result()
        except Exception:  # the step is failing already; its own error is the one to report
            pass


def unpack_bitmask(bitmask: Tensor, vocab: int) -> Tensor:
    """[G, W] int32 bitmask (bit j of word w: token 32 * w + j) -> [G, vocab] bool, on its device.
    The readable form (tests, inspection); the step itself uses `mask_bias`."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [G, W, 32]; an arithmetic shift keeps bit 31 right
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


@functools.lru_cache(maxsize=8)
def _byte_bias(device: torch.device) -> Tensor:
    """[256, 8] float32: entry (b, j) is 0 where bit j of byte b is set, else -inf."""
    bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
    return torch.zeros(256, 8).masked_fill(bits == 0, -torch.inf).to(device)


def mask_bias(bitmask: Tensor, vocab: int) -> Tensor:
    """[G, W] int32 bitmask -> [G, vocab] float32 additive mask (0 allowed, -inf not).

    One table lookup per byte: the int32 words read as little-endian bytes put byte 4w + k on
    tokens 8 (4w + k) .. + 7, so the bytes in order are the vocabulary in order. On CPU this is
    several times faster than unpacking bits and a masked_fill (which runs element by element)."""
    groups = bitmask.shape[0]
    index = bitmask.contiguous().view(torch.uint8).reshape(-1).long()  # [G * W * 4]
    return _byte_bias(bitmask.device).index_select(0, index).view(groups, -1)[:, :vocab]


def apply_masks(scores: Tensor, masks: PendingMasks) -> Tensor:
    """Disallowed tokens to -inf in the masked rows; scores: [B, V] float32. One host-to-device
    copy of the bitmask and a few batched ops, whatever the number of constrained rows."""
    bitmask = masks.wait()
    if scores.device.type != "cpu":
        bitmask = bitmask.to(scores.device, non_blocking=True)
    if bitmask.shape[1] * 32 < scores.shape[1]:
        raise ValueError(f"grammar masks cover {bitmask.shape[1] * 32} tokens, the logits {scores.shape[1]}")
    bias = mask_bias(bitmask, scores.shape[1])  # [G, V]
    if len(masks.rows) == scores.shape[0]:
        return scores + bias
    rows = torch.tensor(masks.rows, dtype=torch.long, device=scores.device)
    return scores.index_add(0, rows, bias)


class GrammarCompiler:
    """Grammars for one tokenizer: compiled once per (type, value), copied per request, and a
    worker that fills their masks off the model thread."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int],
                 cache_size: int = DEFAULT_CACHE_SIZE, mask_threads: int | None = None):
        """tokenizer_json: the tokenizer.json text; vocab_size: the mask's width in tokens (the
        tokenizer's, added tokens included); eos_token_ids: the tokens allowed where the output is
        complete. mask_threads: llguidance threads filling a batch's masks (default: half the
        cores, at most 8); with one, rows are filled one after the other on the worker."""
        eos = sorted(eos_token_ids)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher | str] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._mask_threads = mask_threads if mask_threads is not None else \
            min(8, max(1, (os.cpu_count() or 2) // 2))
        # Threads only where masks are filled (a shard), not where grammars are only checked (the router).
        self._executor: llguidance.LLExecutor | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._fill_s = 0.0  # moving average of a step's fill time

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, eos_token_ids: Iterable[int], **kwargs) -> "GrammarCompiler":
        """From a `tokenizers` Tokenizer (padding and truncation off: they would change what a token
        sequence decodes to)."""
        plain = Tokenizer.from_str(tokenizer.to_str())
        plain.no_padding()
        plain.no_truncation()
        return cls(plain.to_str(), tokenizer.get_vocab_size(with_added_tokens=True), eos_token_ids, **kwargs)

    def compile(self, spec: GrammarSpec) -> None:
        """Checks `spec` (and warms the cache); GrammarError naming the problem when it is invalid."""
        self._compiled(spec)

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        """A fresh matcher at the start of `spec`; GrammarError when the grammar is invalid."""
        return GrammarMatcher(self._compiled(spec).deep_copy(), spec)

    def _compiled(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
        if hit is None:
            hit = self._build(spec)
            with self._lock:
                self._cache[spec] = hit
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, str):  # a refusal is cached too: a client retrying it costs nothing
            raise GrammarError(hit)
        return hit

    def _build(self, spec: GrammarSpec) -> llguidance.LLMatcher | str:
        try:
            grammar = llguidance_grammar(spec)
        except GrammarError as exc:
            return str(exc)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            return f"invalid {spec.describe()}: {_tidy(matcher.get_error())}"
        # The first mask builds the lexer states the start needs (shared by every copy), here on
        # the compiling thread rather than inside the first step; a grammar that fails only
        # then (a lexer limit) is refused like any other.
        scratch = torch.empty(self.words, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(scratch.data_ptr(), self.words * 4)
        if matcher.is_error():
            return f"invalid {spec.describe()}: {_tidy(matcher.get_error())}"
        return matcher

    def start_masks(self, matchers: Sequence[GrammarMatcher | None], device: torch.device) -> PendingMasks | None:
        """Starts filling the next-token masks of the rows with a matcher; None when no row has one.
        The caller must `wait` (or `done`) before it advances any of these matchers. Called from
        one thread (the shard's model thread)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        active = [m._matcher for m in matchers if m is not None]
        if not rows:
            return None
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
            if self._mask_threads > 1:
                self._executor = llguidance.LLExecutor(num_threads=self._mask_threads)
        executor = self._executor
        bitmask = torch.empty(len(rows), self.words, dtype=torch.int32,
                              pin_memory=device.type == "cuda" and torch.cuda.is_available())

        def fill() -> None:
            started = time.perf_counter()
            if executor is not None and len(active) >= PARALLEL_ROWS:
                executor.unsafe_compute_mask_ptr(
                    [(m, i) for i, m in enumerate(active)], bitmask.data_ptr(), self.words * 4, len(active))
            else:
                for i, m in enumerate(active):
                    m.unsafe_compute_mask_ptr(bitmask[i].data_ptr(), self.words * 4)
            self._fill_s = 0.75 * self._fill_s + 0.25 * (time.perf_counter() - started)

        if self._fill_s < INLINE_FILL_S:
            return PendingMasks(rows, bitmask, _Deferred(fill))
        return PendingMasks(rows, bitmask, self._worker.submit(fill))

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
