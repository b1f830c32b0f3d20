"""Which layers an fp8 KV cache should keep in 16 bits: the rule's measure and what each choice costs.

One load of MODEL in bfloat16; first the load-time rule's measure of every layer (models/kv_cache.py
`probe_ratios`, in units of the format's unit roundoff; the rule keeps a layer over
ROUNDING_THRESHOLD), then, for each `--config` (a format and the layers kept in bfloat16), the same
model with those per-layer scales swapped in: bytes per token, tokens in the same memory against a
bf16 cache, teacher-forced top-1 agreement with the bf16 cache over the real-model test's 8 prompts
x 64 tokens (tests/test_kv_cache_fp8_real.py), and held-out perplexity on `--perplexity-tokens`.
Quality, not speed: the rows need no interleaving, but run it under the benchmark lock anyway.

    flock /tmp/tgs-bench.lock python benchmarks/kv_cache_fp8_layers.py ~/.cache/tgs-bench/models/qwen2.5-coder-1.5b/hf \\
        --config e4m3:none --config e4m3:0 --config e4m3:auto --config e5m2:auto --perplexity-tokens 1024
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_kv_cache_fp8_real import NEW_TOKENS, PROMPTS, teacher_forced_top1  # noqa: E402

from text_generation_server.engine.types import GenerationRequest  # noqa: E402
from text_generation_server.jobs.perplexity import default_text, evaluate  # noqa: E402
from text_generation_server.kernels.kv_fp8 import KVScales  # noqa: E402
from text_generation_server.models import kv_cache  # noqa: E402
from text_generation_server.models.loader import get_model  # noqa: E402
from text_generation_server.quantizers.dist import single_process_group  # noqa: E402
from text_generation_server.settings.serve_args import parse_kv_skip_layers  # noqa: E402

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--config", action="append", default=[],
                        help="FORMAT:LAYERS, FORMAT e4m3 or e5m2, LAYERS auto, none or ids (0,1 or 0-3)")
    parser.add_argument("--perplexity-tokens", type=int, default=1024)
    args = parser.parse_args()
    lm = get_model(args.model, dtype="bfloat16", kv_cache_dtype="fp8_e4m3fn", kv_cache_fp8_skip_layers="none")
    layout, bf16_bytes = lm.kv_layout, lm.kv_layout.bytes_per_token(torch.bfloat16)
    ids = lm.tokenizer.encode(kv_cache.PROBE_TEXT).ids[:kv_cache.PROBE_TOKENS]
    kept = {}
    for name, dtype in FORMATS.items():
        ones = [KVScales.ones(dtype, layout.kv_heads, lm.device)] * layout.num_layers
        ratios = kv_cache.probe_ratios(lm.model, ids, layout, ones, torch.bfloat16, lm.device, single_process_group())
        kept[name] = [i for i, r in enumerate(ratios) if r > kv_cache.ROUNDING_THRESHOLD]
        print(f"{name} measure per layer ({len(ids)} probe tokens; kept over {kv_cache.ROUNDING_THRESHOLD:g}: "
              f"{kept[name]}): " + " ".join(f"{i}:{r:.2f}" for i, r in enumerate(ratios)), flush=True)

    def configure(fmt: str | None, layers: list[int]) -> None:
        if fmt is None:
            lm.kv_dtype, lm.kv_scales = torch.bfloat16, None
            return
        lm.kv_dtype = FORMATS[fmt]
        lm.kv_scales = [None if i in layers else KVScales.ones(lm.kv_dtype, layout.kv_heads, lm.device)
                        for i in range(layout.num_layers)]

    configure(None, [])
    done = lm.generate([GenerationRequest(id=i, inputs=p, max_new_tokens=NEW_TOKENS, ignore_eos_token=True)
                        for i, p in enumerate(PROMPTS)])
    sequences = []
    for prompt, result in zip(PROMPTS, done):
        prompt_ids = lm.tokenizer.encode(prompt).ids
        sequences.append((prompt_ids + list(result.token_ids), len(prompt_ids)))
    want = [teacher_forced_top1(lm, s, n) for s, n in sequences]
    text = default_text("heldout")
    base = evaluate(lm, text, max_tokens=args.perplexity_tokens).perplexity
    print("\n| cache | layers in bf16 | bytes/token | tokens vs bf16 cache | top-1 agreement | perplexity |")
    print("|---|---|---:|---:|---:|---:|")
    print(f"| bf16 | all | {bf16_bytes} | 1.00x | 100% | {base:.4f} |", flush=True)
    for config in args.config:
        fmt, _, spec = config.partition(":")
        if fmt not in FORMATS:
            parser.error(f"--config {config!r}: the format must be one of {', '.join(FORMATS)}")
        value = parse_kv_skip_layers(spec or "auto", "--config")
        layers = kept[fmt] if value == "auto" else [] if value == "none" else sorted(kv_cache.layer_ids(value))
        configure(fmt, layers)
        started = time.monotonic()
        same = sum(int((teacher_forced_top1(lm, s, n) == w).sum()) for (s, n), w in zip(sequences, want))
        total = sum(len(w) for w in want)
        ppl = evaluate(lm, text, max_tokens=args.perplexity_tokens).perplexity
        label = f"{','.join(map(str, layers)) or 'none'}" + (" (the rule)" if value == "auto" else "")
        print(f"| {fmt} | {label} | {lm.kv_bytes_per_token} | {bf16_bytes / lm.kv_bytes_per_token:.2f}x | "
              f"{same / total:.2%} ({same}/{total}) | {ppl:.4f} ({ppl / base - 1:+.2%}) |  <!-- "
              f"{time.monotonic() - started:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
