"""launcher/cpu_affinity.py: which cores a CPU rank and the router take, and the pinning itself
(in child processes: pinning the test process would slow every later test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from text_generation_server.launcher import cpu_affinity as ca
from text_generation_server.settings.serve_args import ServeArgs


@pytest.mark.parametrize("available, world, threads, expected", [
    ([0, 1], 1, 1, [[1]]),  # the embedded model on 2 cores: one core left to the router
    ([0, 1], 1, 2, [[0, 1]]),  # a large model takes both: the router floats
    (list(range(16)), 2, 7, [list(range(1, 8)), list(range(8, 15))]),
    (list(range(16)), 2, 8, [list(range(0, 8)), list(range(8, 16))]),
    ([2, 3, 6, 7], 1, 3, [[3, 6, 7]]),  # a taskset or cpuset mask: its cores, not the machine's
    ([0, 1], 2, 1, [[0], [1]]),
])
def test_rank_cores_are_disjoint_and_leave_the_first_to_the_router(available, world, threads, expected):
    got = [ca.rank_cpus(available, r, world, threads) for r in range(world)]
    assert got == expected
    taken = [c for cpus in got for c in cpus]
    assert len(set(taken)) == len(taken)
    left = ca.router_cpus(available, got)
    if len(taken) < len(available):
        assert left == [c for c in available if c not in taken] and available[0] in left
    else:
        assert left is None


@pytest.mark.parametrize("available, world, threads", [([0], 1, 1), ([0, 1], 1, 3), ([0, 1, 2, 3], 2, 3)])
def test_nothing_is_pinned_where_the_threads_do_not_fit(available, world, threads):
    assert all(ca.rank_cpus(available, r, world, threads) is None for r in range(world))


def test_a_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match="rank 2 of 2"):
        ca.rank_cpus([0, 1, 2, 3], 2, 2, 1)
    with pytest.raises(ValueError, match="0 thread"):
        ca.rank_cpus([0, 1], 0, 1, 0)


def test_the_router_is_not_pinned_beside_an_unpinned_rank():
    assert ca.router_cpus([0, 1, 2, 3], [{0, 1, 2, 3}]) is None
    assert ca.router_cpus([0, 1, 2, 3], [{1, 2}, {3}]) == [0]


def test_cores_are_printed_as_ranges():
    assert ca.format_cpus([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert ca.format_cpus([5]) == "5"


def test_off_and_omp_num_threads_pin_nothing(monkeypatch):
    pinned = []
    monkeypatch.setattr(ca, "pin_threads", lambda cpus: pinned.append(cpus) or True)
    monkeypatch.setattr(ca, "available_cpus", lambda: [0, 1, 2, 3])
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert ca.pin_rank("off", 0, 1, 2) is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert ca.pin_rank("auto", 0, 1, 2) is None
    assert pinned == []
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert ca.pin_rank("auto", 0, 1, 2) == [1, 2]
    assert pinned == [[1, 2]]


def test_the_flag_takes_auto_or_off_and_names_itself_otherwise():
    assert ServeArgs(model="m").cpu_affinity == "auto"
    with pytest.raises(ValueError, match="--cpu-affinity"):
        ServeArgs(model="m", cpu_affinity="numa").validate()


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_pinning_covers_running_threads_and_the_ones_made_later():
    got = _run("""
        import json, os, threading
        from text_generation_server.launcher import cpu_affinity as ca
        target = [ca.available_cpus()[-1]]
        stop = threading.Event()
        before = threading.Thread(target=stop.wait); before.start()
        assert ca.pin_threads(target)
        after = threading.Thread(target=stop.wait); after.start()
        masks = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
        stop.set(); before.join(); after.join()
        print(json.dumps({"target": target, "masks": list(masks.values()), "threads": len(masks)}))
    """)
    assert got["threads"] == 3
    assert all(mask == got["target"] for mask in got["masks"])


def test_the_router_takes_the_cores_its_ranks_left():
    """A stand-in rank process pinned to the last core; the router (this child) takes the rest."""
    got = _run("""
        import json, os, subprocess, sys
        from text_generation_server.launcher import cpu_affinity as ca
        available = ca.available_cpus()
        rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            if len(available) > 1:
                os.sched_setaffinity(rank.pid, {available[-1]})
            mine = ca.pin_router("auto", [rank.pid])
            off = ca.router_cpus(available, [os.sched_getaffinity(rank.pid)])
            print(json.dumps({"available": available, "mine": mine, "expected": off,
                              "now": sorted(os.sched_getaffinity(0))}))
        finally:
            rank.kill()
    """)
    if len(got["available"]) > 1:
        assert got["mine"] == got["available"][:-1] == got["now"]
    else:  # one core: the rank holds it all and nothing is pinned
        assert got["mine"] is None and got["now"] == got["available"]


def test_a_mask_the_system_refuses_leaves_the_process_unbound(monkeypatch):
    def refuse(tid, cpus):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(ca.os, "sched_setaffinity", refuse)
    monkeypatch.setattr(ca, "available_cpus", lambda: [0, 1, 2, 3])
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert ca.pin_threads([1]) is False
    assert ca.pin_rank("auto", 0, 1, 2) is None
