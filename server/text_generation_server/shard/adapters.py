"""The shard's LoRA adapter calls (not in TGI): LoadAdapter, UnloadAdapter, and Info's list.

They run on the model thread like the steps, so a load never races a forward that could read the
slot it writes; the router sends them between steps, to every rank. Refusals carry the status
models/adapters.py names (INVALID_ARGUMENT, ALREADY_EXISTS, RESOURCE_EXHAUSTED, NOT_FOUND,
FAILED_PRECONDITION), and the shard keeps serving.
"""

from __future__ import annotations

from typing import Iterable

from text_generation_server.engine.batch import Batch
from text_generation_server.models.adapters import AdapterBusy, AdapterInvalid, AdapterSlots, LoadedAdapter
from text_generation_server.pb.generate.v3 import generate_pb2 as pb

LORA_OFF = ("LoRA adapters are off on this server: start it with --lora-adapters, or --max-loras N to reserve "
            "slots for adapters loaded at run time")


def adapter_info(adapter: LoadedAdapter) -> pb.AdapterInfo:
    return pb.AdapterInfo(name=adapter.name, path=adapter.path, rank=adapter.rank,
                          target_modules=adapter.target_modules, alpha=adapter.alpha)


def infos(slots: AdapterSlots | None) -> list[pb.AdapterInfo]:
    if slots is None:
        return []
    # A copy of the slot list (one C-level copy): Info answers on the event loop while a load or
    # unload may change the slots on the model thread.
    loaded = [a for a in list(slots.slots) if a is not None]
    return [adapter_info(a) for a in sorted(loaded, key=lambda a: a.name)]


def load(slots: AdapterSlots | None, request: pb.LoadAdapterRequest) -> pb.LoadAdapterResponse:
    if slots is None:
        raise AdapterBusy(LORA_OFF)
    if not request.path:
        raise AdapterInvalid(f"adapter '{request.name}': a path is needed")
    return pb.LoadAdapterResponse(adapter=adapter_info(slots.load(request.name, request.path)))


def unload(slots: AdapterSlots | None, request: pb.UnloadAdapterRequest, batches: Iterable[Batch]
           ) -> pb.UnloadAdapterResponse:
    """Refused while a cached batch still has a row of the adapter: its slot must not change under it."""
    if slots is None:
        raise AdapterBusy(LORA_OFF)
    slot = slots.slot_of(request.name)
    if slot is not None:
        users = [s.request.id for b in batches for s in b.states if s.adapter == slot]
        if users:
            raise AdapterBusy(f"adapter '{request.name}' is in use by requests {sorted(set(users))[:8]}: let them "
                              "finish (or cancel them) before unloading it")
    slots.unload(request.name)
    return pb.UnloadAdapterResponse()
