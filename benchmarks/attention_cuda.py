"""CUDA paged attention (kernels/paged_attention.py) against torch on Llama-3-8B attention shapes.

Decode, for each batch x context (every sequence at the full context, blocks shuffled):
- torch: the gather-then-SDPA path (index_select of each sequence's blocks, then
  scaled_dot_product_attention with a key mask and enable_gqa), as server/layers/attention.py
  did before the Triton backend;
- triton: paged_decode with the splits decode_splits picks for this GPU's SM count, and with
  one split (to show what flash-decoding buys);
and the speed-up, the largest difference between the two outputs, and the K/V read bandwidth
(K and V bytes the step must read / time) against the device's copy bandwidth measured here
(read + write bytes of a 1 GiB device-to-device copy / time).

Prefill, for each context: paged_prefill of one sequence with no cached prefix (K/V read from
shuffled blocks) against SDPA's flash backend on contiguous tensors (K/V repeated to the query
heads, outside the timing), causal; speed-up and TFLOP/s (4 x heads x head_dim x L(L+1)/2).

Times are medians of CUDA-graph replays, as the server's decode runs (Python launch cost not
measured; --eager times plain calls instead), with L2 flushed before each replay unless --hot.
A torch case that runs out of memory is reported as OOM and the run goes on.

    python benchmarks/attention_cuda.py                      # batches 1,8,32,64 x 1k,8k,32k
    python benchmarks/attention_cuda.py --quick              # batch 1 and 32 at 8k, prefill 8k
    python benchmarks/attention_cuda.py --dtype bfloat16 --contexts 4096
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bench_common import command_line, md_table, ratio  # benchmarks/ is on sys.path here
from text_generation_server.kernels import paged_attention as pa

BATCHES = [1, 8, 32, 64]
CONTEXTS = [1024, 8192, 32768]
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


class Timer:
    """Median time in microseconds of fn(), replayed from a CUDA graph unless eager."""

    def __init__(self, hot: bool, reps: int, eager: bool):
        self.reps = reps
        self.eager = eager
        self.flush = None if hot else torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn) -> float:
        for _ in range(3):
            fn()  # compile, warm the allocator; an out-of-memory shows here, outside any capture
        run = fn
        if not self.eager:
            torch.cuda.empty_cache()  # the graph's private pool cannot reuse blocks cached by eager calls
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            run = graph.replay
            run()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for start, end in zip(starts, ends):
            if self.flush is not None:
                self.flush.zero_()
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def copy_gbs() -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + bytes written per second)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) / statistics.median(times) / 1e9


def paged_cache(batch: int, context: int, args: argparse.Namespace, gen: torch.Generator):
    """K/V for `batch` sequences of `context` positions in shuffled blocks (block 0 left unused)."""
    per_seq = -(-context // args.block_size)
    num_blocks = 1 + batch * per_seq
    shape = (num_blocks, args.block_size, args.kv_heads, args.head_dim)
    key_cache = torch.randn(shape, device="cuda", dtype=args.torch_dtype, generator=gen)
    value_cache = torch.randn(shape, device="cuda", dtype=args.torch_dtype, generator=gen)
    blocks = torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1
    block_tables = blocks.view(batch, per_seq).to(torch.int32).contiguous()
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return key_cache, value_cache, block_tables, seq_lens


def torch_decode(q, key_cache, value_cache, index, mask, scale):
    # q [B, H, D]; index: the tables flattened; mask [B, 1, 1, L] -> [B, H, D]
    batch, heads, dim = q.shape
    kv_heads = key_cache.shape[2]
    length = mask.shape[-1]
    k = key_cache.index_select(0, index).view(batch, length, kv_heads, dim).transpose(1, 2)
    v = value_cache.index_select(0, index).view(batch, length, kv_heads, dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=heads != kv_heads)
    return out.squeeze(2)


def bench_decode(batch: int, context: int, args: argparse.Namespace, timer: Timer, sms: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + context)
    key_cache, value_cache, block_tables, seq_lens = paged_cache(batch, context, args, gen)
    q = torch.randn(batch, args.heads, args.head_dim, device="cuda", dtype=args.torch_dtype, generator=gen)
    scale = args.head_dim ** -0.5
    splits = pa.decode_splits(context, args.block_size, batch, args.kv_heads, num_sms=sms)
    workspace = pa.decode_workspace(batch, args.heads, args.head_dim, splits, q.device)
    out_split = torch.empty_like(q)
    out_one = torch.empty_like(q)

    def triton_split():
        pa.paged_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, num_splits=splits,
                        out=out_split, workspace=workspace)

    def triton_one():
        pa.paged_decode(q, key_cache, value_cache, block_tables, seq_lens, scale, out=out_one)

    row = {"batch": batch, "context": context, "splits": splits,
           "t_split": timer(triton_split), "t_one": timer(triton_one)}
    kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * q.element_size()
    row["gbs"] = kv_bytes / (row["t_split"] * 1e-6) / 1e9
    try:
        index = block_tables.reshape(-1)
        length = block_tables.shape[1] * args.block_size
        mask = (torch.arange(length, device="cuda")[None, :] < seq_lens[:, None])[:, None, None, :]
        ref = torch.empty_like(q)

        def torch_path():
            ref.copy_(torch_decode(q, key_cache, value_cache, index, mask, scale))

        row["t_torch"] = timer(torch_path)
        torch_path()
        row["err"] = max((out.float() - ref.float()).abs().max().item() for out in (out_split, out_one))
    except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one: the gather copies all K/V
        row["t_torch"] = row["err"] = None
        row["why"] = str(e).splitlines()[0][:120]
        torch.cuda.empty_cache()
    return row


def bench_prefill(context: int, args: argparse.Namespace, timer: Timer) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator(device="cuda").manual_seed(context)
    key_cache, value_cache, block_tables, seq_lens = paged_cache(1, context, args, gen)
    q = torch.randn(context, args.heads, args.head_dim, device="cuda", dtype=args.torch_dtype, generator=gen)
    cu = torch.tensor([0, context], dtype=torch.int32, device="cuda")
    scale = args.head_dim ** -0.5
    out = torch.empty_like(q)

    def triton_path():
        pa.paged_prefill(q, key_cache, value_cache, cu, seq_lens, block_tables, scale, max_q_len=context, out=out)

    row = {"context": context, "t_triton": timer(triton_path)}
    row["tflops"] = 4 * args.heads * args.head_dim * context * (context + 1) / 2 / (row["t_triton"] * 1e-6) / 1e12
    try:
        pos = torch.arange(context, device="cuda")
        ids = block_tables[0, pos // args.block_size].long()
        group = args.heads // args.kv_heads
        # Contiguous [1, H, L, D], K/V repeated to the query heads: the layout flash runs best on.
        def contiguous(t: torch.Tensor) -> torch.Tensor:  # [L, heads, D] -> [1, heads, L, D]
            return t.transpose(0, 1).unsqueeze(0).contiguous()

        k = contiguous(key_cache[ids, pos % args.block_size].repeat_interleave(group, 1))
        v = contiguous(value_cache[ids, pos % args.block_size].repeat_interleave(group, 1))
        qf = contiguous(q)
        ref = torch.empty_like(qf)

        def flash_path():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                ref.copy_(F.scaled_dot_product_attention(qf, k, v, is_causal=True, scale=scale))

        row["t_flash"] = timer(flash_path)
        flash_path()
        row["err"] = (out.float() - ref[0].transpose(0, 1).float()).abs().max().item()
    except RuntimeError as e:  # out of memory, or no flash kernel for this device/dtype
        row["t_flash"] = row["err"] = None
        row["why"] = str(e).splitlines()[0][:120]
        torch.cuda.empty_cache()
    return row


def _fmt(v: float | None, spec: str) -> str:
    return "OOM/n.a." if v is None else format(v, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float16", choices=sorted(DTYPES))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--hot", action="store_true", help="do not flush L2 between calls")
    ap.add_argument("--eager", action="store_true", help="time plain calls, not CUDA-graph replays")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--quick", action="store_true", help="batch 1 and 32 at 8k; prefill at 8k")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/attention_cuda.py needs a CUDA GPU, and torch.cuda.is_available() is False on this "
              "machine. The kernels' CPU tests run them in Triton's interpreter: "
              "python -m pytest tests/test_paged_attention.py", file=sys.stderr)
        return 2
    ok, why = pa.paged_attention_available(torch.device("cuda"))
    if not ok:
        print(f"benchmarks/attention_cuda.py: the Triton paged-attention kernels cannot run here: {why}",
              file=sys.stderr)
        return 2
    if args.quick:
        args.batches, args.contexts = "1,32", "8192"
    args.torch_dtype = DTYPES[args.dtype]
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    props = torch.cuda.get_device_properties(0)
    timer = Timer(args.hot, args.reps, args.eager)
    started = time.time()
    bandwidth = copy_gbs()
    decode_rows, prefill_rows = [], []
    with torch.inference_mode():
        for context in contexts:
            for batch in batches:
                row = bench_decode(batch, context, args, timer, props.multi_processor_count)
                decode_rows.append(row)
                print(f"decode batch {batch} context {context}: torch {_fmt(row['t_torch'], '.1f')} us, triton "
                      f"{row['t_split']:.1f} us (x{row['splits']}), one split {row['t_one']:.1f} us", flush=True)
                torch.cuda.empty_cache()
        if not args.no_prefill:
            for context in contexts:
                row = bench_prefill(context, args, timer)
                prefill_rows.append(row)
                print(f"prefill {context}: flash {_fmt(row['t_flash'], '.1f')} us, triton {row['t_triton']:.1f} us",
                      flush=True)
                torch.cuda.empty_cache()

    print()
    print(f"Command: `{command_line(script='benchmarks/attention_cuda.py')}`")
    print(f"Device: {props.name} ({props.multi_processor_count} SMs, measured copy bandwidth {bandwidth:.0f} GB/s); "
          f"torch {torch.__version__}; triton {pa.triton.__version__}; {datetime.date.today().isoformat()}; "
          f"{args.heads} q heads, {args.kv_heads} KV heads, head_dim {args.head_dim}, {args.dtype}, block_size "
          f"{args.block_size}; {'eager calls' if args.eager else 'CUDA-graph replays'}, L2 "
          f"{'hot' if args.hot else 'flushed before each'}; median of {args.reps}; run took "
          f"{time.time() - started:.0f} s.")
    print()
    print("Decode. Times in microseconds; speed-up = torch time / triton time (higher is better); GB/s = K/V bytes "
          "read / triton time.")
    print()
    head = ["batch", "context", "torch gather+SDPA", "triton (splits)", "speed-up", "triton 1 split",
            "max |diff|", "K/V GB/s", "% of copy BW"]
    cells = [[str(r["batch"]), str(r["context"]), _fmt(r["t_torch"], ".1f"), f"{r['t_split']:.1f} (x{r['splits']})",
              ratio(r["t_torch"], r["t_split"], missing="n.a."), f"{r['t_one']:.1f}", _fmt(r["err"], ".1e"),
              f"{r['gbs']:.0f}", f"{100 * r['gbs'] / bandwidth:.0f}%"] for r in decode_rows]
    print("\n".join(md_table(head, cells)))
    if prefill_rows:
        print()
        print("Prefill (one sequence, no cached prefix). Speed-up = flash time / triton time.")
        print()
        head = ["context", "SDPA flash (contiguous)", "triton paged", "speed-up", "triton TFLOP/s", "max |diff|"]
        cells = [[str(r["context"]), _fmt(r["t_flash"], ".1f"), f"{r['t_triton']:.1f}",
                  ratio(r["t_flash"], r["t_triton"], missing="n.a."), f"{r['tflops']:.0f}", _fmt(r["err"], ".1e")]
                 for r in prefill_rows]
        print("\n".join(md_table(head, cells)))
    print()
    for r in decode_rows:
        if r.get("why"):
            print(f"torch decode not run at batch {r['batch']} context {r['context']}: {r['why']}")
    for r in prefill_rows:
        if r.get("why"):
            print(f"flash not run at {r['context']}: {r['why']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
