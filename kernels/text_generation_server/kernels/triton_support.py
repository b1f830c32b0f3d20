"""What every Triton kernel module here shares: the optional import, the interpreter switch, and
@triton.jit functions defined on first use.

Kernels are defined lazily, once per TRITON_INTERPRET setting, because Triton decides at
definition time whether a function runs compiled or in the interpreter: a test that sets
TRITON_INTERPRET=1 after import must still get interpreted kernels. A module without Triton
installed still imports; its kernels refuse through can_implement instead.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Callable

try:
    import triton
    import triton.language as tl
except ImportError:  # the modules must import on machines without Triton
    triton = None
    tl = None

__all__ = ["LazyKernels", "interpreting", "tl", "triton"]


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET=1) right now."""
    knobs = getattr(triton, "knobs", None)
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
        mode = interpreting()
        if mode not in self._by_mode:
            self._by_mode[mode] = self._define()
        return self._by_mode[mode]
