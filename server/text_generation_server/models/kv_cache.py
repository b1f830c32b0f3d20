"""`--kv-cache-dtype`: which dtype the paged KV cache holds, and each layer's fp8 scales.

auto keeps what the checkpoint declares for its KV cache (quantizers/kv_cache.py), else the
model's dtype; an fp8 flag on a checkpoint that declares nothing runs with scales of 1.0 (said at
startup: values beyond the format's range saturate), and a flag that contradicts the declaration
is refused naming both. Scales are read for each attention module that says where its tensors
live (`kv_prefix`) and which KV heads this rank holds (`kv_head_ids`), so tensor parallel ranks
each keep their heads' scales.

`--kv-cache-fp8-skip-layers` keeps some layers of an fp8 cache in the model's dtype (their scales
become None; layers/attention.py sizes and allocates each layer in its own dtype). auto measures
it at load: one prefill of a probe text records every layer's keys and values as the cache would
store them, and a layer stays unquantized where fp8's rounding (with the layer's scales) is large
against the token-dependent part of what it stores (`rounding_ratios`). fp8's step is relative to
a number's magnitude, so a channel that sits at a large near-constant value (Qwen2.5's bias-driven
keys at -354 +- 1.7 in layers 0-1) loses all of its token-to-token variation; that variation, not
the constant, is what attention reads (a constant key channel shifts every score of a query alike).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from loguru import logger

from text_generation_server.kernels.kv_fp8 import FP8_KV_DTYPES, KVScales
from text_generation_server.layers.attention import AttentionMetadata, KVCache, KVLayout
from text_generation_server.quantizers.dist import ProcessGroup
from text_generation_server.quantizers.factory import read_kv_cache_declaration
from text_generation_server.quantizers.kv_cache import KvCacheDeclaration, load_kv_scales
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights
from text_generation_server.settings.serve_args import parse_kv_cache_dtype, parse_kv_skip_layers


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


# auto: a layer stays unquantized where fp8's rounding error is more than this many times the
# format's unit roundoff (e4m3: 2^-4, e5m2: 2^-3; `unit_roundoff`) relative to the token-dependent
# spread of its keys or values (root mean squares over a KV head's tokens and channels, the worst
# head). Numbers without a large common offset round within one unit roundoff of themselves, so an
# ordinary layer measures under 1 (Qwen2.5-1.5B: 0.6-0.9 in both formats); over 2 means an offset
# shared by every token is taking the precision the token-to-token differences need (Qwen2.5-1.5B:
# layers 0, 1, 7, 15 at 21, 3.0, 2.3, 3.0 in e4m3; BENCHMARKS.md "fp8 KV cache: per-layer dtypes").
ROUNDING_THRESHOLD = 2.0
# What the probe prefill reads: prose, code and numbers, so that every kind of token a server sees
# moves the keys; its first PROBE_TOKENS tokens are used.
PROBE_TEXT = (
    "The cache keeps the keys and values of every token a request has seen, so a long conversation "
    "costs memory in proportion to its length. On the 14th of March, 2023, about 1,250 people answered "
    "the survey; 62% of them said the report was clear.\n\n"
    "def merge(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:\n"
    "    out = []\n    for start, end in sorted(intervals):\n"
    "        if out and start <= out[-1][1]:\n            out[-1] = (out[-1][0], max(out[-1][1], end))\n"
    "        else:\n            out.append((start, end))\n    return out\n\n"
    "SELECT name, COUNT(*) AS n FROM orders WHERE total > 100 GROUP BY name ORDER BY n DESC;\n"
    "Der Zug nach Berlin fährt um 9:45 Uhr ab. Le train part à l'heure. 東京は日本の首都です。\n"
    "Q: What is 17 * 24? A: 408. Q: Which planet is largest? A: Jupiter.\n"
)
PROBE_TOKENS = 256


class _RecordingCache(KVCache):
    """A cache in the model's dtype that keeps what each layer stores (the probe's tokens)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stored: dict[int, list[torch.Tensor]] = {}

    def store(self, layer, slots, key, value):
        self.stored[layer] = [key.detach().float(), value.detach().float()]
        super().store(layer, slots, key, value)

    def store_latent(self, layer, slots, latent):
        self.stored[layer] = [latent.detach().float().unsqueeze(1)]
        super().store_latent(layer, slots, latent)


def rounding_ratio(x: torch.Tensor, scales: KVScales, which: str) -> float:
    """x [tokens, heads, dim] (float32): the largest over heads of rms(fp8 round trip - x) /
    rms(x - its mean over tokens); inf where a head stores the same numbers for every token and
    rounding changes them."""
    error = scales.dequantize(scales.quantize(x, which), which, torch.float32) - x
    spread = x - x.mean(dim=0, keepdim=True)
    num = error.square().sum(dim=(0, 2))
    den = spread.square().sum(dim=(0, 2))
    ratio = torch.where(den > 0, (num / den.clamp_min(1e-30)).sqrt(),
                        torch.where(num > 0, torch.inf, 0.0))
    return float(ratio.max())


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next number: the largest relative rounding error in range."""
    return float(torch.finfo(dtype).eps) / 2


def rounding_ratios(stored: dict[int, list[torch.Tensor]], scales: Sequence[KVScales | None],
                    num_layers: int) -> list[float]:
    """Each layer's `rounding_ratio` in units of its format's `unit_roundoff`, keys and values the
    worse of the two (a latent: its keys); nan for a layer the probe did not see store anything."""
    out = []
    for layer in range(num_layers):
        tensors, layer_scales = stored.get(layer), scales[layer]
        if tensors is None or layer_scales is None:
            out.append(float("nan"))
            continue
        worst = max(rounding_ratio(t, layer_scales, which) for t, which in zip(tensors, ("key", "value")))
        out.append(worst / unit_roundoff(layer_scales.dtype))
    return out


@torch.inference_mode()
def probe_ratios(net: torch.nn.Module, token_ids: list[int], layout: KVLayout, scales: Sequence[KVScales | None],
                 dtype: torch.dtype, device: torch.device, process_group: ProcessGroup) -> list[float]:
    """`rounding_ratios` of one prefill of `token_ids` (the worst over tensor parallel ranks, whose
    heads differ, so that every rank keeps the same layers)."""
    block_size = 16
    blocks = -(-len(token_ids) // block_size)
    cache = _RecordingCache(layout.num_layers, blocks, block_size, layout.kv_heads, layout.head_dim, dtype, device,
                            latent=layout.latent)
    n = len(token_ids)
    meta = AttentionMetadata(is_prefill=True, slots=torch.arange(n, device=device), prefill_lens=[n],
                             block_tables=torch.arange(blocks, device=device).unsqueeze(0))
    net(torch.tensor(token_ids, device=device), torch.arange(n, device=device), cache, meta,
        logits_indices=torch.tensor([n - 1], device=device))
    ratios = torch.tensor(rounding_ratios(cache.stored, scales, layout.num_layers), dtype=torch.float32,
                          device=device)
    gathered = process_group.all_gather_last_dim(ratios.unsqueeze(-1).nan_to_num(nan=-1.0))
    return [float("nan") if r < 0 else r for r in gathered.amax(dim=-1).tolist()]


def skip_layers(flag: str | None, net: torch.nn.Module, tokenizer, layout: KVLayout, scales: list[KVScales],
                dtype: torch.dtype, device: torch.device, process_group: ProcessGroup,
                log: bool) -> list[KVScales | None]:
    """`scales` with None for the layers the fp8 cache keeps in `dtype` (the model's):
    `--kv-cache-fp8-skip-layers` auto (measured, `probe_ratios`), none, or a list of layer ids."""
    value = parse_kv_skip_layers(flag or "auto", "--kv-cache-fp8-skip-layers")
    kind = str(scales[0].dtype).removeprefix("torch.") if scales else "fp8"
    if value == "none":
        if log:
            logger.info("KV cache {}: every layer in fp8 (--kv-cache-fp8-skip-layers none)", kind)
        return list(scales)
    if value != "auto":
        layers = layer_ids(value)
        beyond = [i for i in layers if i >= layout.num_layers]
        if beyond:
            raise ValueError(f"--kv-cache-fp8-skip-layers {value}: layers {beyond} do not exist (this model has "
                             f"{layout.num_layers}, 0-{layout.num_layers - 1})")
        if log:
            logger.info("KV cache {}: layers {} kept in {} (--kv-cache-fp8-skip-layers)", kind, value,
                        str(dtype).removeprefix("torch."))
        return [None if i in layers else s for i, s in enumerate(scales)]
    context = getattr(getattr(net, "config", None), "max_context", None) or PROBE_TOKENS
    ids = tokenizer.encode(PROBE_TEXT).ids[:min(PROBE_TOKENS, context)] if tokenizer is not None else []
    if len(ids) < 2:
        if log:
            logger.warning("KV cache {}: no probe text to measure the layers with (no tokenizer), every layer in "
                           "fp8", kind)
        return list(scales)
    ratios = probe_ratios(net, ids, layout, scales, dtype, device, process_group)
    kept = [i for i, r in enumerate(ratios) if r > ROUNDING_THRESHOLD]
    if log:
        measured = [r for r in ratios if r == r]
        if not measured:
            logger.warning("KV cache {}: the probe saw no layer store K/V (this model's implementation does not "
                           "go through the paged cache), every layer in fp8", kind)
        elif kept:
            rest = [r for i, r in enumerate(ratios) if i not in kept and r == r]
            logger.info("KV cache {}: layers {} kept in {}: fp8 rounding errs by {} x the format's unit roundoff "
                        "relative to what their keys/values vary by from token to token (threshold {:g}; the other "
                        "layers {:.2f}..{:.2f}); --kv-cache-fp8-skip-layers none or a list overrides", kind,
                        ",".join(map(str, kept)), str(dtype).removeprefix("torch."),
                        ", ".join(f"{ratios[i]:.1f}" for i in kept), ROUNDING_THRESHOLD,
                        min(rest, default=0.0), max(rest, default=0.0))
        else:
            logger.info("KV cache {}: every layer in fp8 (fp8 rounding errs by {:.2f}..{:.2f} x the format's unit "
                        "roundoff relative to what keys/values vary by from token to token, under the threshold "
                        "{:g})", kind, min(measured), max(measured), ROUNDING_THRESHOLD)
    return [None if i in kept else s for i, s in enumerate(scales)]


def layer_ids(value: str) -> set[int]:
    """The layer ids of a --kv-cache-fp8-skip-layers list (parse_kv_skip_layers's canonical form)."""
    out: set[int] = set()
    for part in value.split(","):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out
