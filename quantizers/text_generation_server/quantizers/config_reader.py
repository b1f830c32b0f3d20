"""Typed reads from a checkpoint's JSON config files, with errors that name the file and the key.

One reader for every config a checkpoint carries: config.json's model settings (read by the
model families), and the quantization configs (config.json `quantization_config`,
quantize_config.json, quant_config.json, a bitsandbytes quant_state) read by each format's
`from_config`. So a missing, mistyped or unsupported value is reported the same way wherever it
is read: `<file>: '<key>' ...`, the key spelled with its path inside the file (`prefix`) when the
reader looks at a nested object.
"""

from __future__ import annotations

import builtins
import math
from typing import Any

from text_generation_server.quantizers.sources import CheckpointError


class ConfigReader:
    """Values of one JSON object (`data`) read from `source` (a file, or a tensor holding JSON).

    A key set to null counts as absent everywhere: `get` returns the default, `has` is false.
    """

    def __init__(self, data: dict, source: str, prefix: str = ""):
        self.data = data
        self.source = source
        self.prefix = prefix  # the path of `data` inside the file ("quantization_config.")

    def where(self, key: str) -> str:
        """How an error names the key: "<source>: '<prefix><key>'"."""
        return f"{self.source}: '{self.prefix}{key}'"

    def with_values(self, **values: Any) -> "ConfigReader":
        """The same config with some keys set (defaults a family derives before reading on)."""
        return ConfigReader({**self.data, **values}, self.source, self.prefix)

    # -- untyped -----------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def need(self, key: str) -> Any:
        if self.data.get(key) is None:
            raise CheckpointError(f"{self.source}: missing required key '{self.prefix}{key}'")
        return self.data[key]

    def first(self, *keys: str, default: Any = None, required: bool = False) -> Any:
        """The first of several names a key goes by (n_embd / hidden_size)."""
        for key in keys:
            if self.data.get(key) is not None:
                return self.data[key]
        if required:
            others = f" (or {', '.join(keys[1:])})" if len(keys) > 1 else ""
            raise CheckpointError(f"{self.source}: missing required key '{self.prefix}{keys[0]}'{others}")
        return default

    # -- typed ---------------------------------------------------------------------------------
    def positive_int(self, *keys: str, default: int | None = None) -> int:
        """An integer > 0 under the first of `keys` present (integral floats such as 4096.0 too)."""
        value = self.first(*keys, default=default, required=default is None)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value or value <= 0:
            raise CheckpointError(f"{self.where(keys[0])} must be a positive integer, got {value!r}")
        return int(value)

    def number(self, key: str, default: float | None = None) -> float | None:
        """A finite int or float, as a float; None when absent and no default."""
        value = self.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise CheckpointError(f"{self.where(key)} must be a finite number, got {value!r}")
        return float(value)

    def names(self, key: str) -> tuple[builtins.str, ...]:
        """A list of module names (modules_to_not_convert, targets); () when absent."""
        value = self.data.get(key)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(isinstance(v, builtins.str) for v in value):
            raise CheckpointError(f"{self.where(key)} must be a list of module names, got {value!r}")
        return tuple(value)

    def _present(self, key: builtins.str, aliases: tuple[builtins.str, ...]) -> builtins.str:
        """The first of key and its aliases that is set (key itself when none is)."""
        for name in (key, *aliases):
            if self.data.get(name) is not None:
                return name
        return key

    # Named after the type they return (callers read `keys.int("bits")`); defined last so the
    # annotations above still mean the builtins.
    def int(self, key: builtins.str, default: builtins.int | None = None,
            aliases: tuple[builtins.str, ...] = ()) -> builtins.int:
        """An integer (not a bool), under `key` or the first alias set; required without a default."""
        key = self._present(key, aliases)
        value = self.data.get(key, default)
        if value is None:
            raise CheckpointError(f"{self.where(key)} is required")
        if isinstance(value, builtins.bool) or not isinstance(value, builtins.int):
            raise CheckpointError(f"{self.where(key)} must be an integer, got {value!r}")
        return value

    def bool(self, key: builtins.str, default: builtins.bool) -> builtins.bool:
        value = self.data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, builtins.bool):
            raise CheckpointError(f"{self.where(key)} must be true or false, got {value!r}")
        return value

    def str(self, key: builtins.str, default: builtins.str | None = None,
            aliases: tuple[builtins.str, ...] = ()) -> builtins.str | None:
        key = self._present(key, aliases)
        value = self.data.get(key, default)
        if value is not None and not isinstance(value, builtins.str):
            raise CheckpointError(f"{self.where(key)} must be a string, got {value!r}")
        return value

    # -- refusals ------------------------------------------------------------------------------
    def unsupported(self, key: builtins.str, value: Any, method: builtins.str,
                    supported: builtins.str) -> CheckpointError:
        """A value a quantization method cannot load (what is, listed): for the caller to raise."""
        return CheckpointError(
            f"{self.where(key)} = {value!r} is not yet supported for {method} (supported: {supported})"
        )

    def refuse(self, key: builtins.str, why: builtins.str) -> CheckpointError:
        """A model setting the server does not implement, and why: for the caller to raise."""
        return CheckpointError(f"{self.source}: {self.prefix}{key} = {self.data.get(key)!r} is not supported: {why}")
