"""FP8 (e4m3) checkpoints, and `--quantize fp8` for dense ones.

Layouts (specs/formats.md): `weight` float8_e4m3fn [N, K] with
- quant_method "fp8" (AutoFP8, vLLM, transformers FineGrainedFP8): `weight_scale` float32,
  one per tensor ([] or [1]) or per channel ([N, 1] or [N]); with weight_block_size
  [bn, bk] (DeepSeek-V3 style) `weight_scale_inv` [ceil(N/bn), ceil(K/bk)], which despite
  its name multiplies: W = weight * scale. activation_scheme "static" adds `input_scale`.
- quant_method "fbgemm_fp8" (Meta's Llama 3.1 FP8): `weight_scale` per channel [N, 1],
  dynamic per-token activations capped by activation_scale_ub.
- compressed-tensors "float-quantized": read by quantizers/compressed_tensors.py with the
  `Fp8CheckpointLoader` below (`weight_scale` [1], [N, 1] or the block grid).

Sharding keeps the checkpoint's exact weights: column shards take their rows' scales,
row shards their columns' block scales, and a rank boundary inside a 128-block keeps
that block's scale on both sides. Fused parts (q, k, v) keep one scale each: per-tensor
parts become per-channel scales of the fused weight, never a common requantized scale.
Their static input scales fuse to the largest one, so no part's calibrated range clips (the
parts of one matmul see one input, so calibration gives them one scale; where it did not, the
load says so).

Activations: each loader records what the checkpoint declares (kernels/fp8.py computes it on
every device): "fp8" checkpoints with activation_scheme "static" use each linear's input_scale;
"dynamic" means per-token scales, or per token and 128-column group (the weight's block columns)
for block-scaled weights, as DeepSeek-V3 and transformers' fp8 kernels quantize them; fbgemm_fp8
is per token capped at activation_scale_ub; `--quantize fp8` declares per-token dynamic inputs.
A row-parallel shard holds part of each input row, so its dynamic scales come from its own
columns (groups stay aligned to the checkpoint's): at world size > 1 those inputs round slightly
differently from world size 1's, on every device, as in other tensor-parallel fp8 servers; the
checkpoint loader says so once. Static scales are exact at every world size.

`--quantize fp8` on a dense checkpoint quantizes each linear while loading it, with
per-channel scales (amax of each full output row / 448) and dynamic activations (a
dense checkpoint brings no calibration data for static ones). Per-channel rather than
per-tensor: e4m3 keeps 3 mantissa bits from 448 down to 2^-6 (subnormals to 2^-9), so
precision is relative either way, but a per-tensor scale set by the loudest row pushes
the small weights of quieter rows into the subnormals and to zero; per-channel scales
give every row the whole range. They cost nothing at run time (_scaled_mm's rowwise
scale_b, the dequant multiply), and column shards and fused parts keep their rows'
scales with no common scale to agree on. Row-parallel shards take scales from the full
rows, so every world size holds the same quantized weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from loguru import logger

from text_generation_server.kernels.fp8 import E4M3_MAX, FP8_DTYPE, Fp8Weight, dequantize_fp8
from text_generation_server.kernels.select import build_linear
from text_generation_server.quantizers.config import QuantizerConfig
from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.sharding import layer_kind, part_sizes, rank_rows
from text_generation_server.quantizers.sources import CheckpointError, SafetensorsSource, safetensors_files
from text_generation_server.quantizers.weights import Weights, WeightsLoader

_DENSE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Tensor names only quantized checkpoints have (GPTQ/AWQ, compressed-tensors, fp8, bitsandbytes, EXL2).
_QUANTIZED_SUFFIXES = (".qweight", ".qzeros", ".weight_packed", ".weight_scale", ".weight_scale_inv", ".SCB",
                       ".q_weight", ".weight.absmax")


@dataclass(frozen=True)
class Fp8Config(QuantizerConfig):
    """quant_method "fp8" / "fbgemm_fp8", or `--quantize fp8` on a dense checkpoint."""

    method: ClassVar[str] = "fp8"
    on_load: ClassVar[bool] = True
    checkpoint_method: str = "fp8"  # "fp8", "fbgemm_fp8", or "on-load" (dense checkpoint quantized while loading)
    activation_scheme: str = "dynamic"  # "static": the checkpoint stores input_scale
    weight_block_size: tuple[int, int] | None = None
    activation_scale_ub: float | None = None  # fbgemm_fp8: cap on a token's dynamic maximum

    @property
    def quantize_on_load(self) -> bool:
        return self.checkpoint_method == "on-load"

    def describe(self) -> str:
        if self.quantize_on_load:
            return "fp8 e4m3, quantized on load (per-channel weight scales, dynamic per-token activations)"
        if self.checkpoint_method == "fbgemm_fp8":
            ub = "" if self.activation_scale_ub is None else f", activation_scale_ub {self.activation_scale_ub:g}"
            return f"fbgemm_fp8 e4m3 per-channel, dynamic per-token activations{ub}"
        scales = ("block {}x{}".format(*self.weight_block_size) if self.weight_block_size
                  else "per-tensor/per-channel")
        acts = "static per-tensor" if self.activation_scheme == "static" else (
            f"dynamic per-token (groups of {self.weight_block_size[1]})" if self.weight_block_size
            else "dynamic per-token")
        return f"fp8 e4m3 {scales}, {acts} activations"

    @classmethod
    def from_config(cls, data: dict, source: str, prefix: str = "") -> "Fp8Config":
        keys = ConfigReader(data, source, prefix)
        method = (keys.str("quant_method", "fp8") or "fp8").lower()
        dense = keys.names("ignored_layers") + keys.names("modules_to_not_convert")
        if method == "fbgemm_fp8":
            ub = data.get("activation_scale_ub")
            if ub is not None and (isinstance(ub, bool) or not isinstance(ub, (int, float)) or not ub > 0):
                raise CheckpointError(f"{keys.where('activation_scale_ub')} must be a positive number, got {ub!r}")
            return cls(source=source, modules_to_not_convert=dense, checkpoint_method="fbgemm_fp8",
                       activation_scheme="dynamic", activation_scale_ub=None if ub is None else float(ub))
        fmt = keys.str("fmt", "e4m3")
        if fmt != "e4m3":
            raise keys.unsupported("fmt", fmt, "fp8", "e4m3")
        scheme = keys.str("activation_scheme", "dynamic")
        if scheme not in ("static", "dynamic"):
            raise keys.unsupported("activation_scheme", scheme, "fp8", "static, dynamic")
        block = data.get("weight_block_size")
        if block is not None:
            if (not isinstance(block, list) or len(block) != 2
                    or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
                raise CheckpointError(f"{keys.where('weight_block_size')} must be two positive integers "
                                      f"[rows, columns] such as [128, 128], got {block!r}")
            block = (block[0], block[1])
        return cls(source=source, modules_to_not_convert=dense, checkpoint_method="fp8",
                   activation_scheme=scheme, weight_block_size=block)

    @classmethod
    def for_dense_checkpoint(cls, flag: str, folder: Path) -> "Fp8Config":
        """Refuses a folder whose tensors are already quantized but that carries no config saying how."""
        try:
            keys = SafetensorsSource(safetensors_files(folder)).keys()
        except CheckpointError:
            keys = []  # no readable weights: loading the model reports that
        for key in keys:
            if key in ("gptq_bits", "gptq_groupsize") or key.endswith(_QUANTIZED_SUFFIXES):
                raise CheckpointError(f"--quantize {flag}: {folder} holds quantized tensors ('{key}') but no "
                                      "quantization config; only float16, bfloat16 or float32 checkpoints can be "
                                      "quantized while loading")
        return cls(source=f"--quantize {flag} (dense checkpoint {folder}, quantized while loading)",
                   checkpoint_method="on-load", activation_scheme="dynamic")


@dataclass(frozen=True)
class Fp8Scheme:
    """How one module's fp8 tensors are named and laid out."""

    source: str  # the config, for errors
    scale_name: str = "weight_scale"
    strategy: str | None = None  # "tensor", "channel", "block"; None: per-tensor or per-channel by shape
    block: tuple[int, int] | None = None  # (rows, columns) per scale, for "block"
    activation: str = "dynamic-token"  # what the checkpoint declares: see kernels.fp8.ACTIVATIONS
    activation_scale_ub: float | None = None
    activation_group_size: int | None = None  # "dynamic-group": input columns per scale
    zero_point_name: str | None = None  # compressed-tensors may store an all-zero weight_zero_point


@dataclass
class Fp8LinearWeight:
    """One rank's fp8 linear, in the canonical form the fp8 kernels run."""

    fp8: Fp8Weight
    prefix: str  # the checkpoint prefix(es), for errors
    layer: str = ""  # the kind of layer, for the kernel log
    act_dtype: torch.dtype = torch.float32
    device_type: str = "cpu"

    @property
    def shape(self) -> tuple[int, int]:
        return self.fp8.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.fp8, dtype)

    def get_linear(self, bias: torch.Tensor | None) -> torch.nn.Module:
        return build_linear(self.fp8, bias, self.act_dtype, self.device_type, self.layer or self.prefix)


def _rank_part_rows(weights: Weights, sizes: list[int], name: str) -> torch.Tensor:
    """Global output rows this rank holds of each fused part, in order (as get_packed_sharded slices them)."""
    world, rank = weights.process_group.size, weights.process_group.rank
    rows, offset = [], 0
    for size in sizes:
        if size % world != 0:
            raise CheckpointError(f"tensor '{name}': a fused part of {size} output features does not divide "
                                  f"into {world} shards")
        shard = size // world
        rows.append(torch.arange(offset + rank * shard, offset + (rank + 1) * shard))
        offset += size
    return torch.cat(rows)


def _blocks(index: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the scale blocks these global indices fall in, each index's position among them)."""
    used, local = torch.unique(index // size, sorted=True, return_inverse=True)
    return used, local.to(torch.int32)


def _check_fp8(tensor: torch.Tensor, name: str, weights: Weights, source: str) -> torch.Tensor:
    if tensor.dtype != FP8_DTYPE:
        raise CheckpointError(f"tensor '{name}' is {str(tensor.dtype).removeprefix('torch.')} (in "
                              f"{weights.files_of(name)}), but {source} says it is fp8: expected float8_e4m3fn "
                              "(safetensors F8_E4M3)")
    return tensor


class Fp8CheckpointLoader(WeightsLoader):
    """Reads fp8 checkpoint tensors into `Fp8LinearWeight`s, sharded without requantizing."""

    def __init__(self, scheme: Fp8Scheme):
        self.scheme = scheme
        self._noted_row_scales = False

    def describe(self) -> str:
        return f"Fp8CheckpointLoader({self.scheme.strategy or 'tensor/channel'}, {self.scheme.activation})"

    # -- helpers ---------------------------------------------------------------------
    def _layout(self, weights: Weights, prefix: str) -> tuple[int, int, str]:
        """(N, K, strategy), every tensor's presence and shape checked against the config."""
        s = self.scheme
        name, scale = f"{prefix}.weight", f"{prefix}.{s.scale_name}"
        for tensor in (name, scale):
            if not weights.has_tensor(tensor):
                raise CheckpointError(f"tensor '{tensor}' not found (in {weights.files_of(prefix)}): every fp8 "
                                      f"linear stores it ({s.source})")
        shape = weights.get_shape(name)
        if len(shape) != 2:
            raise CheckpointError(f"tensor '{name}' has shape {shape}, expected [out_features, in_features]")
        n, k = shape
        got = weights.get_shape(scale)
        strategy = s.strategy
        if strategy is None:
            strategy = "tensor" if math.prod(got) == 1 else "channel"
        if strategy == "block":
            bn, bk = s.block
            want = [-(-n // bn), -(-k // bk)]
            ok = got == want
            expected = f"{want} for blocks of {bn}x{bk}"
        elif strategy == "channel":
            ok = got in ([n, 1], [n])
            expected = f"[{n}, 1] (per channel) or a single value (per tensor)" if s.strategy is None else f"[{n}, 1]"
        else:
            ok = math.prod(got) == 1
            expected = "a single value (per tensor)"
        if not ok:
            raise CheckpointError(f"tensor '{scale}' has shape {got} (in {weights.files_of(scale)}), expected "
                                  f"{expected} to match '{name}' {shape} ({s.source})")
        return n, k, strategy

    def _grid(self, weights: Weights, prefix: str, strategy: str, n: int) -> torch.Tensor:
        """The full scale grid, float32 [R, C]."""
        name = f"{prefix}.{self.scheme.scale_name}"
        scale = weights.get_tensor(name, to_dtype=False)
        if not scale.is_floating_point() or scale.dtype == FP8_DTYPE:
            raise CheckpointError(f"tensor '{name}' is {scale.dtype}, expected float32 (or another wide float) scales")
        scale = scale.float()
        if strategy == "tensor":
            return scale.reshape(1, 1)
        if strategy == "channel":
            return scale.reshape(n, 1)
        return scale

    def _select(self, grid: torch.Tensor, strategy: str, rows: torch.Tensor, cols: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scale grid, row_block, col_block) of this rank's rows and columns (global indices)."""
        device = grid.device
        if strategy == "tensor":
            return grid, torch.zeros(len(rows), dtype=torch.int32, device=device), \
                torch.zeros(len(cols), dtype=torch.int32, device=device)
        if strategy == "channel":
            return grid[rows.to(device)].contiguous(), torch.arange(len(rows), dtype=torch.int32, device=device), \
                torch.zeros(len(cols), dtype=torch.int32, device=device)
        bn, bk = self.scheme.block
        used_rows, row_block = _blocks(rows, bn)
        used_cols, col_block = _blocks(cols, bk)
        scale = grid[used_rows.to(device)][:, used_cols.to(device)].contiguous()
        return scale, row_block.to(device), col_block.to(device)

    def _input_scale(self, weights: Weights, prefix: str) -> torch.Tensor | None:
        if self.scheme.activation != "static":
            return None  # a dynamic checkpoint's stored input_scale, if any, is not used
        name = f"{prefix}.input_scale"
        if not weights.has_tensor(name):
            raise CheckpointError(f"tensor '{name}' not found (in {weights.files_of(prefix)}): static activation "
                                  f"scales are stored per linear ({self.scheme.source})")
        scale = weights.get_tensor(name, to_dtype=False)
        if scale.numel() != 1 or not scale.is_floating_point() or not float(scale) > 0:
            raise CheckpointError(f"tensor '{name}' must hold one positive float, got {scale.dtype} "
                                  f"{list(scale.shape)} (in {weights.files_of(name)})")
        return scale.float().reshape(())

    def _check_zero_point(self, weights: Weights, prefix: str) -> None:
        if self.scheme.zero_point_name is None:
            return
        name = f"{prefix}.{self.scheme.zero_point_name}"
        if weights.has_tensor(name) and bool(weights.get_tensor(name, to_dtype=False).float().ne(0).any()):
            raise CheckpointError(f"tensor '{name}' holds non-zero zero points (in {weights.files_of(name)}): "
                                  "asymmetric fp8 weights are not yet supported (supported: symmetric)")

    def _note_row_scales(self, prefix: str, cols: torch.Tensor, k: int) -> None:
        """Says (once) where dynamic input scales cannot see a whole row: a row-parallel shard holds
        some of the input columns, and its kernel (on any device) takes amax over those only."""
        s = self.scheme
        if not s.activation.startswith("dynamic") or len(cols) in (0, k) or self._noted_row_scales:
            return
        start, stop, group = int(cols[0]), int(cols[-1]) + 1, s.activation_group_size
        if s.activation == "dynamic-group":
            if start % group == 0 and (stop % group == 0 or stop == k):
                return  # whole groups: exactly the checkpoint's scales
            what = (f"the checkpoint's {group}-column input groups cut by a rank boundary take their scales from "
                    f"this rank's part only (a world size that splits K into multiples of {group} keeps them whole)")
        else:
            what = (f"their per-{s.activation.removeprefix('dynamic-')} input scales come from these columns only, "
                    "as tensor-parallel fp8 kernels compute them")
        self._noted_row_scales = True
        logger.info("{} and the other row-parallel fp8 layers: this rank holds input columns [{}, {}) of {}, so {}; "
                    "their rounded inputs differ slightly from world size 1's", prefix, start, stop, k, what)

    def _weight(self, weights: Weights, prefix: str, w8: torch.Tensor, strategy: str, n: int, rows: torch.Tensor,
                cols: torch.Tensor, layer: str, k: int) -> Fp8LinearWeight:
        """`rows` and `cols`: the global indices of w8's rows and columns; n, k: the full N and K."""
        grid = self._grid(weights, prefix, strategy, n)
        scale, row_block, col_block = self._select(grid, strategy, rows, cols)
        self._check_zero_point(weights, prefix)
        self._note_row_scales(prefix, cols, k)
        fp8 = Fp8Weight(weight=w8, scale=scale, row_block=row_block, col_block=col_block,
                        activation=self.scheme.activation, input_scale=self._input_scale(weights, prefix),
                        activation_scale_ub=self.scheme.activation_scale_ub,
                        activation_group_size=self.scheme.activation_group_size,
                        activation_group_offset=int(cols[0]) if len(cols) else 0)
        return Fp8LinearWeight(fp8, prefix, layer, weights.dtype, weights.device.type)

    # -- WeightsLoader -----------------------------------------------------------------
    def get_weights(self, weights: Weights, prefix: str) -> Fp8LinearWeight:
        n, k, strategy = self._layout(weights, prefix)
        name = f"{prefix}.weight"
        w8 = _check_fp8(weights.get_tensor(name, to_dtype=False), name, weights, self.scheme.source)
        return self._weight(weights, prefix, w8, strategy, n, torch.arange(n), torch.arange(k), layer_kind(prefix), k)

    def get_weights_col_packed(self, weights: Weights, prefix: str, block_sizes: int | list[int]
                               ) -> Fp8LinearWeight:
        n, k, strategy = self._layout(weights, prefix)
        name = f"{prefix}.weight"
        sizes = part_sizes(n, block_sizes, name)
        rows = _rank_part_rows(weights, sizes, name)
        w8 = weights.get_packed_sharded(name, dim=0, block_sizes=sizes, to_dtype=False)
        _check_fp8(w8, name, weights, self.scheme.source)
        return self._weight(weights, prefix, w8, strategy, n, rows, torch.arange(k), layer_kind(prefix), k)

    def get_multi_weights_col(self, weights: Weights, prefixes: list[str], dim: int) -> Fp8LinearWeight:
        if dim != 0:
            raise ValueError(f"fp8 weights fuse along the output dimension (dim 0), not dim {dim}")
        parts = [self.get_weights_col(weights, p) for p in prefixes]
        first = parts[0].fp8
        for prefix, part in zip(prefixes, parts):
            w = part.fp8
            if w.shape[1] != first.shape[1] or not torch.equal(w.col_block, first.col_block) \
                    or w.scale.shape[1] != first.scale.shape[1]:
                raise CheckpointError(f"'{prefix}' ({w.shape[1]} inputs, {w.scale.shape[1]} scale columns) cannot "
                                      f"be fused with '{prefixes[0]}' ({first.shape[1]} inputs, "
                                      f"{first.scale.shape[1]} scale columns) into one matmul")
        offsets = torch.tensor([0] + [p.fp8.scale.shape[0] for p in parts[:-1]]).cumsum(0).tolist()
        inputs = [p.fp8.input_scale for p in parts]
        if inputs[0] is not None and len({float(s) for s in inputs}) > 1:
            logger.warning("{}: fused into one matmul, the parts' static input scales {} differ; the fused "
                           "layer quantizes its input with the largest, so the smaller parts' inputs round "
                           "more coarsely than the checkpoint declares", "+".join(prefixes),
                           [round(float(s), 6) for s in inputs])
        fused = Fp8Weight(
            weight=torch.cat([p.fp8.weight for p in parts]),
            scale=torch.cat([p.fp8.scale for p in parts]),
            row_block=torch.cat([p.fp8.row_block + off for p, off in zip(parts, offsets)]),
            col_block=first.col_block, activation=first.activation,
            # The largest calibrated input scale covers every part's range.
            input_scale=None if inputs[0] is None else torch.stack(inputs).max(),
            activation_scale_ub=first.activation_scale_ub, activation_group_size=first.activation_group_size,
            activation_group_offset=first.activation_group_offset,
        )
        return Fp8LinearWeight(fused, "+".join(prefixes), layer_kind(prefixes), weights.dtype, weights.device.type)

    def get_weights_row(self, weights: Weights, prefix: str) -> Fp8LinearWeight:
        n, k, strategy = self._layout(weights, prefix)
        name = f"{prefix}.weight"
        cols = rank_rows(weights, k, name)
        w8 = weights.get_sharded(name, dim=1, to_dtype=False)
        _check_fp8(w8, name, weights, self.scheme.source)
        return self._weight(weights, prefix, w8, strategy, n, torch.arange(n), torch.arange(cols.start, cols.stop),
                            layer_kind(prefix), k)


# -- quantize on load --------------------------------------------------------------------------
def channel_scales(weight: torch.Tensor) -> torch.Tensor:
    """float32 [N, 1]: each output row's max |w| / 448 (1 for an all-zero row)."""
    amax = weight.float().abs().amax(dim=1, keepdim=True)
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def quantize_e4m3(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rounds weight / scale to the nearest e4m3 value (saturating at +-448)."""
    return (weight.float() / scales).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


class Fp8OnLoadLoader(WeightsLoader):
    """`--quantize fp8` on a dense checkpoint: each linear is quantized per channel as it is read."""

    def __init__(self, config: Fp8Config):
        self.config = config

    def describe(self) -> str:
        return "Fp8OnLoadLoader(per-channel, dynamic activations)"

    def _dense(self, weights: Weights, name: str, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype not in _DENSE_DTYPES:
            raise CheckpointError(f"tensor '{name}' is {str(tensor.dtype).removeprefix('torch.')} (in "
                                  f"{weights.files_of(name)}): {self.config.source} quantizes float16, bfloat16 "
                                  "or float32 weights (an already quantized checkpoint needs its quantization config)")
        return tensor

    def _weight(self, weights: Weights, prefix: str, w: torch.Tensor, scales: torch.Tensor,
                layer: str) -> Fp8LinearWeight:
        n, k = w.shape
        device = w.device
        fp8 = Fp8Weight(weight=quantize_e4m3(w, scales), scale=scales.contiguous(),
                        row_block=torch.arange(n, dtype=torch.int32, device=device),
                        col_block=torch.zeros(k, dtype=torch.int32, device=device), activation="dynamic-token")
        return Fp8LinearWeight(fp8, prefix, layer, weights.dtype, weights.device.type)

    def get_weights(self, weights: Weights, prefix: str) -> Fp8LinearWeight:
        name = f"{prefix}.weight"
        w = self._dense(weights, name, weights.get_tensor(name, to_dtype=False))
        return self._weight(weights, prefix, w, channel_scales(w), layer_kind(prefix))

    def get_weights_col_packed(self, weights: Weights, prefix: str, block_sizes: int | list[int]
                               ) -> Fp8LinearWeight:
        name = f"{prefix}.weight"
        w = self._dense(weights, name, weights.get_packed_sharded(name, dim=0, block_sizes=block_sizes,
                                                                  to_dtype=False))
        return self._weight(weights, prefix, w, channel_scales(w), layer_kind(prefix))

    def get_multi_weights_col(self, weights: Weights, prefixes: list[str], dim: int) -> Fp8LinearWeight:
        if dim != 0:
            raise ValueError(f"fp8 weights fuse along the output dimension (dim 0), not dim {dim}")
        parts = [self._dense(weights, f"{p}.weight", weights.get_sharded(f"{p}.weight", dim=0, to_dtype=False))
                 for p in prefixes]
        if len({p.shape[1] for p in parts}) > 1:
            shapes = ", ".join(f"'{p}.weight' {list(t.shape)}" for p, t in zip(prefixes, parts))
            raise CheckpointError(f"tensors fused into one matmul disagree in their inputs: {shapes}")
        w = torch.cat(parts)
        return self._weight(weights, "+".join(prefixes), w, channel_scales(w), layer_kind(prefixes))

    def get_weights_row(self, weights: Weights, prefix: str) -> Fp8LinearWeight:
        name = f"{prefix}.weight"
        full = self._dense(weights, name, weights.get_tensor(name, to_dtype=False))
        cols = rank_rows(weights, full.shape[1], name)
        # Scales of the full rows: every world size quantizes to the same weights.
        return self._weight(weights, prefix, full[:, cols].contiguous(), channel_scales(full), layer_kind(prefix))


def fp8_scheme(config: Fp8Config) -> Fp8Scheme:
    """The tensor layout an "fp8" / "fbgemm_fp8" checkpoint config describes."""
    if config.checkpoint_method == "fbgemm_fp8":
        return Fp8Scheme(source=config.source, strategy="channel", activation="dynamic-token",
                         activation_scale_ub=config.activation_scale_ub)
    if config.weight_block_size is not None:
        # Dynamic inputs of block-scaled weights: one scale per token and block of input columns.
        static = config.activation_scheme == "static"
        return Fp8Scheme(source=config.source, scale_name="weight_scale_inv", strategy="block",
                         block=config.weight_block_size, activation="static" if static else "dynamic-group",
                         activation_group_size=None if static else config.weight_block_size[1])
    return Fp8Scheme(source=config.source,
                     activation="static" if config.activation_scheme == "static" else "dynamic-token")


def fp8_loader(config: Fp8Config) -> WeightsLoader:
    if config.quantize_on_load:
        return Fp8OnLoadLoader(config)
    return Fp8CheckpointLoader(fp8_scheme(config))


CONFIGS: dict[str, type[QuantizerConfig]] = {"fp8": Fp8Config, "fbgemm_fp8": Fp8Config}
LOADERS = {Fp8Config: fp8_loader}
