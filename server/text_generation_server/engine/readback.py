"""The step's one device-to-host transfer.

Everything the Python side of a step needs from the device (chosen ids, their logprobs, the
top-n alternatives, prompt-token logprobs) is packed into one float64 tensor and read with one
`tolist()`: one sync per step, however many requests ask for how much.
"""

from __future__ import annotations

import torch


def to_host(next_ids: torch.Tensor, logprobs: torch.Tensor, top_n: list[int], prompt_values: list[torch.Tensor]
            ) -> tuple[list[int], list[float], list[tuple[list[int], list[float]]] | None, list[list[float]]]:
    """(chosen ids, their logprobs, per row its top_n[row] (ids, logprobs) or None when nobody
    asked, the prompt logprobs of each of `prompt_values`), in one transfer.

    next_ids: [rows]; logprobs: [rows, vocab]; prompt_values: [count] each."""
    rows = torch.arange(len(next_ids), device=next_ids.device)
    parts = [next_ids.to(torch.float64), logprobs[rows, next_ids].to(torch.float64)]
    width = min(max(top_n, default=0), logprobs.shape[1])
    if width:
        values, ids = logprobs.topk(width, dim=-1)
        parts += [ids.flatten().to(torch.float64), values.flatten().to(torch.float64)]
    parts += [v.to(torch.float64) for v in prompt_values]
    flat = torch.cat(parts).tolist()
    n = len(next_ids)
    next_list = [int(x) for x in flat[:n]]
    chosen = flat[n:2 * n]
    offset = 2 * n
    tops = None
    if width:
        ids_flat = flat[offset:offset + n * width]
        vals_flat = flat[offset + n * width:offset + 2 * n * width]
        offset += 2 * n * width
        tops = [([int(t) for t in ids_flat[r * width:r * width + k]], vals_flat[r * width:r * width + k])
                for r, k in enumerate(top_n)]
    prompt_lps = []
    for v in prompt_values:
        count = v.shape[0]
        prompt_lps.append(flat[offset:offset + count])
        offset += count
    return next_list, chosen, tops, prompt_lps
