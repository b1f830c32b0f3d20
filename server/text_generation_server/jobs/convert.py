"""Pickle (.bin/.pt) to safetensors conversion.

This is the one place that unpickles, and it does so with weights_only=True so a
malicious checkpoint cannot run code. Shared storages (tied weights) are cloned,
because safetensors refuses tensors that alias each other.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from loguru import logger
from safetensors.torch import load_file, save_file

from text_generation_server.quantizers.sources import CheckpointError


def _pickle_files(folder: Path) -> list[Path]:
    index = folder / "pytorch_model.bin.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid index ({exc})") from exc
        return [folder / n for n in names]
    return sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pt"))


def _load_pickle(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several unrelated types for bad or unsafe files
        raise CheckpointError(f"cannot load {path} with weights_only=True: {exc}") from exc
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path} does not hold a flat dict of tensors")
    return state


def convert_folder(folder: Path, output: Path, max_shard_bytes: int) -> list[Path]:
    folder, output = Path(folder), Path(output)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder")
    files = _pickle_files(folder)
    if not files:
        raise CheckpointError(f"{folder} has no .bin or .pt weight files to convert")
    if any(output.glob("*.safetensors")):
        raise CheckpointError(f"{output} already has safetensors files; remove them first")
    output.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    seen: set[str] = set()
    for path in files:
        for name, tensor in _load_pickle(path).items():
            if name in seen:
                raise CheckpointError(f"tensor '{name}' appears in more than one file ({path})")
            seen.add(name)
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            # clone: breaks storage sharing (tied weights) that safetensors rejects
            shards[-1][name] = tensor.detach().clone().contiguous()
            size += nbytes
    written: list[Path] = []
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        path = output / name
        save_file(shard, str(path), metadata={"format": "pt"})
        reloaded = load_file(str(path))
        for key, tensor in shard.items():
            if not torch.equal(reloaded[key], tensor):
                raise CheckpointError(f"verification failed for tensor '{key}' in {path}")
            weight_map[key] = name
        written.append(path)
        logger.info("wrote {} ({} tensors)", path, len(shard))
    if len(shards) > 1:
        index = output / "model.safetensors.index.json"
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
        written.append(index)
    return written
