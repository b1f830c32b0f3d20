"""Decode speed of the transformers fallback against the native family, side by side.

One random Llama checkpoint (written by this script: hidden 512, 8 layers, GQA) loaded twice
in this process, `--model-impl native` and `--model-impl transformers`; both decode the same
greedy requests (identical tokens are checked) at each batch size, the two implementations
alternating round by round so load on the machine hits both alike. Reported: decode tokens/s
per implementation and the ratio native / transformers (target: <= 1.3 on CPU).

Run: python benchmarks/model_impl_decode.py [--batch-sizes 1,8,32] [--new-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from bench_common import (  # noqa: E402
    command_line, load_averages, load_line, machine_line, md_table, now_iso, openmp_as_serve, parse_ints, ratio,
)

openmp_as_serve()  # the ranks' OpenMP waits, set before torch loads libgomp

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def write_model(folder: Path, hidden: int, layers: int) -> None:
    import transformers
    from helpers import build_tokenizer

    config = transformers.LlamaConfig(vocab_size=300, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                      num_key_value_heads=max(1, hidden // 256), max_position_embeddings=1024,
                                      eos_token_id=0, bos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.save_pretrained(folder)
    build_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))


def decode_rate(lm, batch_size: int, new_tokens: int, prompt_len: int = 32) -> tuple[float, list[list[int]]]:
    """Decode tokens per second of one batch (its prefill excluded), and the tokens."""
    from helpers import ids_request, random_ids

    batch = lm.make_batch(0, [ids_request(i, random_ids(prompt_len, i), new_tokens) for i in range(batch_size)])
    tokens: dict[int, list[int]] = {}
    generations, batch, _ = lm.generate_token(batch)  # the prefill
    for g in generations:
        tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
    start, steps = time.perf_counter(), 0
    while batch is not None:
        generations, batch, _ = lm.generate_token(batch)
        steps += 1
        for g in generations:
            tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
    elapsed = time.perf_counter() - start
    return batch_size * steps / elapsed, [tokens[i] for i in range(batch_size)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    batches = parse_ints(args.batch_sizes, "--batch-sizes")
    if args.threads:
        torch.set_num_threads(args.threads)
    from loguru import logger

    from text_generation_server.models.loader import get_model

    logger.remove()
    start_load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        write_model(folder, args.hidden, args.layers)
        models = {impl: get_model(str(folder), dtype="float32", model_impl=impl) for impl in ("native", "transformers")}
        for lm in models.values():
            lm.allocate_kv_cache(lm.blocks_for(max(batches) * (32 + args.new_tokens)) + max(batches))
        rows = []
        for batch_size in batches:
            rates = {impl: [] for impl in models}
            for _ in range(args.rounds):
                outputs = {}
                for impl, lm in models.items():
                    rate, tokens = decode_rate(lm, batch_size, args.new_tokens)
                    rates[impl].append(rate)
                    outputs[impl] = tokens
                if outputs["native"] != outputs["transformers"]:
                    raise SystemExit(f"batch {batch_size}: the two implementations chose different tokens")
            best = {impl: max(r) for impl, r in rates.items()}
            rows.append([batch_size, f"{best['native']:.1f}", f"{best['transformers']:.1f}",
                         ratio(best["native"], best["transformers"])])
    print(f"# --model-impl transformers vs native: decode tokens/s ({now_iso()})")
    print(f"command: {command_line(script='benchmarks/model_impl_decode.py', argv=argv)}")
    print(machine_line(f"torch threads {torch.get_num_threads()}"))
    print(f"model: random Llama, hidden {args.hidden}, {args.layers} layers, float32; {args.new_tokens} new tokens, "
          f"best of {args.rounds} alternating rounds; identical greedy tokens checked")
    print()
    print("\n".join(md_table(["batch", "native tok/s", "transformers tok/s", "native / transformers"], rows, "rrrr")))
    print()
    print(load_line(start=start_load))
    print(f"load averages at the end: {load_averages()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
