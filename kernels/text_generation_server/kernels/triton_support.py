"""What every Triton kernel module here shares: the optional import, the interpreter switch, and
@triton.jit functions defined on first use.

Kernels are defined lazily, once per TRITON_INTERPRET setting, because Triton decides at
definition time whether a function runs compiled or in the interpreter: a test that sets
TRITON_INTERPRET=1 after import must still get interpreted kernels. A module without Triton
installed still imports; its kernels refuse through can_implement instead.

Triton itself is imported on first use, not with the kernel table: importing it costs a CPU
rank (which never runs a Triton kernel outside tests) 0.3-0.8 s of every start. Until then
`triton` and `tl` are stand-ins that import the real module on their first attribute; the first
`LazyKernels` call puts the real modules in the defining module's globals, which is where
Triton's compiler resolves `tl` inside a kernel. `triton is None` still means "not installed".
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from types import ModuleType, SimpleNamespace
from typing import Any, Callable


class _Deferred:
    """A module imported on its first attribute access."""

    def __init__(self, name: str):
        self._name = name

    def load(self) -> ModuleType:
        return importlib.import_module(self._name)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.load(), attr)

    def __repr__(self) -> str:
        return f"<{self._name}, imported on first use>"


def _find(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


triton: Any = _Deferred("triton") if _find("triton") else None  # the modules must import without Triton
tl: Any = _Deferred("triton.language") if triton is not None else None

__all__ = ["LazyKernels", "interpreting", "tl", "triton"]


def _bind_real_modules(namespace: dict) -> None:
    """Replaces the stand-ins a kernel module imported with the real modules (see the docstring)."""
    for name, value in list(namespace.items()):
        if isinstance(value, _Deferred):
            namespace[name] = value.load()


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1) right now."""
    # Not imported yet: nobody can have set its knobs, and the environment is what it will read.
    knobs = getattr(sys.modules["triton"], "knobs", None) if "triton" in sys.modules else None
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


class LazyKernels:
    """A module's @triton.jit functions, built by `define` on first use for the current
    interpreter setting and kept per setting."""

    def __init__(self, define: Callable[[], SimpleNamespace]):
        self._define = define
        self._by_mode: dict[bool, SimpleNamespace] = {}

    def __call__(self) -> SimpleNamespace:
        if triton is None:
            raise RuntimeError("triton is not installed")
        _bind_real_modules(self._define.__globals__)
        mode = interpreting()
        if mode not in self._by_mode:
            self._by_mode[mode] = self._define()
        return self._by_mode[mode]
