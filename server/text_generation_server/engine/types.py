"""Plain data types of the engine, independent of the wire protocol.

The shard service converts protobuf messages to and from these, so the engine,
the CLI and tests never depend on generated stubs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from text_generation_server.generation.sampling import SamplingParams
from text_generation_server.generation.stopping import FinishReason


class RequestError(ValueError):
    """A request (or batch) as sent is invalid: the caller's fault, reported as INVALID_ARGUMENT.

    Anything else raised during a step is the server's fault (INTERNAL), even a ValueError
    from deep inside a kernel. `code`: the gRPC status the shard answers with.
    """

    code = "INVALID_ARGUMENT"


class AdapterNotFound(RequestError):
    """A request names a LoRA adapter that is not loaded (NOT_FOUND): never the base model instead."""

    code = "NOT_FOUND"


class BatchNotFound(KeyError):
    """A call names a batch the shard does not hold (NOT_FOUND)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "batch not found"


@dataclass
class GenerationRequest:
    id: int
    inputs: str
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 20
    stop_sequences: list[str] = field(default_factory=list)
    ignore_eos_token: bool = False
    truncate: int = 0  # keep at most this many input tokens (from the end); 0 = no truncation
    prefill_logprobs: bool = False
    top_n_tokens: int = 0
    blocks: list[int] = field(default_factory=list)  # KV blocks handed in by a router; empty = model allocates
    slots: list[int] = field(default_factory=list)
    add_special_tokens: bool = True
    # Tokens at the start of the prompt whose K/V are already in `blocks` (a prefix cache hit):
    # the shard computes only the rest.
    cache_len: int = 0
    # Prompt tokens to prefill in the first forward (chunked prefill); None = the whole prompt.
    # Later chunks are sized by the shard within its max_batch_prefill_tokens.
    chunk_len: int | None = None
    # The prompt as token ids, when the router tokenized it already (then `inputs` is not
    # tokenized again); truncation still applies.
    input_ids: list[int] | None = None
    # The LoRA adapter the request runs with (a loaded adapter's name); None or "": the base model.
    adapter_id: str | None = None


@dataclass
class Tokens:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    is_special: list[bool] = field(default_factory=list)


@dataclass
class GeneratedText:
    text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int | None


@dataclass
class Generation:
    request_id: int
    tokens: Tokens
    prefill_tokens: Tokens | None = None
    generated_text: GeneratedText | None = None
    top_tokens: list[Tokens] = field(default_factory=list)


@dataclass
class CachedBatchInfo:
    id: int
    request_ids: list[int]
    size: int
    max_tokens: int
    current_tokens: int


@dataclass
class StepTimings:
    forward_ns: int
    decode_ns: int
    total_ns: int

    def __add__(self, other: "StepTimings") -> "StepTimings":
        return StepTimings(self.forward_ns + other.forward_ns, self.decode_ns + other.decode_ns,
                           self.total_ns + other.total_ns)


@dataclass
class Completion:
    """A whole request's result, assembled from its per-step generations."""

    request_id: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    seed: int | None
    steps: list[Generation]

    @classmethod
    def from_steps(cls, request_id: int, steps: list[Generation]) -> "Completion":
        final = steps[-1].generated_text
        if final is None:
            raise ValueError(f"request {request_id} has not finished")
        ids = [i for g in steps for i in g.tokens.ids]
        return cls(request_id, final.text, ids, final.finish_reason, final.seed, steps)
