"""Faults and abuse that test_launcher.py and test_serve.py do not already cover.

Already covered elsewhere (not repeated here):
- test_launcher.py: an idle rank SIGKILLed -> serve exits non-zero naming the rank, no orphans;
  SIGTERM during a request drains it and exits 0; a second SIGINT forces exit 130;
  SIGKILL of the launcher leaves no rank.
- test_serve.py: a cancelled stream frees its KV blocks; every invalid field -> INVALID_ARGUMENT;
  max_concurrent_requests -> RESOURCE_EXHAUSTED.

Here: a failure inside the model (in-process shard and router, the fault injected with a
torch forward hook, no test hook in production code); a rank killed mid-generation; a
client process SIGKILLed mid-stream; owner-only shard sockets; loopback-only listening
by default; the gRPC message size limit; the `health` command against a live server.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from conftest import clean_env, free_port, pid_alive
from grpc_health.v1 import health_pb2, health_pb2_grpc
from serve_client import (
    Completion, MetricsSnapshot, client_stub, generate, launch_serve, long_greedy_prompt, poll_metrics, request,
    rpc_error, scrape,
)

from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc
from text_generation_server.settings.serve_args import ServeArgs

MAX_MESSAGE_BYTES = 64 * 1024


# -- an in-process server: the real shard service and router over real sockets ------------------------------
class LayerFault:
    """A real failure inside the model: while armed, the hidden state entering one decoder
    layer loses a feature column, so the layer's own RMSNorm raises torch's shape error.
    `slow_decode_s` makes every decode step slower, to keep a request running meanwhile."""

    def __init__(self, layer):
        self.kind: str | None = None  # "prefill" or "decode": fire once on the next such forward
        self.min_rows = 0  # decode only: fire once the batch holds at least this many requests
        self.fired = 0
        self.slow_decode_s = 0.0
        self._lock = threading.Lock()
        self.handle = layer.register_forward_pre_hook(self._hook)

    def arm(self, kind: str, min_rows: int = 0) -> None:
        with self._lock:
            self.kind, self.min_rows = kind, min_rows

    def _hook(self, module, args):
        hidden, ctx = args
        meta = ctx.meta
        if not meta.is_prefill and self.slow_decode_s:
            time.sleep(self.slow_decode_s)
        with self._lock:
            kind = "prefill" if meta.is_prefill else "decode"
            if self.kind != kind or (kind == "decode" and hidden.shape[0] < self.min_rows):
                return None
            self.kind = None
            self.fired += 1
        return (hidden[..., :-1], ctx)


class InProcessServer:
    """serve_shard + run_router on one event loop in a thread; the model object stays reachable."""

    def __init__(self, model_dir: Path, sock_dir: Path):
        import torch

        from text_generation_server.models.loader import get_model

        torch.set_num_threads(1)
        self.model = get_model(str(model_dir))
        port, metrics_port = free_port(), free_port()
        self.args = ServeArgs(
            model=str(model_dir), port=port, metrics_port=metrics_port, uds_path=str(sock_dir / "inproc"),
            max_total_tokens=256, max_batch_prefill_tokens=512, max_batch_total_tokens=4096, memory_fraction=0.05,
        )
        self.fault = LayerFault(self.model.model.layers[1])
        self.port, self.metrics_port = port, metrics_port
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="inproc-server", daemon=True)
        self.channels: list[grpc.Channel] = []

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by the fixture, never swallowed
            self.error = exc

    async def _serve(self) -> None:
        from text_generation_server.router.main import run_router
        from text_generation_server.shard.service import serve_shard

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        shard_stop = asyncio.Event()
        shard = asyncio.create_task(serve_shard(self.model, self.args.uds_path, 0, 1, 0.05,
                                                self.args.max_batch_total_tokens, shard_stop))
        try:
            await run_router(self.args, [f"unix://{self.args.uds_path}-0"], self._stop)
        finally:
            shard_stop.set()
            await shard

    def start(self, timeout_s: float = 60.0) -> None:
        self._thread.start()
        health = health_pb2_grpc.HealthStub(self.channel())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.error is not None:
                raise AssertionError(f"the in-process server failed: {self.error!r}")
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise AssertionError("the in-process server did not start serving")

    def stop(self) -> None:
        for ch in self.channels:
            ch.close()
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)
        self.fault.handle.remove()

    def channel(self) -> grpc.Channel:
        ch = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.channels.append(ch)
        return ch

    def socket_path(self, rank: int) -> str:
        return f"{self.args.uds_path}-{rank}"


@pytest.fixture(scope="module")
def inproc(tiny_model, tmp_path_factory):
    server = InProcessServer(tiny_model, tmp_path_factory.mktemp("sock"))
    try:
        server.start()
        yield server
    finally:
        server.stop()
    assert server.error is None, f"the in-process server ended with {server.error!r}"


def _consume(call) -> tuple[list[cpb.GenerateStreamResponse], grpc.RpcError | None, float]:
    """All messages of a stream, the error that ended it (or None), and when it ended."""
    got = []
    try:
        for message in call:
            got.append(message)
    except grpc.RpcError as exc:
        return got, exc, time.monotonic()
    return got, None, time.monotonic()


def _long_prompts(stub, count: int, min_tokens: int, max_new_tokens: int) -> dict[str, Completion]:
    """Prompts whose greedy completions run at least min_tokens (a random model may emit EOS anywhere)."""
    found = {}
    for i in range(40):
        prompt = f"def f{i}(x):" if i % 2 else f"import m{i}\nclass C{i}:"
        done = generate(stub, request(prompt, max_new_tokens=max_new_tokens))
        if len(done.token_ids) >= min_tokens:
            found[prompt] = done
            if len(found) == count:
                return found
    raise AssertionError(f"only {len(found)} of 40 prompts give {min_tokens} greedy tokens")


def _layer_error(inproc: InProcessServer, rows: int) -> str:
    """What torch says about the corrupted input, reproduced outside the server (its first line)."""
    import torch

    norm = inproc.model.model.layers[1].input_norm
    with pytest.raises(RuntimeError) as info:
        norm(torch.zeros(rows, inproc.model.config.hidden_size - 1))
    return str(info.value).splitlines()[0]


def _failures(snap: MetricsSnapshot, reason: str) -> float:
    return snap.value("tgi_request_failure_total", err=reason)


def test_model_failure_in_decode_fails_its_requests_and_serving_goes_on(inproc):
    stub = cpb_grpc.TextGenerationStub(inproc.channel())
    alone = _long_prompts(stub, count=3, min_tokens=60, max_new_tokens=80)
    before = poll_metrics(inproc, lambda s: s.value("tgs_kv_blocks_used", None) == 0)
    fired = inproc.fault.fired
    inproc.fault.arm("decode", min_rows=3)  # fires once all three share a decode batch
    calls = [stub.GenerateStream(request(p, max_new_tokens=80), timeout=60) for p in alone]
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(_consume, calls))
    assert inproc.fault.fired == fired + 1, "the fault never fired: the three requests never shared a decode step"
    for (messages, error, _), (prompt, reference) in zip(results, alone.items()):
        assert error is not None, f"{prompt!r} completed although its batch failed"
        assert error.code() == grpc.StatusCode.INTERNAL, error
        assert "decode failed" in error.details() and "RuntimeError" in error.details(), error.details()
        assert _layer_error(inproc, rows=3) in error.details(), "the status must carry the model's own message"
        assert 1 <= len(messages) < len(reference.token_ids)
        assert [m.token.id for m in messages] == reference.token_ids[:len(messages)]

    after = scrape(inproc)  # the failure is settled by the time its status reaches the client
    assert after.value("tgs_kv_blocks_used", None) == 0
    assert after.value("tgs_kv_blocks_free", None) == before.value("tgs_kv_blocks_free", None)
    assert after.value("tgi_batch_current_size", None) == 0 and after.value("tgi_queue_size", None) == 0
    assert _failures(after, "decode") - _failures(before, "decode") == 3
    failed_steps = after.value("tgi_batch_inference_failure_total", method="decode")
    assert failed_steps - before.value("tgi_batch_inference_failure_total", method="decode") == 1

    # Recovered: the same requests, together again, give their single-request answers.
    with ThreadPoolExecutor(max_workers=3) as pool:
        again = list(pool.map(lambda p: generate(stub, request(p, max_new_tokens=80)), alone))
    assert again == list(alone.values())
    health = health_pb2_grpc.HealthStub(inproc.channel())
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING


def test_model_failure_in_prefill_fails_only_the_new_request(inproc):
    stub = cpb_grpc.TextGenerationStub(inproc.channel())
    (prompt, reference), = _long_prompts(stub, count=1, min_tokens=60, max_new_tokens=80).items()
    before = poll_metrics(inproc, lambda s: s.value("tgs_kv_blocks_used", None) == 0)
    fired = inproc.fault.fired
    inproc.fault.slow_decode_s = 0.02  # the running request outlives the failed prefill by a wide margin
    try:
        call = stub.GenerateStream(request(prompt, max_new_tokens=80), timeout=60)
        first = next(call)  # prefilled: now decoding
        inproc.fault.arm("prefill")
        error = rpc_error(stub.Generate, request("class Broken:", max_new_tokens=5), timeout=60)
        failed_at = time.monotonic()
        rest, stream_error, ended_at = _consume(call)
    finally:
        inproc.fault.slow_decode_s = 0.0
    assert inproc.fault.fired == fired + 1
    assert error.code() == grpc.StatusCode.INTERNAL, error
    assert "prefill failed" in error.details() and "RuntimeError" in error.details(), error.details()
    assert stream_error is None, f"the running request was failed too: {stream_error}"
    assert ended_at > failed_at, "the running request had finished before the failure; nothing was tested"
    assert [m.token.id for m in [first, *rest]] == reference.token_ids
    assert rest[-1].generated_text == reference.text

    after = poll_metrics(inproc, lambda s: s.value("tgs_kv_blocks_used", None) == 0)
    assert _failures(after, "prefill") - _failures(before, "prefill") == 1
    assert after.value("tgi_request_success_total") - before.value("tgi_request_success_total") == 1


def test_model_failure_frees_the_blocks_a_shard_assigned_itself(inproc):
    """A TGI-style caller may leave block assignment to the shard; a failed step must not leak them."""
    from text_generation_server.pb.generate.v3 import generate_pb2 as spb
    from text_generation_server.pb.generate.v3 import generate_pb2_grpc as spb_grpc

    poll_metrics(inproc, lambda s: s.value("tgs_kv_blocks_used", None) == 0)  # the router is idle
    channel = grpc.insecure_channel(f"unix://{inproc.socket_path(0)}")
    inproc.channels.append(channel)
    shard = spb_grpc.TextGenerationServiceStub(channel)
    allocator = inproc.model.allocator
    free_before = allocator.free_blocks
    greedy = spb.NextTokenChooserParameters(temperature=1.0, top_p=1.0, typical_p=1.0, repetition_penalty=1.0)
    own = 10**12
    req = spb.Request(id=own, inputs="def f(x):", parameters=greedy, add_special_tokens=True,
                      stopping_parameters=spb.StoppingCriteriaParameters(max_new_tokens=40, ignore_eos_token=True))
    # Armed first: the shard computes the batch's first decode ahead as soon as the prefill answers,
    # and the Decode below then reports that step's failure.
    inproc.fault.arm("decode", min_rows=1)
    first = shard.Prefill(spb.PrefillRequest(batch=spb.Batch(id=own, requests=[req], size=1)), timeout=30)
    assert allocator.free_blocks < free_before, "the shard should have assigned blocks itself"
    err = rpc_error(shard.Decode, spb.DecodeRequest(batches=[first.batch]), timeout=30)
    assert err.code() == grpc.StatusCode.INTERNAL and "RuntimeError" in err.details(), err.details()
    assert allocator.free_blocks == free_before, "the failed batch kept its KV blocks"
    shard.ClearCache(spb.ClearCacheRequest(id=own), timeout=30)  # the router's follow-up is harmless
    missing = rpc_error(shard.Decode, spb.DecodeRequest(batches=[first.batch]), timeout=30)
    assert missing.code() == grpc.StatusCode.NOT_FOUND
    stub = cpb_grpc.TextGenerationStub(inproc.channel())
    assert generate(stub, request("def f(x):", max_new_tokens=4)).token_ids


# -- a rank killed mid-generation --------------------------------------------------------------------------
def test_rank_killed_mid_generation_stops_serve_and_fails_the_stream(tiny_model, start_serve):
    server = start_serve(tiny_model, num_shard=2)
    server.wait_serving()
    shards = server.shard_pids()
    assert sorted(shards) == [0, 1]
    stub = client_stub(server)
    prompt = long_greedy_prompt(stub, min_tokens=150)
    call = stub.GenerateStream(request(prompt, max_new_tokens=200), timeout=60)
    got = [next(call) for _ in range(3)]
    os.kill(shards[1], signal.SIGKILL)
    killed_at = time.monotonic()
    rest, error, ended_at = _consume(call)

    assert error is not None, f"the stream completed ({len(got) + len(rest)} tokens) although rank 1 died"
    assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL), error
    assert error.details(), "the client must learn why its stream ended"
    assert ended_at - killed_at < 10
    assert server.wait_exit(15) != 0
    assert time.monotonic() - killed_at < 15
    assert "shard rank 1 exited with code -9" in server.log()
    assert wait_gone(list(shards.values()), 5), "a rank outlived serve"
    assert not any(os.path.exists(server.socket_path(r)) for r in range(2))


def wait_gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# -- abuse and security defaults on one real serve --------------------------------------------------------
@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """serve with default --hostname, a small --max-message-bytes, started under umask 000."""
    sock_dir = tmp_path_factory.mktemp("sock")
    old = os.umask(0)  # the most permissive umask a deployment could have; sockets must stay private
    try:
        proc = launch_serve(tiny_model, sock_dir, tmp_path_factory.mktemp("logs"),
                            "--max-message-bytes", str(MAX_MESSAGE_BYTES), name="abuse")
    finally:
        os.umask(old)
    try:
        proc.wait_serving()
        yield proc
    finally:
        proc.cleanup()


def test_shard_socket_is_owner_only(served):
    info = os.stat(served.socket_path(0))
    assert stat.S_ISSOCK(info.st_mode)
    assert info.st_uid == os.getuid()
    assert info.st_mode & 0o077 == 0, f"socket mode {oct(info.st_mode & 0o777)}: group/others can connect"


def _listening(port: int) -> list[str]:
    """Addresses with a TCP socket in LISTEN on `port` (this network namespace, from /proc/net)."""
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        path = Path("/proc/net") / table
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if fields[3] != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
            found.append(socket.inet_ntop(family, raw))
    return found


def _own_ipv4_addresses() -> list[str]:
    """This machine's IPv4 interface addresses (SIOCGIFADDR per interface; no traffic leaves)."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            found.append(socket.inet_ntoa(packed[20:24]))
    return found


def test_listens_on_loopback_only_by_default(served):
    loopback = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
    for port in (served.port, served.metrics_port):
        addresses = _listening(port)
        assert addresses, f"nothing listens on port {port}"
        assert set(addresses) <= loopback, f"port {port} listens on {addresses}"
    for address in _own_ipv4_addresses():
        if address.startswith("127."):
            continue
        with socket.socket() as s:
            s.settimeout(2)
            assert s.connect_ex((address, served.port)) != 0, f"the gRPC port answers on {address}"


def test_message_over_max_message_bytes_is_refused(served):
    stub = client_stub(served)
    huge = request("x" * (MAX_MESSAGE_BYTES + 1024), max_new_tokens=1)
    for call in (stub.Generate, stub.GenerateStream):
        err = rpc_error(call, huge, timeout=30)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
        assert "larger than max" in err.details(), err.details()
    assert generate(stub, request("def f(x):", max_new_tokens=4)).token_ids  # still serving


CLIENT = r"""
import sys, grpc
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc
stub = cpb_grpc.TextGenerationStub(grpc.insecure_channel("127.0.0.1:" + sys.argv[1]))
params = cpb.GenerateParameters(max_new_tokens=int(sys.argv[3]))
stream = stub.GenerateStream(cpb.GenerateRequest(inputs=sys.argv[2], parameters=params))
next(stream)
print("streaming", flush=True)
sys.stdin.read()  # until killed
"""


def test_client_killed_mid_stream_frees_its_blocks(served):
    stub = client_stub(served)
    prompt = long_greedy_prompt(stub, min_tokens=150)
    before = poll_metrics(served, lambda s: s.value("tgs_kv_blocks_used", None) == 0)
    client = subprocess.Popen([sys.executable, "-c", CLIENT, str(served.port), prompt, "200"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=clean_env())
    try:
        assert client.stdout.readline().strip() == b"streaming", "the client did not start streaming"
        held = scrape(served)
        os.kill(client.pid, signal.SIGKILL)
        client.wait(timeout=10)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    assert held.value("tgs_kv_blocks_used", None) > 0, "the request was no longer running when the client died"
    cancelled = before.value("tgs_request_cancelled_total")
    after = poll_metrics(served, lambda s: s.value("tgs_kv_blocks_used", None) == 0
                         and s.value("tgs_request_cancelled_total") == cancelled + 1)
    assert after.value("tgs_kv_blocks_free", None) == before.value("tgs_kv_blocks_free", None)
    assert after.value("tgi_batch_current_size", None) == 0
    assert after.value("tgi_request_success_total") == before.value("tgi_request_success_total")
    assert generate(stub, request(prompt, max_new_tokens=5)).token_ids


def test_health_command_reports_serving(served):
    exe = Path(sys.executable).parent / "text-generation-server"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "text_generation_server.cli"]
    done = subprocess.run(cmd + ["health", "--port", str(served.port)], capture_output=True, text=True,
                          timeout=60, env=clean_env())
    assert done.returncode == 0, done.stderr
    assert "SERVING" in done.stdout


# -- nothing unpickles or runs code from a checkpoint, outside `convert` ------------------------------------
UNPICKLERS = {("torch", "load"), ("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler"),
              ("numpy", "load"), ("np", "load"), ("joblib", "load"), ("dill", "load"), ("marshal", "loads")}
CONVERT = Path("server") / "text_generation_server" / "jobs" / "convert.py"


def test_no_unpickling_or_remote_code_outside_convert():
    """A model folder is data: only `convert` unpickles (weights_only=True); nothing runs its code."""
    import ast

    repo = Path(__file__).resolve().parents[1]
    found, convert_loads = [], []
    for folder in ("server", "quantizers", "kernels"):
        for path in sorted((repo / folder).rglob("*.py")):
            rel = path.relative_to(repo)
            tree = ast.parse(path.read_text(), filename=str(rel))
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = (f.value.id, f.attr) if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) \
                        else None
                    if name in UNPICKLERS:
                        if rel == CONVERT and name == ("torch", "load"):
                            convert_loads.append(node)
                        else:
                            found.append(f"{rel}:{node.lineno} {name[0]}.{name[1]}")
                    if isinstance(f, ast.Name) and f.id in ("exec", "eval", "__import__"):
                        found.append(f"{rel}:{node.lineno} {f.id}()")
                    for kw in node.keywords:
                        if kw.arg == "trust_remote_code":
                            found.append(f"{rel}:{node.lineno} trust_remote_code")
    assert not found, "unpickling or code execution outside convert: " + ", ".join(found)
    assert convert_loads, "convert no longer calls torch.load: update this test"
    for call in convert_loads:
        weights_only = [kw for kw in call.keywords if kw.arg == "weights_only"]
        assert weights_only and isinstance(weights_only[0].value, ast.Constant) and weights_only[0].value.value is True
