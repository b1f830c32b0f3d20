"""The router's view of the LoRA adapters: which names are loaded, who may load more, from where.

The shards hold the weights (layers/lora.py); the router knows the loaded set from the shards'
Info at startup and from its own LoadAdapter / UnloadAdapter answers since, so a request naming
an adapter that is not loaded is refused here (NOT_FOUND) and never reaches a shard, let alone
runs on the base model.

Each load gets a `key` of its own (a counter): the prefix cache seeds its block hashes with it
(router/block_pool.py), so the same prompt under two adapters, or under the base and an adapter,
never shares KV, and an adapter unloaded and loaded again under the same name (maybe other
weights) never finds the blocks of its previous life.

Loading at run time reads files on the server at a client's word, so it is off unless the
operator names the directory adapters may come from (--lora-load-dir), and, on a server without
API keys (anyone who reaches the port could call it), unless --lora-load-without-api-key says so
too. A path is resolved (symlinks, `..`) before it is checked, and so is every entry of the
adapter's folder: a link inside the directory pointing out of it is refused like a path outside.
The check and the shard's read are two moments: someone who can rewrite the directory in between
can defeat it, so the directory must be writable only by whom the operator trusts.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import grpc

from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb

ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
LOAD_DIR_FLAG = "--lora-load-dir"
WITHOUT_KEY_FLAG = "--lora-load-without-api-key"


class AdapterError(Exception):
    """A refused adapter call or lookup, with the gRPC status it answers."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Adapter:
    """A loaded adapter: what the shards reported, its prefix-cache key, and whether it is being
    unloaded (then new requests are refused while the ones holding it finish)."""

    info: cpb.AdapterInfo
    key: int
    draining: bool = False


def check_name(name: str, reserved: Iterable[str] = ()) -> str:
    """A name a request can use: INVALID_ARGUMENT naming the rule otherwise."""
    if not ADAPTER_NAME.fullmatch(name or ""):
        raise AdapterError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"name {name!r} is not an adapter name: 1 to 64 of A-Z a-z 0-9 . _ -")
    if name in set(reserved):
        raise AdapterError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"name {name!r} is the base model's name: requests could not tell them apart")
    return name


@dataclass(frozen=True)
class LoadPolicy:
    """Whether LoadAdapter / UnloadAdapter are open, and the directory loads must come from."""

    directory: Path | None  # resolved; None: run-time loading is off
    api_key_required: bool  # the client port checks API keys
    without_api_key: bool = False  # the operator opened loading on a port without keys

    @classmethod
    def from_settings(cls, load_dir: str | None, api_key_required: bool, without_api_key: bool) -> "LoadPolicy":
        """ValueError naming the flag when the directory is not one."""
        if load_dir is None:
            return cls(None, api_key_required, without_api_key)
        directory = Path(load_dir).expanduser()
        if not directory.is_dir():
            raise ValueError(f"{LOAD_DIR_FLAG} {load_dir}: not a directory")
        return cls(directory.resolve(strict=True), api_key_required, without_api_key)

    @property
    def open(self) -> bool:
        return self.directory is not None and (self.api_key_required or self.without_api_key)

    def check_open(self) -> None:
        """FAILED_PRECONDITION when loading is off; PERMISSION_DENIED on a port without keys."""
        if self.directory is None:
            raise AdapterError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"loading adapters at run time is off on this server (start it with {LOAD_DIR_FLAG} "
                               "DIR to allow loads from DIR)")
        if not (self.api_key_required or self.without_api_key):
            raise AdapterError(grpc.StatusCode.PERMISSION_DENIED,
                               "loading adapters at run time needs API keys on this server (--api-key or "
                               f"--api-key-file), or {WITHOUT_KEY_FLAG} to let any caller load from "
                               f"{LOAD_DIR_FLAG}")

    def resolve(self, path: str) -> Path:
        """The adapter folder `path` names (absolute, or relative to the directory), resolved;
        INVALID_ARGUMENT when it, or anything in it, lies outside the directory or is no folder.
        Whether a path outside exists is never said."""
        self.check_open()
        assert self.directory is not None
        if not path or "\x00" in path:
            raise AdapterError(grpc.StatusCode.INVALID_ARGUMENT, "path must name an adapter folder")
        given = Path(path)
        candidate = given if given.is_absolute() else self.directory / given
        outside = AdapterError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"path {path!r} is outside {LOAD_DIR_FLAG} ({self.directory}): refused")
        try:
            real = candidate.resolve(strict=False)
        except (OSError, RuntimeError):  # a symlink loop
            raise outside from None
        if not self._inside(real):
            raise outside
        if not real.is_dir():
            raise AdapterError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"path {path!r} is not an adapter folder under {LOAD_DIR_FLAG}")
        for entry in real.iterdir():
            try:
                target = entry.resolve(strict=False)
            except (OSError, RuntimeError):
                raise outside from None
            if not self._inside(target):
                raise AdapterError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"path {path!r}: {entry.name} links outside {LOAD_DIR_FLAG}: refused")
        return real

    def _inside(self, path: Path) -> bool:
        assert self.directory is not None
        return path == self.directory or self.directory in path.parents


class AdapterSet:
    """The loaded adapters by name, as the router knows them."""

    def __init__(self, infos: Iterable[cpb.AdapterInfo] = (), reserved: Iterable[str] = ()):
        """reserved: names that mean the base model (the OpenAI `model` field's)."""
        self._keys = itertools.count(1)
        self._loaded: dict[str, Adapter] = {}
        self._pending: set[str] = set()  # loads under way
        self.reserved = frozenset(reserved)
        for info in infos:
            self.add(info)

    def add(self, info: cpb.AdapterInfo) -> Adapter:
        adapter = Adapter(info=info, key=next(self._keys))
        self._loaded[info.name] = adapter
        return adapter

    def remove(self, name: str) -> None:
        self._loaded.pop(name, None)

    def __contains__(self, name: str) -> bool:
        return name in self._loaded

    def names(self) -> list[str]:
        return sorted(self._loaded)

    def infos(self) -> list[cpb.AdapterInfo]:
        return [self._loaded[name].info for name in sorted(self._loaded)]

    def get(self, name: str) -> Adapter:
        """The adapter, even while it drains; NOT_FOUND otherwise."""
        adapter = self._loaded.get(name)
        if adapter is None:
            raise AdapterError(grpc.StatusCode.NOT_FOUND, f"adapter {name!r} is not loaded")
        return adapter

    def usable(self, name: str) -> Adapter:
        """The adapter a new request may use: NOT_FOUND naming it when it is not loaded or is
        being unloaded (never the base model instead)."""
        adapter = self._loaded.get(name)
        if adapter is None:
            loaded = ", ".join(self.names()) or "none"
            raise AdapterError(grpc.StatusCode.NOT_FOUND,
                               f"adapter_id {name!r}: no adapter of that name is loaded (loaded: {loaded})")
        if adapter.draining:
            raise AdapterError(grpc.StatusCode.NOT_FOUND, f"adapter_id {name!r}: the adapter is being unloaded")
        return adapter

    def reserve(self, name: str) -> None:
        """A load of `name` begins: ALREADY_EXISTS when it is loaded or being loaded."""
        check_name(name, self.reserved)
        if name in self._loaded or name in self._pending:
            raise AdapterError(grpc.StatusCode.ALREADY_EXISTS, f"adapter {name!r} is loaded already")
        self._pending.add(name)

    def settle(self, name: str, info: cpb.AdapterInfo | None) -> Adapter | None:
        """The load of `name` ended: loaded with `info`, or failed (None)."""
        self._pending.discard(name)
        return self.add(info) if info is not None else None
