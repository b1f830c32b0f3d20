"""Quantized formats end to end: resident weight memory and decode tokens/s against bf16, side by side.

Decoding is memory-bound once the weights dwarf the caches, so a small model
would measure per-op overhead instead of formats. This builds one random Llama
with 7B-sized layers (hidden 4096, intermediate 11008; a few layers and a small
vocabulary keep it quick), writes it as a bf16 checkpoint, quantizes it with our
own `quantize` (GPTQ layout, round-to-nearest: timing does not depend on how the
codes were chosen), and loads every format through `get_model` the way `serve`
does: checkpoint formats from their folders, on-load formats with `--quantize`.
For each it reports the bytes of weights resident after load and the decode
tokens/s at each batch size, timed in interleaved rounds (bf16, gptq, ..., bf16,
gptq, ...) so machine noise hits every format alike; the ratios are the result.

    python benchmarks/quant_decode.py --threads 2 --batch-sizes 1,4,16 --formats bf16,gptq-4bit,eetq
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_common import (  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
    command_line, load_line, machine_line, md_table, now_iso, openmp_as_serve, ratio,
)

openmp_as_serve()  # the ranks' OpenMP waits, set before torch loads libgomp

import torch  # noqa: E402
from loguru import logger  # noqa: E402
from prompts import CODE_PROMPTS  # noqa: E402

ASSETS = Path(__file__).resolve().parent.parent / "server" / "text_generation_server" / "assets" / "tiny-pycoder"

# name -> (checkpoint to load: "bf16" or "gptq-<bits>", --quantize flag or None)
FORMATS = {
    "bf16": ("bf16", None),
    "gptq-4bit": ("gptq-4", None),
    "gptq-8bit": ("gptq-8", None),
    "fp8": ("bf16", "fp8"),
    "eetq": ("bf16", "eetq"),
    "bitsandbytes-nf4": ("bf16", "bitsandbytes-nf4"),
    "bitsandbytes-fp4": ("bf16", "bitsandbytes-fp4"),
    "bitsandbytes": ("bf16", "bitsandbytes"),
}


def write_bf16_model(folder: Path, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
                     vocab: int, seed: int) -> None:
    """A random Llama checkpoint in bf16 with the embedded model's tokenizer (vocabulary 4096)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(ASSETS / name, folder / name)
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": rand(vocab, hidden, scale=0.02),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
               "lm_head.weight": rand(vocab, hidden, scale=hidden ** -0.5)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "self_attn.q_proj.weight": rand(hidden, hidden, scale=hidden ** -0.5),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden, scale=hidden ** -0.5),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden, scale=hidden ** -0.5),
            p + "self_attn.o_proj.weight": rand(hidden, hidden, scale=hidden ** -0.5),
            p + "mlp.gate_proj.weight": rand(intermediate, hidden, scale=hidden ** -0.5),
            p + "mlp.up_proj.weight": rand(intermediate, hidden, scale=hidden ** -0.5),
            p + "mlp.down_proj.weight": rand(hidden, intermediate, scale=intermediate ** -0.5),
        }
    save_file(tensors, str(folder / "model.safetensors"))


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model's modules hold (parameters, buffers and plain tensor
    attributes, which packed kernels use), each storage counted once. The KV cache lives
    outside the model and is not counted."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in seen or storage.nbytes() == 0:
            return
        seen.add(key)
        total += storage.nbytes()

    for module in model.modules():
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            add(t)
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                add(value)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    if isinstance(item, torch.Tensor):
                        add(item)
    return total


def kernels_of(model: torch.nn.Module) -> str:
    names = sorted({getattr(m, "kernel_name") for m in model.modules() if hasattr(m, "kernel_name")})
    return ", ".join(names)


class Runner:
    def __init__(self, name: str, folder: Path, quantize: str | None, max_batch: int, new_tokens: int):
        from text_generation_server.models.loader import get_model

        self.name = name
        self.lm = get_model(str(folder), dtype="bfloat16", quantize=quantize)
        self.new_tokens = new_tokens
        self.weight_bytes = resident_weight_bytes(self.lm.model)
        self.kernels = kernels_of(self.lm.model)
        self.lm.allocate_kv_cache(1 + max_batch * self.lm.blocks_for(64 + new_tokens))

    def decode_tokens_per_s(self, batch_size: int) -> tuple[float, list[list[int]]]:
        from text_generation_server.engine.types import GenerationRequest

        requests = [GenerationRequest(id=i, inputs=CODE_PROMPTS[i % len(CODE_PROMPTS)],
                                      max_new_tokens=self.new_tokens, ignore_eos_token=True)
                    for i in range(batch_size)]
        ids: dict[int, list[int]] = {r.id: [] for r in requests}
        batch = self.lm.make_batch(0, requests)
        generations, batch, _ = self.lm.generate_token(batch)
        start = time.perf_counter()
        while batch is not None:
            generations, batch, _ = self.lm.generate_token(batch)
            for gen in generations:
                ids[gen.request_id].extend(gen.tokens.ids)
        elapsed = time.perf_counter() - start
        return batch_size * (self.new_tokens - 1) / elapsed, [ids[r.id] for r in requests]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", default="bf16,gptq-4bit,gptq-8bit,eetq,fp8,bitsandbytes-nf4",
                        help=f"comma-separated, from {', '.join(FORMATS)}")
    parser.add_argument("--batch-sizes", default="1,4,16")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds; the median is reported")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=11008)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--workdir", default="", help="keep the checkpoints here (default: a temporary folder)")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.formats.split(",") if n.strip()]
    unknown = [n for n in names if n not in FORMATS]
    if unknown:
        parser.error(f"unknown format(s) {', '.join(unknown)}; choose from {', '.join(FORMATS)}")
    if "bf16" not in names:
        names.insert(0, "bf16")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    logger.remove()
    logger.add(sys.stderr, level="WARNING")

    from text_generation_server.jobs.quantize.options import QuantizeOptions

    from text_generation_server.jobs.quantize.pipeline import quantize

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="quant-decode-"))
    try:
        folders = {"bf16": work / "bf16"}
        if not folders["bf16"].exists():
            write_bf16_model(folders["bf16"], args.hidden, args.intermediate, args.layers, args.heads,
                             args.kv_heads, args.vocab, seed=0)
        for name in names:
            checkpoint = FORMATS[name][0]
            if checkpoint.startswith("gptq-") and checkpoint not in folders:
                bits = int(checkpoint.split("-")[1])
                out = work / checkpoint
                if not out.exists():
                    quantize(str(folders["bf16"]), out, QuantizeOptions(method="rtn", bits=bits, group_size=128,
                                                                        sym=True))
                folders[checkpoint] = out
        runners = []
        for name in names:
            checkpoint, flag = FORMATS[name]
            runners.append(Runner(name, folders[checkpoint], flag, max(batch_sizes), args.new_tokens))
            gc.collect()
        timings: dict[tuple[str, int], list[float]] = {}
        for runner in runners:  # warm-up: first calls pay for allocation and kernel setup
            runner.decode_tokens_per_s(1)
        for _ in range(args.rounds):
            for b in batch_sizes:
                for runner in runners:
                    tps, _ = runner.decode_tokens_per_s(b)
                    timings.setdefault((runner.name, b), []).append(tps)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    base = runners[0]
    lines = [
        "## Quantized formats end to end: weight memory and decode tokens/s against bf16",
        "",
        f"- command: `{command_line()}`",
        f"- model: random Llama, hidden {args.hidden}, intermediate {args.intermediate}, {args.layers} layers, "
        f"{args.heads} heads / {args.kv_heads} KV heads, vocabulary {args.vocab}; bf16 activations; "
        f"{args.new_tokens} new tokens per request; median of {args.rounds} interleaved rounds",
        f"- machine: {machine_line(f'torch threads {torch.get_num_threads()}', load_line())}",
        f"- date: {now_iso()}",
        "",
    ]
    rows = []
    for runner in runners:
        cells = []
        for b in batch_sizes:
            tps = statistics.median(timings[(runner.name, b)])
            ref = statistics.median(timings[(base.name, b)])
            cells.append(f"{tps:.1f} ({ratio(tps, ref)})")
        rows.append([runner.name, runner.kernels, f"{runner.weight_bytes / 2**20:.0f}",
                     ratio(runner.weight_bytes, base.weight_bytes), *cells])
    lines += md_table(["format", "kernels", "weights MiB", "vs bf16", *(f"tok/s b={b} (x bf16)" for b in batch_sizes)],
                      rows, "llrr" + "r" * len(batch_sizes))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
