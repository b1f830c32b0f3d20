"""compressed-tensors checkpoints: pack-quantized (W4A16, W8A16 int codes packed along K)
and float-quantized (fp8 e4m3: FP8, FP8_DYNAMIC, FP8_BLOCK and weight-only W8A16 fp8).

Layout (specs/formats.md): weight_packed int32 [N, ceil(K/(32/b))], least
significant first along K, values stored as signed + 2^(b-1); weight_scale [N, G]
(G = 1 for the channel strategy); weight_zero_point, only when asymmetric, is
packed the same way but along N: int32 [ceil(N/(32/b)), G]; optional weight_g_idx
[K]; weight_shape [N, K]. Stored unsigned codes and zero points give
W = s * (q - z) directly; symmetric means z = 2^(b-1).

float-quantized: `weight` float8_e4m3fn [N, K], `weight_scale` [1] (tensor), [N, 1]
(channel) or [ceil(N/bn), ceil(K/bk)] (block, block_structure [bn, bk]), `input_scale` [1]
for static activations; an all-zero `weight_zero_point` may be stored. Those modules are
read by the fp8 loader (quantizers/fp8.py), with the group's input_activations: static
per-tensor (input_scale), or dynamic per token, per tensor or per token and group (FP8_BLOCK's
1x128). Every fp8 kernel computes that declared input quantization (on CPU by emulation), as
compressed-tensors does when the checkpoint's authors (and transformers) run it. A weight-only
group (input_activations null) keeps its inputs as they are, except on fp8-scaled-mm, whose
tensor cores need e4m3 inputs: there they get dynamic per-token scales.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from text_generation_server.kernels import packing
from text_generation_server.kernels.base import QuantizedWeight
from text_generation_server.kernels.select import build_linear
from text_generation_server.quantizers.config import CompressedTensorsConfig, WeightScheme
from text_generation_server.quantizers.fp8 import Fp8CheckpointLoader, Fp8LinearWeight, Fp8Scheme
from text_generation_server.quantizers.sharding import (
    check_g_idx,
    check_split,
    layer_kind,
    natural_g_idx,
    part_sizes,
    rank_rows,
    shard_packed,
    trim_groups,
)
from text_generation_server.quantizers.sources import CheckpointError
from text_generation_server.quantizers.weights import Weights, WeightsLoader


@dataclass
class CompressedTensorsWeight:
    """One rank's pack-quantized linear, still packed as the checkpoint stores it."""

    weight_packed: torch.Tensor  # int32 [N, ceil(K/pack)]
    weight_scale: torch.Tensor  # [N, G]
    weight_zero_point: torch.Tensor | None  # int32 [ceil(N/pack), G], None when symmetric
    g_idx: torch.Tensor  # int32 [K]
    in_features: int  # K (weight_packed may be padded past it)
    bits: int
    group_size: int  # -1 for the channel strategy
    prefix: str
    layer: str = ""
    act_dtype: torch.dtype = torch.float32
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        p, k, pack = self.prefix, self.in_features, 32 // self.bits
        if self.weight_packed.dtype != torch.int32 or self.weight_packed.dim() != 2:
            raise CheckpointError(f"tensor '{p}.weight_packed' must be 2-D int32, got "
                                  f"{self.weight_packed.dtype} {list(self.weight_packed.shape)}")
        n, words = self.weight_packed.shape
        if words != -(-k // pack):
            raise CheckpointError(f"tensor '{p}.weight_packed' has {words} words per row, but K = {k} at "
                                  f"{self.bits} bits needs {-(-k // pack)}")
        if self.weight_scale.dim() != 2 or self.weight_scale.shape[0] != n:
            raise CheckpointError(f"tensor '{p}.weight_scale' has shape {list(self.weight_scale.shape)}, "
                                  f"expected [{n}, groups] to match '{p}.weight_packed'")
        groups = self.weight_scale.shape[1]
        zp = self.weight_zero_point
        if zp is not None and (zp.dtype != torch.int32 or list(zp.shape) != [-(-n // pack), groups]):
            raise CheckpointError(f"tensor '{p}.weight_zero_point' has {zp.dtype} {list(zp.shape)}, expected "
                                  f"int32 [{-(-n // pack)}, {groups}] (packed along N)")
        if self.g_idx.shape != (k,):
            raise CheckpointError(f"tensor '{p}.weight_g_idx' has shape {list(self.g_idx.shape)}, expected [{k}]")
        check_g_idx(self.g_idx, groups, f"{p}.weight_g_idx", f"{p}.weight_scale")

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight_packed.shape[0], self.in_features

    def to_quantized(self) -> QuantizedWeight:
        n, k = self.shape
        codes = packing.unpack_pack_quantized(self.weight_packed, self.bits, k)  # uint8 [N, K]
        zeros = None
        if self.weight_zero_point is not None:
            # Packed along N: unpacking its transpose [G, N/pack] along the last dim gives [G, N].
            zeros = packing.unpack_pack_quantized(self.weight_zero_point.t(), self.bits, n).float()
        group_size = k if self.group_size == -1 else self.group_size
        return QuantizedWeight(qweight=codes.t().contiguous(), scales=self.weight_scale.t().float().contiguous(),
                               zeros=zeros, g_idx=self.g_idx, bits=self.bits, group_size=group_size)

    def get_linear(self, bias: torch.Tensor | None) -> torch.nn.Module:
        return build_linear(self.to_quantized(), bias, self.act_dtype, self.device_type, self.layer or self.prefix)


class CompressedTensorsLoader(WeightsLoader):
    """Column layers split N (zero points by whole words); row layers split the packed K words.

    Modules of a float-quantized group go to the fp8 loader with that group's layout.
    """

    def __init__(self, config: CompressedTensorsConfig):
        self.config = config
        self._fp8_loaders: dict[WeightScheme, Fp8CheckpointLoader] = {}

    def _fp8(self, scheme: WeightScheme) -> Fp8CheckpointLoader:
        if scheme not in self._fp8_loaders:
            self._fp8_loaders[scheme] = Fp8CheckpointLoader(Fp8Scheme(
                source=self.config.source, scale_name="weight_scale", strategy=scheme.strategy, block=scheme.block,
                activation=scheme.activations or "none", activation_group_size=scheme.activation_group_size,
                zero_point_name="weight_zero_point"))
        return self._fp8_loaders[scheme]

    def describe(self) -> str:
        return f"CompressedTensorsLoader({self.config.describe()})"

    def _scheme(self, prefix: str) -> WeightScheme:
        scheme = self.config.scheme_for(prefix)
        if scheme is None:
            raise CheckpointError(f"'{prefix}' is not targeted by any config group in {self.config.source}")
        return scheme

    def _check(self, weights: Weights, prefix: str, scheme: WeightScheme) -> tuple[int, int, int]:
        """(N, K, groups), with every tensor checked against the config."""
        for name in ("weight_packed", "weight_scale") + (() if scheme.symmetric else ("weight_zero_point",)):
            if not weights.has_tensor(f"{prefix}.{name}"):
                extra = " (the config group is asymmetric)" if name == "weight_zero_point" else ""
                raise CheckpointError(f"tensor '{prefix}.{name}' not found (in {weights.files_of(prefix)}){extra}")
        n, words = weights.get_shape(f"{prefix}.weight_packed")
        pack = 32 // scheme.bits
        k = words * pack
        if weights.has_tensor(f"{prefix}.weight_shape"):
            shape = [int(v) for v in weights.get_tensor(f"{prefix}.weight_shape").reshape(-1)]
            if len(shape) != 2 or shape[0] != n or -(-shape[1] // pack) != words:
                raise CheckpointError(
                    f"tensor '{prefix}.weight_shape' = {shape} disagrees with '{prefix}.weight_packed' [{n}, {words}] "
                    f"at num_bits = {scheme.bits} ({self.config.source})"
                )
            k = shape[1]
        elif weights.has_tensor(f"{prefix}.weight_g_idx"):
            k = weights.get_shape(f"{prefix}.weight_g_idx")[0]
        scale_n, groups = weights.get_shape(f"{prefix}.weight_scale")
        want = 1 if scheme.group_size == -1 else -(-k // scheme.group_size)
        if scale_n != n or groups != want:
            kind = "channel" if scheme.group_size == -1 else f"group_size = {scheme.group_size}"
            raise CheckpointError(
                f"tensor '{prefix}.weight_scale' has shape {[scale_n, groups]}, but [{n}, {want}] follows from "
                f"'{prefix}.weight_packed' (K = {k}) and {kind} ({self.config.source}): config and tensors disagree"
            )
        return n, k, groups

    def _g_idx(self, weights: Weights, prefix: str, k: int, scheme: WeightScheme) -> torch.Tensor:
        name = f"{prefix}.weight_g_idx"
        if weights.has_tensor(name):
            return weights.get_tensor(name).to(torch.int32)
        return natural_g_idx(k, scheme.group_size, weights.device)

    def _weight(self, weights: Weights, prefix: str, scheme: WeightScheme, packed, scale, zp, g_idx, k,
                layer: str) -> CompressedTensorsWeight:
        return CompressedTensorsWeight(weight_packed=packed, weight_scale=scale, weight_zero_point=zp, g_idx=g_idx,
                                       in_features=k, bits=scheme.bits, group_size=scheme.group_size, prefix=prefix,
                                       layer=layer, act_dtype=weights.dtype, device_type=weights.device.type)

    def get_weights(self, weights: Weights, prefix: str) -> CompressedTensorsWeight | Fp8LinearWeight:
        scheme = self._scheme(prefix)
        if scheme.type == "float":
            return self._fp8(scheme).get_weights(weights, prefix)
        n, k, _ = self._check(weights, prefix, scheme)
        zp = None if scheme.symmetric else weights.get_tensor(f"{prefix}.weight_zero_point")
        return self._weight(weights, prefix, scheme, weights.get_tensor(f"{prefix}.weight_packed"),
                            weights.get_tensor(f"{prefix}.weight_scale", to_dtype=False), zp,
                            self._g_idx(weights, prefix, k, scheme), k, layer_kind(prefix))

    def get_weights_col_packed(self, weights: Weights, prefix: str, block_sizes: int | list[int]
                               ) -> CompressedTensorsWeight | Fp8LinearWeight:
        scheme = self._scheme(prefix)
        if scheme.type == "float":
            return self._fp8(scheme).get_weights_col_packed(weights, prefix, block_sizes)
        n, k, _ = self._check(weights, prefix, scheme)
        sizes = part_sizes(n, block_sizes, f"{prefix}.weight_packed")
        packed = weights.get_packed_sharded(f"{prefix}.weight_packed", dim=0, block_sizes=sizes)
        scale = weights.get_packed_sharded(f"{prefix}.weight_scale", dim=0, block_sizes=sizes, to_dtype=False)
        zp = None
        if not scheme.symmetric:
            zp = shard_packed(weights, f"{prefix}.weight_zero_point", 0, sizes, scheme.bits, "output features")
        return self._weight(weights, prefix, scheme, packed, scale, zp, self._g_idx(weights, prefix, k, scheme), k,
                            layer_kind(prefix))

    def get_multi_weights_col(self, weights: Weights, prefixes: list[str], dim: int
                              ) -> CompressedTensorsWeight | Fp8LinearWeight:
        if dim != 0:
            raise ValueError(f"compressed-tensors weights fuse along the output dimension (dim 0), not dim {dim}")
        schemes = [self._scheme(p) for p in prefixes]
        if len(set(schemes)) > 1:
            raise CheckpointError(f"{', '.join(prefixes)} use different quantization schemes in "
                                  f"{self.config.source}: they cannot be fused into one matmul")
        if schemes[0].type == "float":
            return self._fp8(schemes[0]).get_multi_weights_col(weights, prefixes, dim)
        parts = [self.get_weights_col(weights, p) for p in prefixes]
        first = parts[0]
        pack = 32 // first.bits
        for prefix, part in zip(prefixes, parts):
            if part.in_features != first.in_features or not torch.equal(part.g_idx, first.g_idx):
                raise CheckpointError(f"'{prefix}' and '{prefixes[0]}' differ in their inputs or weight_g_idx: "
                                      "layers fused into one matmul must share them")
            if part.weight_zero_point is not None and len(parts) > 1 and part.shape[0] % pack != 0:
                raise CheckpointError(f"tensor '{prefix}.weight_zero_point': {part.shape[0]} rows on this rank "
                                      f"do not fill whole words ({pack} per word), so it cannot be fused")
        zps = [p.weight_zero_point for p in parts]
        return CompressedTensorsWeight(
            weight_packed=torch.cat([p.weight_packed for p in parts]),
            weight_scale=torch.cat([p.weight_scale for p in parts]),
            weight_zero_point=None if zps[0] is None else torch.cat(zps), g_idx=first.g_idx,
            in_features=first.in_features, bits=first.bits, group_size=first.group_size, prefix="+".join(prefixes),
            layer=layer_kind(prefixes), act_dtype=weights.dtype, device_type=weights.device.type,
        )

    def get_weights_row(self, weights: Weights, prefix: str) -> CompressedTensorsWeight | Fp8LinearWeight:
        scheme = self._scheme(prefix)
        if scheme.type == "float":
            return self._fp8(scheme).get_weights_row(weights, prefix)
        n, k, groups = self._check(weights, prefix, scheme)
        rows = rank_rows(weights, k, f"{prefix}.weight_packed")
        world = weights.process_group.size
        if world == 1:
            packed = weights.get_tensor(f"{prefix}.weight_packed")
        else:
            check_split(f"{prefix}.weight_packed", [k], world, 32 // scheme.bits, "input features")
            packed = weights.get_sharded(f"{prefix}.weight_packed", dim=1)
        g_idx = self._g_idx(weights, prefix, k, scheme)
        check_g_idx(g_idx, groups, f"{prefix}.weight_g_idx", f"{prefix}.weight_scale")
        zp = None if scheme.symmetric else weights.get_tensor(f"{prefix}.weight_zero_point")
        g_idx, (scale, zp) = trim_groups(g_idx[rows], [
            (weights.get_tensor(f"{prefix}.weight_scale", to_dtype=False), 1), (zp, 1),
        ])
        return self._weight(weights, prefix, scheme, packed, scale, zp, g_idx, k // world, layer_kind(prefix))
