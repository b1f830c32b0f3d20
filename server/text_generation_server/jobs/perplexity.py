"""Perplexity of a loadable model on a text file: the number quantization is judged by.

The text is tokenized once and cut into consecutive windows of `seqlen` tokens;
each window is one prefill, and every token but a window's first is scored from
the tokens before it in that window (the evaluation the GPTQ paper reports).
Windows do not overlap, so each token counts once and the result does not depend
on batching. The model is built by `get_model`, so anything `serve` loads,
quantized or not, is measured through the same kernels it is served with.

This module also reads the text datasets both commands use: a .txt file (the
whole text) or a .jsonl file (one object per line with a "text" field), and
draws `quantize`'s calibration samples from them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from loguru import logger

from text_generation_server.layers.attention import AttentionMetadata, KVCache

DEFAULT_MAX_SEQLEN = 512
BATCH_TOKENS = 4096  # tokens per forward: windows are batched, bounding the logits to [4096, vocab]


class DatasetError(ValueError):
    """A text dataset is missing, unreadable, of an unknown kind, or empty."""


def read_text_dataset(path: str | Path) -> str:
    """The text of a .txt file, or the "text" fields of a .jsonl file joined by blank lines."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset {path} does not exist or is not a file")
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"dataset {path} cannot be read as UTF-8 text: {exc}") from exc
    suffix = path.suffix.lower()
    if suffix == ".txt":
        text = raw
    elif suffix == ".jsonl":
        texts = []
        for number, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{number}: not a JSON object ({exc})") from exc
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DatasetError(f"{path}:{number}: each line must be an object with a string 'text' field")
            texts.append(record["text"])
        text = "\n\n".join(t for t in texts if t)
    else:
        raise DatasetError(f"dataset {path}: unsupported file type '{suffix or '(none)'}' (use .txt or .jsonl)")
    if not text.strip():
        raise DatasetError(f"dataset {path} holds no text")
    return text


def default_text(split: str, max_chars: int | None = None) -> str:
    """A split of the stdlib corpus: the data every machine has, so no download is needed."""
    from text_generation_server.jobs.corpus import corpus_text

    return corpus_text(split, max_chars=max_chars)


def calibration_text(dataset: str | Path | None, tokens: int, seed: int) -> str:
    """The dataset's text, or (None) seeded documents from across the corpus train split.

    The default reads about eight characters per calibration token (twice what the
    tokenizer needs), so samples come from many modules, not the first few files.
    """
    if dataset is not None:
        return read_text_dataset(dataset)
    from text_generation_server.jobs import corpus

    budget = max(200_000, tokens * 8)
    files = corpus.corpus_files("train")
    order = torch.randperm(len(files), generator=torch.Generator().manual_seed(seed)).tolist()
    parts, size = [], 0
    for i in order:
        text = corpus.read_document(files[i])
        if text:
            parts.append(text)
            size += len(text)
            if size >= budget:
                break
    return corpus.EOS_TEXT.join(parts)


def calibration_samples(tokenizer, text: str, nsamples: int, seqlen: int, seed: int) -> torch.Tensor:
    """[nsamples, seqlen] token ids: windows at seeded random offsets into the tokenized text."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if not ids:
        raise DatasetError("the calibration dataset tokenizes to no tokens")
    if len(ids) < seqlen:
        raise DatasetError(f"the calibration dataset has {len(ids)} tokens, fewer than --seqlen {seqlen}: "
                           "give more text or a smaller --seqlen")
    ids = torch.tensor(ids, dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - seqlen + 1, (nsamples,), generator=generator)
    return torch.stack([ids[s:s + seqlen] for s in starts.tolist()])


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    tokens: int  # tokens scored
    nll: float  # summed negative log-likelihood (nats)
    windows: int
    seqlen: int

    def to_json(self) -> dict:
        return {"perplexity": self.perplexity, "tokens": self.tokens, "nll": self.nll,
                "windows": self.windows, "seqlen": self.seqlen}


def token_windows(ids: list[int], seqlen: int) -> list[list[int]]:
    """Consecutive windows of `seqlen` ids; a last short window is kept when it scores a token."""
    if seqlen < 2:
        raise ValueError(f"seqlen must be at least 2 (one token to condition on, one to score), got {seqlen}")
    windows = [ids[i:i + seqlen] for i in range(0, len(ids), seqlen)]
    return [w for w in windows if len(w) >= 2]


@torch.inference_mode()
def windows_nll(model: torch.nn.Module, windows: list[list[int]], cache: KVCache, device: torch.device) -> float:
    """Summed NLL (nats) of tokens 1.. of each window given the ones before them, in one prefill.

    Windows are separate sequences of one batch: attention never crosses them, so
    batching changes only the speed (bigger matmuls), not a single score.
    """
    lens = [len(w) for w in windows]
    ids = torch.tensor([t for w in windows for t in w], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    meta = AttentionMetadata(is_prefill=True, slots=torch.arange(len(ids), device=device), prefill_lens=lens)
    logits = model(ids, positions, cache, meta)  # [tokens, vocab] float32
    # Every position but each window's last predicts the next id of its window.
    last = torch.tensor(lens, device=device).cumsum(0) - 1
    keep = torch.ones(len(ids), dtype=torch.bool, device=device)
    keep[last] = False
    logprobs = torch.log_softmax(logits[keep].float(), dim=-1)
    targets = ids.roll(-1)[keep]
    return float(-logprobs.gather(1, targets.unsqueeze(1)).sum())


def evaluate(lm, text: str, seqlen: int | None = None, max_tokens: int | None = None,
             batch_tokens: int = BATCH_TOKENS) -> PerplexityResult:
    """Perplexity of a loaded `CausalLM` on `text`."""
    config = lm.config
    if seqlen is None:
        seqlen = min(config.max_context, DEFAULT_MAX_SEQLEN)
    if seqlen > config.max_context:
        raise ValueError(f"--seqlen {seqlen} exceeds the model's {config.context_name}")
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"--max-tokens must be at least 2, got {max_tokens}")
    ids = lm.tokenizer.encode(text, add_special_tokens=False).ids
    if max_tokens is not None:
        ids = ids[:max_tokens]
    windows = token_windows(ids, seqlen)
    if not windows:
        raise DatasetError(f"the text tokenizes to {len(ids)} token(s): at least 2 are needed to score one")
    per_batch = max(1, batch_tokens // seqlen)
    width = per_batch * seqlen
    cache = lm.new_kv_cache(1, width)
    nll = 0.0
    for start in range(0, len(windows), per_batch):
        nll += windows_nll(lm.model, windows[start:start + per_batch], cache, lm.device)
    scored = sum(len(w) - 1 for w in windows)
    return PerplexityResult(perplexity=math.exp(nll / scored), tokens=scored, nll=nll, windows=len(windows),
                            seqlen=seqlen)


def perplexity(
    model: str | None,
    dataset: str | Path | None = None,
    seqlen: int | None = None,
    max_tokens: int | None = None,
    dtype: str | None = None,
    quantize: str | None = None,
    kv_cache_dtype: str | None = None,
    kv_cache_fp8_skip_layers: str | None = None,
) -> PerplexityResult:
    """Loads `model` (a folder or the embedded id) and measures it on `dataset`.

    Without a dataset the held-out split of the stdlib corpus is used: the text the
    embedded model never trained on.
    """
    from text_generation_server.models.loader import get_model

    text = read_text_dataset(dataset) if dataset is not None else default_text("heldout")
    lm = get_model(model, dtype=dtype, quantize=quantize, kv_cache_dtype=kv_cache_dtype,
                   kv_cache_fp8_skip_layers=kv_cache_fp8_skip_layers)
    result = evaluate(lm, text, seqlen=seqlen, max_tokens=max_tokens)
    logger.info("{}: perplexity {:.4f} over {} tokens ({} windows of up to {})", lm.model_id, result.perplexity,
                result.tokens, result.windows, result.seqlen)
    return result
