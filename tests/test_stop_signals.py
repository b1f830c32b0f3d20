"""A rank tells its launcher's SIGTERM from anyone else's (launcher/process_exit.py
wait_for_stop_signals): a stop sent to the whole process group must not end a rank under the
launcher's drain. integration-tests/test_launcher.py sends one to a running `serve`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

CHILD = """
import os, signal, sys, threading
from text_generation_server.launcher.process_exit import wait_for_stop_signals
launcher = int(sys.argv[1])
done = threading.Event()
def on_launcher():
    print("launcher", flush=True)
    done.set()
def on_other(pid):
    print(f"other {pid}", flush=True)
assert wait_for_stop_signals(launcher, on_launcher, on_other) is not None
print("ready", flush=True)
done.wait(60)
"""


@pytest.mark.skipif(not hasattr(signal, "sigwaitinfo"), reason="no sigwaitinfo on this platform")
def test_the_launchers_sigterm_is_told_from_anyone_elses():
    # Started as the launcher starts ranks: SIGTERM blocked from the first instruction.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(os.getpid())], stdout=subprocess.PIPE, text=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    try:
        assert child.stdout.readline().strip() == "ready"
        subprocess.run([sys.executable, "-c", f"import os, signal; os.kill({child.pid}, signal.SIGTERM)"],
                       check=True)  # from another process
        line = child.stdout.readline().split()
        assert line[0] == "other" and int(line[1]) not in (0, os.getpid()), line
        assert child.poll() is None  # still running: a SIGTERM from outside stops nothing by itself
        os.kill(child.pid, signal.SIGTERM)  # from the "launcher"
        assert child.stdout.readline().strip() == "launcher"
        assert child.wait(30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
