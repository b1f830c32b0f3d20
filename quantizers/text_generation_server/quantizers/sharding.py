"""Sharding rules every quantized format shares.

Quantized tensors are packed: several codes per int32 word, along the output
dimension (GPTQ qzeros, AWQ qweight/qzeros, compressed-tensors zero points) or
the input dimension (GPTQ qweight, compressed-tensors weight_packed). A rank's
slice of a packed dimension must start and end on a word boundary, and group
scales must follow the rows a rank owns even when group boundaries and shard
boundaries do not line up. These helpers enforce both, so every loader either
returns exactly the rank's part of the dense weight or raises naming the tensor
and the world size.
"""

from __future__ import annotations

import re

import torch

from text_generation_server.quantizers.sources import CheckpointError

from text_generation_server.quantizers.weights import Weights


def packing_unit(bits: int) -> tuple[int, int]:
    """(values, words): the smallest run of codes that fills whole int32 words.

    3-bit codes form one little-endian bit stream: 32 values span 3 words.
    """
    if 32 % bits == 0:
        return 32 // bits, 1
    if bits == 3:
        return 32, 3
    raise CheckpointError(f"{bits}-bit codes cannot be packed into int32 words")


def layer_kind(prefixes: str | list[str]) -> str:
    """"self_attn.q_proj+k_proj+v_proj" for every layer's qkv: what the kernel log groups by."""
    if isinstance(prefixes, str):
        prefixes = [prefixes]
    names = [re.sub(r"^(.*\.)?layers\.\d+\.", "", p) for p in prefixes]
    head, _, _ = names[0].rpartition(".")
    if len(names) > 1 and all(n.rpartition(".")[0] == head for n in names):
        return (head + "." if head else "") + "+".join(n.rpartition(".")[2] for n in names)
    return "+".join(names)


def part_sizes(total: int, block_sizes: int | list[int], name: str) -> list[int]:
    """Fused part sizes along the output dimension, as a list."""
    if isinstance(block_sizes, int):
        if block_sizes <= 0 or total % block_sizes != 0:
            raise CheckpointError(f"tensor '{name}': {total} output features do not split into {block_sizes} parts")
        return [total // block_sizes] * block_sizes
    if sum(block_sizes) != total:
        raise CheckpointError(f"tensor '{name}' has {total} output features, expected {sum(block_sizes)} "
                              f"(parts {list(block_sizes)})")
    return list(block_sizes)


def check_split(name: str, sizes: list[int], world: int, unit: int, what: str) -> None:
    """Every rank's share of every part must be whole words of packed codes."""
    for size in sizes:
        if size % world != 0:
            raise CheckpointError(f"tensor '{name}': a part of {size} {what} does not divide into {world} shards")
        if world > 1 and (size // world) % unit != 0:
            raise CheckpointError(
                f"tensor '{name}': {size // world} {what} per rank at world size {world} is not a multiple of "
                f"the {unit} codes packed per word, so the packed tensor cannot be split there"
            )


def shard_packed(weights: Weights, name: str, dim: int, sizes: list[int], bits: int, what: str) -> torch.Tensor:
    """This rank's share of each part of a tensor packed along `dim` (sizes in codes, not words)."""
    world = weights.process_group.size
    if world == 1:
        return weights.get_tensor(name)  # every part whole, in order: no boundary to respect
    values, words = packing_unit(bits)
    check_split(name, sizes, world, values, what)
    for size in sizes:
        if size % values != 0:
            raise CheckpointError(f"tensor '{name}': a fused part of {size} {what} does not fill whole packed "
                                  f"words ({values} codes per {words} word(s)), so the parts cannot be separated")
    return weights.get_packed_sharded(name, dim, [s // values * words for s in sizes])


def shard_rows_packed(weights: Weights, name: str, k: int, bits: int) -> torch.Tensor:
    """This rank's rows of a tensor packed along K on dim 0 (GPTQ qweight)."""
    world = weights.process_group.size
    if world == 1:
        return weights.get_tensor(name)
    values, _ = packing_unit(bits)
    check_split(name, [k], world, values, "input features")
    return weights.get_sharded(name, dim=0)


def natural_g_idx(k: int, group_size: int, device: torch.device) -> torch.Tensor:
    """g_idx of a checkpoint without act-order: row k is in group k // group_size."""
    if group_size == -1:
        return torch.zeros(k, dtype=torch.int32, device=device)
    return (torch.arange(k, dtype=torch.int32, device=device) // group_size).to(torch.int32)


def rank_rows(weights: Weights, k: int, name: str) -> slice:
    """The input rows [k0, k1) this rank owns in a row-parallel layer."""
    world, rank = weights.process_group.size, weights.process_group.rank
    if k % world != 0:
        raise CheckpointError(f"tensor '{name}': {k} input features do not divide into {world} shards")
    local = k // world
    return slice(rank * local, (rank + 1) * local)


def check_g_idx(g_idx: torch.Tensor, groups: int, name: str, scales_name: str) -> None:
    if g_idx.numel() and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups):
        raise CheckpointError(
            f"tensor '{name}' has group indices in [{int(g_idx.min())}, {int(g_idx.max())}], but '{scales_name}' "
            f"has {groups} groups"
        )


def trim_groups(g_idx: torch.Tensor, group_dim_tensors: list[tuple[torch.Tensor | None, int]]
                ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Keeps the groups this rank's rows use, renumbered from zero.

    A row-parallel rank owns rows [k0, k1). Without act-order and with group
    boundaries on shard boundaries that is exactly its own groups; otherwise
    (act-order, or a group straddling two ranks) each row still points at its
    true group, so nothing is wrong, only a few groups are shared between ranks.
    """
    if g_idx.numel() == 0:
        return g_idx, [t for t, _ in group_dim_tensors]
    lo, hi = int(g_idx.min()), int(g_idx.max()) + 1
    kept = [None if t is None else t.narrow(dim, lo, hi - lo).contiguous() for t, dim in group_dim_tensors]
    return (g_idx - lo).to(torch.int32), kept
