"""From a checkpoint folder and `--quantize` to the `WeightsLoader` a model is built with.

`read_quantization_config(folder, quantize)` reads how a checkpoint was quantized;
`get_loader(config)` turns that into the `WeightsLoader` the model is built with.
Both look formats up in the two tables below, the only place method strings and config
types are mapped, and every loader `get_loader` returns is wrapped so that modules the
checkpoint left dense (modules_to_not_convert, compressed-tensors `ignore` and untargeted
modules) are loaded by the default loader through `Weights.use_loader`: model code asks
for a linear's weight by prefix and never learns which format, or which exception, it got.

This module sits above every format module (each imports config.py and weights.py, never
this), so the tables are complete whenever either function can be called.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from text_generation_server.quantizers import bitsandbytes, eetq, exl2, fp8, gguf, marlin
from text_generation_server.quantizers import kv_cache as kv_cache_format
from text_generation_server.quantizers.awq import AWQLoader
from text_generation_server.quantizers.checkpoint import read_json
from text_generation_server.quantizers.compressed_tensors import CompressedTensorsLoader
from text_generation_server.quantizers.config import (
    CONFIG_FILES,
    NOT_YET_SUPPORTED,
    AWQConfig,
    CompressedTensorsConfig,
    GPTQConfig,
    QuantizerConfig,
)
from text_generation_server.quantizers.gptq import GPTQLoader
from text_generation_server.quantizers.gguf_arch import open_source as open_gguf_source
from text_generation_server.quantizers.gguf_file import gguf_files
from text_generation_server.quantizers.sources import (
    CheckpointError,
    SafetensorsSource,
    TensorSource,
    safetensors_files,
)
from text_generation_server.quantizers.weights import DefaultWeightsLoader, Weights, WeightsLoader

# Formats in their own modules: each exports CONFIGS (method and flag names -> config type)
# and LOADERS (config type -> loader factory). A new format is added here and nowhere else.
_FORMAT_MODULES = (marlin, exl2, fp8, bitsandbytes, eetq, gguf)

# How each method's name (a checkpoint's quant_method, or a `--quantize` flag) maps to its
# config type: the one place method strings are looked up.
METHODS: dict[str, type[QuantizerConfig]] = {
    "gptq": GPTQConfig,
    "awq": AWQConfig,
    "compressed-tensors": CompressedTensorsConfig,
    **{name: config for module in _FORMAT_MODULES for name, config in module.CONFIGS.items()},
}

# Config type -> loader.
LOADERS: dict[type[QuantizerConfig], Callable[[QuantizerConfig], WeightsLoader]] = {
    GPTQConfig: GPTQLoader,
    AWQConfig: AWQLoader,
    CompressedTensorsConfig: CompressedTensorsLoader,
    **{config: loader for module in _FORMAT_MODULES for config, loader in module.LOADERS.items()},
}
_ALIASES = {"compressed_tensors": "compressed-tensors"}


def _checkpoint_method(data: dict, method: str) -> str:
    """GPTQ checkpoints in Marlin layout say quant_method gptq: their format key decides."""
    if method == "gptq" and (data.get("checkpoint_format") in ("marlin", "marlin_24")
                             or data.get("is_marlin_format") is True):
        return "marlin"
    return method


def method_of_flag(quantize: str) -> str:
    """Normalises `--quantize`, failing for methods we do not (yet) load."""
    name = _ALIASES.get(quantize.lower(), quantize.lower())
    if name in METHODS:
        return name
    if name in NOT_YET_SUPPORTED:
        raise ValueError(f"--quantize {quantize}: not yet supported (supported: {', '.join(METHODS)})")
    raise ValueError(f"--quantize {quantize}: unknown quantization method (supported: {', '.join(METHODS)})")


def _find_config(folder: Path) -> tuple[dict, str, str, str] | None:
    """(dict, file, key prefix, method) of the first quantization config in the folder."""
    for name in CONFIG_FILES:
        path = folder / name
        data = read_json(path, required=False)
        if data is None:
            continue
        prefix = ""
        if name == "config.json":
            data = data.get("quantization_config")
            if data is None:
                continue
            if not isinstance(data, dict):
                raise CheckpointError(f"{path}: 'quantization_config' must be an object")
            prefix = "quantization_config."
        method = data.get("quant_method")
        if method is None:
            # Older AutoGPTQ / AutoAWQ files do not name their method: their keys do.
            method = "awq" if ("w_bit" in data or "version" in data) else "gptq" if "bits" in data else None
        if not isinstance(method, str):
            raise CheckpointError(f"{path}: '{prefix}quant_method' is missing and the keys do not identify a method")
        return data, str(path), prefix, _checkpoint_method(data, method.lower())
    return None


def _legacy_weights(folder: Path) -> Weights | None:
    """The folder's tensors, if they carry legacy GPTQ parameters."""
    try:
        files = safetensors_files(folder)
    except CheckpointError:
        return None
    weights = Weights(SafetensorsSource(files), torch.device("cpu"), torch.float32)
    return weights if weights.has_tensor("gptq_bits") else None


def read_quantization_config(folder: str | Path, quantize: str | None) -> QuantizerConfig | None:
    """The checkpoint's quantization, checked against `--quantize`; None for a dense checkpoint."""
    folder = Path(folder)
    wanted = method_of_flag(quantize) if quantize is not None else None
    gguf_config = gguf.read_config(folder)
    if gguf_config is not None:
        if wanted not in (None, "gguf"):
            raise CheckpointError(f"--quantize {quantize}: {folder} is a GGUF model, whose tensors keep their own "
                                  "llama.cpp types; serve it without --quantize, or `quantize` it first")
        return gguf_config
    found = _find_config(folder)
    if found is None:
        legacy = _legacy_weights(folder) if wanted in (None, "gptq") else None
        if legacy is not None:
            return GPTQConfig.from_tensors(legacy)
        if wanted is not None and METHODS[wanted].on_load:
            return METHODS[wanted].for_dense_checkpoint(quantize, folder)
        if wanted is not None:
            raise CheckpointError(
                f"--quantize {quantize}: {folder} is not a quantized checkpoint (no 'quantization_config' in "
                f"config.json, no quantize_config.json or quant_config.json, no gptq_bits tensor)"
            )
        return None
    data, path, prefix, method = found
    if method not in METHODS:
        known = "not yet supported" if method in NOT_YET_SUPPORTED else "unknown"
        raise CheckpointError(f"{path}: '{prefix}quant_method' = '{method}' is {known} "
                              f"(supported: {', '.join(METHODS)})")
    # Parsed before the flag is compared: whether a flag of another type still fits can depend on
    # the config's content (compressed-tensors is fp8 only when every scheme is float-quantized).
    config = METHODS[method].from_config(data, path, prefix)
    if wanted is not None:
        if METHODS[wanted] is type(config):
            config.check_flag(quantize)
        elif not config.accepts_flag(wanted):
            declared = data.get("quant_method")
            says = (f"says '{prefix}quant_method' = '{declared}' ({config.describe()})" if declared is not None
                    else f"names no '{prefix}quant_method'; its keys describe {config.describe()}")
            raise CheckpointError(f"--quantize {quantize} disagrees with the checkpoint: {path} {says}")
    legacy = _legacy_weights(folder)
    if legacy is not None:
        config.check_tensors(legacy)
    return config


def tensor_source(path: str | Path) -> TensorSource:
    """Where a model's tensors come from: its GGUF file(s), else its safetensors files."""
    files = gguf_files(Path(path))
    if files is not None:
        return open_gguf_source(files)
    return SafetensorsSource(safetensors_files(Path(path)))


class SelectiveLoader(WeightsLoader):
    """The format's loader for quantized modules, the default loader for the ones left dense.

    Whether a module is quantized is the config's answer (`config.quantizes(prefix)`);
    dense modules are loaded inside `weights.use_loader(dense)`, the same hook model
    code uses for an unquantized head, so both paths share one mechanism.
    """

    def __init__(self, config: QuantizerConfig, quantized: WeightsLoader, dense: WeightsLoader | None = None):
        self.config = config
        self.quantized = quantized
        self.dense = dense or DefaultWeightsLoader()

    def describe(self) -> str:
        return self.quantized.describe()

    def _is_dense(self, prefixes: list[str]) -> bool:
        dense = [not self.config.quantizes(p) for p in prefixes]
        if any(dense) and not all(dense):
            listed = [p for p, d in zip(prefixes, dense) if d]
            others = [p for p, d in zip(prefixes, dense) if not d]
            raise CheckpointError(
                f"{', '.join(listed)} left unquantized but {', '.join(others)} quantized ({self.config.source}): "
                "layers fused into one matmul must be quantized alike"
            )
        return all(dense)

    def get_weights(self, weights: Weights, prefix: str):
        if self._is_dense([prefix]):
            with weights.use_loader(self.dense):
                return weights.get_weights(prefix)
        return self.quantized.get_weights(weights, prefix)

    def get_weights_col_packed(self, weights: Weights, prefix: str, block_sizes: int | list[int]):
        if self._is_dense([prefix]):
            with weights.use_loader(self.dense):
                return weights.get_weights_col_packed(prefix, block_sizes)
        return self.quantized.get_weights_col_packed(weights, prefix, block_sizes)

    def get_weights_col(self, weights: Weights, prefix: str):
        if self._is_dense([prefix]):
            with weights.use_loader(self.dense):
                return weights.get_weights_col(prefix)
        return self.quantized.get_weights_col(weights, prefix)

    def get_multi_weights_col(self, weights: Weights, prefixes: list[str], dim: int):
        if self._is_dense(prefixes):
            with weights.use_loader(self.dense):
                return weights.get_multi_weights_col(prefixes, dim)
        return self.quantized.get_multi_weights_col(weights, prefixes, dim)

    def get_weights_row(self, weights: Weights, prefix: str):
        if self._is_dense([prefix]):
            with weights.use_loader(self.dense):
                return weights.get_weights_row(prefix)
        return self.quantized.get_weights_row(weights, prefix)


def get_loader(config: QuantizerConfig | None) -> WeightsLoader:
    """The loader for a checkpoint quantized as `config` (None: a dense checkpoint)."""
    if config is None:
        return DefaultWeightsLoader()
    factory = LOADERS.get(type(config))
    if factory is None:
        raise ValueError(f"no loader is registered for {type(config).__name__}")
    return SelectiveLoader(config, factory(config))


def read_kv_cache_declaration(folder: str | Path) -> kv_cache_format.KvCacheDeclaration | None:
    """How the checkpoint quantized its KV cache (quantizers/kv_cache.py), beside its weights'
    format: None where it declares nothing; other tools' declarations refused by name."""
    return kv_cache_format.read_kv_cache_declaration(folder)
