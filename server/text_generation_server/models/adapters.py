"""LoRA adapters in PEFT's layout: read, checked against the base model, sliced for this rank and
written into the linears' slots (layers/lora.py).

A PEFT folder holds adapter_config.json and adapter_model.safetensors, whose tensors are named
`base_model.model.<module>.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]) for each
adapted module, <module> being the base model's module path, which for the native families is the
checkpoint's tensor prefix (model.layers.0.self_attn.q_proj). PEFT adds
`scaling * lora_B(lora_A(x))` to the module's output, scaling = lora_alpha / r, or
lora_alpha / sqrt(r) with use_rslora, r and alpha per module through rank_pattern / alpha_pattern
(peft/tuners/lora/layer.py update_layer, peft/utils/other.py get_pattern_key). Here the scaling is
folded into A once, at load.

Refused by name: DoRA (use_dora, lora_magnitude_vector), trained biases (bias, lora_bias),
modules_to_save, embedding and lm_head targets, target_parameters, modules that are not a linear
this server can adapt, shapes that do not fit the base, a rank over --max-lora-rank.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from loguru import logger
from safetensors import safe_open

from text_generation_server.engine.types import RequestError
from text_generation_server.layers.lora import LoraLinear, LoraRouting

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>A|B)(?:\.default)?\.weight$")
_EMBEDDING_NAMES = ("embed_tokens", "lm_head", "wte", "wpe", "word_embeddings", "embed_in", "embed_out")


class AdapterError(RequestError):
    """An adapter load or unload refused; `code` is the gRPC status name the shard answers with."""

    code = "INVALID_ARGUMENT"


class AdapterInvalid(AdapterError):
    code = "INVALID_ARGUMENT"


class AdapterExists(AdapterError):
    code = "ALREADY_EXISTS"


class AdapterSlotsFull(AdapterError):
    code = "RESOURCE_EXHAUSTED"


class AdapterUnknown(AdapterError):
    code = "NOT_FOUND"


class AdapterBusy(AdapterError):
    code = "FAILED_PRECONDITION"


@dataclass
class PeftModule:
    a: torch.Tensor  # [r, in], scaling folded in (float32)
    b: torch.Tensor  # [out, r] (float32)
    rank: int
    alpha: float


@dataclass
class PeftAdapter:
    path: str
    alpha: float
    rank: int  # the largest module rank
    target_modules: list[str]
    modules: dict[str, PeftModule] = field(default_factory=dict)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's get_pattern_key: the first pattern key that matches the module path's end."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def read_peft(path: str | Path, max_rank: int) -> PeftAdapter:
    """A PEFT LoRA folder, checked (AdapterInvalid naming what is wrong)."""
    folder = Path(path)
    config_path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise AdapterInvalid(f"adapter folder {folder} does not exist")
    try:
        config = json.loads(config_path.read_text())
    except OSError:
        raise AdapterInvalid(f"{config_path} is missing (a PEFT adapter folder holds {CONFIG_FILE} and "
                             f"{WEIGHTS_FILE})") from None
    except ValueError as exc:
        raise AdapterInvalid(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterInvalid(f"{config_path} must hold a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterInvalid(f"{config_path}: peft_type {peft_type} is not supported (LORA only)")
    if config.get("use_dora"):
        raise AdapterInvalid(f"{config_path}: DoRA adapters (use_dora) are not supported")
    if config.get("modules_to_save"):
        raise AdapterInvalid(f"{config_path}: modules_to_save {config['modules_to_save']} is not supported "
                             "(an adapter may only add low-rank terms to linears)")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise AdapterInvalid(f"{config_path}: trained biases (bias={config.get('bias')!r}, "
                             f"lora_bias={config.get('lora_bias')!r}) are not supported")
    embedded = [t for t in _targets(config) if t.rsplit(".", 1)[-1] in _EMBEDDING_NAMES]
    if embedded:
        raise AdapterInvalid(f"{config_path}: target_modules {embedded}: embedding and lm_head adapters are not "
                             "supported")
    if config.get("target_parameters"):
        raise AdapterInvalid(f"{config_path}: target_parameters is not supported")
    try:
        r_default = int(config.get("r", 8))
        alpha_default = float(config.get("lora_alpha", 8))
    except (TypeError, ValueError):
        raise AdapterInvalid(f"{config_path}: r and lora_alpha must be numbers") from None
    rslora = bool(config.get("use_rslora", False))
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        raise AdapterInvalid(f"{weights_path} is missing (only safetensors adapters are read)")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            for key in f.keys():
                if "lora_magnitude_vector" in key:
                    raise AdapterInvalid(f"{weights_path}: '{key}' is a DoRA magnitude: DoRA is not supported")
                if "lora_embedding" in key or any(part in _EMBEDDING_NAMES for part in key.split(".")):
                    raise AdapterInvalid(f"{weights_path}: '{key}': embedding adapters are not supported")
                match = _KEY.match(key)
                if match is None:
                    raise AdapterInvalid(f"{weights_path}: tensor '{key}' is not a LoRA A/B weight (biases, "
                                         "modules_to_save and other PEFT methods are not supported)")
                parts.setdefault(match["module"], {})[match["part"]] = f.get_tensor(key)
    except AdapterError:
        raise
    except Exception as exc:  # a truncated or foreign file
        raise AdapterInvalid(f"{weights_path} cannot be read as safetensors: {exc}") from None
    if not parts:
        raise AdapterInvalid(f"{weights_path} holds no LoRA weights")
    adapter = PeftAdapter(str(folder), alpha_default, 0, _targets(config))
    for module, ab in sorted(parts.items()):
        leaf = module.rsplit(".", 1)[-1]
        if leaf in _EMBEDDING_NAMES:
            raise AdapterInvalid(f"{weights_path}: module '{module}': embedding and lm_head adapters are not "
                                 "supported")
        if set(ab) != {"A", "B"}:
            raise AdapterInvalid(f"{weights_path}: module '{module}' has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise AdapterInvalid(f"{weights_path}: module '{module}': lora_A {list(a.shape)} and lora_B "
                                 f"{list(b.shape)} are not [r, in] and [out, r]")
        rank = int(a.shape[0])
        r_cfg = int(_pattern_value(rank_pattern, module, r_default))
        if r_cfg != rank:
            raise AdapterInvalid(f"{weights_path}: module '{module}' has rank {rank}, {CONFIG_FILE} says {r_cfg}")
        if rank > max_rank:
            raise AdapterInvalid(f"{weights_path}: module '{module}' has rank {rank}, over --max-lora-rank "
                                 f"{max_rank}")
        alpha = float(_pattern_value(alpha_pattern, module, alpha_default))
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        adapter.modules[module] = PeftModule(a.float() * scaling, b.float(), rank, alpha)
        adapter.rank = max(adapter.rank, rank)
    return adapter


def _targets(config: dict) -> list[str]:
    targets = config.get("target_modules") or []
    return [targets] if isinstance(targets, str) else [str(t) for t in targets]


@dataclass
class LoadedAdapter:
    name: str
    path: str
    slot: int
    rank: int
    alpha: float
    target_modules: list[str]


class AdapterSlots:
    """The adapters loaded on this rank, by name, in the fixed slots of every adaptable linear."""

    def __init__(self, model: torch.nn.Module, routing: LoraRouting, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_rank}")
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.routing = routing
        self.by_tensor: dict[str, LoraLinear] = {}
        self.linears: list[LoraLinear] = []
        for path, module in model.named_modules():
            layout = getattr(module, "lora_layout", None)
            if layout is None or ".experts." in f".{path}.":
                continue  # expert linears run inside the fused MoE kernels, never their forward
            hook = LoraLinear(layout, routing, max_loras, max_rank, dtype, device)
            module.lora = hook
            self.linears.append(hook)
            for tensor in layout.tensors:
                self.by_tensor[tensor] = hook
        self.slots: list[LoadedAdapter | None] = [None] * max_loras
        self.by_name: dict[str, LoadedAdapter] = {}

    @property
    def nbytes(self) -> int:
        """Bytes of every slot of every linear on this rank (allocated at startup)."""
        return sum(h.nbytes for h in self.linears)

    def slot_of(self, name: str) -> int | None:
        found = self.by_name.get(name)
        return None if found is None else found.slot

    def load(self, name: str, path: str) -> LoadedAdapter:
        if not name:
            raise AdapterInvalid("an adapter needs a name")
        if name in self.by_name:
            raise AdapterExists(f"adapter '{name}' is already loaded (from {self.by_name[name].path})")
        free = next((i for i, s in enumerate(self.slots) if s is None), None)
        if free is None:
            raise AdapterSlotsFull(f"adapter '{name}': all {self.max_loras} adapter slots are in use "
                                   f"(--max-loras {self.max_loras}); unload one first")
        adapter = read_peft(path, self.max_rank)
        writes = self._place(adapter)
        for hook, a, b in writes:
            hook.write(free, a, b)
        loaded = LoadedAdapter(name, adapter.path, free, adapter.rank, adapter.alpha, sorted(
            adapter.target_modules or {m.rsplit(".", 1)[-1] for m in adapter.modules}))
        self.slots[free] = loaded
        self.by_name[name] = loaded
        logger.info("adapter '{}' loaded from {} into slot {} (rank {}, {} modules)", name, adapter.path, free,
                    adapter.rank, len(adapter.modules))
        return loaded

    def unload(self, name: str) -> None:
        found = self.by_name.pop(name, None)
        if found is None:
            raise AdapterUnknown(f"adapter '{name}' is not loaded")
        for hook in self.linears:
            hook.clear(found.slot)
        self.slots[found.slot] = None
        logger.info("adapter '{}' unloaded (slot {})", name, found.slot)

    def _place(self, adapter: PeftAdapter) -> list[tuple[LoraLinear, torch.Tensor, torch.Tensor]]:
        """Each adapted linear's A and B for this rank (checked before any slot is written)."""
        unknown = sorted(m for m in adapter.modules if m not in self.by_tensor)
        if unknown:
            raise AdapterInvalid(f"adapter {adapter.path}: modules {unknown[:4]} are not linears of this base "
                                 f"model that adapters can change (a different base model?)")
        by_hook: dict[int, LoraLinear] = {}
        for module in adapter.modules:
            hook = self.by_tensor[module]
            by_hook[id(hook)] = hook
        writes = []
        for hook in by_hook.values():
            layout = hook.layout
            mine = [t for t in layout.tensors if t in adapter.modules]
            offsets, start = {}, 0
            for t in mine:
                m = adapter.modules[t]
                if m.a.shape[1] != layout.in_features or m.b.shape[0] != layout.out_features[t]:
                    raise AdapterInvalid(
                        f"adapter {adapter.path}: module '{t}' is [{m.b.shape[0]} x {m.a.shape[1]}] (out x in), the "
                        f"base model's is [{layout.out_features[t]} x {layout.in_features}] (a different base model?)")
                offsets[t] = start
                start += m.rank
            lo, hi = layout.in_range
            a = torch.cat([adapter.modules[t].a[:, lo:hi] for t in mine], dim=0)
            b = torch.zeros(layout.local_out, start)
            row = 0
            for t, first, stop in layout.outputs:
                if t in offsets:
                    m = adapter.modules[t]
                    b[row:row + stop - first, offsets[t]:offsets[t] + m.rank] = m.b[first:stop]
                row += stop - first
            writes.append((hook, a, b))
        return writes


def enable_lora(lm, max_loras: int, max_rank: int) -> AdapterSlots:
    """Preallocates `max_loras` slots of rank `max_rank` in every linear of a CausalLM an adapter may
    change, before warmup (which counts them before sizing the KV cache); adapters then load into
    them and requests find them by name (BatchBuilder.adapter_slot)."""
    if lm.model_impl != "native":
        raise ValueError("LoRA adapters need a native model family (--model-impl native)")
    routing = LoraRouting(lm.device, max(lm.graph_buckets, default=1), max_loras)
    lm.adapters = lm.builder.adapters = AdapterSlots(lm.model, routing, max_loras, max_rank, lm.dtype, lm.device)
    if lm.process_group.rank == 0:
        logger.info("LoRA: {} adapter slots of rank {} in {} linears ({:.1f} MiB on this rank)", max_loras, max_rank,
                    len(lm.adapters.linears), lm.adapters.nbytes / 2**20)
    return lm.adapters


def start_lora(lm, max_loras: int, max_rank: int, adapters: list[str]) -> AdapterSlots:
    """`serve --lora-adapters name=path,... --max-loras --max-lora-rank` on one rank: the slots, then
    the named adapters; a refusal stops the rank naming the adapter (ValueError)."""
    slots = enable_lora(lm, max_loras, max_rank)
    for entry in adapters:
        name, _, path = entry.partition("=")
        try:
            slots.load(name, path)
        except AdapterError as exc:
            raise ValueError(f"--lora-adapters {name}={path}: {exc}") from None
    return slots
