"""CPU ranks and the router on disjoint cores (`serve --cpu-affinity`).

Why: on a CPU a decode step's forward is the rank's threads streaming weights through one core's
caches. Left to the scheduler, the router, the clients' streams and the rank's own event loop land
on the model thread's core from step to step: the forward then pays for the cache and the time
slices it loses. On the 2-core EPYC VM of BENCHMARKS.md, the embedded model's forward took 2.06-2.26
ms inside the rank against 1.6 ms in-process; with the rank on one core and the router and client on
the other, 1.76-1.92 ms. llama.cpp and vLLM's CPU backend bind their compute threads for the same
reason (vLLM: VLLM_CPU_OMP_THREADS_BIND).

The rule (one owner per fact: the rank decides its threads, launcher/rank.cpu_threads_per_rank, and
pins itself; the router only takes what the ranks left):
- the cores are those this process may run on (os.sched_getaffinity: a `taskset`, a container's
  cpuset), not the machine's count;
- when the ranks' threads leave a core over, rank r takes cores [1 + r*t, 1 + (r+1)*t) of them, and
  the first (and any other left over) is the router's;
- when they take every core, rank r takes [r*t, (r+1)*t) and the router is not pinned;
- nothing is pinned with one core, with OMP_NUM_THREADS set (the user chose the threads), with
  --cpu-affinity off, on a GPU, or with --shard-in-process (one process holds both).
Every thread of the process is pinned, those running already and (by inheritance) those made later.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from loguru import logger


def available_cpus() -> list[int]:
    """The cores this process may run on, in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux: every core, and no pinning (pin_threads says so)
        return list(range(os.cpu_count() or 1))


def rank_cpus(available: Sequence[int], rank: int, world_size: int, threads: int) -> list[int] | None:
    """The cores rank `rank` of `world_size` pins its `threads` threads to, or None (not pinned)."""
    if world_size < 1 or not 0 <= rank < world_size or threads < 1:
        raise ValueError(f"rank {rank} of {world_size} ranks with {threads} thread(s): no such rank")
    if len(available) <= 1 or threads * world_size > len(available):
        return None
    first = 1 if threads * world_size < len(available) else 0
    return list(available[first + rank * threads:first + (rank + 1) * threads])


def router_cpus(available: Sequence[int], ranks: Iterable[Iterable[int]]) -> list[int] | None:
    """The cores the router pins itself to: those no rank holds, or None where the ranks hold every
    core (or one rank is not pinned: its mask is every core)."""
    taken = {c for cpus in ranks for c in cpus}
    left = [c for c in available if c not in taken]
    return left if left and len(left) < len(available) else None


def pin_threads(cpus: Sequence[int]) -> bool:
    """Pins every thread of this process to `cpus` (threads made later inherit it from their maker).
    False where the system has no per-thread affinity."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return False
    done = False
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            done = True
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as exc:  # a mask the process may not take (a cpuset changed under it): stay unbound
            logger.warning("CPU affinity: cores {} not taken ({}); placement left to the OS", format_cpus(cpus), exc)
            return False
    return done


def pin_rank(mode: str, rank: int, world_size: int, threads: int) -> list[int] | None:
    """Pins this rank process per the module's rule; returns the cores, or None when not pinned."""
    if mode != "auto" or "OMP_NUM_THREADS" in os.environ:
        return None
    cpus = rank_cpus(available_cpus(), rank, world_size, threads)
    if cpus is None or not pin_threads(cpus):
        return None
    logger.info("rank {}: {} thread(s) pinned to core(s) {} (--cpu-affinity off leaves them to the OS)", rank,
                threads, format_cpus(cpus))
    return cpus


def pin_router(mode: str, rank_pids: Sequence[int]) -> list[int] | None:
    """Pins the router's process to the cores its ranks left over, read from the ranks' own masks
    (the ranks pin themselves once their thread count is known); None when nothing is left over."""
    if mode != "auto" or not rank_pids:
        return None
    try:
        masks = [os.sched_getaffinity(pid) for pid in rank_pids]
    except (AttributeError, OSError):  # a rank that ended is the supervisor's to report
        return None
    cpus = router_cpus(available_cpus(), masks)
    if cpus is None or not pin_threads(cpus):
        return None
    logger.info("router pinned to core(s) {}, beside its rank(s) on {}", format_cpus(cpus),
                " | ".join(format_cpus(sorted(m)) for m in masks))
    return cpus


def format_cpus(cpus: Sequence[int]) -> str:
    """0-3,8 style (taskset's and /proc's list form)."""
    parts: list[str] = []
    cpus = sorted(cpus)
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)
