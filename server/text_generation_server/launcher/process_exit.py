"""How a rank process ends: with its launcher, when stuck, and without interpreter teardown.

No rank outlives the launcher that started it: PR_SET_PDEATHSIG has Linux deliver a
signal when the launcher dies (even by SIGKILL), and a watchdog thread catches a launcher
that died before prctl ran. A rank blocked in a collective whose peer is gone cannot
finish its stop, so a timer ends it regardless; and a rank that is done leaves with
os._exit, because its native gloo/NCCL and gRPC threads make a normal exit slow or hang.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Callable

from loguru import logger

_PR_SET_PDEATHSIG = 1


def exit_process(code: int) -> None:
    """Ends the process without interpreter teardown, once everything worth cleaning up is cleaned up.

    A rank holds native gloo/NCCL and gRPC threads whose teardown takes seconds (and can
    hang when a peer is gone); the socket is already removed and logs are flushed here.
    """
    logger.complete()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def set_parent_death_signal(sig: signal.Signals = signal.SIGTERM) -> bool:
    """Asks Linux to send `sig` to this process when its parent dies; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        logger.warning("prctl(PR_SET_PDEATHSIG) failed: {}", os.strerror(ctypes.get_errno()))
        return False
    return True


def watch_parent(parent_pid: int, on_gone: Callable[[], None], interval_s: float = 0.5) -> threading.Thread:
    """Calls `on_gone` once the parent is gone (we are re-parented), including before prctl ran."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        on_gone()

    thread = threading.Thread(target=watch, name="parent-watchdog", daemon=True)
    thread.start()
    return thread


def wait_for_stop_signals(launcher_pid: int, on_launcher: Callable[[], None],
                          on_other: Callable[[int], None]) -> threading.Thread | None:
    """Hands each SIGTERM to `on_launcher` when the launcher sent it (its stop, or Linux's parent-death
    signal, which names the dying parent) and to `on_other` (with the sender's pid, 0 when unknown)
    otherwise; None where the platform cannot tell senders apart.

    A stop sent to the whole process group or cgroup (systemd's default KillMode=control-group,
    `kill -TERM -<pgid>`) reaches every rank together with the launcher. A rank that stopped on it
    would cut the launcher's drain short (in-flight requests failed, `serve` exiting 1 as if a rank
    had crashed); told apart by sender, the rank can let the launcher drain and stop it after.
    SIGTERM must be blocked in every thread for this (the launcher starts ranks with it blocked:
    shard_procs.ShardProcesses.start): it then stays pending until this thread takes it.
    """
    if not hasattr(signal, "sigwaitinfo"):
        return None
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # this thread and the threads it starts

    def wait() -> None:
        while True:
            info = signal.sigwaitinfo({signal.SIGTERM})
            if info.si_pid == launcher_pid:
                on_launcher()
            else:
                on_other(info.si_pid)

    thread = threading.Thread(target=wait, name="stop-signals", daemon=True)
    thread.start()
    return thread


def hard_exit_later(delay_s: float, code: int) -> None:
    """A rank blocked in a collective (its peer died) cannot finish; exit anyway after `delay_s`."""
    def bail() -> None:
        logger.warning("still running {:.0f} s after the stop request; exiting now", delay_s)
        logger.complete()
        os._exit(code)

    timer = threading.Timer(delay_s, bail)
    timer.daemon = True
    timer.start()
