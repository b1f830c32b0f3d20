"""Writes LoRA adapters in PEFT's layout (adapter_config.json, adapter_model.safetensors) for a base
checkpoint, with random A and B, for the router and serving tests.

The tensor names are PEFT's (`base_model.model.<module>.lora_A.weight` [r, in] and `lora_B`
[out, r], peft/utils/save_and_load.py), the modules the checkpoint's linears; B is not zero (a
trained adapter's never is), and `scale` makes the low-rank term large enough that greedy tokens
change on a tiny model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, base: Path, seed: int, rank: int = 8, alpha: float = 16.0,
                  targets: tuple[str, ...] = DEFAULT_TARGETS, scale: float = 0.5) -> Path:
    """An adapter of every linear of `base` whose name ends in one of `targets`."""
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for file in sorted(base.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                module = key.removesuffix(".weight")
                if not key.endswith(".weight") or module.rsplit(".", 1)[-1] not in targets:
                    continue
                out_features, in_features = f.get_slice(key).get_shape()
                a = torch.randn(rank, in_features, generator=generator) * scale / in_features ** 0.5
                b = torch.randn(out_features, rank, generator=generator) * scale
                tensors[f"base_model.model.{module}.lora_A.weight"] = a.contiguous()
                tensors[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
    if not tensors:
        raise ValueError(f"{base} has no linear named {targets}")
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base), "r": rank,
        "lora_alpha": alpha, "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
        "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
    }))
    return folder
