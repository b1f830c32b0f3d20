"""CPU decode of a small random mixture-of-experts model: our engine against transformers.

Writes a random Qwen3-MoE checkpoint with transformers' own class (hidden 512, 6 layers, 32
experts, 4 per token, expert intermediate 256; every layer sparse) and runs
benchmarks/decode_vs_transformers.py on it: both sides decode the same greedy prompts in float32,
interleaved in one process, token ids compared. The MoE target is ours >= 1.5x transformers at
batch 8 (transformers loops over the experts a batch touches, one_hot and where per expert; ours
sorts the (token, slot) pairs once and runs two GEMMs per active expert).

    python benchmarks/moe_decode.py [--batch-sizes 1,8,32] [--new-tokens 64] [--experts 32] [--top-k 4]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def write_moe(folder: Path, hidden: int, layers: int, experts: int, top_k: int, intermediate: int) -> None:
    import transformers
    from helpers import build_tokenizer

    config = transformers.AutoConfig.for_model(
        "qwen3_moe", vocab_size=300, hidden_size=hidden, intermediate_size=4 * intermediate, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
        num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=intermediate, norm_topk_prob=True,
        max_position_embeddings=1024, eos_token_id=0, bos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape) * 0.05 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(folder)
    build_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    import decode_vs_transformers

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "qwen3-moe-random"
        write_moe(folder, args.hidden, args.layers, args.experts, args.top_k, args.intermediate)
        print(f"model: random qwen3_moe, hidden {args.hidden}, {args.layers} layers, {args.experts} experts, "
              f"top-{args.top_k}, expert intermediate {args.intermediate}")
        forwarded = ["--model", str(folder), "--batch-sizes", args.batch_sizes, "--new-tokens", str(args.new_tokens),
                     "--repeats", str(args.repeats), "--targets", "8:1.5"]
        if args.threads:
            forwarded += ["--threads", str(args.threads)]
        return decode_vs_transformers.main(forwarded)


if __name__ == "__main__":
    sys.exit(main())
