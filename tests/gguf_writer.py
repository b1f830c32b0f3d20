"""Tiny GGUF files for tests, written with the gguf package.

The package quantizes the legacy formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) itself but not the
K-quants: their blocks are written here from random codes and scales (random bytes, with every
float16 field replaced by a small finite value), which also exercises every code and scale value.
Weights are stored with llama.cpp's q/k row permutation for the llama architecture, as
convert_hf_to_gguf.py writes them; the byte-level BPE tokenizer is gpt2-style.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

T = gguf.GGMLQuantizationType
# byte offsets of the float16 fields in each K-quant block
_K_HALVES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
_K_SCALE = {T.Q2_K: 3e-3, T.Q3_K: 5e-4, T.Q4_K: 1e-4, T.Q5_K: 5e-5, T.Q6_K: 2e-5}

DIMS = dict(hidden=256, intermediate=768, heads=4, kv_heads=2, layers=2)
# transformers reads no head_dim from a qwen3 GGUF and takes Qwen3Config's default, 128.
ARCH_DIMS = {"qwen3": dict(heads=2, kv_heads=1)}


def byte_tokens() -> list[str]:
    """GPT-2's 256 byte symbols, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


MERGES = ["Ġ t", "h e", "i n", "Ġt he", "r e", "o n", "e r", "Ġ a"]


def vocabulary(size: int = 0) -> tuple[list[str], list[int]]:
    """Byte tokens, a few merges and three control tokens, padded with unused ones up to `size`;
    eos is always the third token from the end."""
    tokens = byte_tokens() + ["".join(m.split()) for m in MERGES]
    tokens += [f"<unused{i}>" for i in range(max(0, size - len(tokens) - 3))]
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 3) + [3, 3, 3]
    return tokens, types


# Phi3Config's default pad_token_id (32000) must be inside the vocabulary for transformers to build it.
ARCH_VOCAB = {"phi3": 32064}


def k_quant_bytes(rng: np.random.Generator, qtype, rows: int, cols: int) -> np.ndarray:
    """Random blocks of a K-quant: [rows, bytes per row] uint8."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for at in _K_HALVES[qtype]:
        half = rng.uniform(0.2, 1.0, size=(rows, cols // block)) * _K_SCALE[qtype]
        blocks[..., at:at + 2] = np.frombuffer(half.astype(np.float16).tobytes(), np.uint8).reshape(rows, -1, 2)
    return blocks.reshape(rows, -1)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k layout (convert_hf_to_gguf.py's permute): rotary halves interleaved per head."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_weights(rng: np.random.Generator, arch: str, vocab: int) -> dict[str, np.ndarray]:
    """Hugging Face-named float32 tensors of a tiny model (q/k not yet permuted)."""
    d = {**DIMS, **ARCH_DIMS.get(arch, {})}
    h, i = d["hidden"], d["intermediate"]
    head_dim = h // d["heads"]
    out: dict[str, np.ndarray] = {"model.embed_tokens.weight": rng.normal(0, 0.5, (vocab, h)),
                                  "model.norm.weight": 1 + rng.normal(0, 0.1, h)}
    for layer in range(d["layers"]):
        p = f"model.layers.{layer}."
        out[p + "input_layernorm.weight"] = 1 + rng.normal(0, 0.1, h)
        out[p + "post_attention_layernorm.weight"] = 1 + rng.normal(0, 0.1, h)
        out[p + "self_attn.q_proj.weight"] = rng.normal(0, 0.06, (d["heads"] * head_dim, h))
        out[p + "self_attn.k_proj.weight"] = rng.normal(0, 0.06, (d["kv_heads"] * head_dim, h))
        out[p + "self_attn.v_proj.weight"] = rng.normal(0, 0.06, (d["kv_heads"] * head_dim, h))
        out[p + "self_attn.o_proj.weight"] = rng.normal(0, 0.06, (h, d["heads"] * head_dim))
        out[p + "mlp.gate_proj.weight"] = rng.normal(0, 0.06, (i, h))
        out[p + "mlp.up_proj.weight"] = rng.normal(0, 0.06, (i, h))
        out[p + "mlp.down_proj.weight"] = rng.normal(0, 0.04, (h, i))
        if arch == "qwen2":
            for n in ("q", "k", "v"):
                rows = out[p + f"self_attn.{n}_proj.weight"].shape[0]
                out[p + f"self_attn.{n}_proj.bias"] = rng.normal(0, 0.1, rows)
        if arch == "gemma3":
            out[p + "pre_feedforward_layernorm.weight"] = 1 + rng.normal(0, 0.1, h)
            out[p + "post_feedforward_layernorm.weight"] = 1 + rng.normal(0, 0.1, h)
        if arch in ("qwen3", "gemma3"):
            out[p + "self_attn.q_norm.weight"] = 1 + rng.normal(0, 0.1, head_dim)
            out[p + "self_attn.k_norm.weight"] = 1 + rng.normal(0, 0.1, head_dim)
    return {k: v.astype(np.float32) for k, v in out.items()}


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


_ARCH_NAMES = {"gemma3": {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                          "post_feedforward_layernorm": "post_ffw_norm"},
               "phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}}


def fuse_phi3(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Phi-3 stores q, k, v as one qkv_proj and gate, up as one gate_up_proj."""
    out = {}
    for name, w in weights.items():
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        if ".q_proj." in name:
            name, w = name.replace("q_proj", "qkv_proj"), np.concatenate(
                [w, weights[name.replace("q_proj", "k_proj")], weights[name.replace("q_proj", "v_proj")]])
        elif ".gate_proj." in name:
            name, w = name.replace("gate_proj", "gate_up_proj"), np.concatenate(
                [w, weights[name.replace("gate_proj", "up_proj")]])
        out[name] = w
    return out


def gguf_name(hf: str, arch: str = "qwen2") -> str:
    if hf.startswith("model.layers."):
        _, _, layer, rest = hf.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{_ARCH_NAMES.get(arch, {}).get(module) or _GGUF_NAMES[module]}.{kind}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf]


def write_gguf(path: Path, arch: str = "qwen2", qtype=T.Q8_0, seed: int = 0, v_type=None, tied: bool = True,
               name: str = "tiny", split_max_tensors: int = 0, rope_scaling: tuple[str, float] | None = None,
               chat_template: str | None = None, head_type=None, embedding_type=None) -> Path:
    """A tiny model: every linear in `qtype` (attn_v in `v_type` when given, as Q4_K_M files do),
    norms and biases F32, the embedding F16 (or `embedding_type`; an untied head F16, or `head_type`). With `split_max_tensors`, split files (the writer names
    them path-0000i-of-0000n.gguf); the first is returned."""
    rng = np.random.default_rng(seed)
    tokens, types = vocabulary(ARCH_VOCAB.get(arch, 0))
    d = {**DIMS, **ARCH_DIMS.get(arch, {})}
    head_dim = d["hidden"] // d["heads"]
    weights = random_weights(rng, arch, len(tokens))
    if not tied:
        weights["lm_head.weight"] = rng.normal(0, 0.5, (len(tokens), d["hidden"])).astype(np.float32)
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    writer.add_name(name)
    writer.add_context_length(512)
    writer.add_embedding_length(d["hidden"])
    writer.add_block_count(d["layers"])
    writer.add_feed_forward_length(d["intermediate"])
    writer.add_head_count(d["heads"])
    writer.add_head_count_kv(d["kv_heads"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch in ("llama", "qwen3", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(MERGES)
    writer.add_eos_token_id(len(tokens) - 3)
    writer.add_bos_token_id(len(tokens) - 3)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        writer.add_rope_scaling_factor(rope_scaling[1])
        writer.add_rope_scaling_orig_ctx_len(128)
    if arch == "gemma3":
        writer.add_sliding_window(64)
    if arch == "phi3":
        weights = fuse_phi3(weights)
    for hf, w in weights.items():
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            w = _permute(w, d["heads"] if ".q_proj." in hf else d["kv_heads"])
        if arch == "gemma3" and hf.endswith("norm.weight"):
            w = w + 1  # llama.cpp stores Gemma's 1 + w
        name_ = gguf_name(hf, arch)
        if w.ndim == 1:
            writer.add_tensor(name_, w)
        elif hf == "lm_head.weight" and head_type is not None:
            add_matrix(writer, name_, w, head_type, rng)
        elif hf == "model.embed_tokens.weight" and embedding_type is not None:
            add_matrix(writer, name_, w, embedding_type, rng)
        elif hf in ("model.embed_tokens.weight", "lm_head.weight"):
            writer.add_tensor(name_, w.astype(np.float16))
        else:
            t = v_type if (v_type is not None and ".v_proj." in hf) else qtype
            add_matrix(writer, name_, w, t, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    parts = sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))
    return parts[0] if split_max_tensors and parts else path


def add_matrix(writer, name: str, w: np.ndarray, qtype, rng: np.random.Generator) -> None:
    if qtype == T.F32:
        writer.add_tensor(name, w)
    elif qtype == T.F16:
        writer.add_tensor(name, w.astype(np.float16))
    elif qtype in _K_HALVES:
        raw = k_quant_bytes(rng, qtype, *w.shape)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    else:
        raw = gguf.quants.quantize(w, qtype)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
