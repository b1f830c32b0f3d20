"""Next-token selection for a batch whose requests carry different parameters.

Every processor works on the whole batch at once with one tensor of per-row
parameters; a row whose parameter is "off" passes through unchanged, so a request
gets the same distribution whether it runs alone or beside others. The order is
the one TGI uses: repetition penalty, frequency penalty, the grammar mask,
temperature, top-k, top-p, typical-p. Filters keep every token tied with the last
one kept, so the result never depends on how a sort orders equal values.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, replace
from typing import Sequence

import torch
from loguru import logger
from torch import Tensor

from text_generation_server.generation import request_fields
from text_generation_server.kernels import cpu_pointwise
from text_generation_server.generation.grammar import GrammarMatcher, GrammarSpec, PendingMasks, apply_masks

# Rows of [L, V] log-softmax computed at once by prefill_logprobs; bounds its memory.
_PREFILL_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class SamplingParams:
    """One request's token-selection parameters, as the client API and shard protocol carry them."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    do_sample: bool = False
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    # Constrained output (a JSON schema or a regex); None: unconstrained. The chooser masks the
    # logits with the row's GrammarMatcher, which the batch builder compiles from this.
    grammar: GrammarSpec | None = None

    def validate(self) -> None:
        """Each field by its request-field validator (generation/request_fields.py), as a shard checks
        a request: fail early naming the field, rather than with NaNs deep inside a batch. top_k 0
        and seed None are unset."""
        request_fields.temperature(self.temperature)
        if self.top_k != 0:
            request_fields.top_k(self.top_k)
        request_fields.top_p(self.top_p)
        request_fields.typical_p(self.typical_p)
        request_fields.do_sample(self.do_sample)
        if self.seed is not None:
            request_fields.seed(self.seed)
        request_fields.repetition_penalty(self.repetition_penalty)
        request_fields.frequency_penalty(self.frequency_penalty)
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise request_fields.InvalidField("grammar", f" must be None or a GrammarSpec, got {self.grammar!r}")

    def with_tgi_sampling(self) -> "SamplingParams":
        """These parameters as TGI's shard would run them: sampling whenever a warper is set.

        TGI samples a request whose temperature, top_k, top_p or typical_p is set
        even when do_sample is false; the chooser here takes do_sample literally.
        Requests from a TGI router should pass through this to behave the same.
        """
        warped = self.temperature != 1.0 or self.top_k != 0 or self.top_p < 1.0 or self.typical_p < 1.0
        return self if self.do_sample or not warped else replace(self, do_sample=True)


def _history_ids(history: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Make padded histories safe to gather/scatter with.

    Returns (ids, valid), both [B, T]. Pad positions (whatever their value, even
    -1 or >= V) are replaced by the row's first token, which is already in the
    history, so writing a penalised value there again changes nothing. Rows with
    an empty history get id 0; callers neutralise those rows.
    """
    positions = torch.arange(history.shape[1], device=history.device)
    valid = positions[None, :] < lengths[:, None]
    first = torch.where(lengths[:, None] > 0, history[:, :1], torch.zeros_like(history[:, :1]))
    return torch.where(valid, history, first), valid


def apply_repetition_penalty(scores: Tensor, history: Tensor, lengths: Tensor, penalty: Tensor) -> Tensor:
    """CTRL-style penalty: divide positive logits, multiply negative ones, of tokens seen in the history.

    scores: [B, V] float, history: [B, T] int64 right-padded, lengths: [B], penalty: [B].
    """
    if history.shape[1] == 0:
        return scores
    ids, _ = _history_ids(history, lengths)
    # A row without history writes its placeholder id back unchanged.
    penalty = torch.where(lengths > 0, penalty, torch.ones_like(penalty))[:, None]
    picked = scores.gather(1, ids)  # [B, T]
    picked = torch.where(picked > 0, picked / penalty, picked * penalty)
    # Duplicate ids write identical values, so scatter's write order does not matter.
    return scores.scatter(1, ids, picked)


def apply_frequency_penalty(scores: Tensor, history: Tensor, lengths: Tensor, penalty: Tensor) -> Tensor:
    """OpenAI-style penalty: subtract penalty * (occurrences of the token in the history).

    Works in O(B * T) with a scatter-add rather than a [B, V] count table.
    """
    if history.shape[1] == 0:
        return scores
    ids, valid = _history_ids(history, lengths)
    weights = valid.to(scores.dtype) * (-penalty)[:, None]  # pads add 0
    return scores.scatter_add(1, ids, weights)


def apply_temperature(scores: Tensor, temperature: Tensor) -> Tensor:
    """Scale logits per row; temperature: [B] > 0."""
    return scores / temperature[:, None]


def apply_top_k(scores: Tensor, top_k: Tensor, max_k: int) -> Tensor:
    """Keep each row's k highest logits (and ties with the k-th); k == 0 or k >= V keeps all.

    top_k: [B] int64. max_k is the batch's largest k, known on the host so the
    single topk call needs no device sync.
    """
    vocab = scores.shape[-1]
    width = min(max_k, vocab)
    if width <= 0:
        return scores
    values = scores.topk(width, dim=-1).values  # [B, width], descending
    off = (top_k <= 0) | (top_k >= vocab)
    kth = (top_k.clamp(min=1, max=width) - 1)[:, None]
    threshold = values.gather(1, kth).masked_fill(off[:, None], -math.inf)
    return scores.masked_fill(scores < threshold, -math.inf)


def _count_until_mass(sorted_probs: Tensor, mass: Tensor) -> Tensor:
    """How many leading entries are needed to reach `mass`: [B, 1] int64, always >= 1.

    An entry is kept while the mass before it is still below the target, which is
    the smallest prefix whose mass is >= target. The exclusive sum is built by
    shifting the cumulative sum (not by subtracting), so it is monotone and the
    count is a prefix length.
    """
    cumulative = sorted_probs.cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=-1)
    return (before < mass[:, None]).sum(dim=-1, keepdim=True).clamp(min=1)


def apply_top_p(scores: Tensor, top_p: Tensor, candidates: int | None = None) -> Tensor:
    """Nucleus filtering: keep the most likely tokens whose mass first reaches top_p; 1 keeps all.

    candidates: when top-k already left at most this many tokens in every row that
    uses top-p (the usual top_k=50, top_p=0.9 request), only that many are sorted
    instead of the whole vocabulary. Masses still use the full row's normaliser, so
    tokens tied with the k-th beyond the candidates are counted, and kept, exactly.
    """
    vocab = scores.shape[-1]
    if candidates is not None and 0 < candidates < vocab:
        sorted_scores = scores.topk(candidates, dim=-1).values  # [B, candidates], descending
    else:
        sorted_scores = scores.sort(dim=-1, descending=True).values  # [B, V]
    probs = (sorted_scores - torch.logsumexp(scores, dim=-1, keepdim=True)).exp()
    count = _count_until_mass(probs, top_p)
    threshold = sorted_scores.gather(1, count - 1)
    threshold = threshold.masked_fill((top_p >= 1)[:, None], -math.inf)
    return scores.masked_fill(scores < threshold, -math.inf)


def apply_typical_p(scores: Tensor, typical_p: Tensor) -> Tensor:
    """Locally typical filtering (Meister et al. 2022): keep the tokens whose surprisal is closest
    to the entropy until their mass reaches typical_p; 1 keeps all."""
    log_probs = scores.log_softmax(dim=-1)
    probs = log_probs.exp()
    entropy = -(log_probs * probs).nansum(dim=-1, keepdim=True)  # -inf * 0 = nan -> ignored
    distance = (-log_probs - entropy).abs()  # filtered tokens: +inf, sorted last
    sorted_distance, order = distance.sort(dim=-1)
    count = _count_until_mass(probs.gather(1, order), typical_p)
    threshold = sorted_distance.gather(1, count - 1)
    threshold = threshold.masked_fill((typical_p >= 1)[:, None], math.inf)
    return scores.masked_fill(distance > threshold, -math.inf)


def greedy_choice(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's argmax and its log-probability, as the chooser picks and reports them for a
    greedy row without processors: ids [rows] int64, and (id, logprob) pairs [rows, 2] float64,
    the layout the step reads back in one transfer (engine/readback.py).

    The log-softmax is torch's fused kernel, the chooser's own: the logprobs are the values the
    full path reports, bit for bit, and a CUDA graph runs this after the forward (no launches of
    its own); eagerly it is four launches whatever the batch. On the CPU the argmax is one native
    call where the extension is loaded (torch's took ~130 us over a 151936-word vocabulary on the
    2-core EPYC, ~0.4% of a 1.5B model's step): the same index."""
    scores = logits.to(torch.float32)
    ids = cpu_pointwise.argmax(scores) if scores.device.type == "cpu" else None
    if ids is None:
        ids = scores.argmax(dim=-1)
    picked = torch.empty(ids.shape[0], 2, dtype=torch.float64, device=scores.device)
    picked[:, 0].copy_(ids)
    picked[:, 1:].copy_(torch.log_softmax(scores, dim=-1).gather(1, ids[:, None]))
    return ids, picked


def exponential_race(probs: Tensor, uniforms: Tensor) -> Tensor:
    """One token per row drawn from `probs` ([S, V], rows need not be normalised): argmax(p / E).

    With E_i = -log(U_i) ~ Exp(1) independent, E_i / p_i is exponential with rate p_i and
    the smallest of them is token i with probability p_i / sum(p) exactly, so no CDF is
    built: elementwise float32 work and one argmax, no cumulative sum over the vocabulary
    and no float64 (slow on GPUs).

    uniforms: [S, V] in [0, 1), overwritten with the noise. U is clamped away from 0 so E is
    finite and a token with mass always beats the filtered ones (p = 0). E's smallest value,
    about 6e-8 (the 24-bit grid of float32 uniforms), is the floor torch's CUDA exponential_
    has too; it only shaves tokens whose probability is far below 1e-7.
    """
    noise = uniforms.clamp_(min=torch.finfo(uniforms.dtype).tiny).log_().neg_()  # E: (0, 87.4]
    return (probs / noise).argmax(dim=-1)


def _clone_generator(generator: torch.Generator) -> torch.Generator:
    """A generator continuing from `generator`'s state, independently of it (one call where torch
    has `clone_state`: decode ahead forks every sampling row's generator each step)."""
    clone = getattr(generator, "clone_state", None)
    if clone is not None:
        return clone()
    twin = torch.Generator(device=generator.device)
    twin.set_state(generator.get_state())
    return twin


class HeterogeneousNextTokenChooser:
    """Chooses the next token for every row of a batch whose rows have different parameters.

    Each sampling row owns a torch.Generator seeded with its seed, and each row with a
    grammar its GrammarMatcher. filter() and concatenate() hand the same generator and
    matcher objects to the new chooser, so a request continues its own random stream and
    grammar across continuous-batching changes; the old chooser must not be used after
    either call, except by a step that filters it to the rows drawing now (rows finishing their
    prompt; a speculative step's rows reaching their next position), which is how a row draws
    exactly once per token it gets, whatever the step's shape.
    """

    def __init__(self, params: list[SamplingParams], device: torch.device,
                 matchers: Sequence[GrammarMatcher | None] | None = None) -> None:
        """params: validated already, where the request entered (SamplingParams.validate).
        matchers: one per row, compiled from the row's `grammar` (GrammarCompiler.matcher);
        None where the row has none. Omitted: no row may have a grammar."""
        if matchers is None:
            matchers = [None] * len(params)
        if len(matchers) != len(params):
            raise ValueError(f"{len(matchers)} grammar matchers for {len(params)} rows")
        for index, (row, matcher) in enumerate(zip(params, matchers)):
            if (row.grammar is None) != (matcher is None):
                raise ValueError(f"request {index} in batch: a grammar needs its matcher, and only it has one")
        seeds: list[int] = []
        generators: list[torch.Generator | None] = []
        for row in params:
            if row.do_sample:
                seed = row.seed if row.seed is not None else secrets.randbits(64)
                generator = torch.Generator(device=device)
                generator.manual_seed(seed)
                if row.seed is None:
                    logger.debug("drew seed {} for a sampling request without one", seed)
            else:
                seed = row.seed if row.seed is not None else 0
                generator = None
            seeds.append(seed)
            generators.append(generator)
        self._setup(list(params), seeds, generators, list(matchers), torch.device(device))

    @classmethod
    def _from_parts(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        generators: list[torch.Generator | None],
        matchers: list[GrammarMatcher | None],
        device: torch.device,
    ) -> "HeterogeneousNextTokenChooser":
        chooser = cls.__new__(cls)
        chooser._setup(params, seeds, generators, matchers, device)
        return chooser

    def _setup(
        self,
        params: list[SamplingParams],
        seeds: list[int],
        generators: list[torch.Generator | None],
        matchers: list[GrammarMatcher | None],
        device: torch.device,
    ) -> None:
        self.device = device
        self._params = params
        self._seeds = seeds
        self._generators = generators
        self._matchers = matchers
        self._grammar_rows = [i for i, m in enumerate(matchers) if m is not None]

        def column(name: str, off: float, dtype: torch.dtype = torch.float32) -> Tensor | None:
            values = [getattr(row, name) for row in params]
            if all(value == off for value in values):
                return None  # no row uses this processor: skip it entirely
            return torch.tensor(values, dtype=dtype, device=device)

        self._repetition = column("repetition_penalty", 1.0)
        self._frequency = column("frequency_penalty", 0.0)
        self._temperature = column("temperature", 1.0)
        self._top_k = column("top_k", 0, torch.int64)
        self._max_top_k = max((row.top_k for row in params), default=0)
        self._top_p = column("top_p", 1.0)
        self._typical_p = column("typical_p", 1.0)
        # If every top-p row is also top-k limited, top-p need only sort the top max_k logits.
        nucleus_rows = [row for row in params if row.top_p < 1.0]
        self._top_p_candidates = (
            self._max_top_k if nucleus_rows and all(row.top_k > 0 for row in nucleus_rows) else None
        )
        self._sample_rows = [index for index, row in enumerate(params) if row.do_sample]
        # Built only when some row samples: torch.tensor(list, device=) is a synchronous copy on
        # CUDA, and choosers are rebuilt at every filter and decode-ahead fork.
        self._sample_index = torch.tensor(self._sample_rows, dtype=torch.int64, device=device) \
            if self._sample_rows else torch.empty(0, dtype=torch.int64, device=device)

    def __len__(self) -> int:
        return len(self._params)

    @property
    def greedy_only(self) -> bool:
        """Whether every row is greedy without processors or grammar: its tokens and logprobs are
        then `greedy_choice` of the logits, which a decode graph computes with the forward."""
        return not self._sample_rows and not self._grammar_rows and all(
            column is None for column in (self._repetition, self._frequency, self._temperature, self._top_k,
                                          self._top_p, self._typical_p))

    @property
    def params(self) -> list[SamplingParams]:
        return list(self._params)

    @property
    def seeds(self) -> list[int]:
        """The seed each row used (drawn ones included, so clients can replay); 0 for unseeded greedy rows."""
        return list(self._seeds)

    @property
    def matchers(self) -> list[GrammarMatcher | None]:
        """Each row's grammar matcher (None: unconstrained), for GrammarCompiler.start_masks."""
        return list(self._matchers)

    def accept(self, tokens: list[int]) -> list[bool] | None:
        """Advances every row's grammar by the token it was given; per row, whether its grammar is
        now complete (the request must end). None when no row has a grammar."""
        if not self._grammar_rows:
            return None
        if len(tokens) != len(self._params):
            raise ValueError(f"{len(tokens)} tokens for a batch of {len(self._params)}")
        return [matcher is not None and matcher.accept(token) for matcher, token in zip(self._matchers, tokens)]

    def __call__(self, scores: Tensor, history: Tensor, history_lengths: Tensor,
                 masks: PendingMasks | None = None) -> tuple[Tensor, Tensor]:
        """Process the batch's last-position logits and pick one token per row.

        scores: [B, V] logits; history: [B, T] token ids, right-padded with any
        value; history_lengths: [B] valid lengths; masks: the grammar rows' next-token
        masks (GrammarCompiler.start_masks on this chooser's matchers, computed while the
        forward ran). Returns next_ids [B] int64 and logprobs [B, V] float32, the
        log-softmax of the processed scores (filtered tokens are -inf).
        """
        batch = len(self._params)
        if scores.dim() != 2 or scores.shape[0] != batch:
            raise ValueError(f"scores must be [{batch}, vocab], got {tuple(scores.shape)}")
        if history.dim() != 2 or history.shape[0] != batch:
            raise ValueError(f"history must be [{batch}, tokens], got {tuple(history.shape)}")
        if tuple(history_lengths.shape) != (batch,):
            raise ValueError(f"history_lengths must be [{batch}], got {tuple(history_lengths.shape)}")
        scores = scores.to(torch.float32)
        if self._repetition is not None or self._frequency is not None:
            history = history.to(device=scores.device, dtype=torch.int64)
            history_lengths = history_lengths.to(device=scores.device, dtype=torch.int64)
        if self._repetition is not None:
            scores = apply_repetition_penalty(scores, history, history_lengths, self._repetition)
        if self._frequency is not None:
            scores = apply_frequency_penalty(scores, history, history_lengths, self._frequency)
        if masks is not None:
            # Before the warpers, so top-k/top-p/typical-p choose among allowed tokens (TGI's order).
            scores = apply_masks(scores, masks)
        elif self._grammar_rows:
            raise ValueError("rows with a grammar need their masks (GrammarCompiler.start_masks)")
        if self._temperature is not None:
            scores = apply_temperature(scores, self._temperature)
        if self._top_k is not None:
            scores = apply_top_k(scores, self._top_k, self._max_top_k)
        if self._top_p is not None:
            scores = apply_top_p(scores, self._top_p, self._top_p_candidates)
        if self._typical_p is not None:
            scores = apply_typical_p(scores, self._typical_p)

        logprobs = torch.log_softmax(scores, dim=-1)
        if not self._sample_rows:
            return scores.argmax(dim=-1), logprobs
        if len(self._sample_rows) == batch:  # every row samples: no argmax, no row gathers
            return self._draw(logprobs), logprobs
        next_ids = scores.argmax(dim=-1).index_copy(0, self._sample_index, self._draw(logprobs))
        return next_ids, logprobs

    def _draw(self, logprobs: Tensor) -> Tensor:
        """Sample every sampling row by `exponential_race`, with uniforms from the row's own generator.

        Each row draws V uniforms in one call per step, so a seeded stream depends only on
        its seed and the vocabulary size, never on the rows beside it; only that fill is a
        per-row loop, the rest is batched.
        """
        sampling = logprobs if len(self._sample_rows) == len(self._params) else \
            logprobs.index_select(0, self._sample_index)
        probs = sampling.exp()  # [S, V]
        uniforms = torch.empty_like(probs)
        for index, row in enumerate(self._sample_rows):
            uniforms[index].uniform_(generator=self._generators[row])
        return exponential_race(probs, uniforms)

    def filter(self, indices: list[int]) -> "HeterogeneousNextTokenChooser":
        """Keep the rows at `indices`, in that order (finished requests leave the batch)."""
        size = len(self._params)
        for index in indices:
            if not isinstance(index, int) or not 0 <= index < size:
                raise ValueError(f"filter index {index!r} out of range for a batch of {size}")
        if len(set(indices)) != len(indices):
            raise ValueError(f"filter indices repeat a row (a generator cannot be shared): {indices}")
        if indices == list(range(size)):
            # Every row in place (a decode-ahead fork of a whole batch): the parameter tensors are
            # read only, so they are shared rather than built again from the host. The fields are
            # copied directly (copy.copy's reduce protocol costs more than the fields).
            twin = object.__new__(type(self))
            twin.__dict__.update(self.__dict__)
            return twin
        return self._from_parts(
            [self._params[i] for i in indices],
            [self._seeds[i] for i in indices],
            [self._generators[i] for i in indices],
            [self._matchers[i] for i in indices],
            self.device,
        )

    def fork(self, indices: list[int]) -> "HeterogeneousNextTokenChooser":
        """Like `filter`, but with copied generators and grammar matchers: draws and tokens on the
        fork leave this chooser's random streams and grammars where they were, so a step computed
        ahead can be thrown away."""
        forked = self.filter(indices)
        forked._matchers = [None if m is None else m.fork() for m in forked._matchers]
        forked._generators = [None if g is None else _clone_generator(g) for g in forked._generators]
        return forked

    @classmethod
    def concatenate(cls, choosers: list["HeterogeneousNextTokenChooser"]) -> "HeterogeneousNextTokenChooser":
        """Merge batches, rows in the order given."""
        if not choosers:
            raise ValueError("concatenate needs at least one chooser")
        devices = {chooser.device for chooser in choosers}
        if len(devices) != 1:
            raise ValueError(f"cannot concatenate choosers on different devices: {sorted(map(str, devices))}")
        return cls._from_parts(
            [row for chooser in choosers for row in chooser._params],
            [seed for chooser in choosers for seed in chooser._seeds],
            [generator for chooser in choosers for generator in chooser._generators],
            [matcher for chooser in choosers for matcher in chooser._matchers],
            choosers[0].device,
        )


def top_n_logprobs(logprobs: Tensor, top_n: list[int]) -> list[tuple[list[int], list[float]]]:
    """Per row, the ids and logprobs of its top_n[row] most likely tokens (highest first).

    One topk over the batch's largest n and one host transfer, instead of one per row.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [batch, vocab], got {tuple(logprobs.shape)}")
    if len(top_n) != logprobs.shape[0]:
        raise ValueError(f"top_n has {len(top_n)} entries for a batch of {logprobs.shape[0]}")
    for n in top_n:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"top_n entries must be integers >= 0, got {n!r}")
    width = min(max(top_n, default=0), logprobs.shape[1])
    if width == 0:
        return [([], []) for _ in top_n]
    values, ids = logprobs.topk(width, dim=-1)
    values_list, ids_list = values.tolist(), ids.tolist()
    return [(ids_list[row][:n], values_list[row][:n]) for row, n in enumerate(top_n)]


def prefill_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """Log-probability of each prompt token given its prefix, from the raw model distribution.

    logits: [L, V] for every prompt position, input_ids: [L]. Returns [L] float32
    with NaN at position 0 (nothing predicts the first token). Works in row
    chunks so a long prompt never materialises a full [L, V] float32 log-softmax.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [prompt_len, vocab], got {tuple(logits.shape)}")
    if input_ids.dim() != 1 or input_ids.shape[0] != logits.shape[0]:
        raise ValueError(f"input_ids must be [{logits.shape[0]}] to match logits, got {tuple(input_ids.shape)}")
    length, vocab = logits.shape
    if length == 0:
        raise ValueError("prefill_logprobs needs a prompt of at least one token")
    out = torch.full((length,), math.nan, dtype=torch.float32, device=logits.device)
    targets = input_ids[1:].to(device=logits.device, dtype=torch.int64)
    chunk = max(1, _PREFILL_CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, length - 1, chunk):
        stop = min(start + chunk, length - 1)  # the last position predicts nothing in the prompt
        rows = logits[start:stop].to(torch.float32)  # [n, V], row i predicts token start + i + 1
        wanted = targets[start:stop, None]
        picked = rows.gather(1, wanted).squeeze(1) - torch.logsumexp(rows, dim=-1)
        out[start + 1 : stop + 1] = picked
    return out
