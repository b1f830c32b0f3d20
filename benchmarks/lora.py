"""Decode with LoRA adapters against the base model alone, side by side in one run.

The model (default: the registry's Qwen2.5-Coder-1.5B-Instruct, its GGUF dequantized to a bf16
folder by benchmarks/llamacpp_build.py, cached) is loaded once with `--max-loras` slots of rank
`--rank`; 8 random adapters of that rank on every attention and MLP projection are written in
PEFT's layout and loaded. A batch of `--batch` requests (same prompts every time) is prefilled,
then `--steps` decode steps are timed, for each row of the table in interleaved rounds:
- base: no adapter (the slots are reserved, no row uses one);
- 1 adapter: every row the same adapter;
- N adapters: each row its own adapter (the issue's case: 8 different adapters in a batch of 8).
Columns: decode tokens per second (rows x steps / time, median of the rounds) and the ratio to the
base. The issue's target: >= 0.8x the base's tokens per second with 8 different adapters on CPU.

    flock /tmp/tgs-bench.lock python benchmarks/lora.py                   # Qwen2.5-Coder-1.5B, bf16, CPU
    flock /tmp/tgs-bench.lock python benchmarks/lora.py --model PATH --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import command_line, load_line, machine_line, md_table, now_iso  # noqa: E402

from text_generation_server.engine.types import GenerationRequest  # noqa: E402
from text_generation_server.models.adapters import enable_lora  # noqa: E402
from text_generation_server.models.loader import get_model  # noqa: E402

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def write_adapter(folder: Path, config: dict, rank: int, seed: int) -> None:
    """A PEFT LoRA folder with random A and B on every projection of every layer."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
              "o_proj": (hidden, heads * head_dim), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for block, names in PROJECTIONS.items():
            for name in names:
                out, inp = shapes[name]
                key = f"base_model.model.model.layers.{layer}.{block}.{name}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, inp, generator=g) / inp ** 0.5).bfloat16()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=g) * 0.01).bfloat16()
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [n for v in PROJECTIONS.values()
                                                                                   for n in v]}))


def resolve_model(model: str | None) -> Path:
    if model:
        return Path(model)
    import llamacpp_build as lb

    gguf = lb.ensure_qwen_gguf(lb.cache_root())
    return lb.ensure_hf_from_gguf(gguf, gguf.parent / "hf", lb.cache_root())


def decode_rate(lm, adapters: list[str | None], prompt_len: int, steps: int) -> float:
    requests = [GenerationRequest(id=i, inputs="", input_ids=[(17 * i + 7 * j) % 5000 + 100 for j in range(prompt_len)],
                                  max_new_tokens=steps + 2, ignore_eos_token=True, adapter_id=a)
                for i, a in enumerate(adapters)]
    batch = lm.make_batch(1, requests)
    _, batch, _ = lm.generate_token(batch)  # the prefill (not timed)
    start = time.perf_counter()
    for _ in range(steps):
        _, batch, _ = lm.generate_token(batch)
    elapsed = time.perf_counter() - start
    lm.release(batch)
    return len(adapters) * steps / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a HF folder (default: Qwen2.5-Coder-1.5B from the GGUF)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = resolve_model(args.model)
    config = json.loads((folder / "config.json").read_text())
    lm = get_model(str(folder), dtype=args.dtype)
    slots = enable_lora(lm, args.adapters, args.rank)
    lm.allocate_kv_cache(1 + args.batch * (-(-(args.prompt + args.steps + 4) // lm.block_size)) + 8)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.adapters):
            write_adapter(Path(tmp) / f"a{i}", config, args.rank, seed=i)
            slots.load(f"a{i}", str(Path(tmp) / f"a{i}"))
    cases = {
        "base (slots reserved, unused)": [None] * args.batch,
        "1 adapter, every row": ["a0"] * args.batch,
        f"{args.adapters} adapters, mixed rows": [f"a{i % args.adapters}" for i in range(args.batch)],
    }
    start_load = os.getloadavg()[0]
    rates: dict[str, list[float]] = {name: [] for name in cases}
    with torch.inference_mode():
        for name, rows in cases.items():  # warm up
            decode_rate(lm, rows, args.prompt, 2)
        for _ in range(args.rounds):
            for name, rows in cases.items():
                rates[name].append(decode_rate(lm, rows, args.prompt, args.steps))
    base = statistics.median(rates[next(iter(cases))])
    print(f"LoRA decode, {folder.name} ({args.dtype}), batch {args.batch}, rank {args.rank} on every projection, "
          f"{slots.nbytes / 2**20:.0f} MiB of slots, {args.steps} steps x {args.rounds} rounds, "
          f"{torch.get_num_threads()} thread(s)")
    print(machine_line())
    print(load_line(start=start_load) + " (machine shared with other agents' work)")
    print(f"{now_iso()} | {command_line(script='benchmarks/lora.py')}")
    print()
    rows = [(name, f"{statistics.median(r):.2f}", f"{statistics.median(r) / base:.2f}x",
             " ".join(f"{x:.2f}" for x in r)) for name, r in rates.items()]
    print("\n".join(md_table(["rows", "decode tok/s (median)", "vs base", "rounds"], rows, "lrrl")))


if __name__ == "__main__":
    main()
