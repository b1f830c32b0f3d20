"""New requests to a `Batch`: tokenized, validated, and given KV blocks and slots.

`BatchBuilder` is the half of the model that never runs a forward. It turns requests into
the batched tensors `CausalLM.generate_token` steps over, and it owns the `BlockAllocator`
of the current KV cache: the blocks a request assigns itself come from it here, and return
to it when the batch is filtered or released. The cache's tensors stay with `CausalLM`,
which hands the builder a fresh allocator whenever it allocates a cache (and None when it
drops one), so the two always describe the same pool.
"""

from __future__ import annotations

import threading

import torch
from tokenizers import Tokenizer

from text_generation_server.generation import request_fields
from text_generation_server.generation.detokenize import IncrementalDetokenizer
from text_generation_server.generation.grammar import GrammarCompiler, GrammarMatcher, PendingMasks
from text_generation_server.generation.sampling import HeterogeneousNextTokenChooser
from text_generation_server.generation.stopping import StoppingCriteria
from text_generation_server.engine.batch import Batch, BlockAllocator, RequestState
from text_generation_server.engine.types import AdapterNotFound, GenerationRequest, RequestError


# A request that passed its checks: the request, its prompt's ids, prompt + max_new_tokens, its grammar matcher.
_Prepared = tuple[GenerationRequest, list[int], int, "GrammarMatcher | None"]


def request_error(request_id: int, exc: request_fields.InvalidField) -> RequestError:
    """A field's validator refusing a request, as the shard reports it (INVALID_ARGUMENT)."""
    return RequestError(f"request {request_id}: {exc.shard_message()}")


class BatchBuilder:
    """Requests to batches; blocks to them from the current KV cache's allocator, and back."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_ids: set[int],
        vocab_size: int,
        max_context: int,
        block_size: int,
        device: torch.device,
        context_name: str = "",
    ):
        """vocab_size and max_context (max_position_embeddings, stretched by dynamic/yarn rope;
        `context_name` says so in errors) are the model's: they bound the token ids and the
        length a request may ask for. block_size is validated by CausalLM."""
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._vocab_size = vocab_size
        self.max_context = max_context
        self.context_name = context_name
        self.block_size = block_size
        self.device = device
        # The free list of the current KV cache (CausalLM.allocate_kv_cache sets it); None
        # while no cache is allocated, when no batch can be built.
        self.allocator: BlockAllocator | None = None
        self._grammars: GrammarCompiler | None = None  # built with the first grammar request
        self._grammars_lock = threading.Lock()
        # The loaded LoRA adapters (models/adapters.py enable_lora, AdapterSlots): a request's
        # adapter_id is looked up here. None: LoRA is off, and a request naming an adapter is refused.
        self.adapters = None

    # -- grammars ----------------------------------------------------------------
    @property
    def grammars(self) -> GrammarCompiler:
        """The tokenizer's grammar compiler, built on first use: reading the vocabulary into
        llguidance takes ~20 ms for 4k tokens, ~0.5 s for 64k, which models never asked for a
        grammar need not pay. Thread-safe: the shard compiles on its tokenizer thread."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler.for_tokenizer(self.tokenizer, self.eos_token_ids)
            return self._grammars

    def grammar_masks(self, chooser: HeterogeneousNextTokenChooser) -> PendingMasks | None:
        """Starts the next-token masks of the chooser's grammar rows (None without any), to fill
        while the forward runs."""
        matchers = chooser.matchers
        if not any(m is not None for m in matchers):
            return None
        return self.grammars.start_masks(matchers, self.device)

    # -- KV geometry -----------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return (tokens + self.block_size - 1) // self.block_size

    @staticmethod
    def kv_tokens(total: int) -> int:
        """Positions whose K/V a request can ever write: its last token is never fed back, so a
        request of `total` tokens needs `total - 1` slots (TGI's allocation, liveness checks too).
        Speculation needs none more: a row never proposes past its own last token
        (generation/speculation.py speculation_limit), so every position a speculative step feeds
        is one of these; TGI's router adds Info.speculate slots anyway, which are left unused."""
        return max(total - 1, 1)

    def slots(self, blocks: list[int], total: int) -> list[int]:
        """The cache slot of each of the first `total` positions of a request holding `blocks`."""
        bs = self.block_size
        return [blocks[p // bs] * bs + p % bs for p in range(total)]

    # -- batches ---------------------------------------------------------------
    def tokenize(self, request: GenerationRequest) -> list[int]:
        """The prompt's ids: the router's when it sent them, else tokenized here; truncated."""
        if request.input_ids is not None:
            ids = list(request.input_ids)
        else:
            ids = self.tokenizer.encode(request.inputs, add_special_tokens=request.add_special_tokens).ids
        if request.truncate and len(ids) > request.truncate:
            ids = ids[-request.truncate:]
        try:
            request_fields.input_length(len(ids))
        except request_fields.InvalidField as exc:
            raise request_error(request.id, exc) from None
        return ids

    def make_batch(self, batch_id: int, requests: list[GenerationRequest]) -> Batch:
        """Tokenizes and validates new requests, and gives them KV blocks and slots.

        This is where a request enters the engine, from a shard's Prefill (a TGI router's or
        ours) or from `CausalLM.generate`: each field is checked here by its validator
        (generation/request_fields.py), as the client API checks it, and by nothing downstream.
        Every rejection is a RequestError naming the request and field: the caller's input
        was wrong, and nothing (no block) has been taken yet. One refused request fails the
        whole batch (TGI's contract); `make_batch_refusing` leaves it out instead.
        """
        self._check_batch(requests)
        return self._build(batch_id, [self._prepare(req) for req in requests])

    def make_batch_refusing(self, batch_id: int, requests: list[GenerationRequest]
                            ) -> tuple[Batch | None, dict[int, RequestError]]:
        """`make_batch` request by request: a request its checks refuse is left out, with its
        RequestError by id, and the others make the batch (None when every one was refused), so
        one bad request costs no other its answer. A fault of the batch itself (no request, an
        id twice, no KV cache, no free block) still raises."""
        self._check_batch(requests)
        prepared, refused = [], {}
        for req in requests:
            try:
                prepared.append(self._prepare(req))
            except RequestError as exc:
                refused[req.id] = exc
        return (self._build(batch_id, prepared) if prepared else None), refused

    def _check_batch(self, requests: list[GenerationRequest]) -> None:
        if not requests:
            raise RequestError("a batch needs at least one request")
        if self.allocator is None:
            raise RuntimeError("the KV cache is not allocated (call warmup or allocate_kv_cache first)")
        seen: set[int] = set()
        for req in requests:
            if req.id in seen:
                raise RequestError(f"request id {req.id} appears twice in the batch")
            seen.add(req.id)

    def adapter_slot(self, req: GenerationRequest) -> int:
        """The slot of the request's adapter (-1: the base model); AdapterNotFound (NOT_FOUND) when
        it names one that is not loaded: never the base model instead."""
        if not req.adapter_id:
            return -1
        slot = self.adapters.slot_of(req.adapter_id) if self.adapters is not None else None
        if slot is None:
            off = "" if self.adapters is not None else " (LoRA adapters are off on this server)"
            raise AdapterNotFound(f"request {req.id}: adapter '{req.adapter_id}' is not loaded{off}")
        return slot

    def _prepare(self, req: GenerationRequest) -> _Prepared:
        """One request's checks, all before any block is taken; RequestError naming it and its field."""
        self.adapter_slot(req)
        try:
            matcher, prompt = self._checked(req)
        except request_fields.InvalidField as exc:
            raise request_error(req.id, exc) from None
        if max(prompt) >= self._vocab_size or min(prompt) < 0:
            bad = max(prompt) if max(prompt) >= self._vocab_size else min(prompt)
            raise RequestError(
                f"request {req.id}: token id {bad} is outside the model's vocabulary of {self._vocab_size}"
            )
        total = len(prompt) + req.max_new_tokens
        # The fields only the shard protocol has (cache_len, chunk_len, the router's blocks and slots):
        if req.cache_len:
            if not req.blocks:
                raise RequestError(f"request {req.id}: cache_len {req.cache_len} needs the blocks that hold it")
            if req.cache_len >= len(prompt):
                raise RequestError(
                    f"request {req.id}: cache_len {req.cache_len} must be less than its {len(prompt)} input "
                    "tokens (the last one is always computed)"
                )
        if req.chunk_len is not None and req.chunk_len < 1:
            raise RequestError(f"request {req.id}: chunk_len must be >= 1, got {req.chunk_len}")
        self._check_router_kv(req, total)
        return req, prompt, total, matcher

    def _build(self, batch_id: int, prepared: list[_Prepared]) -> Batch:
        """The batch of requests that passed their checks: blocks, slots and tensors."""
        states: list[RequestState] = []
        try:
            for req, prompt, total, _ in prepared:
                states.append(self._assign_blocks(req, prompt, total))
        except Exception:
            for state in states:
                if state.owns_blocks:
                    self.allocator.free(state.blocks)
            raise
        width = max(total for _, _, total, _ in prepared)
        max_blocks = max(len(s.blocks) for s in states)
        history = torch.zeros(len(states), width, dtype=torch.long)
        slot_table = torch.full((len(states), width), -1, dtype=torch.long)
        block_tables = torch.zeros(len(states), max_blocks, dtype=torch.long)
        for i, ((req, prompt, total, _), state) in enumerate(zip(prepared, states)):
            history[i, : len(prompt)] = torch.tensor(prompt)
            kv = self.kv_tokens(total)
            slot_table[i, :kv] = torch.tensor(self.slots(state.blocks, kv))
            block_tables[i, : len(state.blocks)] = torch.tensor(state.blocks)
        lengths = torch.tensor([len(p) for _, p, _, _ in prepared], dtype=torch.long)
        return Batch(
            batch_id=batch_id,
            states=states,
            chooser=HeterogeneousNextTokenChooser([req.sampling for req, _, _, _ in prepared], self.device,
                                                  [m for _, _, _, m in prepared]),
            history=history.to(self.device),
            history_lengths=lengths.to(self.device),
            slot_table=slot_table.to(self.device),
            block_tables=block_tables.to(self.device),
        )

    def _checked(self, req: GenerationRequest) -> tuple[GrammarMatcher | None, list[int]]:
        """The request's fields by their validators; its grammar matcher (a copy of the cached
        compiled grammar) and its prompt's ids. InvalidField before any block is taken."""
        request_fields.top_n_tokens(req.top_n_tokens, self._vocab_size)
        req.sampling.validate()
        request_fields.stop(req.stop_sequences)
        matcher = None
        if req.sampling.grammar is not None:
            matcher = request_fields.compiled_grammar(req.sampling.grammar, self.grammars.matcher)
        prompt = self.tokenize(req)
        request_fields.max_new_tokens(req.max_new_tokens, len(prompt), self.max_context,
                                      f"the model's {self.context_name}")
        return matcher, prompt

    def _check_router_kv(self, req: GenerationRequest, total: int) -> None:
        """Validates router-provided blocks and slots before any block is allocated, so a bad
        request leaves the allocator untouched. Attention reads the cache through the block
        table, so a slot that is not `blocks[p // block_size] * block_size + p % block_size`
        would be written where attention never looks: such slots are rejected."""
        if req.slots and not req.blocks:
            raise RequestError(f"request {req.id}: slots were given without the blocks that hold them")
        if not req.blocks:
            return
        num_blocks = self.allocator.num_blocks  # the KV cache's: both are made from one count
        bad = [b for b in req.blocks if not 0 <= b < num_blocks]
        if bad:
            raise RequestError(f"request {req.id}: blocks {bad[:4]} are outside the KV cache of {num_blocks} blocks")
        needed = self.kv_tokens(total)
        if len(req.blocks) * self.block_size < needed:
            raise RequestError(
                f"request {req.id}: {len(req.blocks)} blocks of {self.block_size} cannot hold {needed} tokens"
            )
        if req.slots:
            if len(req.slots) < needed:
                raise RequestError(f"request {req.id}: {len(req.slots)} slots given, {needed} needed")
            expected = self.slots(req.blocks, needed)
            for position, (got, want) in enumerate(zip(req.slots, expected)):
                if got != want:
                    raise RequestError(
                        f"request {req.id}: slot {got} for position {position} does not match its blocks "
                        f"(expected {want})"
                    )

    def _assign_blocks(self, req: GenerationRequest, prompt: list[int], total: int) -> RequestState:
        # Everything that can fail runs before blocks are taken: a block allocated here and
        # then dropped by an exception would be lost for good.
        stopping = StoppingCriteria(self.eos_token_ids, req.stop_sequences, req.max_new_tokens, req.ignore_eos_token)
        detok = IncrementalDetokenizer(self.tokenizer, prompt)
        if req.blocks:  # validated by _check_router_kv
            blocks, owns = list(req.blocks), False
        else:
            blocks, owns = self.allocator.allocate(self.blocks_for(self.kv_tokens(total))), True
        remaining = len(prompt) - req.cache_len
        chunk = remaining if req.chunk_len is None else min(req.chunk_len, remaining)
        return RequestState(req, prompt, blocks, owns, stopping, detok, length=len(prompt),
                            prefilled=req.cache_len, chunk=chunk, adapter=self.adapter_slot(req))

    # -- giving blocks back ------------------------------------------------------
    def filter(self, batch: Batch, request_ids: list[int]) -> Batch | None:
        """Keeps the named requests; None (every block freed) when none is named."""
        if not request_ids:
            batch.release(self.allocator)
            return None
        return batch.filter(request_ids, self.allocator)

    def release(self, batch: Batch) -> None:
        batch.release(self.allocator)
