"""Decode attention at a long context: an fp8 KV cache against 16- and 32-bit ones, side by side.

One decode step's attention over every layer of a model shape (default Qwen2.5-Coder-1.5B: 28
layers, 12 query heads, 2 KV heads, head_dim 128) for `--batch` sequences of `--context` tokens,
through the attention backend the device uses (CPU: torch-sdpa's padded decode, which gathers each
layer's K/V and, for an fp8 cache, dequantizes that copy; CUDA: triton-paged, which reads the fp8
bytes in the kernel). Rows: the cache dtype with the model dtype that reads it; columns: bytes
per token, the cache's size at this context, the step's median time and its ratio to the bf16
cache. Every row runs in the same interleaved rounds, so the ratios share the machine's state.

    python benchmarks/kv_cache_fp8.py                         # CPU, 4k context, batch 1
    python benchmarks/kv_cache_fp8.py --context 32768 --batch 4 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from text_generation_server.kernels.kv_fp8 import KVScales
from text_generation_server.layers.attention import AttentionMetadata, AttentionSpec, KVLayout
from text_generation_server.layers.attention_backends import choose_attention_backend

ROWS = [  # (label, model dtype, cache dtype)
    ("bf16 cache", torch.bfloat16, torch.bfloat16),
    ("fp8_e4m3fn cache, bf16 model", torch.bfloat16, torch.float8_e4m3fn),
    ("fp8_e5m2 cache, bf16 model", torch.bfloat16, torch.float8_e5m2),
    ("fp32 cache (CPU's default dtype)", torch.float32, torch.float32),
    ("fp8_e4m3fn cache, fp32 model", torch.float32, torch.float8_e4m3fn),
]


class Case:
    def __init__(self, label: str, model_dtype: torch.dtype, cache_dtype: torch.dtype, args, device):
        self.label, self.model_dtype, self.cache_dtype = label, model_dtype, cache_dtype
        bs = args.block_size
        blocks_per_seq = -(-args.context // bs)
        layout = KVLayout(args.layers, args.kv_heads, args.head_dim)
        fp8 = cache_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        scales = [KVScales(cache_dtype, torch.full((args.kv_heads,), 0.5, device=device),
                           torch.full((args.kv_heads,), 0.25, device=device))] * args.layers if fp8 else None
        self.cache = layout.allocate(args.batch * blocks_per_seq + 1, bs, cache_dtype, device, scales)
        gen = torch.Generator(device=device).manual_seed(0)
        for layer in range(args.layers):  # random K/V, written as a store would (quantized for fp8)
            for pool, scale in ((self.cache.keys[layer], 0.5), (self.cache.values[layer], 0.25)):
                x = torch.randn(pool.shape, generator=gen, device=device) * scale
                pool.copy_(x.clamp(-400, 400).to(cache_dtype) if fp8 else x.to(cache_dtype))
        self.bytes_per_token = layout.bytes_per_token(cache_dtype)
        self.q = torch.randn(args.batch, args.heads, args.head_dim, generator=gen, device=device).to(model_dtype)
        self.tables = 1 + torch.arange(args.batch * blocks_per_seq, device=device).view(args.batch, blocks_per_seq)
        self.seq_lens = torch.full((args.batch,), args.context, device=device)
        spec = AttentionSpec(device.type, model_dtype, args.heads, args.kv_heads, args.head_dim, bs, False,
                             kv_dtype=cache_dtype if fp8 else None)
        self.backend, _ = choose_attention_backend(spec)
        self.args = args
        self.times: list[float] = []

    def step(self) -> None:
        meta = AttentionMetadata(is_prefill=False, slots=self.seq_lens - 1, block_tables=self.tables,
                                 seq_lens=self.seq_lens, max_seq_len=self.args.context, backend=self.backend)
        scale = self.args.head_dim ** -0.5
        for layer in range(self.args.layers):
            scales = self.cache.scales_of(layer)
            kv = {} if scales is None else {"kv_scales": scales}
            self.backend.decode(self.q, self.cache.keys[layer], self.cache.values[layer], meta, scale, None, **kv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cases = [Case(label, m, c, args, device) for label, m, c in ROWS]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.inference_mode():
        for case in cases:  # warm up (Triton compiles, allocator settles)
            case.step()
        for _ in range(args.rounds):
            for case in cases:
                sync()
                start = time.perf_counter()
                case.step()
                sync()
                case.times.append(time.perf_counter() - start)
    base = statistics.median(cases[0].times)
    print(f"decode attention, {args.layers} layers x {args.heads} heads / {args.kv_heads} KV heads x "
          f"{args.head_dim}, batch {args.batch} at {args.context} tokens, {device.type} "
          f"({cases[0].backend.name}), {torch.get_num_threads()} thread(s), median of {args.rounds}")
    print()
    print("| cache | backend | bytes/token | cache at this context (MiB) | step (ms) | vs bf16 cache |")
    print("|---|---|---:|---:|---:|---:|")
    for case in cases:
        median = statistics.median(case.times)
        mib = case.bytes_per_token * args.context * args.batch / 2**20
        print(f"| {case.label} | {case.backend.name} | {case.bytes_per_token} | {mib:.0f} | {median * 1e3:.2f} | "
              f"{median / base:.2f}x |")


if __name__ == "__main__":
    main()
