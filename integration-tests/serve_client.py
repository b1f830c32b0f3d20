"""Client-side helpers for driving a real `serve` process: stubs, requests, streams, /metrics.

Kept apart from conftest.py (another helper owns it) so test modules share one way
of building requests, collecting streams and reading Prometheus counters.
"""

from __future__ import annotations

import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import grpc
from conftest import SMALL_LIMITS, ServeProcess, clean_env, free_port, serve_command
from prometheus_client.parser import text_string_to_metric_families

from text_generation_server.cli.client_channel import ClientOptions
from text_generation_server.pb.generate.v3 import generate_pb2_grpc as spb_grpc
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc

RPC_TIMEOUT_S = 60.0
# Code-like text of every length the tiny tokenizer knows; prompts are slices of it.
CORPUS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
    "import os\nimport sys\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n"
    "        return self.items.pop()\n\nThe quick brown fox jumps over the lazy dog. "
)


# -- servers -------------------------------------------------------------------------------------------
def launch_serve(model: str | Path | None, sock_dir: Path, log_dir: Path, *flags: str, num_shard: int = 1,
                 name: str = "serve", client: ClientOptions | None = None,
                 env: dict[str, str] | None = None) -> ServeProcess:
    """Starts `serve` like conftest's start_serve, for fixtures wider than one test (module scope).

    The caller owns cleanup (ServeProcess.cleanup()); conftest's start_serve is
    function-scoped, so a server shared by a whole module is built here instead. `client`
    is how the server's channels call it (API key, TLS); `env` is added to the clean environment.
    """
    port, metrics_port = free_port(), free_port()
    uds_path = str(sock_dir / name)
    log_path = log_dir / f"{name}.log"
    cmd = serve_command() + ([str(model)] if model is not None else [])
    cmd += ["--port", str(port), "--metrics-port", str(metrics_port), "--uds-path", uds_path,
            "--num-shard", str(num_shard), *SMALL_LIMITS, *flags]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=clean_env(**(env or {})), start_new_session=True)
    return ServeProcess(proc, port, metrics_port, uds_path, log_path, num_shard, client=client or ClientOptions())


def client_stub(server: ServeProcess) -> cpb_grpc.TextGenerationStub:
    return cpb_grpc.TextGenerationStub(server.channel())


def shard_stub(server: ServeProcess, rank: int = 0) -> spb_grpc.TextGenerationServiceStub:
    """A generate.v3 client on the rank's unix socket, closed with the server's other channels."""
    channel = grpc.insecure_channel(f"unix://{server.socket_path(rank)}")
    server.channels.append(channel)
    return spb_grpc.TextGenerationServiceStub(channel)


# -- requests and answers ------------------------------------------------------------------------------
def request(inputs: str, **parameters) -> cpb.GenerateRequest:
    """A GenerateRequest; unspecified parameters stay unset, so greedy unless told otherwise."""
    return cpb.GenerateRequest(inputs=inputs, parameters=cpb.GenerateParameters(**parameters))


@dataclass
class Completion:
    """What one request produced, in a form that compares across Generate and GenerateStream."""

    text: str
    token_ids: list[int]
    finish_reason: int

    @classmethod
    def from_response(cls, resp: cpb.GenerateResponse) -> "Completion":
        return cls(resp.generated_text, [t.id for t in resp.details.tokens], resp.details.finish_reason)

    @classmethod
    def from_stream(cls, messages: list[cpb.GenerateStreamResponse]) -> "Completion":
        last = messages[-1]
        return cls(last.generated_text, [m.token.id for m in messages], last.details.finish_reason)


def collect_stream(stub: cpb_grpc.TextGenerationStub, req: cpb.GenerateRequest,
                   timeout: float = RPC_TIMEOUT_S) -> list[cpb.GenerateStreamResponse]:
    return list(stub.GenerateStream(req, timeout=timeout))


def generate(stub: cpb_grpc.TextGenerationStub, req: cpb.GenerateRequest,
             timeout: float = RPC_TIMEOUT_S) -> Completion:
    """Generate with details forced on, so token ids can be compared."""
    forced = cpb.GenerateRequest()
    forced.CopyFrom(req)
    forced.parameters.details = True
    return Completion.from_response(stub.Generate(forced, timeout=timeout))


def stream_completion(stub: cpb_grpc.TextGenerationStub, req: cpb.GenerateRequest,
                      timeout: float = RPC_TIMEOUT_S) -> Completion:
    forced = cpb.GenerateRequest()
    forced.CopyFrom(req)
    forced.parameters.details = True
    return Completion.from_stream(collect_stream(stub, forced, timeout))


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:
    """The RpcError a unary call (or the first message of a stream) raises; AssertionError if none."""
    try:
        result = call(*args, **kwargs)
        if hasattr(result, "__next__"):
            next(result)
    except grpc.RpcError as exc:
        return exc
    raise AssertionError(f"{getattr(call, '_method', call)!r} succeeded where an error was expected")


def long_greedy_prompt(stub: cpb_grpc.TextGenerationStub, min_tokens: int, max_new_tokens: int = 200,
                       candidates: Iterable[str] = ("def fibonacci(n):", "import os\nimport sys\n",
                                                    "The quick brown fox", "class Stack:", "x = ")) -> str:
    """A prompt whose greedy completion does not hit EOS early (a random model may emit it anywhere)."""
    lengths = {}
    for prompt in candidates:
        done = generate(stub, request(prompt, max_new_tokens=max_new_tokens))
        if len(done.token_ids) >= min_tokens:
            return prompt
        lengths[prompt] = len(done.token_ids)
    raise AssertionError(f"no prompt gives {min_tokens} greedy tokens; got {lengths}")


# -- /metrics --------------------------------------------------------------------------------------------
class MetricsSnapshot:
    """One scrape of /metrics, parsed with prometheus_client's own text parser."""

    def __init__(self, text: str):
        self.text = text
        # Parsing the whole text is itself a check: a malformed line raises ValueError here.
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples: dict[tuple[str, frozenset], float] = {}
        for family in self.families.values():
            for s in family.samples:
                self.samples[(s.name, frozenset(s.labels.items()))] = s.value

    def value(self, sample: str, default: float | None = 0.0, **labels: str) -> float:
        """The sum over the sample's series that carry `labels` (others, e.g. model_name, are
        summed over); counters and labelled series not yet created read as `default`."""
        wanted = set(labels.items())
        found = [v for (name, series), v in self.samples.items() if name == sample and wanted <= series]
        if found:
            return sum(found)
        if default is None:
            raise KeyError(f"no sample {sample}{labels or ''} in /metrics")
        return default


def scrape(server: ServeProcess, timeout: float = 10.0) -> MetricsSnapshot:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        assert resp.status == 200, f"{url} answered {resp.status}"
        return MetricsSnapshot(resp.read().decode())


def poll_metrics(server: ServeProcess, predicate, timeout_s: float = 10.0) -> MetricsSnapshot:
    """Scrapes until predicate(snapshot) holds; the last snapshot goes into the failure message."""
    deadline = time.monotonic() + timeout_s
    snap = scrape(server)
    while not predicate(snap):
        if time.monotonic() > deadline:
            lines = [line for line in snap.text.splitlines() if line.startswith(("tgs_", "tgi_request", "tgi_queue"))]
            raise AssertionError("metrics never reached the expected state; last scrape:\n" + "\n".join(lines))
        time.sleep(0.05)
        snap = scrape(server)
    return snap


def launch_shard(model: str | Path, sock_dir: Path, log_dir: Path, rank: int, world_size: int, master_port: int,
                 *flags: str, name: str = "shard") -> ServeProcess:
    """One rank of `serve --shard-only`, started the way TGI's launcher starts a shard: RANK,
    WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment, the socket prefix as --uds-path
    (the rank listens on `{uds_path}-{rank}`). The caller owns cleanup (ServeProcess.cleanup())."""
    uds_path = str(sock_dir / name)
    log_path = log_dir / f"{name}-{rank}.log"
    cmd = serve_command() + [str(model), "--shard-only", "--uds-path", uds_path, *flags]
    env = clean_env(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
    return ServeProcess(proc, 0, 0, uds_path, log_path, world_size)
