"""Quantization configs: one frozen dataclass per method, read once at startup.

A checkpoint says how it was quantized in one of three places (config.json
`quantization_config`, quantize_config.json, quant_config.json), or, for the
oldest GPTQ checkpoints, in tensors (`gptq_bits`, `gptq_groupsize`). Every value
is checked here, so a checkpoint we cannot run fails before any weight is read,
with a message that names the file and the key to look at.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from text_generation_server.quantizers.config_reader import ConfigReader
from text_generation_server.quantizers.sources import CheckpointError

from text_generation_server.quantizers.weights import Weights

# Methods users know from other servers that this release cannot load: `--quantize` with
# one of them, or a checkpoint declaring one, fails with "not yet supported", not "unknown".
NOT_YET_SUPPORTED = ("hqq", "aqlm")

CONFIG_FILES = ("config.json", "quantize_config.json", "quant_config.json")

# Legacy GPTQ checkpoints (text-generation-server's own early `quantize` output) carry
# their parameters as tensors instead of a config file.
LEGACY_GPTQ_TENSORS = ("gptq_bits", "gptq_groupsize", "gptq_sym")


def _module_matches(pattern: str, prefix: str) -> bool:
    """Whether a module-list entry names `prefix` (or a module containing it).

    Entries are dotted module paths matched component-wise ("lm_head", "mlp.down_proj",
    "model.layers.0"), so "gate" never matches "gate_proj"; "re:" entries are regular
    expressions matched from the start, as compressed-tensors writes them.
    """
    if pattern.startswith("re:"):
        return re.match(pattern[3:], prefix) is not None
    parts, want = prefix.split("."), pattern.split(".")
    return any(parts[i:i + len(want)] == want for i in range(len(parts) - len(want) + 1))


@dataclass(frozen=True)
class QuantizerConfig:
    """What every method's config has: where it came from and which modules stay dense."""

    method: ClassVar[str] = ""
    source: str
    modules_to_not_convert: tuple[str, ...] = ()

    def quantizes(self, prefix: str) -> bool:
        """False for modules the checkpoint left unquantized (loaded by the default loader)."""
        return not any(_module_matches(p, prefix) for p in self.modules_to_not_convert)

    # Methods that can also quantize a dense checkpoint while loading it (`--quantize fp8`).
    on_load: ClassVar[bool] = False

    @property
    def flag(self) -> str:
        """The `--quantize` value naming this kind of quantization; what a loaded model reports.

        The method, except where one method has several kinds that flags tell apart
        (bitsandbytes int8 / nf4 / fp4), so a report says which one is running.
        """
        return self.method

    def describe(self) -> str:
        return self.method

    def check_tensors(self, weights: Weights) -> None:
        """Cross-checks the config against parameters some checkpoints also store as tensors."""

    def accepts_flag(self, method: str) -> bool:
        """Whether `--quantize` naming another config type's method still describes this checkpoint.

        `method` is the normalised flag (`method_of_flag`). False by default: a flag of another
        type disagrees with the checkpoint. A config says yes where its checkpoint is also,
        truthfully, of that method (a GPTQ checkpoint in Marlin layout says quant_method gptq).
        """
        return False

    def check_flag(self, flag: str) -> None:
        """Raises CheckpointError when `--quantize flag` (same config type) contradicts the checkpoint.

        Only methods with several flags for one config type (bitsandbytes int8 / nf4 / fp4)
        have anything to check.
        """

    @classmethod
    def for_dense_checkpoint(cls, flag: str, folder: Path) -> "QuantizerConfig":
        """The config that quantizes a dense checkpoint on load, for methods with `on_load`."""
        raise CheckpointError(f"--quantize {flag}: {folder} is not a {cls.method} checkpoint, and {cls.method} "
                              "cannot quantize a dense checkpoint while loading it")


GPTQ_BITS = (2, 3, 4, 8)


@dataclass(frozen=True)
class GPTQConfig(QuantizerConfig):
    method: ClassVar[str] = "gptq"
    bits: int = 4
    group_size: int = 128  # -1: one group per output column
    desc_act: bool = False
    sym: bool = True
    static_groups: bool = False
    checkpoint_format: str = "gptq"  # "gptq" (v1: zero points stored minus one) or "gptq_v2"
    quantized_in_block: tuple[str, ...] | None = None  # modules_in_block_to_quantize, flattened

    def __post_init__(self) -> None:
        if self.bits not in GPTQ_BITS:
            raise CheckpointError(f"{self.source}: {self.bits}-bit GPTQ is not yet supported "
                                  f"(supported: {', '.join(map(str, GPTQ_BITS))})")
        if self.group_size != -1 and self.group_size <= 0:
            raise CheckpointError(f"{self.source}: group size must be -1 or positive, got {self.group_size}")

    @property
    def zero_offset(self) -> int:
        """What to add to a stored zero point: v1 writers subtract one before packing."""
        return 1 if self.checkpoint_format == "gptq" else 0

    def quantizes(self, prefix: str) -> bool:
        if not super().quantizes(prefix):
            return False
        if self.quantized_in_block is None or ".layers." not in prefix:
            return True
        return any(_module_matches(name, prefix) for name in self.quantized_in_block)

    def describe(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        order = " act-order" + (" static groups" if self.static_groups else "") if self.desc_act else ""
        return (f"gptq ({self.checkpoint_format}) {self.bits}-bit {group} "
                f"{'sym' if self.sym else 'asym'}{order}")

    @classmethod
    def from_config(cls, data: dict, source: str, prefix: str = "") -> "GPTQConfig":
        keys = ConfigReader(data, source, prefix)
        bits = keys.int("bits")
        if bits not in GPTQ_BITS:
            raise keys.unsupported("bits", bits, "gptq", ", ".join(map(str, GPTQ_BITS)))
        group_size = keys.int("group_size", -1)
        if group_size != -1 and group_size <= 0:
            raise CheckpointError(f"{keys.where('group_size')} must be -1 or positive, got {group_size}")
        fmt = keys.str("checkpoint_format", "gptq", aliases=("format",))
        if keys.bool("is_marlin_format", False):
            fmt = "marlin"
        if fmt not in ("gptq", "gptq_v2"):
            raise keys.unsupported("checkpoint_format", fmt, "gptq", "gptq, gptq_v2")
        if keys.bool("lm_head", False):
            raise keys.unsupported("lm_head", True, "gptq", "false: the head stays unquantized")
        if data.get("dynamic"):
            raise keys.unsupported("dynamic", data["dynamic"], "gptq", "no per-module overrides")
        block = data.get("modules_in_block_to_quantize")
        quantized_in_block = None
        if block is not None:
            flat = [name for group in block for name in (group if isinstance(group, list) else [group])]
            if not all(isinstance(n, str) for n in flat):
                raise CheckpointError(f"{keys.where('modules_in_block_to_quantize')} must list module names")
            quantized_in_block = tuple(flat)
        return cls(
            source=source, bits=bits, group_size=group_size, desc_act=keys.bool("desc_act", False),
            sym=keys.bool("sym", True), static_groups=keys.bool("static_groups", False), checkpoint_format=fmt,
            modules_to_not_convert=keys.names("modules_to_not_convert"), quantized_in_block=quantized_in_block,
        )

    @classmethod
    def from_tensors(cls, weights: Weights) -> "GPTQConfig":
        """A legacy checkpoint: parameters in scalar tensors, asymmetric v1 layout, no act-order."""
        values = {}
        for name in LEGACY_GPTQ_TENSORS:
            if weights.has_tensor(name):
                tensor = weights.get_tensor(name, to_dtype=False)
                if tensor.numel() != 1:
                    raise CheckpointError(f"tensor '{name}' must hold one value, got shape {list(tensor.shape)} "
                                          f"(in {weights.files_of(name)})")
                values[name] = int(tensor.item())
        for name in LEGACY_GPTQ_TENSORS[:2]:
            if name not in values:
                raise CheckpointError(f"tensor '{name}' not found (in {weights.files_of(name)}): without a "
                                      "quantization config, a GPTQ checkpoint must carry gptq_bits and gptq_groupsize")
        source = f"tensor 'gptq_bits' (in {weights.files_of('gptq_bits')})"
        if values["gptq_bits"] not in GPTQ_BITS:
            raise CheckpointError(f"tensor 'gptq_bits' = {values['gptq_bits']} is not yet supported for gptq "
                                  f"(supported: {', '.join(map(str, GPTQ_BITS))}) (in {weights.files_of('gptq_bits')})")
        return cls(source=source, bits=values["gptq_bits"], group_size=values["gptq_groupsize"],
                   sym=bool(values.get("gptq_sym", 0)), desc_act=False, checkpoint_format="gptq")

    def check_tensors(self, weights: Weights) -> None:
        """A checkpoint with both a config and legacy tensors must agree with itself."""
        for name, value in (("gptq_bits", self.bits), ("gptq_groupsize", self.group_size)):
            if weights.has_tensor(name):
                stored = int(weights.get_tensor(name, to_dtype=False).reshape(-1)[0])
                if stored != value:
                    raise CheckpointError(
                        f"tensor '{name}' = {stored} (in {weights.files_of(name)}) disagrees with "
                        f"{self.source} ({'bits' if name == 'gptq_bits' else 'group_size'} = {value})"
                    )


@dataclass(frozen=True)
class AWQConfig(QuantizerConfig):
    method: ClassVar[str] = "awq"
    bits: int = 4
    group_size: int = 128
    zero_point: bool = True
    version: str = "gemm"

    def describe(self) -> str:
        return f"awq ({self.version}) {self.bits}-bit group {self.group_size}"

    @classmethod
    def from_config(cls, data: dict, source: str, prefix: str = "") -> "AWQConfig":
        keys = ConfigReader(data, source, prefix)
        bits = keys.int("bits", aliases=("w_bit",))
        if bits != 4:
            raise keys.unsupported("w_bit" if keys.has("w_bit") else "bits", bits, "awq", "4")
        group_size = keys.int("group_size", aliases=("q_group_size",))
        if group_size <= 0:
            raise CheckpointError(f"{keys.where('group_size')} must be positive, got {group_size}")
        version = (keys.str("version", "gemm") or "gemm").lower()
        if version != "gemm":
            raise keys.unsupported("version", version, "awq", "gemm")
        zero_point = keys.bool("zero_point", True)
        if not zero_point:
            raise keys.unsupported("zero_point", False, "awq", "true")
        return cls(source=source, bits=bits, group_size=group_size, zero_point=zero_point, version=version,
                   modules_to_not_convert=keys.names("modules_to_not_convert"))


@dataclass(frozen=True)
class WeightScheme:
    """One compressed-tensors config group's weight quantization."""

    bits: int
    strategy: str  # int: "group" or "channel"; float: "tensor", "channel" or "block"
    group_size: int  # -1 unless the strategy is "group"
    symmetric: bool
    targets: tuple[str, ...]
    type: str = "int"  # "int" (format pack-quantized) or "float" (float-quantized: fp8 e4m3)
    block: tuple[int, int] | None = None  # float "block": block_structure (rows, columns) per scale
    # float only: how the checkpoint quantizes activations (the fp8 kernels compute the same). None:
    # weight-only (W8A16) checkpoint; "static" (input_scale per linear), "dynamic-token",
    # "dynamic-tensor", "dynamic-group" (per token, activation_group_size columns per scale).
    activations: str | None = None
    activation_group_size: int | None = None

    def describe(self) -> str:
        if self.type == "float":
            block = f" {self.block[0]}x{self.block[1]}" if self.block else ""
            group = f" {self.activation_group_size}" if self.activation_group_size else ""
            acts = f", {self.activations}{group} activations" if self.activations else " weight-only"
            return f"float-quantized fp8 {self.strategy}{block}{acts}"
        group = "" if self.group_size == -1 else f" {self.group_size}"
        return f"pack-quantized int{self.bits} {self.strategy}{group} {'sym' if self.symmetric else 'asym'}"


CT_BITS = (4, 8)
# Each compressed-tensors format and the weight type it stores.
CT_FORMATS = {"pack-quantized": "int", "float-quantized": "float"}


def _block_structure(value: Any, keys: ConfigReader) -> tuple[int, int]:
    """block_structure as compressed-tensors writes it: [rows, columns] (older releases: "RxC")."""
    if isinstance(value, str) and re.fullmatch(r"\d+x\d+", value):
        value = [int(v) for v in value.split("x")]
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise CheckpointError(f"{keys.where('block_structure')} must be two positive integers [rows, columns] "
                              f"such as [128, 128], got {value!r}")
    return value[0], value[1]


def _ct_activations(acts: Any, keys: ConfigReader) -> tuple[str | None, int | None]:
    """(the fp8 activation scheme, its group size) of a float-quantized group's input_activations."""
    if acts is None:
        return None, None
    if not isinstance(acts, dict):
        raise CheckpointError(f"{keys.where('input_activations')} must be an object or null")
    akeys = ConfigReader(acts, keys.source, keys.prefix + "input_activations.")
    method = "compressed-tensors float-quantized activations"
    kind = akeys.str("type", "float")
    if kind != "float":
        raise akeys.unsupported("type", kind, method, "float")
    bits = akeys.int("num_bits")
    if bits != 8:
        raise akeys.unsupported("num_bits", bits, method, "8")
    strategy = akeys.str("strategy", "tensor")
    if akeys.bool("dynamic", False):
        dynamic = {"token": "dynamic-token", "group": "dynamic-group", "tensor": "dynamic-tensor"}
        if strategy not in dynamic:
            raise akeys.unsupported("strategy", strategy, method + " (dynamic)", "token, group, tensor")
        group = None
        if strategy == "group":
            group = akeys.int("group_size")
            if group <= 0:
                raise CheckpointError(f"{akeys.where('group_size')} must be positive, got {group}")
        return dynamic[strategy], group
    if strategy != "tensor":
        raise akeys.unsupported("strategy", strategy, method + " (static)", "tensor")
    return "static", None


def _ct_float_scheme(group: dict, w: dict, wkeys: ConfigReader, gkeys: ConfigReader,
                     targets: tuple[str, ...]) -> WeightScheme:
    method = "compressed-tensors float-quantized"
    bits = wkeys.int("num_bits")
    if bits != 8:
        raise wkeys.unsupported("num_bits", bits, method, "8")
    strategy = wkeys.str("strategy", "tensor")
    if strategy not in ("tensor", "channel", "block"):
        raise wkeys.unsupported("strategy", strategy, method, "tensor, channel, block")
    if not wkeys.bool("symmetric", True):
        raise wkeys.unsupported("symmetric", False, method, "true")
    block = _block_structure(w.get("block_structure"), wkeys) if strategy == "block" else None
    activations, act_group = _ct_activations(group.get("input_activations"), gkeys)
    return WeightScheme(bits=bits, strategy=strategy, group_size=-1, symmetric=True, targets=targets, type="float",
                        block=block, activations=activations, activation_group_size=act_group)


@dataclass(frozen=True)
class CompressedTensorsConfig(QuantizerConfig):
    method: ClassVar[str] = "compressed-tensors"
    schemes: tuple[WeightScheme, ...] = field(default_factory=tuple)

    def scheme_for(self, prefix: str) -> WeightScheme | None:
        """The scheme whose targets name `prefix`; None when the module is not quantized."""
        if not super().quantizes(prefix):
            return None
        leaf = prefix.rsplit(".", 1)[-1]
        for scheme in self.schemes:
            for target in scheme.targets:
                if target == "Linear" and leaf != "lm_head":
                    return scheme
                if target != "Linear" and _module_matches(target, prefix):
                    return scheme
        return None

    def quantizes(self, prefix: str) -> bool:
        return self.scheme_for(prefix) is not None

    def describe(self) -> str:
        return "compressed-tensors " + ", ".join(s.describe() for s in self.schemes)

    def accepts_flag(self, method: str) -> bool:
        """`--quantize fp8` on a float-quantized checkpoint: every weight it quantizes is fp8 e4m3."""
        return method == "fp8" and bool(self.schemes) and all(s.type == "float" for s in self.schemes)

    @classmethod
    def from_config(cls, data: dict, source: str, prefix: str = "") -> "CompressedTensorsConfig":
        keys = ConfigReader(data, source, prefix)
        top_format = keys.str("format")
        status = keys.str("quantization_status", "compressed")
        if status != "compressed":
            raise keys.unsupported("quantization_status", status, "compressed-tensors", "compressed")
        sparsity = data.get("sparsity_config") or {}
        if isinstance(sparsity, dict) and sparsity.get("format") not in (None, "dense"):
            raise keys.unsupported("sparsity_config.format", sparsity.get("format"), "compressed-tensors", "dense")
        groups = data.get("config_groups")
        if not groups and data.get("kv_cache_scheme") is not None:
            # Only the KV cache is quantized (quantizers/kv_cache.py reads its scheme): dense weights.
            return cls(source=source, schemes=(), modules_to_not_convert=keys.names("ignore"))
        if not isinstance(groups, dict) or not groups:
            raise CheckpointError(f"{keys.where('config_groups')} must be a non-empty object")
        schemes = []
        for name, group in groups.items():
            gkeys = ConfigReader(group, source, f"{prefix}config_groups.{name}.")
            fmt = gkeys.str("format", top_format)
            if fmt not in CT_FORMATS:
                owner = gkeys if group.get("format") is not None else keys
                raise owner.unsupported("format", fmt, "compressed-tensors", ", ".join(CT_FORMATS))
            if fmt == "pack-quantized" and group.get("input_activations") is not None:
                raise gkeys.unsupported("input_activations", group["input_activations"], "compressed-tensors",
                                        "null (weight-only W4A16/W8A16)")
            targets = gkeys.names("targets")
            if not targets:
                raise CheckpointError(f"{gkeys.where('targets')} must list the modules it applies to")
            w = group.get("weights")
            if not isinstance(w, dict):
                raise CheckpointError(f"{gkeys.where('weights')} must be an object")
            wkeys = ConfigReader(w, source, f"{prefix}config_groups.{name}.weights.")
            kind = wkeys.str("type", "int")
            if kind != CT_FORMATS[fmt]:
                raise wkeys.unsupported("type", kind, f"compressed-tensors {fmt}", CT_FORMATS[fmt])
            if wkeys.bool("dynamic", False):
                raise wkeys.unsupported("dynamic", True, "compressed-tensors", "false")
            if kind == "float":
                schemes.append(_ct_float_scheme(group, w, wkeys, gkeys, targets))
                continue
            bits = wkeys.int("num_bits")
            if bits not in CT_BITS:
                raise wkeys.unsupported("num_bits", bits, "compressed-tensors", "4, 8")
            strategy = wkeys.str("strategy", "tensor")
            if strategy not in ("group", "channel"):
                raise wkeys.unsupported("strategy", strategy, "compressed-tensors", "group, channel")
            group_size = wkeys.int("group_size") if strategy == "group" else -1
            if strategy == "group" and group_size <= 0:
                raise CheckpointError(f"{wkeys.where('group_size')} must be positive, got {group_size}")
            schemes.append(WeightScheme(bits=bits, strategy=strategy, group_size=group_size,
                                        symmetric=wkeys.bool("symmetric", True), targets=targets))
        return cls(source=source, schemes=tuple(schemes), modules_to_not_convert=keys.names("ignore"))
