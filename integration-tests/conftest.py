"""Real `text-generation-server serve` processes for integration tests.

Each server runs in its own session (so cleanup can kill the launcher and every
rank as one process group) on free TCP ports, with a unique --uds-path under the
test's tmp dir and limits small enough for a CPU-only machine. Output goes to a
log file, never a pipe, so a chatty server cannot block on a full pipe buffer.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from text_generation_server.launcher import shard_procs
from text_generation_server.cli.client_channel import ClientOptions

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

SMALL_LIMITS = [
    "--max-batch-total-tokens", "4096",
    "--max-total-tokens", "256",
    "--max-batch-prefill-tokens", "512",
    "--memory-fraction", "0.05",
]
# Variables a surrounding launcher or torchrun may have set, or that would make a test server
# demand a key or TLS it was not started with; a test server must not inherit them.
_INHERITED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TGS_SERVE_ARGS", "TGS_LAUNCHER_PID",
              "API_KEY", "API_KEY_FILE", "API_KEY_PROTECTS_HEALTH", "TLS_CERT_PATH", "TLS_KEY_PATH",
              "TLS_CLIENT_CA_PATH", "METRICS_HOSTNAME")


def free_port() -> int:
    """Outside the ephemeral range, so no client connection of this run can take it first."""
    return shard_procs.free_port()


def serve_command() -> list[str]:
    """The installed console script when it sits beside this interpreter, else `python -m`."""
    script = Path(sys.executable).parent / "text-generation-server"
    if script.exists():
        return [str(script), "serve"]
    return [sys.executable, "-m", "text_generation_server.cli", "serve"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _INHERITED}
    env["OMP_NUM_THREADS"] = "1"  # two cores shared with other test runs
    # Served ranks keep the CPU kernels' static choices, as the in-process references the tests compare
    # them with (no warmup there): a measured choice (kernels/cpu_tuning.py) may round differently.
    env.setdefault("TGS_CPU_TUNING", "0")
    env.update(extra)
    return env


# -- processes, through psutil when installed, else /proc ------------------------------------------
try:
    import psutil
except ImportError:  # pragma: no cover - depends on the environment
    psutil = None


def pid_alive(pid: int) -> bool:
    """True for a running process; a zombie (exited, not yet reaped) counts as gone."""
    if psutil is not None:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def children_of(pid: int) -> list[int]:
    if psutil is not None:
        try:
            return [c.pid for c in psutil.Process(pid).children()]
        except psutil.NoSuchProcess:
            return []
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.name))
    return found


def env_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


# -- calls with an API key ------------------------------------------------------------------------------
class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                            "compression")),
    grpc.ClientCallDetails,
):
    pass


class MetadataInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                          grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds fixed metadata (the API key) to every call of a channel, so test code that builds
    stubs from a channel need not know whether the server checks keys."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]):
        self.metadata = metadata

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(details.method, details.timeout, [*(details.metadata or ()), *self.metadata],
                            details.credentials, details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def client_channel(target: str, client: ClientOptions, options=()) -> grpc.Channel:
    """`client`'s channel (plaintext or TLS) with its API key on every call."""
    channel = client.channel(target, options)
    return grpc.intercept_channel(channel, MetadataInterceptor(client.metadata)) if client.metadata else channel


# -- one server --------------------------------------------------------------------------------------
@dataclass
class ServeProcess:
    proc: subprocess.Popen
    port: int
    metrics_port: int
    uds_path: str
    log_path: Path
    num_shard: int
    channels: list[grpc.Channel] = field(default_factory=list)
    client: ClientOptions = field(default_factory=ClientOptions)  # how channel() calls: API key, TLS

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def socket_path(self, rank: int) -> str:
        return f"{self.uds_path}-{rank}"

    def channel(self, client: ClientOptions | None = None, fresh: bool = False) -> grpc.Channel:
        """A channel to the client API as `client` (default: the server's own ClientOptions) calls.
        `fresh`: its own connection, never one shared with another channel, so it does a TLS
        handshake of its own."""
        options = [("grpc.use_local_subchannel_pool", 1)] if fresh else []
        ch = client_channel(f"127.0.0.1:{self.port}", self.client if client is None else client, options)
        self.channels.append(ch)
        return ch

    def shard_pids(self) -> dict[int, int]:
        """rank -> pid of the launcher's rank processes (RANK from each child's environment)."""
        ranks = {}
        for child in children_of(self.pid):
            rank = env_of(child).get("RANK")
            if rank is not None and pid_alive(child):
                ranks[int(rank)] = child
        return ranks

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve (pid {self.pid}) still running after {timeout_s:.0f} s; log:\n{self.log()[-4000:]}")

    def wait_serving(self, timeout_s: float = 90.0) -> None:
        """Until the router's grpc.health.v1 reports SERVING; fails early with the log if serve exits."""
        stub = health_pb2_grpc.HealthStub(self.channel())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"serve exited with {self.proc.returncode} before serving; log:\n{self.log()[-4000:]}")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        pytest.fail(f"serve not SERVING after {timeout_s:.0f} s; log:\n{self.log()[-4000:]}")

    def wait_sockets(self, timeout_s: float = 60.0) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"exited with {self.proc.returncode} before listening; log:\n{self.log()[-4000:]}")
            return all(os.path.exists(self.socket_path(r)) for r in range(self.num_shard))

        if not wait_until(ready, timeout_s, 0.1):
            pytest.fail(f"no socket at {self.uds_path}-<rank> after {timeout_s:.0f} s; log:\n{self.log()[-4000:]}")

    def cleanup(self) -> None:
        for ch in self.channels:
            ch.close()
        shards = list(self.shard_pids().values()) if self.proc.poll() is None else []
        try:
            os.killpg(self.pid, signal.SIGKILL)  # the launcher's session: launcher and ranks
        except ProcessLookupError:
            pass
        for pid in shards:  # a rank that left the group still must not survive a test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for rank in range(self.num_shard):
            try:
                os.unlink(self.socket_path(rank))
            except FileNotFoundError:
                pass


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random two-layer Llama with its tokenizer: loads in well under a second."""
    import torch
    from helpers import write_checkpoint

    folder = tmp_path_factory.mktemp("tiny-llama")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        write_checkpoint(folder, "llama", seed=0)
    finally:
        torch.set_num_threads(threads)
    return folder


@pytest.fixture
def start_serve(tmp_path) -> Callable[..., ServeProcess]:
    """start_serve(model, *flags, num_shard=1, limits=True, env=None, uds_path=None, client=None) -> ServeProcess,
    cleaned up; `client` says how its channels call (API key, TLS)."""
    started: list[ServeProcess] = []
    sock_dir = tmp_path / "sock"  # pytest keeps these names short, well inside the unix socket limit
    sock_dir.mkdir(mode=0o700)

    def start(model: str | Path | None, *flags: str, num_shard: int = 1, limits: bool = True,
              env: dict[str, str] | None = None, uds_path: str | None = None,
              client: ClientOptions | None = None) -> ServeProcess:
        port, metrics_port = free_port(), free_port()
        uds_path = uds_path or str(sock_dir / f"s{len(started)}")
        log_path = tmp_path / f"serve-{len(started)}.log"
        cmd = serve_command() + ([str(model)] if model is not None else [])
        cmd += ["--port", str(port), "--metrics-port", str(metrics_port), "--uds-path", uds_path,
                "--num-shard", str(num_shard)]
        cmd += (SMALL_LIMITS if limits else []) + list(flags)
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env if env is not None else clean_env(), start_new_session=True)
        server = ServeProcess(proc, port, metrics_port, uds_path, log_path, num_shard, client=client or ClientOptions())
        started.append(server)
        return server

    yield start
    for server in started:
        server.cleanup()
