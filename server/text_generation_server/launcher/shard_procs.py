"""The rank processes as the launcher sees them: started, polled and stopped, with their sockets.

Each rank is a `serve --shard-only` child that gets the launcher's settings and pid through
its environment (see rank) and rendezvouses with the others on a free local port. A rank is
ready once its unix socket exists; the launcher clears stale sockets before a start and
removes what a killed rank left behind after the stop.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

from loguru import logger

from text_generation_server.launcher.rank import LAUNCHER_PID_ENV, SERVE_ARGS_ENV
from text_generation_server.settings.serve_args import ServeArgs
from text_generation_server.settings.serve_flags import cpu_isa_environment, openmp_environment

_UNIX_PATH_MAX = 107


_PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10000
_handed_out: set[int] = set()


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel picks source ports from for outgoing connections (Linux's default when unknown)."""
    try:
        low, high = (int(v) for v in _PORT_RANGE_FILE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now, for a server that binds it a moment later (torch.distributed's store, a
    test's serve), taken outside the kernel's ephemeral range where possible.

    Why not bind(0): the port it reports is ephemeral, so any outgoing connection on the machine may
    take it as its source port before the server binds it (seen in CI: a metrics port "already in
    use" a second after it was chosen). Ports below the ephemeral range are only ever taken by
    someone binding them on purpose. A port is handed out once per process."""
    low, high = ephemeral_port_range()
    pools = [(a, b) for a, b in ((_LOWEST_PORT, low - 1), (high + 1, 65535)) if a <= b]
    rng = random.SystemRandom()
    for _ in range(200 if pools else 0):
        a, b = rng.choice(pools)
        port = rng.randint(a, b)
        if port in _handed_out:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room outside: the usual race
        s.bind((host, 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    """Popen reports death by signal as a negative code; name the signal, which is what an operator needs."""
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)


def shard_socket(uds_path: str, rank: int) -> str:
    return f"{uds_path}-{rank}"


def prepare_sockets(uds_path: str, world_size: int) -> None:
    """Removes stale sockets of a crashed run; refuses a path a live server still listens on."""
    for rank in range(world_size):
        path = shard_socket(uds_path, rank)
        if len(path.encode()) > _UNIX_PATH_MAX:
            raise ValueError(f"--uds-path is too long for a unix socket ({path!r} exceeds {_UNIX_PATH_MAX} bytes)")
        parent = Path(path).parent
        if not parent.is_dir():
            raise ValueError(f"--uds-path: folder {parent} does not exist")
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            continue
        if not stat.S_ISSOCK(mode):
            raise ValueError(f"--uds-path: {path} exists and is not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except OSError:
                os.unlink(path)  # nobody listens: left over from a crashed run
                logger.debug("removed stale socket {}", path)
                continue
        raise ValueError(f"--uds-path: a server is already listening on {path}; choose another --uds-path")


def remove_sockets(uds_path: str, world_size: int) -> None:
    """A SIGKILLed rank cannot remove its own socket."""
    for rank in range(world_size):
        path = shard_socket(uds_path, rank)
        try:
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)
        except FileNotFoundError:
            pass


class ShardProcesses:
    """The rank processes of one launch: start, poll, stop (SIGTERM, then SIGKILL)."""

    def __init__(self, args: ServeArgs, master_port: int):
        self.args = args
        self.master_port = master_port
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        payload = self.args.to_json()
        # Children inherit the signal mask: blocked, a SIGHUP sent to the process group while a rank
        # is still starting (before rank.ignore_hangup runs) stays pending instead of killing it.
        # SIGTERM blocked too: a rank takes it with sigwaitinfo, which names the sender, so a stop sent
        # to the whole group does not end the rank under the launcher's drain (process_exit.
        # wait_for_stop_signals). The launcher's own signals wait out the spawn and are delivered
        # when the mask is restored.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP, signal.SIGTERM})
        try:
            self._spawn(payload)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    def _spawn(self, payload: str) -> None:
        for rank in range(self.args.num_shard):
            env = dict(os.environ)
            env.update({
                SERVE_ARGS_ENV: payload,
                LAUNCHER_PID_ENV: str(os.getpid()),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(self.args.num_shard),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(self.master_port),
            })
            env.update(cpu_isa_environment(self.args.cpu_isa))  # before the rank imports torch
            env.update(openmp_environment(env))
            cmd = [sys.executable, "-m", "text_generation_server.cli", "serve", "--shard-only"]
            self.procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL))
            logger.debug("started rank {} as pid {}", rank, self.procs[-1].pid)

    def first_exited(self) -> tuple[int, int] | None:
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                return rank, code
        return None

    def all_ready(self) -> bool:
        return all(os.path.exists(shard_socket(self.args.uds_path, r)) for r in range(self.args.num_shard))

    async def stop(self, grace_s: float, hurry: asyncio.Event | None = None) -> None:
        """SIGTERM every live rank, SIGKILL what is left after `grace_s` (or once `hurry` is set), reap them all."""
        alive = [p for p in self.procs if p.poll() is None]
        for proc in alive:
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        hurried_already = hurry is not None and hurry.is_set()
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            if hurry is not None and hurry.is_set() and not hurried_already:
                break
            await asyncio.sleep(0.05)
        for rank, proc in enumerate(self.procs):
            if proc.poll() is None:
                logger.warning("rank {} did not stop within {:.0f} s; killing it", rank, grace_s)
                _signal(proc, signal.SIGKILL)
        for proc in self.procs:
            while proc.poll() is None:  # SIGKILL cannot be ignored; this ends at once
                await asyncio.sleep(0.02)
        remove_sockets(self.args.uds_path, self.args.num_shard)


def _signal(proc: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass
