"""The event loop the launcher, router and ranks run on: uvloop where it is installed.

Why: a decode step crosses the router's and each rank's event loop several times (a Steps call in,
a thread hop to the model and back, the answer out, a token per stream to the clients); on a CPU
that loop machinery is part of every token's host time. uvloop (libuv, used by vLLM's and SGLang's
API servers) runs the same asyncio code with a cheaper loop. TGS_UVLOOP=0 keeps asyncio's own loop
(also the fallback where uvloop is not installed: it is optional, Linux and macOS only).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, Callable, TypeVar

from loguru import logger

UVLOOP_ENV = "TGS_UVLOOP"
T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor, or None for asyncio's default (TGS_UVLOOP=0, or no uvloop)."""
    value = os.environ.get(UVLOOP_ENV, "1").strip().lower()
    if value in ("0", "false", "no", "off"):
        return None
    if value not in ("1", "true", "yes", "on"):
        logger.warning("{}={!r} is not 0/1, true/false, yes/no or on/off: uvloop stays on", UVLOOP_ENV,
                       os.environ[UVLOOP_ENV])
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on the loop loop_factory picks."""
    factory = loop_factory()
    logger.debug("event loop: {}", "uvloop" if factory is not None else "asyncio")
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
