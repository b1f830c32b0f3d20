"""Train the embedded default model `tiny-pycoder` from the interpreter's own stdlib.

The server must start without a model hub, so it ships a small Llama trained
here on text every machine has. The export is exact Hugging Face Llama layout
(parameter names, RoPE convention, tied head), so the same loaders, quantizers
and reference tests that serve real checkpoints also serve this one.

    python scripts/train_embedded.py --output DIR --minutes 30
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

# Other jobs share these cores: with the default active wait an OpenMP thread spins
# while its partner is descheduled (measured: 3-4x the CPU time per step under load).
# Only effective when this module is the first to load torch, as under `python -m`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F
from loguru import logger
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import nn

from text_generation_server.jobs.corpus import (
    EOS_ID, EOS_TEXT, corpus_files, iter_documents, token_byte_lengths, tokenize_documents,
)


@dataclass(frozen=True)
class TinyLlamaConfig:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 32
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value <= 0:
                raise ValueError(f"TinyLlamaConfig.{name} must be positive, got {value}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.vocab_size > 65536:
            raise ValueError(f"vocab_size {self.vocab_size} does not fit the uint16 token arrays")

    def to_hf(self) -> dict:
        """config.json contents; both the v4 and v5 transformers key spellings are written."""
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", **asdict(self),
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
            "torch_dtype": "bfloat16", "dtype": "bfloat16",
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "bos_token_id": EOS_ID, "eos_token_id": EOS_ID, "initializer_range": 0.02, "use_cache": True,
        }


# ---------------------------------------------------------------- model ----


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the autocast dtype, as HF Llama does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_cos_sin(cfg: TinyLlamaConfig, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [seq, head_dim] in the HF convention: frequencies repeated, not interleaved."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device=device).float() / cfg.head_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        q_dim = cfg.num_attention_heads * cfg.head_dim
        kv_dim = cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        c = self.cfg
        # [b, t, hidden] -> [b, heads, t, head_dim]
        q = self.q_proj(x).view(b, t, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # enable_gqa: each group of query heads reads one shared key/value head, no copies.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBody(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TinyLlama(nn.Module):
    """Minimal Llama whose state_dict names are exactly HF LlamaForCausalLM's (lm_head tied)."""

    def __init__(self, cfg: TinyLlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBody(cfg)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [b, t] -> logits [b, t, vocab]
        t = input_ids.shape[1]
        if t > self.cfg.max_position_embeddings:
            raise ValueError(f"sequence length {t} exceeds max_position_embeddings {self.cfg.max_position_embeddings}")
        cos, sin = rotary_cos_sin(self.cfg, t, input_ids.device)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return F.linear(self.model.norm(x), self.model.embed_tokens.weight)

    def init_weights(self, generator: torch.Generator) -> None:
        """GPT-2 style init; residual output projections shrink with depth to keep the stream's variance flat."""
        residual_std = 0.02 / math.sqrt(2 * self.cfg.num_hidden_layers)
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                std = residual_std if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=generator) * std)


def load_exported(folder: str | os.PathLike) -> TinyLlama:
    """Rebuild the training module from an exported folder (float32), for checks against transformers."""
    folder = Path(folder)
    hf = json.loads((folder / "config.json").read_text())
    fields = TinyLlamaConfig.__dataclass_fields__
    cfg = TinyLlamaConfig(**{k: hf[k] for k in fields})
    model = TinyLlama(cfg)
    state = {k: v.float() for k, v in load_file(folder / "model.safetensors").items()}
    model.load_state_dict(state, strict=True)
    return model.eval()


# ------------------------------------------------------------ tokenizer ----


def train_tokenizer(documents: Iterable[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every byte is representable, so any Python file round-trips exactly."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    if tokenizer.token_to_id(EOS_TEXT) != EOS_ID:
        raise RuntimeError(f"{EOS_TEXT} did not get id {EOS_ID}")
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, output: Path, max_length: int) -> None:
    """tokenizer.json plus the small config transformers' AutoTokenizer needs (no BOS: documents are EOS-separated)."""
    tokenizer.save(str(output / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOS_TEXT, "eos_token": EOS_TEXT,
        "unk_token": None, "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": max_length,
    }
    (output / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ----------------------------------------------------------- training ----


@torch.no_grad()
def evaluate(model: TinyLlama, tokens: np.ndarray, seq_len: int, byte_lengths: np.ndarray, batch: int = 16) -> dict:
    """Per-token perplexity and bits/byte over non-overlapping windows of the token stream."""
    model.eval()
    n_windows = (len(tokens) - 1) // seq_len
    if n_windows == 0:
        raise ValueError(f"held-out stream of {len(tokens)} tokens is shorter than one window of {seq_len + 1}")
    data = torch.from_numpy(tokens[: n_windows * seq_len + 1].astype(np.int64))
    byte_lengths = torch.from_numpy(byte_lengths)
    nll, count, nbytes = 0.0, 0, 0.0
    for start in range(0, n_windows, batch):
        rows = range(start, min(start + batch, n_windows))
        x = torch.stack([data[r * seq_len : (r + 1) * seq_len] for r in rows])
        y = torch.stack([data[r * seq_len + 1 : (r + 1) * seq_len + 1] for r in rows])
        logits = model(x).float()
        nll += F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1), reduction="sum").item()
        count += y.numel()
        nbytes += byte_lengths[y].sum().item()
    model.train()
    return {"loss": nll / count, "perplexity": math.exp(nll / count), "bits_per_byte": nll / math.log(2) / nbytes, "tokens": count}


def lr_at(step: int, progress: float, args: argparse.Namespace) -> float:
    """Linear warmup by steps, then cosine decay by progress through the (time or step) budget."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    floor = args.lr * args.min_lr_ratio
    return floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * min(progress, 1.0)))


class Batches:
    """Shuffled non-overlapping windows; each epoch visits every window once before any repeats."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch: int, generator: torch.Generator) -> None:
        self.n_windows = (len(tokens) - 1) // seq_len
        if self.n_windows < batch:
            raise ValueError(f"{len(tokens)} training tokens make {self.n_windows} windows, fewer than batch size {batch}")
        self.tokens, self.seq_len, self.batch, self.gen = tokens, seq_len, batch, generator
        self.order = torch.randperm(self.n_windows, generator=generator)
        self.pos = 0
        self.epochs = 0.0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos + self.batch > self.n_windows:
            self.order = torch.randperm(self.n_windows, generator=self.gen)
            self.pos = 0
        idx = self.order[self.pos : self.pos + self.batch].tolist()
        self.pos += self.batch
        self.epochs += self.batch / self.n_windows
        return self.windows(idx)

    def windows(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        # each row: seq_len + 1 tokens -> inputs [b, seq_len], targets shifted by one
        rows = np.stack([self.tokens[i * self.seq_len : (i + 1) * self.seq_len + 1] for i in idx]).astype(np.int64)
        data = torch.from_numpy(rows)
        return data[:, :-1], data[:, 1:]


def make_optimizer(model: TinyLlama, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW without weight decay on norm gains, which decay would pull towards zero rather than one."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def train_step(
    model: TinyLlama, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
    lr: float, args: argparse.Namespace, bf16: bool,
) -> float:
    """One clipped AdamW step; the loss is taken in float32 even under bf16 autocast."""
    for group in opt.param_groups:
        group["lr"] = lr
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(x)
    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    opt.step()
    return loss.item()


def choose_precision(model: TinyLlama, batches: Batches, args: argparse.Namespace) -> bool:
    """Time a few steps of each precision on a throwaway copy; bf16 autocast only pays off on some CPUs."""
    if args.precision != "auto":
        return args.precision == "bf16"
    timings = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread times more steadily on shared cores; AMX gains show per thread
    for bf16 in (False, True):
        probe = TinyLlama(model.cfg)
        probe.load_state_dict(model.state_dict())
        opt = make_optimizer(probe, args)
        x, y = batches.windows(list(range(batches.batch)))
        train_step(probe, opt, x, y, 1e-4, args, bf16)  # warm-up: allocator and kernel selection
        start = time.perf_counter()
        for _ in range(args.probe_steps):
            train_step(probe, opt, x, y, 1e-4, args, bf16)
        timings[bf16] = (time.perf_counter() - start) / args.probe_steps
    torch.set_num_threads(threads)
    logger.info("precision probe: float32 {:.3f}s/step, bf16 autocast {:.3f}s/step", timings[False], timings[True])
    return timings[True] < timings[False]


class ThreadTuner:
    """Re-pick the faster thread count every few minutes from the times of real training steps.

    On an idle 2-core machine two threads are ~1.7x faster than one; while other jobs
    load the cores, one thread measured ~2x faster than two. Load changes during a run,
    so the choice is re-measured rather than fixed.
    """

    def __init__(self, max_threads: int, probe_steps: int = 4, period_s: float = 180.0) -> None:
        self.choices = sorted({1, max_threads})
        self.probe_steps, self.period_s = probe_steps, period_s
        self.queue: list[int] = []
        self.samples: list[float] = []
        self.timings: dict[int, float] = {}
        self.best = max_threads
        self.next_round = 0.0
        self.history: list[dict] = []

    def before_step(self, now: float) -> None:
        if not self.queue and len(self.choices) > 1 and now >= self.next_round:
            self.queue, self.samples = list(self.choices), []
        torch.set_num_threads(self.queue[0] if self.queue else self.best)

    def after_step(self, seconds: float, now: float) -> None:
        if not self.queue:
            return
        self.samples.append(seconds)
        if len(self.samples) < self.probe_steps:
            return
        self.timings[self.queue.pop(0)] = statistics.median(self.samples)
        self.samples = []
        if not self.queue:
            self.best = min(self.timings, key=self.timings.get)
            self.next_round = now + self.period_s
            self.history.append({"threads": self.best, **{f"s_per_step_{k}": round(v, 3) for k, v in self.timings.items()}})
            logger.info("threads: {} ({})", self.best, ", ".join(f"{k}: {v:.2f}s/step" for k, v in self.timings.items()))


def train(
    model: TinyLlama, batches: Batches, args: argparse.Namespace, bf16: bool, tuner: ThreadTuner,
) -> tuple[int, int, list[float], float]:
    """Optimise until the wall-time budget (or --max-steps) is spent; returns (steps, tokens, recent losses, seconds)."""
    opt = make_optimizer(model, args)
    budget = args.minutes * 60.0
    start = time.time()
    step, tokens_seen, recent = 0, 0, []
    while True:
        elapsed = time.time() - start
        progress = elapsed / budget
        if args.max_steps is not None:
            progress = max(progress, step / args.max_steps)
        if progress >= 1.0:
            break
        lr = lr_at(step, progress, args)
        x, y = batches.next()
        tuner.before_step(elapsed)
        t0 = time.perf_counter()
        loss = train_step(model, opt, x, y, lr, args, bf16)
        tuner.after_step(time.perf_counter() - t0, time.time() - start)
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss became {loss} at step {step}; lower --lr")
        step += 1
        tokens_seen += y.numel()
        recent = (recent + [loss])[-50:]
        if step % args.log_every == 0:
            logger.info(
                "step {} loss {:.4f} lr {:.2e} epoch {:.2f} {:.0f} tok/s elapsed {:.0f}s",
                step, sum(recent) / len(recent), lr, batches.epochs, tokens_seen / (time.time() - start), elapsed,
            )
    return step, tokens_seen, recent, time.time() - start


# ---------------------------------------------------------------- main ----


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", required=True, type=Path, help="folder to write the HF-layout model into")
    p.add_argument("--minutes", type=float, default=30.0, help="wall-time budget for the optimisation loop")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (also sets the LR schedule)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="most intra-op threads; 1 is also tried while training")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--intermediate-size", type=int, default=768, help="a multiple of 128 so GPTQ/Marlin group sizes divide it")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=None, help="default: hidden_size // heads")
    p.add_argument("--max-position-embeddings", type=int, default=1024)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--rms-norm-eps", type=float, default=1e-5)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"), default="auto")
    p.add_argument("--probe-steps", type=int, default=3, help="steps timed per precision when --precision auto")
    p.add_argument("--max-corpus-chars", type=int, default=None, help="truncate each split (for quick runs and tests)")
    p.add_argument("--eval-tokens", type=int, default=None, help="cap on held-out tokens for the final evaluation")
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args(argv)
    if args.minutes <= 0:
        p.error(f"--minutes must be positive, got {args.minutes}")
    if args.max_steps is not None and args.max_steps <= 0:
        p.error(f"--max-steps must be positive, got {args.max_steps}")
    if args.seq_len > args.max_position_embeddings:
        p.error(f"--seq-len {args.seq_len} exceeds --max-position-embeddings {args.max_position_embeddings}")
    if args.head_dim is None:
        if args.hidden_size % args.heads:
            p.error(f"--hidden-size {args.hidden_size} is not divisible by --heads {args.heads}; pass --head-dim")
        args.head_dim = args.hidden_size // args.heads
    return args


def main(argv: list[str] | None = None) -> dict:
    """Tokenizer, corpus, training, evaluation and export in one run; returns what training.json records."""
    args = parse_args(argv)
    command = "python scripts/train_embedded.py " + " ".join(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    cfg = TinyLlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=args.rms_norm_eps, rope_theta=args.rope_theta,
    )
    args.output.mkdir(parents=True, exist_ok=True)
    started = time.time()

    logger.info("training tokenizer (vocab {}) on {} train files", cfg.vocab_size, len(corpus_files("train")))
    tokenizer = train_tokenizer(iter_documents("train", args.max_corpus_chars), cfg.vocab_size)
    if tokenizer.get_vocab_size() != cfg.vocab_size:
        logger.warning("tokenizer learned {} tokens, fewer than {}", tokenizer.get_vocab_size(), cfg.vocab_size)
        cfg = TinyLlamaConfig(**{**asdict(cfg), "vocab_size": tokenizer.get_vocab_size()})
    save_tokenizer(tokenizer, args.output, cfg.max_position_embeddings)
    train_tokens = tokenize_documents(tokenizer, iter_documents("train", args.max_corpus_chars))
    heldout_tokens = tokenize_documents(tokenizer, iter_documents("heldout", args.max_corpus_chars))
    if args.eval_tokens is not None:
        heldout_tokens = heldout_tokens[: args.eval_tokens + 1]
    logger.info("corpus: {} train tokens, {} held-out tokens ({:.1f}s)", len(train_tokens), len(heldout_tokens), time.time() - started)

    gen = torch.Generator().manual_seed(args.seed)
    model = TinyLlama(cfg)
    model.init_weights(gen)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info("model: {} parameters, config {}", n_params, asdict(cfg))
    batches = Batches(train_tokens, args.seq_len, args.batch_size, gen)
    bf16 = choose_precision(model, batches, args)
    logger.info("training with {}", "bf16 autocast" if bf16 else "float32")

    tuner = ThreadTuner(args.threads)
    step, tokens_seen, recent, train_seconds = train(model, batches, args, bf16, tuner)

    # Evaluate the weights as shipped: rounded to bfloat16, computed in float32.
    shipped = TinyLlama(cfg)
    shipped.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    metrics = evaluate(shipped, heldout_tokens, args.seq_len, token_byte_lengths(tokenizer))
    logger.info("held-out: perplexity {:.3f}, {:.4f} bits/byte over {} tokens", metrics["perplexity"], metrics["bits_per_byte"], metrics["tokens"])

    weights = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(args.output / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(args.output / "model.safetensors", 0o644)  # safetensors writes 0600; this is package data
    (args.output / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    generation = {"bos_token_id": EOS_ID, "eos_token_id": EOS_ID}
    (args.output / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    report = {
        "command": command, "seed": args.seed,
        "wall_time_s": round(time.time() - started, 1), "train_time_s": round(train_seconds, 1),
        "steps": step, "tokens_seen": tokens_seen, "epochs": round(batches.epochs, 3),
        "final_train_loss": round(sum(recent) / max(len(recent), 1), 4),
        "heldout_perplexity": round(metrics["perplexity"], 4),
        "heldout_bits_per_byte": round(metrics["bits_per_byte"], 4),
        "heldout_tokens": metrics["tokens"], "eval_seq_len": args.seq_len, "parameters": n_params,
        "precision": "bf16-autocast" if bf16 else "float32", "thread_choices": tuner.history,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "train_tokens": int(len(train_tokens)),
        "hyperparameters": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "python": platform.python_version(), "torch": torch.__version__,
    }
    (args.output / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    logger.info("wrote {} ({} steps, {} tokens, {:.0f}s)", args.output, step, tokens_seen, report["wall_time_s"])
    return report


if __name__ == "__main__":
    main()
