"""From a GGUF's metadata to the checkpoint our families read: config, tensor names, tokenizer.

Read as transformers reads a GGUF (integrations/ggml.py's GGUF_CONFIG_MAPPING and
modeling_gguf_pytorch_utils.py): `{arch}.block_count` is num_hidden_layers, and so on; a llama
file whose general.name says mistral is a mistral; gemma3 is gemma3_text; tie_word_embeddings is
whether `output.weight` is absent; vocab_size falls back to the tokenizer's size. Where transformers
leaves a key to its config class's default (Qwen3's head_dim), the same default is written here.
Tensor names map as data (`_LAYER_NAMES`), llama's q/k rows are un-permuted and Gemma's norms
stored as 1 + w are read back as w, as transformers' tensor processors do.

Architectures outside `ARCHITECTURES` are refused by name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import torch
from loguru import logger
from tokenizers import Tokenizer

from text_generation_server.quantizers.checkpoint import Checkpoint
from text_generation_server.quantizers.gguf_cache import cached_tokenizer
from text_generation_server.quantizers.gguf_file import GGUFFile, GGUFSource, TensorView, open_gguf
from text_generation_server.quantizers.sources import CheckpointError

# GGUF general.architecture -> the model_type our families serve.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text", "phi3": "phi3"}

# {arch}.<key> -> config.json key, for every architecture above.
_COMMON_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_EXTRA_KEYS = {
    "llama": {"rope.dimension_count": "head_dim"},
    "gemma3": {"attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"},
    "qwen3": {"attention.key_length": "head_dim"},
}
# Config-class defaults transformers relies on for keys a GGUF does not store.
_DEFAULTS = {"qwen3": {"head_dim": 128}}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_ARCH_LAYER_NAMES = {
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
_TENSOR = re.compile(r"^(?:blk\.(?P<layer>\d+)\.)?(?P<base>[a-z0-9_]+)\.(?P<kind>weight|bias)$")


def _scalar(value, key: str, source: str):
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise CheckpointError(f"{source}: '{key}' differs per layer ({value}): not supported")
        return value[0]
    return value


def model_config(file: GGUFFile) -> tuple[str, dict]:
    """(GGUF architecture, config.json-style dict) of the file."""
    arch = file.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{file.name}: GGUF architecture '{arch}' is not supported "
                              f"(supported: {', '.join(ARCHITECTURES)})")
    model_type = ARCHITECTURES[arch]
    name = str(file.get("general.name", "")).lower()
    if arch == "llama" and "mistral" in name:
        model_type = "mistral"
    config: dict = {"model_type": model_type, "architectures": [f"from GGUF {arch}"]}
    config.update(_DEFAULTS.get(arch, {}))
    for key, target in {**_COMMON_KEYS, **_EXTRA_KEYS.get(arch, {})}.items():
        value = file.get(f"{arch}.{key}")
        if value is not None:
            config[target] = _scalar(value, f"{arch}.{key}", file.name)
    scaling = file.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling not in ("linear", "yarn"):
            raise CheckpointError(f"{file.name}: '{arch}.rope.scaling.type' = '{scaling}' is not supported "
                                  "(linear, yarn)")
        rope: dict = {"rope_type": scaling, "factor": float(file.get(f"{arch}.rope.scaling.factor", 1.0))}
        original = file.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            rope["original_max_position_embeddings"] = int(original)
        config["rope_scaling"] = rope
    for stored in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"):
        if stored in file.tensors:
            logger.warning("{}: tensor '{}' (per-frequency rope factors) is not applied, as transformers does not "
                           "apply it either: long contexts may differ from the original model", file.name, stored)
    config["tie_word_embeddings"] = "output.weight" not in file.tensors
    if "vocab_size" not in config:
        tokens = file.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise CheckpointError(f"{file.name}: no '{arch}.vocab_size' and no tokenizer.ggml.tokens to count")
        config["vocab_size"] = len(tokens)
    for key, target in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = file.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[target] = int(value)
    return arch, config


def _unpermute(heads: int) -> Callable[[int], torch.Tensor]:
    """HF row -> stored row for llama.cpp's q/k layout: stored rows are (head, pair, dim) where
    HF's are (head, half, dim) (transformers' _reverse_permute_weights)."""
    def order(rows: int) -> torch.Tensor:
        if rows % (2 * heads):
            raise CheckpointError(f"{rows} q/k rows do not split into {heads} heads of rotary pairs")
        dim = rows // heads // 2
        return torch.arange(rows).view(heads, dim, 2).transpose(1, 2).reshape(rows)
    return order


def tensor_views(file: GGUFFile, arch: str, config: dict) -> dict[str, TensorView]:
    """Every tensor our families read, by its Hugging Face name."""
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    views: dict[str, TensorView] = {}
    skipped = []
    for stored in file.tensors:
        match = _TENSOR.match(stored)
        if match is None:
            skipped.append(stored)
            continue
        base = names.get(match["base"]) if match["layer"] is not None else _GLOBAL_NAMES.get(match["base"])
        if not base:
            skipped.append(stored)
            continue
        prefix = f"model.layers.{match['layer']}.{base}" if match["layer"] is not None else base
        order = adjust = None
        if arch == "llama" and match["base"] in ("attn_q", "attn_k"):
            heads = config["num_attention_heads"] if match["base"] == "attn_q" else config.get(
                "num_key_value_heads", config["num_attention_heads"])
            order = _unpermute(int(heads))
        if arch == "gemma3" and match["base"].endswith("norm"):
            adjust = _minus_one
        views[f"{prefix}.{match['kind']}"] = TensorView(stored, order, adjust)
    if skipped:
        logger.info("{}: tensors not read: {}", file.name, ", ".join(skipped[:8]) + (" ..." if len(skipped) > 8 else ""))
    return views


def _minus_one(values: torch.Tensor) -> torch.Tensor:
    return values.float() - 1.0


def tokenizer(file: GGUFFile) -> tuple[Tokenizer, str | None]:
    """The file's tokenizer as transformers converts it (its optional extra), and its chat template:
    converted once per file and converter version, then read from the cache (gguf_cache.py)."""
    return cached_tokenizer(file, lambda: _convert_tokenizer(file))


def _convert_tokenizer(file: GGUFFile) -> tuple[Tokenizer, str | None]:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise CheckpointError(
            f"{file.name}: a GGUF's tokenizer is converted by transformers, which is not installed ({exc}); "
            "install the optional extra: pip install 'text-generation-server[transformers]'"
        ) from exc
    path = Path(file.files[0])
    try:
        converted = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers raises many types for a tokenizer it cannot convert
        raise CheckpointError(f"{file.name}: transformers cannot convert the GGUF tokenizer "
                              f"(tokenizer.ggml.model = {file.get('tokenizer.ggml.model')!r}): {exc}") from exc
    backend = getattr(converted, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise CheckpointError(f"{file.name}: transformers converted the GGUF tokenizer to {type(converted).__name__}, "
                              "which has no `tokenizers` backend")
    return backend, getattr(converted, "chat_template", None)


def eos_ids(file: GGUFFile, vocab: int) -> set[int]:
    """End-of-generation ids: eos, and llama.cpp's end-of-turn / end-of-message where present."""
    ids = set()
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = file.get(f"tokenizer.ggml.{key}")
        if value is not None:
            if not 0 <= int(value) < vocab:
                raise CheckpointError(f"{file.name}: tokenizer.ggml.{key} = {value} is outside the vocabulary "
                                      f"of {vocab} tokens")
            ids.add(int(value))
    return ids


def read_checkpoint(model_id: str, files: list[Path]) -> tuple[Checkpoint, GGUFFile]:
    """The non-weight parts of a GGUF model (folder: the first file), and the open file."""
    file = open_gguf(files)
    _, config = model_config(file)
    backend, _ = tokenizer(file)
    checkpoint = Checkpoint(model_id=model_id, folder=files[0], config=config, tokenizer=backend,
                            eos_token_ids=eos_ids(file, int(config["vocab_size"])))
    return checkpoint, file


def side_files(files: list[Path]) -> dict[str, str]:
    """The files a Hugging Face folder keeps beside its weights, made from the GGUF's metadata
    (what `convert` and `quantize` write): config.json, tokenizer.json, tokenizer_config.json,
    generation_config.json."""
    file = open_gguf(files)
    _, config = model_config(file)
    backend, template = tokenizer(file)
    vocab = int(config["vocab_size"])
    eos = sorted(eos_ids(file, vocab))
    tokens = file.get("tokenizer.ggml.tokens") or []
    names = {key: tokens[int(file.get(f"tokenizer.ggml.{key}_id"))] for key in ("bos_token", "eos_token")
             if file.get(f"tokenizer.ggml.{key}_id") is not None and int(file.get(f"tokenizer.ggml.{key}_id")) < len(tokens)}
    tokenizer_config = {**names, **({"chat_template": template} if template else {})}
    generation = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
    if "bos_token_id" in config:
        generation["bos_token_id"] = config["bos_token_id"]
    return {"config.json": json.dumps({**config, "torch_dtype": "float32"}, indent=2) + "\n",
            "tokenizer.json": backend.to_str(),
            "tokenizer_config.json": json.dumps(tokenizer_config, indent=2) + "\n",
            "generation_config.json": json.dumps(generation, indent=2) + "\n"}


def open_source(files: list[Path]) -> GGUFSource:
    """The file's tensors under Hugging Face names."""
    file = open_gguf(files)
    arch, config = model_config(file)
    return GGUFSource(file, tensor_views(file, arch, config))
