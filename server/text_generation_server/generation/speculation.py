"""N-gram speculation: proposals from a request's own tokens, verified in one forward.

Code, chat transcripts and structured text repeat themselves: when the last few tokens of a
request appeared earlier in its prompt or output, the tokens that followed them then are a
good guess for what follows now (prompt-lookup decoding; TGI's n-gram speculator). A decode
step of a row with such a proposal feeds [last token, p1..pN] at positions L-1..L-1+N over its
cached sequence, a prefill-shaped forward, and so gets the logits of N+1 positions at once.

Exactness: the proposal never decides a token. The row's own chooser runs position by position
(`CausalLM` does it) exactly as N+1 plain decode steps would, with the same processors over the
history including the tokens accepted so far this step, and the row's seeded generator drawing
once per position actually reached; a choice equal to the proposal lets the next position be
looked at, the first one that differs is the step's last token. So the tokens are those of
decoding without speculation, greedy and seeded alike; only the number of forwards changes.
Positions past the last accepted token wrote K/V of rejected guesses into slots beyond the
sequence, which the next forwards overwrite before anything reads them.

This module holds the parts that need no model: the proposal search (a few tensor ops over the
whole batch, one host transfer) and the per-row limits on how far a row may speculate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from text_generation_server.settings.serve_args import MAX_SPECULATE

__all__ = ["MAX_SPECULATE", "NGRAM_SIZES", "Run", "ngram_proposal", "ngram_proposals", "speculation_limit"]

# Tried longest first: a longer match is a better predictor, a shorter one still finds
# something in text that repeats only word by word.
NGRAM_SIZES = (3, 2, 1)


def ngram_proposal(tokens: Sequence[int], limit: int, sizes: Sequence[int] = NGRAM_SIZES) -> list[int]:
    """The definition, in plain Python (tests compare `ngram_proposals` against it): for the first
    n in `sizes` whose trailing n-gram of `tokens` occurred earlier, the up-to-`limit` tokens that
    followed its latest earlier occurrence (never past the end of `tokens`); [] when none did."""
    length = len(tokens)
    if limit < 1:
        return []
    for n in sizes:
        if length < n + 1:
            continue
        tail = list(tokens[length - n:])
        for start in range(length - n - 1, -1, -1):  # an occurrence ending before the trailing one
            if list(tokens[start:start + n]) == tail:
                follow = start + n
                return list(tokens[follow:min(follow + limit, length)])
    return []


def ngram_proposals(history: torch.Tensor, lengths: Sequence[int], limits: Sequence[int],
                    sizes: Sequence[int] = NGRAM_SIZES) -> list[list[int]]:
    """`ngram_proposal` for many rows at once: history [R, T] (each row's tokens, right-padded
    with anything), lengths and limits host ints per row. The search is a window compare per
    n-gram size over the batch on the history's device, and one transfer brings the proposals
    to the host, so it costs the same few kernels whatever the batch holds."""
    rows = len(lengths)
    if rows == 0:
        return []
    if history.dim() != 2 or history.shape[0] != rows or len(limits) != rows:
        raise ValueError(f"history must be [{rows}, T] with one length and one limit per row, "
                         f"got {tuple(history.shape)}, {len(lengths)} lengths, {len(limits)} limits")
    width = max(lengths)
    widest = max(max(limits), 1)
    device = history.device
    history = history[:, :width]
    length = torch.tensor(list(lengths), dtype=torch.long, device=device)
    follow = torch.full((rows,), -1, dtype=torch.long, device=device)  # where the proposal starts
    for n in sizes:
        if width < n + 1:
            continue
        tail_index = (length[:, None] - n + torch.arange(n, device=device)).clamp(min=0)
        tail = history.gather(1, tail_index)  # [R, n]: the trailing n-gram
        match = (history.unfold(1, n, 1) == tail[:, None, :]).all(dim=-1)  # [R, T - n + 1]
        starts = torch.arange(match.shape[1], device=device)
        # Only occurrences that end before the trailing one (a following token exists).
        match &= starts[None, :] + n < length[:, None]
        latest = torch.where(match, starts[None, :], -1).amax(dim=-1)
        follow = torch.where((follow < 0) & (latest >= 0), latest + n, follow)
    offsets = follow.clamp(min=0)[:, None] + torch.arange(widest, device=device)
    proposed = history.gather(1, offsets.clamp(max=width - 1))
    host = torch.cat([follow[:, None], proposed], dim=1).tolist()
    out = []
    for (start, *tokens), n_tokens, limit in zip(host, lengths, limits):
        out.append([] if start < 0 or limit < 1 else tokens[:min(limit, n_tokens - start)])
    return out


@dataclass
class Run:
    """One row's speculation in a step: the tokens proposed after its last token, and where the
    hidden states of the positions that check them sit in the forward's output."""

    row: int  # the request's row in the batch
    emitted: int  # its index among the step's emitting rows (its Generation)
    proposal: list[int]
    first: int  # row in the speculative hidden states of the position that follows proposal[0]


def speculation_limit(speculate: int, length: int, max_length: int, rope_switch: int | None) -> int:
    """How many tokens a decoding row may propose this step.

    Never more than the request can still take after this step's first token: its last token is
    never fed back, so positions fed stay below max_length - 1 and every slot written is one the
    request already holds (no block beyond its own allocation is ever needed). Across a longrope
    switch (Phi-3), where a plain step recomputes the whole sequence once it reaches switch + 1
    tokens, a run stops short of it so that recompute still happens as it would without guesses.
    """
    limit = min(speculate, max_length - length - 1)
    if rope_switch is not None and length <= rope_switch:
        limit = min(limit, rope_switch - length)
    return max(limit, 0)
