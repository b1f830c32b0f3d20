"""Quantized checkpoint formats: configs, the loader factory, and one loader per format.

`read_quantization_config(folder, quantize)` reads how a checkpoint was quantized;
`get_loader(config)` turns that into the `WeightsLoader` the model is built with.
The factory is one registry lookup keyed by config type, and every loader it
returns is wrapped so that modules the checkpoint left dense
(modules_to_not_convert, compressed-tensors `ignore` and untargeted modules) are
loaded by the default loader through `Weights.use_loader`: model code asks for a
linear's weight by prefix and never learns which format, or which exception, it got.
"""

from __future__ import annotations

from typing import Callable

from text_generation_server.quantizers.awq import AWQLoader, AWQWeight
from text_generation_server.quantizers.compressed_tensors import CompressedTensorsLoader, CompressedTensorsWeight
from text_generation_server.quantizers.config import (
    AWQConfig,
    CompressedTensorsConfig,
    GPTQConfig,
    QuantizerConfig,
    read_quantization_config,
)
from text_generation_server.quantizers import bitsandbytes, eetq, exl2, fp8, marlin
from text_generation_server.quantizers.config import METHODS
from text_generation_server.quantizers.gptq import GPTQLoader, GPTQWeight
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import DefaultWeightsLoader, Weights, WeightsLoader

__all__ = [
    "AWQConfig", "AWQLoader", "AWQWeight", "CompressedTensorsConfig", "CompressedTensorsLoader",
    "CompressedTensorsWeight", "GPTQConfig", "GPTQLoader", "GPTQWeight", "LOADERS", "QuantizerConfig",
    "SelectiveLoader", "get_loader", "read_quantization_config",
]

# Config type -> loader. A new format registers here and nowhere else.
LOADERS: dict[type[QuantizerConfig], Callable[[QuantizerConfig], WeightsLoader]] = {
    GPTQConfig: GPTQLoader,
    AWQConfig: AWQLoader,
    CompressedTensorsConfig: CompressedTensorsLoader,
}

# Formats in their own modules: each exports CONFIGS (method and flag names -> config type)
# and LOADERS (config type -> loader factory).
for _module in (marlin, exl2, fp8, bitsandbytes, eetq):
    METHODS.update(_module.CONFIGS)
    LOADERS.update(_module.LOADERS)


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
