"""`--kv-cache-dtype`: which dtype the paged KV cache holds, and each layer's fp8 scales.

auto keeps what the checkpoint declares for its KV cache (quantizers/kv_cache.py), else the
model's dtype; an fp8 flag on a checkpoint that declares nothing runs with scales of 1.0 (said at
startup: values beyond the format's range saturate), and a flag that contradicts the declaration
is refused naming both. Scales are read for each attention module that says where its tensors
live (`kv_prefix`) and which KV heads this rank holds (`kv_head_ids`), so tensor parallel ranks
each keep their heads' scales.
"""

from __future__ import annotations

import torch
from loguru import logger

from text_generation_server.kernels.kv_fp8 import FP8_KV_DTYPES, KVScales
from text_generation_server.layers.attention import KVLayout
from text_generation_server.quantizers.factory import read_kv_cache_declaration
from text_generation_server.quantizers.kv_cache import KvCacheDeclaration, load_kv_scales
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights
from text_generation_server.settings.serve_args import parse_kv_cache_dtype


def resolve_kv_cache_dtype(flag: str | None, declaration: KvCacheDeclaration | None,
                           model_dtype: torch.dtype) -> torch.dtype:
    """The cache's dtype for `--kv-cache-dtype flag` (any spelling the flag takes; None or auto:
    the checkpoint's declaration, else the model's dtype)."""
    if flag is not None:
        flag = parse_kv_cache_dtype(flag, "--kv-cache-dtype")
    if flag in (None, "auto"):
        return FP8_KV_DTYPES[declaration.dtype] if declaration is not None else model_dtype
    if declaration is not None and declaration.dtype != flag:
        raise CheckpointError(f"--kv-cache-dtype {flag} contradicts the checkpoint: {declaration.source} declares "
                              f"a {declaration.dtype} KV cache (leave the flag at auto, or give {declaration.dtype})")
    return FP8_KV_DTYPES[flag]


def attention_modules(net: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """layer id -> the module that stores that layer's K/V and says where its scales live."""
    found: dict[int, torch.nn.Module] = {}
    for module in net.modules():
        if getattr(module, "kv_prefix", None) is not None:
            found[module.layer_id] = module
    return found


def layer_scales(net: torch.nn.Module, weights: Weights, declaration: KvCacheDeclaration | None,
                 layout: KVLayout, kv_dtype: torch.dtype, device: torch.device, log: bool) -> list[KVScales]:
    """One KVScales per layer of `layout`: the checkpoint's where it declares them, else 1.0."""
    ones = KVScales.ones(kv_dtype, layout.kv_heads, device)
    if declaration is None:
        if log:
            logger.warning("KV cache {}: the checkpoint has no k/v scales, so every scale is 1.0 (keys and values "
                           "beyond +-{:g} saturate)", str(kv_dtype).removeprefix("torch."),
                           torch.finfo(kv_dtype).max)
        return [ones] * layout.num_layers
    modules = attention_modules(net)
    if not modules:
        raise CheckpointError(f"{declaration.source} declares calibrated KV scales, but this model's implementation "
                              "(transformers' modeling code) does not read them: serve it with a native family or "
                              "without the declaration")
    scales = []
    for layer in range(layout.num_layers):
        module = modules.get(layer)
        if module is None:
            scales.append(ones)
            continue
        heads = list(module.kv_head_ids)
        key, value = load_kv_scales(weights, declaration, module.kv_prefix, module.kv_heads_total, heads)
        if layout.latent:  # keys and values are the same latents: one scale serves both
            value = key
        scales.append(KVScales(kv_dtype, key, value, unit=bool((key == 1).all() and (value == 1).all())))
    if log:
        logger.info("KV cache {} with the checkpoint's scales ({}): key scales {:.4g}..{:.4g}, value scales "
                    "{:.4g}..{:.4g}", str(kv_dtype).removeprefix("torch."), declaration.describe(),
                    min(float(s.key.min()) for s in scales), max(float(s.key.max()) for s in scales),
                    min(float(s.value.min()) for s in scales), max(float(s.value.max()) for s in scales))
    return scales
