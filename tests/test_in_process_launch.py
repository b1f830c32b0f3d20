"""`serve --shard-in-process` when the rank's loading fails with something other than a bad
setting (a CUDA out-of-memory, a kernel build error): the launcher reports it and exits 1, as it
reports a rank process that died, instead of ending in a traceback."""

from __future__ import annotations

import asyncio

from loguru import logger

from text_generation_server.launcher import rank, supervisor
from text_generation_server.settings.serve_args import ServeArgs


def test_a_rank_that_raises_while_loading_exits_1_naming_the_error(monkeypatch):
    monkeypatch.setenv("TGS_CPU_INT8_ACTIVATIONS", "off")  # restored after: the launch sets the rank's variables

    def load_rank(args, rank_index, world_size, pin=True):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    routed = []
    monkeypatch.setattr(rank, "load_rank", load_rank)
    launch = supervisor._Launch(ServeArgs(shard_in_process=True), lambda: (lambda *a, **k: routed.append(a)), 10.0)
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO")
    try:
        assert asyncio.run(launch.run()) == 1
    finally:
        logger.remove(sink)
    assert routed == [], "the router never starts without a model"
    assert any("the rank failed while loading: RuntimeError: CUDA out of memory" in line for line in lines), lines
    assert any("stopped (exit code 1)" in line for line in lines)
