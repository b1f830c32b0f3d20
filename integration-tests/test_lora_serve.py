"""LoRA adapters through real `serve` processes: --lora-adapters at startup, adapter_id on the client
API and the HTTP APIs, LoadAdapter / UnloadAdapter / ListAdapters at run time, and their refusals.

The main server runs the embedded model with one adapter from the start, run-time loading from a
directory, an API key and the HTTP port. A request with an adapter gets other tokens than the base
model, the same as the engine gives in this process with that adapter; an unknown adapter is
NOT_FOUND (404 over HTTP), never the base model; adapters load and unload while other requests
stream, and none of those fails or changes. Two more servers without API keys check the second
opt-in.
"""

from __future__ import annotations

import json
import subprocess
import threading
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import torch
from adapter_writer import write_adapter
from conftest import free_port
from serve_client import (
    client_stub, generate, launch_serve, request, rpc_error, scrape, shard_stub, stream_completion,
)

from text_generation_server.cli.client_channel import ClientOptions
from text_generation_server.engine.types import GenerationRequest
from text_generation_server.models.adapters import enable_lora
from text_generation_server.models.loader import get_model
from text_generation_server.pb.generate.v3 import generate_pb2 as spb
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.utils.locate import embedded_model_path

KEY = "lora-test-key"
PROMPTS = ["def load(path):", "class Config:\n    def __init__(self", "import os\nimport sys\n"]
NEW = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> Path:
    """allowed/ with three adapters; a folder outside it and a link from inside to it."""
    root = tmp_path_factory.mktemp("lora")
    allowed = root / "allowed"
    base = embedded_model_path()
    write_adapter(allowed / "sql", base, seed=1)
    write_adapter(allowed / "docs", base, seed=2, rank=4, targets=("q_proj", "v_proj", "down_proj"), scale=0.8)
    write_adapter(allowed / "math", base, seed=3, targets=("o_proj", "up_proj"))
    write_adapter(root / "outside", base, seed=4)
    (allowed / "escape").symlink_to(root / "outside", target_is_directory=True)
    return allowed


@pytest.fixture(scope="module")
def server(adapters, tmp_path_factory):
    sock_dir = tmp_path_factory.mktemp("sock")
    log_dir = tmp_path_factory.mktemp("logs")
    http_port = free_port()
    proc = launch_serve(None, sock_dir, log_dir, "--lora-adapters", f"sql={adapters / 'sql'}", "--max-loras", "3",
                        "--lora-load-dir", str(adapters), "--api-key", KEY, "--http-port", str(http_port),
                        name="lora", client=ClientOptions(api_key=KEY))
    proc.http_port = http_port
    try:
        proc.wait_serving(timeout_s=120)
        yield proc
    finally:
        proc.cleanup()


@pytest.fixture(scope="module")
def engine(adapters):
    """The engine's greedy tokens in this process for (prompt, adapter), each request alone."""
    torch.set_num_threads(1)
    lm = get_model(None)
    slots = enable_lora(lm, max_loras=3, max_rank=8)
    for name in ("sql", "docs", "math"):
        slots.load(name, str(adapters / name))
    cache: dict = {}

    def tokens(prompt: str, adapter: str = "", new: int = NEW) -> list[int]:
        if (prompt, adapter, new) not in cache:
            done = lm.generate([GenerationRequest(id=0, inputs=prompt, max_new_tokens=new,
                                                  adapter_id=adapter or None)])[0]
            cache[prompt, adapter, new] = list(done.token_ids)
        return cache[prompt, adapter, new]

    return tokens


def with_adapter(prompt: str, adapter: str, new: int = NEW, **parameters) -> cpb.GenerateRequest:
    req = request(prompt, max_new_tokens=new, **parameters)
    req.parameters.adapter_id = adapter
    return req


def http(server, method: str, path: str, body: dict | None = None, raw: bool = False) -> tuple[int, object]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            data = resp.read()
            return resp.status, data.decode() if raw else json.loads(data or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def test_startup_adapter_is_listed_and_changes_the_answer(server, engine):
    stub = client_stub(server)
    info = stub.Info(cpb.InfoRequest(), timeout=30)
    assert [a.name for a in info.adapters] == ["sql"] and info.adapter_loading
    assert info.adapters[0].rank == 8 and "q_proj" in info.adapters[0].target_modules
    for prompt in PROMPTS:
        base = generate(stub, request(prompt, max_new_tokens=NEW)).token_ids
        sql = generate(stub, with_adapter(prompt, "sql")).token_ids
        assert base == engine(prompt) and sql == engine(prompt, "sql")
    assert any(engine(p) != engine(p, "sql") for p in PROMPTS), "the test adapter must change greedy tokens"
    streamed = stream_completion(stub, with_adapter(PROMPTS[0], "sql")).token_ids
    assert streamed == engine(PROMPTS[0], "sql")
    # The same prompt again, now cached under both: each keeps its own answer.
    assert generate(stub, with_adapter(PROMPTS[0], "sql")).token_ids == engine(PROMPTS[0], "sql")
    assert generate(stub, request(PROMPTS[0], max_new_tokens=NEW)).token_ids == engine(PROMPTS[0])


def test_an_unknown_adapter_is_not_found_never_the_base(server):
    stub = client_stub(server)
    for call in (stub.Generate, stub.GenerateStream):
        error = rpc_error(call, with_adapter(PROMPTS[0], "nope"), timeout=30)
        assert error.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in error.details()


def test_load_list_unload_at_run_time(server, adapters, engine):
    stub = client_stub(server)
    loaded = stub.LoadAdapter(cpb.LoadAdapterRequest(name="docs", path="docs"), timeout=60).adapter
    assert loaded.name == "docs" and loaded.rank == 4 and Path(loaded.path) == (adapters / "docs").resolve()
    assert [a.name for a in stub.ListAdapters(cpb.ListAdaptersRequest(), timeout=30).adapters] == ["docs", "sql"]
    assert generate(stub, with_adapter(PROMPTS[1], "docs")).token_ids == engine(PROMPTS[1], "docs")
    again = rpc_error(stub.LoadAdapter, cpb.LoadAdapterRequest(name="docs", path="docs"), timeout=30)
    assert again.code() == grpc.StatusCode.ALREADY_EXISTS
    stub.UnloadAdapter(cpb.UnloadAdapterRequest(name="docs"), timeout=60)
    assert rpc_error(stub.Generate, with_adapter(PROMPTS[1], "docs"), timeout=30).code() == grpc.StatusCode.NOT_FOUND
    assert rpc_error(stub.UnloadAdapter, cpb.UnloadAdapterRequest(name="docs"), timeout=30).code() == \
        grpc.StatusCode.NOT_FOUND
    assert [a.name for a in stub.Info(cpb.InfoRequest(), timeout=30).adapters] == ["sql"]


@pytest.mark.parametrize("path", ["../outside", "escape", "docs/../../outside", "/etc", "sql/../../allowed/../"
                                  "outside"])
def test_a_path_outside_the_directory_is_refused(server, path):
    error = rpc_error(client_stub(server).LoadAdapter, cpb.LoadAdapterRequest(name="evil", path=path), timeout=30)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "outside --lora-load-dir" in error.details()


def test_adapter_calls_need_the_api_key(server):
    stub = client_stub(server)
    bare = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    server.channels.append(bare)
    from text_generation_server.pb.text_generation.v1 import text_generation_pb2_grpc as cpb_grpc

    error = rpc_error(cpb_grpc.TextGenerationStub(bare).LoadAdapter, cpb.LoadAdapterRequest(name="m", path="math"),
                      timeout=30)
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "m" not in [a.name for a in stub.ListAdapters(cpb.ListAdaptersRequest(), timeout=30).adapters]


def test_http_model_field_and_tgi_adapter_id(server, engine):
    stub = client_stub(server)
    status, models = http(server, "GET", "/v1/models")
    assert status == 200
    ids = [m["id"] for m in models["data"]]
    assert ids[1:] == ["sql"] and models["data"][1]["parent"] == ids[0]
    grpc_text = stub.Generate(with_adapter(PROMPTS[0], "sql"), timeout=60).generated_text
    status, body = http(server, "POST", "/v1/completions", {"model": "sql", "prompt": PROMPTS[0], "max_tokens": NEW})
    assert status == 200 and body["choices"][0]["text"] == grpc_text and body["model"] == "sql"
    status, body = http(server, "POST", "/generate",
                        {"inputs": PROMPTS[0], "parameters": {"max_new_tokens": NEW, "adapter_id": "sql"}})
    assert status == 200 and body["generated_text"] == grpc_text
    base_text = stub.Generate(request(PROMPTS[0], max_new_tokens=NEW), timeout=60).generated_text
    status, body = http(server, "POST", "/v1/completions", {"model": ids[0], "prompt": PROMPTS[0], "max_tokens": NEW})
    assert status == 200 and body["choices"][0]["text"] == base_text
    status, body = http(server, "POST", "/v1/completions", {"model": "nope", "prompt": "x", "max_tokens": 2})
    assert status == 404 and "'nope'" in body["error"]["message"] and "sql" in body["error"]["message"]
    status, body = http(server, "POST", "/generate", {"inputs": "x", "parameters": {"adapter_id": "nope"}})
    assert status == 404 and "'nope'" in body["error"]
    status, body = http(server, "POST", "/generate", {"inputs": "x", "parameters": {"watermark": True}})
    assert status == 422 and "watermark" in body["error"]


def test_vllm_load_and_unload_endpoints(server, engine):
    """vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter, under the same checks."""
    status, text = http(server, "POST", "/v1/load_lora_adapter", {"lora_name": "math", "lora_path": "math"}, raw=True)
    assert status == 200 and text == "Success: LoRA adapter 'math' added successfully."
    status, body = http(server, "POST", "/v1/completions", {"model": "math", "prompt": PROMPTS[2], "max_tokens": NEW})
    grpc_answer = generate(client_stub(server), with_adapter(PROMPTS[2], "math"))
    assert grpc_answer.token_ids == engine(PROMPTS[2], "math")
    assert status == 200 and body["choices"][0]["text"] == grpc_answer.text
    assert "math" in [m["id"] for m in http(server, "GET", "/v1/models")[1]["data"]]
    status, body = http(server, "POST", "/v1/load_lora_adapter", {"lora_name": "math", "lora_path": "math"})
    assert status == 400 and "loaded already" in body["error"]["message"]
    status, body = http(server, "POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "../outside"})
    assert status == 400 and "outside --lora-load-dir" in body["error"]["message"]
    status, text = http(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "math"}, raw=True)
    assert status == 200 and text == "Success: LoRA adapter 'math' removed successfully."
    status, body = http(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "math"})
    assert status == 404 and "'math'" in body["error"]["message"]
    status, body = http(server, "POST", "/v1/load_lora_adapter", {"lora_name": "y"})
    assert status == 400 and body["error"]["param"] == "lora_path"


def test_request_counters_carry_the_adapter(server):
    stub = client_stub(server)
    before = scrape(server)
    generate(stub, with_adapter(PROMPTS[2], "sql", new=3))
    generate(stub, request(PROMPTS[2], max_new_tokens=3))
    after = scrape(server)
    assert after.value("tgi_request_count_total", adapter="sql") - before.value("tgi_request_count_total",
                                                                                adapter="sql") == 1
    assert after.value("tgi_request_success_total", adapter="sql") - before.value("tgi_request_success_total",
                                                                                  adapter="sql") == 1
    assert after.value("tgi_request_count_total") - before.value("tgi_request_count_total") == 2


def test_loading_while_others_stream_fails_none(server, engine):
    """Streams of the base model and of sql run while math loads and unloads three times."""
    stub = client_stub(server)
    long_new = 40
    cases = [(PROMPTS[0], ""), (PROMPTS[1], "sql"), (PROMPTS[2], ""), (PROMPTS[0], "sql")]
    results: dict[int, object] = {}

    def stream(i: int, prompt: str, adapter: str) -> None:
        try:
            results[i] = stream_completion(stub, with_adapter(prompt, adapter, new=long_new), timeout=300).token_ids
        except grpc.RpcError as exc:  # recorded: the assertion below names it
            results[i] = exc

    threads = [threading.Thread(target=stream, args=(i, p, a)) for i, (p, a) in enumerate(cases)]
    for t in threads:
        t.start()
    for _ in range(3):
        stub.LoadAdapter(cpb.LoadAdapterRequest(name="math", path="math"), timeout=60)
        generate(stub, with_adapter(PROMPTS[1], "math", new=4))
        stub.UnloadAdapter(cpb.UnloadAdapterRequest(name="math"), timeout=120)
    for t in threads:
        t.join(timeout=300)
    for i, (prompt, adapter) in enumerate(cases):
        assert not isinstance(results[i], Exception), f"stream {i} failed: {results[i]}"
        assert results[i] == engine(prompt, adapter, long_new), f"stream {i} changed"


def test_without_api_keys_loading_needs_the_second_opt_in(adapters, start_serve):
    closed = start_serve(None, "--lora-load-dir", str(adapters), "--http-port", str(http_port := free_port()))
    opened = start_serve(None, "--lora-load-dir", str(adapters), "--lora-load-without-api-key", "--max-loras", "1")
    closed.wait_serving(timeout_s=120)
    opened.wait_serving(timeout_s=120)
    error = rpc_error(client_stub(closed).LoadAdapter, cpb.LoadAdapterRequest(name="sql", path="sql"), timeout=30)
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED and "--lora-load-without-api-key" in error.details()
    assert not client_stub(closed).Info(cpb.InfoRequest(), timeout=30).adapter_loading
    closed.http_port = http_port
    status, body = http(closed, "POST", "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "sql"})
    assert status == 403 and "--lora-load-without-api-key" in body["error"]["message"]
    stub = client_stub(opened)
    assert stub.LoadAdapter(cpb.LoadAdapterRequest(name="sql", path="sql"), timeout=60).adapter.name == "sql"
    full = rpc_error(stub.LoadAdapter, cpb.LoadAdapterRequest(name="docs", path="docs"), timeout=30)
    assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-loras" in full.details()


def test_generate_cli_names_the_adapter(server, engine):
    from conftest import clean_env, serve_command

    cli = serve_command()[:-1] + ["generate"]
    done = subprocess.run(cli + ["--server", f"127.0.0.1:{server.port}", "--api-key", KEY, "--adapter-id", "sql",
                                 "--max-new-tokens", str(NEW), "--json", PROMPTS[0]],
                          capture_output=True, text=True, timeout=120, env=clean_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[0])["token_ids"] == engine(PROMPTS[0], "sql")
    missing = subprocess.run(cli + ["--server", f"127.0.0.1:{server.port}", "--api-key", KEY, "--adapter-id", "nope",
                                    "--max-new-tokens", "2", PROMPTS[0]],
                             capture_output=True, text=True, timeout=120, env=clean_env())
    assert missing.returncode != 0 and "nope" in missing.stderr


def test_two_ranks_load_and_unload_together(adapters, start_serve, engine):
    two = start_serve(None, "--lora-load-dir", str(adapters), "--lora-load-without-api-key", "--max-loras", "2",
                      num_shard=2)
    two.wait_serving(timeout_s=180)
    stub = client_stub(two)
    stub.LoadAdapter(cpb.LoadAdapterRequest(name="docs", path="docs"), timeout=120)
    for rank in (0, 1):
        assert [a.name for a in shard_stub(two, rank).Info(spb.InfoRequest(), timeout=30).adapters] == ["docs"]
    assert generate(stub, with_adapter(PROMPTS[1], "docs")).token_ids == engine(PROMPTS[1], "docs")
    assert generate(stub, request(PROMPTS[1], max_new_tokens=NEW)).token_ids == engine(PROMPTS[1])
    stub.UnloadAdapter(cpb.UnloadAdapterRequest(name="docs"), timeout=120)
    for rank in (0, 1):
        assert not shard_stub(two, rank).Info(spb.InfoRequest(), timeout=30).adapters
