"""What a checkpoint declares about its KV cache, and the fp8 scales it ships for it.

Two declarations are read:

- compressed-tensors (llmcompressor): `quantization_config.kv_cache_scheme`, e.g. {"type": "float",
  "num_bits": 8, "strategy": "tensor", "dynamic": false, "symmetric": true}: an fp8 e4m3 cache with
  one static scale per layer ("tensor") or per KV head ("attn_head"), stored as
  `{attention}.k_scale` / `{attention}.v_scale` (older exports: `{attention}.k_proj.output_scale`
  / `{attention}.v_proj.output_scale`);
- ModelOpt: `kv_cache_quant_algo` = "FP8" (in config.json's quantization_config or in
  hf_quant_config.json's "quantization"), scales `{attention}.k_proj.k_scale` /
  `{attention}.v_proj.v_scale`.

Any other way of declaring a quantized KV cache (another algorithm, integer or dynamic schemes,
other tools' keys such as AMD Quark's `kv_cache_group`) is refused by name rather than served as
if it were not there. A scale s means the cache holds fp8(x / s) (kernels/kv_fp8.py), which is
what both tools calibrate. `load_kv_scales` reads one layer's, cut to the KV heads of this rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from text_generation_server.quantizers.checkpoint import read_json
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights

E4M3 = "fp8_e4m3fn"
E5M2 = "fp8_e5m2"
# compressed-tensors strategies: one scale per layer, or one per KV head.
CT_STRATEGIES = {"tensor": False, "attn_head": True}
# Keys other tools use to declare a quantized KV cache; a non-empty value is refused by name.
FOREIGN_KEYS = ("kv_cache_group", "kv_cache_config", "kv_cache_dtype", "kv_cache_quant_config", "kv_quant")


@dataclass(frozen=True)
class KvCacheDeclaration:
    """A checkpoint's KV cache quantization: the fp8 format, where it was declared, the names
    its scales are stored under (each a pair of suffixes of the attention module's prefix, tried
    in order), and whether they are per KV head."""

    dtype: str
    source: str
    scale_names: tuple[tuple[str, str], ...]
    per_head: bool = False

    def describe(self) -> str:
        return f"{self.dtype} with {'per-head' if self.per_head else 'per-layer'} k/v scales (from {self.source})"


def _refuse(where: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: {what}; this server reads compressed-tensors' kv_cache_scheme (static fp8, per "
                           "tensor or attn_head) and ModelOpt's kv_cache_quant_algo FP8")


def _compressed_tensors(scheme: object, where: str) -> KvCacheDeclaration:
    if not isinstance(scheme, dict):
        raise _refuse(where, f"must be an object, got {scheme!r}")
    kind, bits = scheme.get("type", "int"), scheme.get("num_bits")
    if kind != "float" or bits != 8:
        raise _refuse(where, f"type {kind!r} with num_bits {bits!r} is not an fp8 KV cache (only float, 8 bits is)")
    if scheme.get("dynamic", False):
        raise _refuse(where, "dynamic KV scales are not supported (the scales must be calibrated and stored)")
    if not scheme.get("symmetric", True):
        raise _refuse(where, "an asymmetric (zero-point) KV cache is not supported")
    strategy = scheme.get("strategy", "tensor")
    if strategy not in CT_STRATEGIES:
        raise _refuse(where, f"strategy {strategy!r} is not supported (tensor or attn_head)")
    return KvCacheDeclaration(E4M3, where, (("k_scale", "v_scale"), ("k_proj.output_scale", "v_proj.output_scale")),
                              per_head=CT_STRATEGIES[strategy])


def _modelopt(algo: object, where: str) -> KvCacheDeclaration | None:
    if algo is None:
        return None
    if not isinstance(algo, str) or algo.upper() != "FP8":
        raise _refuse(where, f"kv_cache_quant_algo {algo!r} is not supported (FP8 is)")
    return KvCacheDeclaration(E4M3, where, (("k_proj.k_scale", "v_proj.v_scale"), ("k_scale", "v_scale")))


def _from_section(section: dict, where: str) -> KvCacheDeclaration | None:
    for key in FOREIGN_KEYS:
        if section.get(key):
            raise _refuse(f"{where}.{key}", f"{key} = {section[key]!r} declares a KV cache this server does not read")
    if section.get("kv_cache_scheme") is not None:
        return _compressed_tensors(section["kv_cache_scheme"], f"{where}.kv_cache_scheme")
    if "kv_cache_quant_algo" in section:
        return _modelopt(section["kv_cache_quant_algo"], f"{where}.kv_cache_quant_algo")
    return None


def read_kv_cache_declaration(folder: str | Path) -> KvCacheDeclaration | None:
    """The checkpoint's KV cache declaration; None where it declares none (a 16-bit cache)."""
    folder = Path(folder)
    found = []
    config = read_json(folder / "config.json", required=False) or {}
    section = config.get("quantization_config")
    if isinstance(section, dict):
        found.append(_from_section(section, f"{folder / 'config.json'}: quantization_config"))
    modelopt = read_json(folder / "hf_quant_config.json", required=False)
    if isinstance(modelopt, dict) and isinstance(modelopt.get("quantization"), dict):
        found.append(_from_section(modelopt["quantization"], f"{folder / 'hf_quant_config.json'}: quantization"))
    found = [d for d in found if d is not None]
    if len(found) > 1 and found[0].dtype != found[1].dtype:
        raise CheckpointError(f"{found[0].source} and {found[1].source} declare different KV caches")
    return found[0] if found else None


def _scale(weights: Weights, name: str, kv_heads: int, heads: list[int], per_head: bool) -> torch.Tensor:
    tensor = weights.get_tensor(name, to_dtype=False).float().reshape(-1).cpu()
    if tensor.numel() == 1:
        tensor = tensor.expand(len(heads))
    elif tensor.numel() == kv_heads and (per_head or kv_heads == 1):
        tensor = tensor[heads]
    else:
        expected = f"1 or {kv_heads} (one per KV head)" if per_head else "1 (one per layer)"
        raise CheckpointError(f"'{name}' has {tensor.numel()} values, expected {expected} "
                              f"(in {weights.files_of(name)})")
    values = tensor.tolist()
    if not all(math.isfinite(v) and v > 0 for v in values):
        raise CheckpointError(f"'{name}' holds a scale that is not a positive finite number: {values} "
                              f"(in {weights.files_of(name)})")
    return tensor.contiguous().to(weights.device)


def load_kv_scales(weights: Weights, declaration: KvCacheDeclaration, prefix: str, kv_heads: int,
                   heads: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(key, value) scales, float32 [len(heads)], of the attention module at `prefix`: for this
    rank's KV heads `heads` (indices among the layer's `kv_heads`). A per-layer scale serves
    every head; a missing one fails naming the tensors looked for."""
    for key_name, value_name in declaration.scale_names:
        key, value = f"{prefix}.{key_name}", f"{prefix}.{value_name}"
        if weights.has_tensor(key) and weights.has_tensor(value):
            return (_scale(weights, key, kv_heads, heads, declaration.per_head),
                    _scale(weights, value, kv_heads, heads, declaration.per_head))
    tried = ", ".join(f"{prefix}.{k} and {prefix}.{v}" for k, v in declaration.scale_names)
    raise CheckpointError(f"{declaration.source} declares an fp8 KV cache but the checkpoint has no scales for "
                          f"'{prefix}' (looked for {tried})")
