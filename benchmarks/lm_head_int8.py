"""Decode with the lm_head as int8 (`--quantize-lm-head int8`) against the dense head, side by side.

A small model's head is its largest matrix (Qwen2.5-0.5B: 151936 x 896, 27% of its weights) and
decode reads all of it every step. This loads one checkpoint twice in this process, dense head
and int8 head, and decodes the same greedy requests with both at each batch size, alternating
round by round so machine load hits both alike. Reported: decode tokens/s of each, their ratio,
and how many greedy tokens agree (int8 rounding of the head may flip near-ties).

    python benchmarks/lm_head_int8.py --model FOLDER [--dtype bfloat16] [--batch-sizes 1,8]
        [--new-tokens 32] [--rounds 3]

Without --model it writes a random Qwen2.5-0.5B-shaped checkpoint (hidden 896, 24 layers,
vocabulary 151936, tied embeddings) with transformers and uses that.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import command_line, load_line, machine_line, md_table, now_iso, parse_ints  # noqa: E402
from model_impl_decode import decode_rate as decode  # noqa: E402


def write_qwen05(folder: Path) -> None:
    import json

    import transformers
    from helpers import build_tokenizer

    config = transformers.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                      num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                                      tie_word_embeddings=True, eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) * 0.02 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(folder)
    build_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    batches = parse_ints(args.batch_sizes, "--batch-sizes")
    from loguru import logger

    from text_generation_server.models.loader import get_model

    logger.remove()
    start_load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model
        if folder is None:
            folder = str(Path(tmp) / "qwen05")
            write_qwen05(Path(folder))
        models = {"dense": get_model(folder, dtype=args.dtype),
                  "int8": get_model(folder, dtype=args.dtype, quantize_lm_head="int8")}
        for lm in models.values():
            lm.allocate_kv_cache(lm.blocks_for(max(batches) * (32 + args.new_tokens)) + max(batches))
            decode(lm, 1, 4)  # warm
        head = models["dense"].model.head.projection.weight
        rows = []
        for batch_size in batches:
            rates: dict[str, list[float]] = {name: [] for name in models}
            outputs = {}
            for _ in range(args.rounds):
                for name, lm in models.items():
                    rate, outputs[name] = decode(lm, batch_size, args.new_tokens)
                    rates[name].append(rate)
            best = {name: max(r) for name, r in rates.items()}
            agree = sum(a == b for d, q in zip(outputs["dense"], outputs["int8"]) for a, b in zip(d, q))
            total = sum(map(len, outputs["dense"]))
            rows.append([batch_size, f"{best['dense']:.1f}", f"{best['int8']:.1f}",
                         f"**{best['int8'] / best['dense']:.2f}x**", f"{agree}/{total}"])
    print(f"# lm_head int8 vs dense: decode tokens/s ({now_iso()})")
    print(f"command: {command_line(script='benchmarks/lm_head_int8.py', argv=argv)}")
    print(machine_line(f"torch threads {torch.get_num_threads()}"))
    print(f"model: {args.model or 'random Qwen2.5-0.5B shape'}, {args.dtype}; head {list(head.shape)} "
          f"({head.numel() * head.element_size() / 2**20:.0f} MiB dense); {args.new_tokens} new tokens, best of "
          f"{args.rounds} alternating rounds")
    print()
    print("\n".join(md_table(["batch", "dense head tok/s", "int8 head tok/s", "int8 / dense", "same greedy tokens"],
                             rows, "rrrrr")))
    print()
    print(load_line(start=start_load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
