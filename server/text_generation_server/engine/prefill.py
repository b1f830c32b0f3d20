"""Which tokens a prefill-shaped step computes, and how prompts move on after it.

A step that is not a plain decode runs one forward over every request's new tokens,
flattened: the next chunk of each prompt still prefilling (over its cached prefix), the last
token of each decoding row followed by the n-gram tokens it proposes, and, across a longrope
switch, a whole sequence recomputed. `flatten_step` lays those out and says which rows of the
forward's output belong to whom; `advance_prompts` and `plan_chunks` move the prompts past
the chunk computed and size the next one within max_batch_prefill_tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from text_generation_server.engine.batch import Batch, RequestState
from text_generation_server.generation.speculation import Run


@dataclass
class PromptSpan:
    """Logit rows of one prefilling request whose prompt-token logprobs were asked for."""

    state: RequestState
    row: int  # first of its rows in the forward's logits
    count: int  # prompt tokens these rows score (the row at prompt position p scores token p + 1)
    values: torch.Tensor | None = None


@dataclass
class FlatStep:
    """The inputs of one prefill-shaped forward, and the rows of its output that matter."""

    ids: torch.Tensor  # [tokens]: every included row's new tokens, one row after another
    positions: torch.Tensor  # [tokens]
    slots: torch.Tensor  # [tokens]: where each token's K/V is written
    seq_lens: torch.Tensor | None  # [tokens]: the length rotary sees (length-dependent rope only)
    q_lens: list[int]  # new tokens of each included row
    cache_lens: list[int]  # tokens each included row has cached before them
    included: list[int]  # batch rows with tokens in this forward (a prompt may wait a step)
    logit_rows: list[int]  # forward rows whose hidden states the step needs logits of
    extra_rows: list[int]  # forward rows whose hidden states check a proposal (after logit_rows)
    emit: list[int]  # batch rows that draw a token this step
    last_rows: list[int]  # per emitting row, its index in logit_rows (the row its token is drawn from)
    spans: list[PromptSpan]  # prompt logprobs asked for
    runs: list[Run]  # rows speculating
    decode_rows: list[int]  # forward rows of decoding requests (their last token and proposals)


def flatten_step(batch: Batch, proposals: dict[int, list[int]], recomputes: Callable[[RequestState], bool],
                 rope_length_dependent: bool, device: torch.device) -> FlatStep:
    """Lays out a step's new tokens as one forward. Writes the proposals into the batch's history
    (the forward reads its ids from there) and starts the prompt logprobs of requests that asked."""
    if proposals:
        # Written past each row's length, where the history is padding to everyone else (and
        # where the accepted tokens land anyway): the forward reads its ids from there.
        where = [(i, batch.states[i].length + j, t) for i, p in proposals.items() for j, t in enumerate(p)]
        r, c, v = (torch.tensor(x, dtype=torch.long, device=device) for x in zip(*where))
        batch.history[r, c] = v
    runs: list[Run] = []
    extra_rows: list[int] = []
    decode_rows: list[int] = []
    ids, positions, slots, q_lens, cache_lens, logit_rows = [], [], [], [], [], []
    lengths: list[torch.Tensor] | None = [] if rope_length_dependent else None
    emit: list[int] = []
    last_rows: list[int] = []
    spans: list[PromptSpan] = []
    offset = 0
    included: list[int] = []
    for i, state in enumerate(batch.states):
        if state.prefilling and state.chunk == 0:
            continue
        included.append(i)
        if state.prefilling:
            first, n = state.prefilled, state.chunk
            done = first + n >= state.input_length
            if state.request.prefill_logprobs:
                if state.prompt_logprobs is None:
                    # Nothing predicts the first token; a cached prefix has no logits here.
                    state.prompt_logprobs = [math.nan] * (first + 1)
                # Row p predicts token p + 1; the prompt's last row predicts the first new token.
                scored = min(n, state.input_length - 1 - first)
                spans.append(PromptSpan(state, len(logit_rows), scored))
                logit_rows.extend(range(offset, offset + n))
            elif done:
                logit_rows.append(offset + n - 1)
        elif recomputes(state):
            first, n, done = 0, state.length, True  # the whole sequence, over its own slots
            logit_rows.append(offset + n - 1)
        else:
            first, n, done = state.length - 1, 1 + len(proposals.get(i, ())), True
            logit_rows.append(offset)
            decode_rows.extend(range(offset, offset + n))
            if n > 1:
                runs.append(Run(row=i, emitted=len(emit), proposal=proposals[i], first=len(extra_rows)))
                extra_rows.extend(range(offset + 1, offset + n))
        if done:
            emit.append(i)
            last_rows.append(len(logit_rows) - 1)
        ids.append(batch.history[i, first:first + n])
        slots.append(batch.slot_table[i, first:first + n])
        positions.append(torch.arange(first, first + n, device=device))
        if lengths is not None:
            # The length transformers computes a token's rotary with: the whole prompt for
            # prompt tokens (however it is chunked), the sequence so far for generated ones.
            lengths.append(torch.clamp(positions[-1] + 1, min=state.length if recomputes(state)
                                       else state.input_length))
        q_lens.append(n)
        cache_lens.append(first)
        offset += n
    return FlatStep(
        ids=torch.cat(ids), positions=torch.cat(positions), slots=torch.cat(slots),
        seq_lens=torch.cat(lengths) if lengths is not None else None, q_lens=q_lens, cache_lens=cache_lens,
        included=included, logit_rows=logit_rows, extra_rows=extra_rows, emit=emit, last_rows=last_rows,
        spans=spans, runs=runs, decode_rows=decode_rows,
    )


def advance_prompts(batch: Batch, spans: list[PromptSpan], logprob_lists: list[list[float]]) -> None:
    """Moves every prefilling request past the chunk this step computed."""
    for span, lps in zip(spans, logprob_lists):
        if span.state.prompt_logprobs is not None:
            span.state.prompt_logprobs.extend(lps)
    for state in batch.states:
        if state.prefilling:
            state.prefilled += state.chunk
            state.chunk = 0


def plan_chunks(batch: Batch, max_prefill_tokens: int | None) -> None:
    """Sizes the next prompt chunk of every request still prefilling: within
    max_batch_prefill_tokens, after one token for each decoding request, oldest first.
    Requests past the budget wait a step (chunk 0); the first always moves on."""
    waiting = [s for s in batch.states if s.prefilling]
    if not waiting:
        return
    decoding = sum(1 for s in batch.states if not s.prefilling and not s.finished)
    budget = (max_prefill_tokens or math.inf) - decoding
    for index, state in enumerate(waiting):
        remaining = state.input_length - state.prefilled
        state.chunk = int(max(1 if index == 0 else 0, min(remaining, budget)))
        budget -= state.chunk
