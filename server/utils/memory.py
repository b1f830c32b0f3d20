"""How much memory is left for the KV cache, on CPU and CUDA."""

from __future__ import annotations

import gc

import torch


def available_bytes(device: torch.device) -> int:
    """Free memory the KV cache may draw from right now."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text.lower()
    )
