"""The batch a shard keeps between generate_token calls, and its block allocator.

A batch holds per-request Python state (stopping criteria, detokenizer, blocks)
next to batched device tensors (token history, slot table, block tables), so a
decode step builds its inputs with a few tensor ops instead of per-request work.
`filter` and `concatenate` keep both in step for continuous batching.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from text_generation_server.generation.detokenize import IncrementalDetokenizer
from text_generation_server.generation.sampling import HeterogeneousNextTokenChooser
from text_generation_server.generation.stopping import StoppingCriteria
from text_generation_server.engine.types import CachedBatchInfo, GenerationRequest, RequestError


class OutOfBlocksError(RuntimeError):
    """The shard's own KV block pool cannot hold a request."""


class BlockAllocator:
    """Free list for the KV blocks a shard assigns itself (when no router hands them in).

    Block 0 is never handed out: TGI's router reserves it for health checks, and
    we keep the same convention so both can share a cache.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocksError(
                f"the KV cache has {len(self._free)} free blocks, {count} are needed; "
                "lower max_new_tokens or the batch size"
            )
        return [self._free.pop() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


@dataclass
class RequestState:
    request: GenerationRequest
    prompt_ids: list[int]
    blocks: list[int]
    owns_blocks: bool
    stopping: StoppingCriteria
    detokenizer: IncrementalDetokenizer
    length: int  # tokens in the sequence so far (prompt + generated)
    finished: bool = False
    # Prompt tokens whose K/V are in the cache: the cached prefix the request arrived with
    # (cache_len), then each prefilled chunk. The prompt is done when it reaches input_length.
    prefilled: int = 0
    chunk: int = 0  # prompt tokens the next forward processes (0 once the prompt is done)
    prompt_logprobs: list[float] | None = None  # gathered chunk by chunk for prefill_logprobs
    # The sequence's last token (the prompt's until the request gets one, then set with every
    # token it gets): a decode step's input, known on the host, so the inputs go up in one copy.
    last_token: int = -1
    adapter: int = -1  # the LoRA adapter slot the row runs with (-1: the base model); forks keep it

    def __post_init__(self) -> None:
        if self.last_token < 0 and self.prompt_ids:
            self.last_token = self.prompt_ids[-1]

    @property
    def input_length(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt_ids)

    @property
    def step_tokens(self) -> int:
        """Tokens the next forward computes for this request, at least: a decoding row that
        speculates adds its proposal, within what this count leaves of max_batch_prefill_tokens
        (CausalLM._proposals), so routers budget prompt chunks first, as without speculation."""
        return self.chunk if self.prefilling else 1

    def fork(self) -> "RequestState":
        """A copy whose progress can advance without touching this one (blocks stay ours).

        Copied field by field from `__dict__` (no __init__ or __post_init__ to run again): decode
        ahead forks every row every step, and `dataclasses.replace` cost several times more."""
        twin = object.__new__(RequestState)
        twin.__dict__.update(self.__dict__)
        twin.blocks = list(self.blocks)
        twin.owns_blocks = False
        twin.stopping = self.stopping.fork()
        twin.detokenizer = self.detokenizer.fork()
        if self.prompt_logprobs is not None:
            twin.prompt_logprobs = list(self.prompt_logprobs)
        return twin

    @property
    def max_length(self) -> int:
        return self.input_length + self.request.max_new_tokens

    def slot(self, position: int, block_size: int) -> int:
        """The KV slot of `position`, as the batch's slot table holds it (-1 past the positions
        the request can ever write, `BatchBuilder.kv_tokens`)."""
        if position >= max(self.max_length - 1, 1):
            return -1
        return self.blocks[position // block_size] * block_size + position % block_size


class Batch:
    def __init__(
        self,
        batch_id: int,
        states: list[RequestState],
        chooser: HeterogeneousNextTokenChooser,
        history: torch.Tensor,
        history_lengths: torch.Tensor,
        slot_table: torch.Tensor,
        block_tables: torch.Tensor,
    ):
        self.batch_id = batch_id
        self.states = states
        self.chooser = chooser
        self.history = history  # [B, T] int64: prompt + generated ids
        self.history_lengths = history_lengths  # [B] int64
        # Never written in place (filter, concatenate and fork make new ones, a whole-batch fork
        # shares them): a decode graph keeps the last block table it copied by identity.
        self.slot_table = slot_table  # [B, T] int64: KV slot of each position (-1 past the end)
        self.block_tables = block_tables  # [B, max_blocks] int64

    @property
    def prefilling(self) -> bool:
        """Whether some request still has prompt tokens to prefill (the next step is not a pure decode)."""
        return any(s.prefilling for s in self.states)

    def __len__(self) -> int:
        return len(self.states)

    @property
    def request_ids(self) -> list[int]:
        return [s.request.id for s in self.states]

    def info(self) -> CachedBatchInfo:
        return CachedBatchInfo(
            id=self.batch_id,
            request_ids=self.request_ids,
            size=len(self.states),
            max_tokens=sum(s.max_length for s in self.states),
            # TGI's meaning: tokens the next forward computes (a router budgets prefill with it).
            current_tokens=sum(s.step_tokens for s in self.states if not s.finished),
        )

    def filter(self, request_ids: list[int], allocator: BlockAllocator | None) -> "Batch":
        """Keeps the named requests (in the given order); frees the blocks of the rest."""
        position = {rid: i for i, rid in enumerate(self.request_ids)}
        unknown = [rid for rid in request_ids if rid not in position]
        if unknown:
            raise RequestError(f"batch {self.batch_id} has no requests {unknown}")
        if len(set(request_ids)) != len(request_ids):
            raise RequestError("request_ids must not repeat")
        keep = [position[rid] for rid in request_ids]
        kept = set(keep)
        for i, state in enumerate(self.states):
            if i not in kept and state.owns_blocks and allocator is not None:
                allocator.free(state.blocks)
                state.blocks = []
        index = torch.tensor(keep, dtype=torch.long, device=self.history.device)
        max_len = max(self.states[i].max_length for i in keep)
        max_blocks = max(len(self.states[i].blocks) for i in keep)
        return Batch(
            batch_id=self.batch_id,
            states=[self.states[i] for i in keep],
            chooser=self.chooser.filter(keep),
            history=self.history.index_select(0, index)[:, :max_len],
            history_lengths=self.history_lengths.index_select(0, index),
            slot_table=self.slot_table.index_select(0, index)[:, :max_len],
            block_tables=self.block_tables.index_select(0, index)[:, :max_blocks],
        )

    def fork(self, request_ids: list[int]) -> "Batch":
        """An independent copy of the named rows, for a decode step computed ahead of its request.

        Tensors a step writes (the history and its lengths), stopping counters, detokenizers
        and random streams are copied, so running a step on the fork leaves this batch exactly
        as it was; the slot and block tables, which no step writes, and the KV blocks are shared
        (the fork writes only positions from each row's last token on, past what any step has
        kept: the next position, or with speculation the proposed ones after it; a replayed step
        writes them again before anything reads them). The fork never frees blocks: this batch
        owns them.
        """
        position = {rid: i for i, rid in enumerate(self.request_ids)}
        keep = [position[rid] for rid in request_ids]
        states = [self.states[i].fork() for i in keep]
        chooser = self.chooser.fork(keep)
        if keep == list(range(len(self.states))):
            # The whole batch (decode ahead's usual fork): two copies, no index from the host
            # (torch.tensor(list, device=) is a synchronous copy on CUDA), and the same block
            # table object, so a decode graph sees it unchanged and copies nothing.
            return Batch(self.batch_id, states, chooser, self.history.clone(), self.history_lengths.clone(),
                         self.slot_table, self.block_tables)
        index = torch.tensor(keep, dtype=torch.long, device=self.history.device)
        return Batch(
            batch_id=self.batch_id,
            states=states,
            chooser=chooser,
            history=self.history.index_select(0, index),
            history_lengths=self.history_lengths.index_select(0, index),
            slot_table=self.slot_table.index_select(0, index),
            block_tables=self.block_tables.index_select(0, index),
        )

    def adopt_blocks(self, source: "Batch") -> None:
        """Takes over block ownership from the batch this one was forked from (a committed fork);
        rows that did not come from `source` (merged in) keep their own."""
        owners = {s.request.id: s for s in source.states}
        for state in self.states:
            origin = owners.get(state.request.id)
            if origin is not None:
                state.owns_blocks, state.blocks = origin.owns_blocks, list(origin.blocks)

    def release(self, allocator: BlockAllocator | None) -> None:
        """Frees the blocks this batch assigned itself (ClearCache, or the end of a batch)."""
        for state in self.states:
            if state.owns_blocks and allocator is not None and state.blocks:
                allocator.free(state.blocks)
                state.blocks = []

    @classmethod
    def concatenate(cls, batches: list["Batch"]) -> "Batch":
        if not batches:
            raise ValueError("cannot concatenate zero batches")
        if len(batches) == 1:
            return batches[0]
        width = max(b.history.shape[1] for b in batches)
        blocks = max(b.block_tables.shape[1] for b in batches)

        def pad(t: torch.Tensor, cols: int, value: int) -> torch.Tensor:
            if t.shape[1] == cols:
                return t
            return torch.nn.functional.pad(t, (0, cols - t.shape[1]), value=value)

        return cls(
            batch_id=batches[0].batch_id,
            states=[s for b in batches for s in b.states],
            chooser=HeterogeneousNextTokenChooser.concatenate([b.chooser for b in batches]),
            history=torch.cat([pad(b.history, width, 0) for b in batches]),
            history_lengths=torch.cat([b.history_lengths for b in batches]),
            slot_table=torch.cat([pad(b.slot_table, width, -1) for b in batches]),
            block_tables=torch.cat([pad(b.block_tables, blocks, 0) for b in batches]),
        )
