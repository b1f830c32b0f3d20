"""Test-side builders: small random checkpoints and tokenizers, written to disk.

transformers is used here (test time only) to create reference models and to
save them in the exact Hugging Face layout our loader reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SAMPLE_TEXT = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Ünïcödé: 日本語 テキスト 😀 — ok.",
    "import os\nimport sys\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n",
]


def build_tokenizer(vocab_size: int = 300) -> Tokenizer:
    """A byte-level BPE tokenizer with <|endoftext|> as id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(SAMPLE_TEXT * 20, trainer=trainer)
    return tok


ARCH_CONFIGS = {
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    "llama3_rope": dict(
        model_type="llama",
        num_attention_heads=6,
        num_key_value_heads=2,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        rope_theta=500000.0,
    ),
    "llama_linear_rope_tied": dict(
        model_type="llama", num_attention_heads=3, num_key_value_heads=3,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, tie_word_embeddings=True,
    ),
    "mistral_window": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=1, sliding_window=7),
    "qwen2_bias": dict(model_type="qwen2", num_attention_heads=6, num_key_value_heads=3),
    "phi3_fused": dict(model_type="phi3", num_attention_heads=4, num_key_value_heads=2),
}


def hf_config(name: str, vocab_size: int, **overrides):
    import transformers

    spec = dict(ARCH_CONFIGS[name])
    model_type = spec.pop("model_type")
    base = dict(
        vocab_size=vocab_size, hidden_size=48, intermediate_size=88, num_hidden_layers=2,
        max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        eos_token_id=0, bos_token_id=0, pad_token_id=0,
    )
    base.update(spec)
    base.update(overrides)
    if model_type == "phi3":
        base.setdefault("sliding_window", None)
    cls = transformers.AutoConfig.for_model(model_type, **base)
    return cls


def write_checkpoint(folder: Path, name: str = "llama", seed: int = 0, dtype=torch.float32, **overrides):
    """Writes a random model of architecture `name` and a tokenizer; returns the HF model."""
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    config = hf_config(name, tokenizer.get_vocab_size(), **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init is small; widen weights so tests see real differences between positions.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model = model.to(dtype).eval()
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    return model
