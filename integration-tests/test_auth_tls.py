"""Who may call, end to end: API keys and TLS on the client port of real `serve` processes.

Three servers on the tiny Llama, one per configuration, shared by the module and started
together (startup is the slow part):

- keys: API_KEY="env-key-1,env-key-2" (TGI's variable, two keys for rotation) plus
  --api-key-file; plaintext; health and reflection open.
- tls: --tls-cert-path/--tls-key-path from a CA made here, --api-key and
  --api-key-protects-health; its certificate is rotated under an open stream.
- mtls: TLS plus --tls-client-ca-path (client certificates required), no key.

Tests run in file order; the rotation tests come last for their server.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from conftest import REPO, clean_env, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from pki import Authority
from serve_client import Completion, collect_stream, generate, launch_serve, request, rpc_error, scrape

from text_generation_server.cli.client_channel import ClientOptions
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc
from text_generation_server.router.auth import REFUSAL

ENV_KEYS = ("env-key-1", "env-key-2")
TLS_KEY = "tls-key"
PROMPT = "def fibonacci(n):"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
CLI = [str(Path(sys.executable).parent / "text-generation-server")]
if not Path(CLI[0]).exists():
    CLI = [sys.executable, "-m", "text_generation_server.cli"]


# -- certificates and servers ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("pki")
    authorities = {name: Authority(f"{name} CA") for name in ("serving", "next", "clients", "rogue")}
    paths = {}
    for name, authority in authorities.items():
        paths[f"{name}_ca"] = folder / f"{name}-ca.crt"
        paths[f"{name}_ca"].write_bytes(authority.cert)
    paths["tls_cert"], paths["tls_key"] = authorities["serving"].issue("tls server").write(folder, "tls")
    paths["mtls_cert"], paths["mtls_key"] = authorities["serving"].issue("mtls server").write(folder, "mtls")
    paths["client_cert"], paths["client_key"] = authorities["clients"].issue("client", server=False).write(
        folder, "client")
    paths["rogue_cert"], paths["rogue_key"] = authorities["rogue"].issue("rogue", server=False).write(
        folder, "rogue")
    paths["keys"] = folder / "keys.txt"
    paths["keys"].write_text("# one key per line\nfile-key-1\n")
    return {"folder": folder, "next": authorities["next"], **{k: str(v) for k, v in paths.items()}}


def tls_client(pki: dict, **extra) -> ClientOptions:
    return ClientOptions(ca_path=pki["serving_ca"], **extra)


def mtls_client(pki: dict, who: str = "client") -> ClientOptions:
    return ClientOptions(ca_path=pki["serving_ca"], cert_path=pki[f"{who}_cert"], key_path=pki[f"{who}_key"])


@pytest.fixture(scope="module")
def servers(tiny_model, pki, tmp_path_factory):
    sock_dir, log_dir = tmp_path_factory.mktemp("sock"), tmp_path_factory.mktemp("logs")
    started = {
        "keys": launch_serve(tiny_model, sock_dir, log_dir, "--api-key-file", pki["keys"], name="keys",
                             env={"API_KEY": ",".join(ENV_KEYS)}, client=ClientOptions(api_key=ENV_KEYS[0])),
        "tls": launch_serve(tiny_model, sock_dir, log_dir, "--tls-cert-path", pki["tls_cert"], "--tls-key-path",
                            pki["tls_key"], "--api-key", TLS_KEY, "--api-key-protects-health", name="tls",
                            client=tls_client(pki, api_key=TLS_KEY)),
        "mtls": launch_serve(tiny_model, sock_dir, log_dir, "--tls-cert-path", pki["mtls_cert"], "--tls-key-path",
                             pki["mtls_key"], "--tls-client-ca-path", pki["clients_ca"], name="mtls",
                             client=mtls_client(pki)),
    }
    try:
        for server in started.values():
            server.wait_serving(timeout_s=180)
        yield started
    finally:
        for server in started.values():
            server.cleanup()


@pytest.fixture(scope="module")
def keys_server(servers):
    return servers["keys"]


@pytest.fixture(scope="module")
def tls_server(servers):
    return servers["tls"]


@pytest.fixture(scope="module")
def mtls_server(servers):
    return servers["mtls"]


def stub_for(server, client: ClientOptions, fresh: bool = False) -> cpb_grpc.TextGenerationStub:
    return cpb_grpc.TextGenerationStub(server.channel(client, fresh=fresh))


def assert_serves(stub: cpb_grpc.TextGenerationStub) -> None:
    """A unary and a streaming call both succeed, and agree."""
    req = request(PROMPT, max_new_tokens=6)
    whole = generate(stub, req)
    streamed = Completion.from_stream(collect_stream(stub, request(PROMPT, max_new_tokens=6, details=True)))
    assert whole == streamed and len(whole.token_ids) >= 1


def refused_calls(stub: cpb_grpc.TextGenerationStub, metadata=()) -> list[grpc.RpcError]:
    """The error of each client-API method: unary, server streaming, and the two small ones."""
    kw = {"timeout": 10, "metadata": metadata}
    return [
        rpc_error(stub.Generate, request(PROMPT, max_new_tokens=4), **kw),
        rpc_error(stub.GenerateStream, request(PROMPT, max_new_tokens=4), **kw),
        rpc_error(stub.Tokenize, cpb.TokenizeRequest(inputs=PROMPT), **kw),
        rpc_error(stub.Info, cpb.InfoRequest(), **kw),
    ]


def run_cli(*argv: str, **env: str) -> subprocess.CompletedProcess:
    """The CLI with conftest's clean environment (no API_KEY of the machine's) plus `env`."""
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=clean_env(**env), check=False)


# -- API keys ------------------------------------------------------------------------------------------------
def test_no_key_and_wrong_keys_are_unauthenticated_and_counted(keys_server):
    before = scrape(keys_server)
    stub = stub_for(keys_server, ClientOptions())
    missing = refused_calls(stub)
    wrong = [
        *refused_calls(stub, (("authorization", "Bearer env-key-3"),)),
        *refused_calls(stub, (("authorization", "Bearer env-key-1x"),)),
        *refused_calls(stub, (("authorization", "Basic env-key-1"),)),
        *refused_calls(stub, (("authorization", "env-key-1"),)),
    ]
    for err in missing + wrong:
        assert err.code() == UNAUTHENTICATED, err
        assert err.details() == REFUSAL  # the same words whatever was wrong: nothing about the keys
    unknown = rpc_error(keys_server.channel(ClientOptions()).unary_unary("/text_generation.v1.TextGeneration/Nope"),
                        b"", timeout=10)
    assert unknown.code() == UNAUTHENTICATED  # without a key, not even which methods exist

    def counted(snap) -> bool:
        return (snap.value("tgs_request_unauthenticated_total", reason="missing")
                - before.value("tgs_request_unauthenticated_total", reason="missing") == len(missing) + 1
                and snap.value("tgs_request_unauthenticated_total", reason="invalid")
                - before.value("tgs_request_unauthenticated_total", reason="invalid") == len(wrong))

    assert wait_until(lambda: counted(scrape(keys_server)), 10)
    assert scrape(keys_server).value("tgi_request_count") == before.value("tgi_request_count")
    log = keys_server.log()
    assert "refused /text_generation.v1.TextGeneration/" in log and "API key" in log
    assert "env-key-3" not in log and "env-key-1x" not in log


def test_each_key_opens_unary_and_streaming_calls(keys_server):
    for key in (*ENV_KEYS, "file-key-1"):
        assert_serves(stub_for(keys_server, ClientOptions(api_key=key)))
    stub = stub_for(keys_server, ClientOptions())
    info = stub.Info(cpb.InfoRequest(), timeout=10, metadata=(("authorization", "bearer env-key-2"),))
    assert info.max_total_tokens == 256


def test_health_and_reflection_stay_open_without_a_key(keys_server):
    channel = keys_server.channel(ClientOptions())
    resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    listed = next(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=10))
    assert "text_generation.v1.TextGeneration" in {s.name for s in listed.list_services_response.service}
    result = run_cli("health", "--port", str(keys_server.port))
    assert result.returncode == 0 and "SERVING" in result.stdout, result.stderr


def test_cli_generate_sends_the_key(keys_server):
    argv = ["generate", "--server", f"127.0.0.1:{keys_server.port}", "--max-new-tokens", "4", "--json", PROMPT]
    refused = run_cli(*argv)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
    done = run_cli(*argv, "--api-key", "file-key-1")
    assert done.returncode == 0, done.stderr
    assert '"generated_tokens"' in done.stdout
    from_env = run_cli(*argv, API_KEY=",".join(ENV_KEYS))  # as serve reads it: the first key is sent
    assert from_env.returncode == 0, from_env.stderr


def test_shard_sockets_are_owner_only(keys_server):
    mode = os.stat(keys_server.socket_path(0)).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_key_file_rotation_and_sighup_keep_serving(keys_server, pki):
    keys = Path(pki["keys"])
    keys.write_text("file-key-2\n")  # picked up when the file changes
    assert wait_until(lambda: _works(keys_server, "file-key-2"), 10)
    assert not _works(keys_server, "file-key-1")
    keys.write_text("file-key-3\n")
    os.kill(keys_server.pid, signal.SIGHUP)  # an explicit re-read; SIGHUP must not stop the server
    assert wait_until(lambda: "received SIGHUP" in keys_server.log(), 10)
    assert wait_until(lambda: _works(keys_server, "file-key-3"), 10)
    assert keys_server.proc.poll() is None
    assert_serves(stub_for(keys_server, ClientOptions(api_key=ENV_KEYS[1])))  # the fixed keys are unchanged


def _works(server, key: str) -> bool:
    try:
        stub_for(server, ClientOptions(api_key=key)).Info(cpb.InfoRequest(), timeout=10)
        return True
    except grpc.RpcError as err:
        assert err.code() == UNAUTHENTICATED, err
        return False


# -- TLS -----------------------------------------------------------------------------------------------------
def test_tls_serves_a_client_that_trusts_the_ca(tls_server, pki):
    assert_serves(stub_for(tls_server, tls_client(pki, api_key=TLS_KEY)))
    assert "(TLS, API key (1 accepted) on every service)" in tls_server.log()


def test_plaintext_and_untrusting_clients_are_refused(tls_server, pki):
    for client in (ClientOptions(api_key=TLS_KEY), ClientOptions(api_key=TLS_KEY, ca_path=pki["next_ca"])):
        err = rpc_error(stub_for(tls_server, client, fresh=True).Info, cpb.InfoRequest(), timeout=10)
        assert err.code() == grpc.StatusCode.UNAVAILABLE, (client, err)


def test_protected_health_and_reflection_need_the_key(tls_server, pki):
    channel = tls_server.channel(tls_client(pki))
    err = rpc_error(health_pb2_grpc.HealthStub(channel).Check, health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert err.code() == UNAUTHENTICATED
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    err = rpc_error(reflection.ServerReflectionInfo, iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                    timeout=10)
    assert err.code() == UNAUTHENTICATED
    assert rpc_error(stub_for(tls_server, tls_client(pki)).Info, cpb.InfoRequest(), timeout=10).code() \
        == UNAUTHENTICATED
    health = ["health", "--port", str(tls_server.port), "--tls-ca-path", pki["serving_ca"]]
    refused = run_cli(*health)
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr, refused.stderr
    passed = run_cli(*health, "--api-key", TLS_KEY)
    assert passed.returncode == 0 and "SERVING" in passed.stdout, passed.stderr
    plaintext = run_cli("health", "--port", str(tls_server.port), "--api-key", TLS_KEY)
    assert plaintext.returncode == 1


def test_broken_replacement_keeps_the_current_certificate(tls_server, pki):
    good = Path(pki["tls_cert"]).read_bytes()
    Path(pki["tls_cert"]).write_text("-----BEGIN CERTIFICATE-----\nbroken\n-----END CERTIFICATE-----\n")
    os.kill(tls_server.pid, signal.SIGHUP)  # re-read now: SIGHUP must not stop the server
    assert wait_until(lambda: "cannot be used" in tls_server.log(), 10)
    assert_serves(stub_for(tls_server, tls_client(pki, api_key=TLS_KEY), fresh=True))
    assert tls_server.proc.poll() is None
    Path(pki["tls_cert"]).write_bytes(good)


def test_certificate_rotation_keeps_open_streams_and_new_connections_see_it(tls_server, pki, tmp_path):
    """Last for this server: it ends with the drain that proves the old connection still lives."""
    old_client, new_client = tls_client(pki, api_key=TLS_KEY), ClientOptions(api_key=TLS_KEY, ca_path=pki["next_ca"])
    channel = tls_server.channel(old_client, fresh=True)
    stub = cpb_grpc.TextGenerationStub(channel)
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=120)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    stream = stub.GenerateStream(request(PROMPT, max_new_tokens=200, ignore_eos_token=True), timeout=120)
    first = next(stream)

    rotated = pki["next"].issue("rotated server")
    for data, target in ((rotated.cert, pki["tls_cert"]), (rotated.key, pki["tls_key"])):
        staged = tmp_path / Path(target).name
        staged.write_bytes(data)
        os.replace(staged, target)  # how secrets are rotated: a whole new file, never a half-written one

    def new_cert_served() -> bool:
        try:
            stub_for(tls_server, new_client, fresh=True).Info(cpb.InfoRequest(), timeout=10)
            return True
        except grpc.RpcError:
            return False

    assert wait_until(new_cert_served, 20, interval_s=0.2)
    err = rpc_error(stub_for(tls_server, old_client, fresh=True).Info, cpb.InfoRequest(), timeout=10)
    assert err.code() == grpc.StatusCode.UNAVAILABLE  # a new connection gets the new certificate
    assert "serving certificate" in tls_server.log()

    rest = list(stream)  # the stream opened before the rotation runs to its end
    assert len(rest) + 1 == 200 and rest[-1].HasField("generated_text") and first.token.id >= 0
    assert_serves(stub)  # its connection still carries new calls
    # The health stream opened before the rotation still receives what the server sends after it.
    tls_server.proc.send_signal(signal.SIGTERM)
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert tls_server.wait_exit(60) == 0


# -- mutual TLS ------------------------------------------------------------------------------------------------
def test_mutual_tls_needs_a_client_certificate_from_the_ca(mtls_server, pki):
    for client in (tls_client(pki), mtls_client(pki, "rogue"), ClientOptions()):
        err = rpc_error(stub_for(mtls_server, client, fresh=True).Info, cpb.InfoRequest(), timeout=10)
        assert err.code() == grpc.StatusCode.UNAVAILABLE, (client, err)
    assert_serves(stub_for(mtls_server, mtls_client(pki), fresh=True))
    assert "(mutual TLS, no API key)" in mtls_server.log()


def test_cli_with_a_client_certificate(mtls_server, pki):
    tls = ["--tls-ca-path", pki["serving_ca"], "--tls-client-cert-path", pki["client_cert"],
           "--tls-client-key-path", pki["client_key"]]
    passed = run_cli("health", "--port", str(mtls_server.port), *tls)
    assert passed.returncode == 0, passed.stderr
    refused = run_cli("health", "--port", str(mtls_server.port), "--tls-ca-path", pki["serving_ca"])
    assert refused.returncode == 1
    done = run_cli("generate", "--server", f"localhost:{mtls_server.port}", "--max-new-tokens", "3", *tls, PROMPT)
    assert done.returncode == 0 and done.stdout.startswith(PROMPT), done.stderr
