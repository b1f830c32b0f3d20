"""The HTTP APIs (serve --http-port) through real `serve` processes and the clients people use.

One server runs a copy of the embedded model that carries Qwen2.5-Coder-1.5B-Instruct's chat template (with
tools), an API key, a CORS origin and --max-client-batch-size 4; a second one serves over mutual
TLS. The `openai` package and huggingface_hub's InferenceClient talk to it unchanged; answers
equal the gRPC API's for the same request, token for token; a raw socket checks the SSE framing as
curl sees it; `required` and named tool choices come back as calls whose arguments validate
against the tool's schema (gRPC's Chat too); 100 hostile bodies get 4xx and the server keeps
serving; a client that goes away cancels its request.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path

import grpc
import jsonschema
import openai
import pytest
from conftest import free_port, wait_until
from huggingface_hub import InferenceClient
from pki import Authority
from serve_client import client_stub, generate, launch_serve, poll_metrics, request, scrape
from test_tool_calls import QWEN25_TEMPLATE, WEATHER

from text_generation_server.cli.client_channel import ClientOptions
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.utils.locate import embedded_model_path

KEY = "http-test-key"
ORIGIN = "https://app.example"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("http-model") / "tiny-pycoder-tools"
    shutil.copytree(embedded_model_path(), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN25_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("http-pki")
    serving, clients, following = Authority("serving CA"), Authority("clients CA"), Authority("next CA")
    (folder / "ca.crt").write_bytes(serving.cert)
    (folder / "next-ca.crt").write_bytes(following.cert)
    (folder / "clients.crt").write_bytes(clients.cert)
    cert, key = serving.issue("http server").write(folder, "server")
    ccert, ckey = clients.issue("client", server=False).write(folder, "client")
    return {"ca": str(folder / "ca.crt"), "clients": str(folder / "clients.crt"), "cert": str(cert), "key": str(key),
            "client_cert": str(ccert), "client_key": str(ckey), "next": following, "next_ca": str(folder / "next-ca.crt")}


@pytest.fixture(scope="module")
def servers(chat_model, pki, tmp_path_factory):
    sock_dir, log_dir = tmp_path_factory.mktemp("sock"), tmp_path_factory.mktemp("logs")
    http_port, tls_port = free_port(), free_port()
    main = launch_serve(chat_model, sock_dir, log_dir, "--http-port", str(http_port), "--api-key", KEY,
                        "--cors-allow-origin", ORIGIN, "--max-client-batch-size", "4", "--max-message-bytes",
                        "1000000", "--max-total-tokens", "1024", "--max-input-tokens", "800", name="http", client=ClientOptions(api_key=KEY))
    tls = launch_serve(None, sock_dir, log_dir, "--http-port", str(tls_port), "--tls-cert-path", pki["cert"],
                       "--tls-key-path", pki["key"], "--tls-client-ca-path", pki["clients"],
                       "--max-concurrent-requests", "2", name="http-tls",
                       client=ClientOptions(ca_path=pki["ca"], cert_path=pki["client_cert"],
                                            key_path=pki["client_key"]))
    main.http_port, tls.http_port = http_port, tls_port  # type: ignore[attr-defined]
    try:
        main.wait_serving(timeout_s=180)
        tls.wait_serving(timeout_s=180)
        yield main, tls
    finally:
        main.cleanup()
        tls.cleanup()


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


def base(server) -> str:
    return f"http://127.0.0.1:{server.http_port}"


def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=base(server) + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path: str, body: bytes | str | dict, headers: dict | None = None,
         method: str = "POST") -> tuple[int, dict, bytes]:
    """A raw request, as curl sends it: (status, headers, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=120)
    data = json.dumps(body).encode() if isinstance(body, dict) else body.encode() if isinstance(body, str) else body
    all_headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
    conn.request(method, path, body=data if method == "POST" else None, headers=all_headers)
    resp = conn.getresponse()
    out = resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    conn.close()
    return out


def grpc_tokens(server, prompt: str, max_new_tokens: int) -> tuple[str, list[int], list[str]]:
    resp = client_stub(server).Generate(request(prompt, max_new_tokens=max_new_tokens, details=True), timeout=60)
    return resp.generated_text, [t.id for t in resp.details.tokens], [t.text for t in resp.details.tokens]


# -- OpenAI --------------------------------------------------------------------------------------------
def test_models_and_completions_equal_the_grpc_tokens(server):
    client = oai(server)
    [model] = client.models.list().data
    assert model.id.endswith("tiny-pycoder-tools")  # the checkpoint as given; its folder's name is accepted too
    for prompt in ("def fibonacci(n):", "import os\n"):
        text, _, texts = grpc_tokens(server, prompt, 12)
        done = client.completions.create(model=model.id, prompt=prompt, max_tokens=12, logprobs=1)
        assert done.choices[0].text == text and done.choices[0].logprobs.tokens == texts
        assert done.usage.completion_tokens == len(texts) and done.usage.prompt_tokens > 0
        streamed = client.completions.create(model=model.id, prompt=prompt, max_tokens=12, stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == text


def test_prompt_lists_and_n_within_the_client_batch_limit(server):
    client = oai(server)
    done = client.completions.create(model="tiny-pycoder-tools", prompt=["def a", "class B"], n=2, max_tokens=5)
    assert len(done.choices) == 4 and [c.index for c in done.choices] == [0, 1, 2, 3]
    assert done.choices[0].text == done.choices[1].text == grpc_tokens(server, "def a", 5)[0]  # greedy copies
    with pytest.raises(openai.BadRequestError, match="max-client-batch-size"):
        client.completions.create(model="tiny-pycoder-tools", prompt=["a", "b", "c"], n=2, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=r"400 - max_tokens \(5000\) \+ 2 input tokens exceeds"):
        client.completions.create(model="tiny-pycoder-tools", prompt="def a", max_tokens=5000)
    with pytest.raises(openai.BadRequestError, match="400 - prompt must not be empty"):
        client.completions.create(model="tiny-pycoder-tools", prompt="", max_tokens=5)


def test_chat_equals_grpc_chat_and_streams_deltas_with_usage(server):
    client = oai(server)
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A stack class"}]
    grpc_resp = client_stub(server).Chat(cpb.ChatRequest(
        messages=[cpb.Message(role=m["role"], content=m["content"]) for m in messages],
        parameters=cpb.GenerateParameters(max_new_tokens=16, details=True)), timeout=60)
    done = client.chat.completions.create(model="tiny-pycoder-tools", messages=messages, max_tokens=16, logprobs=True,
                                          top_logprobs=2)
    choice = done.choices[0]
    assert choice.message.content == grpc_resp.generated_text and choice.message.role == "assistant"
    assert [t.token for t in choice.logprobs.content] == [t.text for t in grpc_resp.details.tokens]
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert done.usage.completion_tokens == grpc_resp.details.generated_tokens
    chunks = list(client.chat.completions.create(model="tiny-pycoder-tools", messages=messages, max_tokens=16,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == grpc_resp.generated_text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == done.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    # n = 2, streamed: two choices interleaved by index, each the greedy answer.
    chunks = list(client.chat.completions.create(model="tiny-pycoder-tools", messages=messages, max_tokens=16, n=2,
                                                 stream=True))
    for index in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == index)
        assert text == grpc_resp.generated_text


def test_stop_sequences_end_the_text_and_json_mode_parses(server):
    client = oai(server)
    full = client.completions.create(model="tiny-pycoder-tools", prompt="def fibonacci(n):", max_tokens=20).choices[0]
    stop = full.text.strip()[:2]
    done = client.completions.create(model="tiny-pycoder-tools", prompt="def fibonacci(n):", max_tokens=20,
                                     stop=[stop]).choices[0]
    assert done.finish_reason == "stop" and done.text == full.text[:full.text.index(stop)]
    answer = client.chat.completions.create(
        model="tiny-pycoder-tools", messages=[{"role": "user", "content": "weather?"}], max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), WEATHER)


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tool_choices_give_valid_calls(server, stream):
    client = oai(server)
    messages = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        kwargs = dict(model="tiny-pycoder-tools", messages=messages, tools=TOOLS, tool_choice=choice, max_tokens=150)
        if stream:
            chunks = list(client.chat.completions.create(**kwargs, stream=True))
            deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
            calls = [(d.function.name, d.function.arguments, d.id) for d in deltas]
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            done = client.chat.completions.create(**kwargs).choices[0]
            assert done.message.content is None
            calls = [(c.function.name, c.function.arguments, c.id) for c in done.message.tool_calls]
            finish = done.finish_reason
        assert finish == "tool_calls" and len(calls) == 1
        name, arguments, call_id = calls[0]
        assert call_id.startswith("call_")
        if isinstance(choice, dict):
            assert name == "add"
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    # A conversation carrying the call and its result renders and runs.
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "5"}]
    assert client.chat.completions.create(model="tiny-pycoder-tools", messages=follow, tools=TOOLS,
                                          max_tokens=5).choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_grpc_chat_with_a_forced_tool(server):
    stub = client_stub(server)
    tools = [cpb.Tool(name=t["function"]["name"], description=t["function"].get("description", ""),
                      parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS]
    req = cpb.ChatRequest(messages=[cpb.Message(role="user", content="weather in Oslo?")], tools=tools,
                          tool_choice=cpb.TOOL_CHOICE_FUNCTION, tool_choice_function="get_weather",
                          parameters=cpb.GenerateParameters(max_new_tokens=150))
    resp = stub.Chat(req, timeout=60)
    [call] = resp.tool_calls
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    last = list(stub.ChatStream(req, timeout=60))[-1]
    assert [c.name for c in last.tool_calls] == ["get_weather"] and last.tool_calls[0].arguments == call.arguments
    # auto: the model's own syntax is parsed (the Qwen template's: Hermes <tool_call>); a regex makes
    # this random model write one.
    written = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    auto = cpb.ChatRequest(messages=[cpb.Message(role="user", content="1 + 2?")], tools=tools,
                           parameters=cpb.GenerateParameters(max_new_tokens=100, grammar=cpb.Grammar(
                               type=cpb.GRAMMAR_TYPE_REGEX, value=re.escape(written))))
    for resp in (stub.Chat(auto, timeout=60), list(stub.ChatStream(auto, timeout=60))[-1]):
        assert resp.generated_text == written
        assert [(c.name, json.loads(c.arguments)) for c in resp.tool_calls] == [("add", {"a": 1, "b": 2})]
    auto.tool_choice = cpb.TOOL_CHOICE_NONE  # the same text, not read as a call
    assert list(stub.Chat(auto, timeout=60).tool_calls) == []
    bad = cpb.ChatRequest(messages=[cpb.Message(role="user", content="x")],
                          tools=[cpb.Tool(name="f", parameters='{"type": "object", "properties": {"a": {"type": "nope"}}}')])
    with pytest.raises(grpc.RpcError) as err:
        stub.Chat(bad, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tools[0]" in err.value.details()


def test_a_deeply_nested_grammar_is_invalid_argument_on_grpc(server):
    deep = '{"type": "object", "properties": {"a": ' * 2000 + "{}" + "}}" * 2000
    req = request("x = ", max_new_tokens=2)
    req.parameters.grammar.CopyFrom(cpb.Grammar(type=cpb.GRAMMAR_TYPE_JSON, value=deep))
    with pytest.raises(grpc.RpcError) as err:
        client_stub(server).Generate(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "nests deeper" in err.value.details()


# -- TGI -------------------------------------------------------------------------------------------------
def test_inference_client_works_unchanged_and_equals_grpc(server):
    client = InferenceClient(model=base(server), token=KEY)
    text, ids, _ = grpc_tokens(server, "class Stack:", 10)
    assert client.text_generation("class Stack:", max_new_tokens=10) == text
    out = client.text_generation("class Stack:", max_new_tokens=10, details=True, decoder_input_details=True)
    assert [t.id for t in out.details.tokens] == ids and out.details.finish_reason in ("length", "eos_token")
    assert out.details.prefill[0].logprob is None and out.details.prefill[1].logprob <= 0
    events = list(client.text_generation("class Stack:", max_new_tokens=10, stream=True, details=True))
    assert [e.token.id for e in events] == ids and events[-1].generated_text == text
    assert events[-1].details.generated_tokens == len(ids)
    chat = client.chat_completion([{"role": "user", "content": "A stack class"}], max_tokens=8)
    assert chat.choices[0].message.content and chat.usage.completion_tokens <= 8
    status, _, body = post(server, "/tokenize", {"inputs": "def x"})
    assert status == 200 and [t["text"] for t in json.loads(body)] == ["def", " x"]
    status, _, body = post(server, "/info", b"", method="GET")
    assert status == 200 and json.loads(body)["max_client_batch_size"] == 4


def _sse_texts(raw: bytes) -> list[str]:
    """The text each event carries (OpenAI's chunks, TGI's tokens), in order; [DONE] as itself."""
    texts = []
    for event in raw.decode().strip().split("\n\n"):
        payload = event.removeprefix("data:").strip()
        if payload == "[DONE]":
            texts.append(payload)
            continue
        data = json.loads(payload)
        if "token" in data:
            texts.append(data["token"]["text"])
        for choice in data.get("choices", []):
            texts.append(choice.get("text", choice.get("delta", {}).get("content")) or "")
    return texts


def test_sse_framing_as_curl_sees_it(server):
    for path, body, done_marker in (
        ("/v1/completions", {"prompt": "import os", "max_tokens": 4, "stream": True}, True),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
         True),
        ("/generate_stream", {"inputs": "import os", "parameters": {"max_new_tokens": 4}}, False),
    ):
        status, headers, raw = post(server, path, body)
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        if shutil.which("curl"):  # and as curl itself reads it: the same events
            curl = subprocess.run(["curl", "-sN", "--fail-with-body", "-H", f"Authorization: Bearer {KEY}", "-d",
                                   json.dumps(body), base(server) + path], capture_output=True, timeout=120)
            assert curl.returncode == 0, curl.stderr
            assert _sse_texts(curl.stdout) == _sse_texts(raw) and len(_sse_texts(raw)) >= 2
        text = raw.decode()
        assert text.endswith("\n\n")
        events = text[:-2].split("\n\n")
        assert all(e.startswith("data:") and "\n" not in e for e in events), events
        if done_marker:
            assert events[-1] == "data: [DONE]"
            assert all(json.loads(e[len("data: "):])["object"] for e in events[:-1])
        else:
            assert json.loads(events[-1][len("data:"):])["details"]["finish_reason"] in ("length", "eos_token")


# -- the door: keys, CORS, TLS, hostile bodies, disconnects ----------------------------------------------
def test_api_key_cors_and_health(server):
    status, _, body = post(server, "/v1/models", b"", headers={"Authorization": "Bearer wrong"}, method="GET")
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    status, _, body = post(server, "/generate", {"inputs": "x"}, headers={"Authorization": ""})
    assert status == 401 and json.loads(body)["error_type"] == "authentication"
    assert post(server, "/health", b"", headers={"Authorization": ""}, method="GET")[0] == 200
    status, headers, _ = post(server, "/v1/chat/completions", b"", method="OPTIONS", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    status, headers, _ = post(server, "/v1/models", b"", method="GET", headers={"Origin": "https://other.example"})
    assert status == 200 and "access-control-allow-origin" not in headers
    assert scrape(server).value("tgs_request_unauthenticated_total") >= 2


def _https(port: int, ca: str, pki: dict, path: str = "/v1/completions", body: dict | None = None
           ) -> http.client.HTTPResponse:
    context = ssl.create_default_context(cafile=ca)
    context.load_cert_chain(pki["client_cert"], pki["client_key"])
    conn = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=60)
    conn.request("POST", path, body=json.dumps(body or {"prompt": "def a", "max_tokens": 3}),
                 headers={"Content-Type": "application/json"})
    return conn.getresponse()


def _https_completion(port: int, ca: str, pki: dict) -> dict:
    resp = _https(port, ca, pki)
    assert resp.status == 200
    return json.loads(resp.read())


def test_at_capacity_is_429_in_each_api_shape(servers, pki):
    _, tls = servers  # --max-concurrent-requests 2
    long = {"prompt": "def a", "max_tokens": 240, "ignore_eos": True, "stream": True}
    streams = [_https(tls.http_port, pki["ca"], pki, body=long) for _ in range(2)]
    try:
        assert all(s.status == 200 and s.readline().startswith(b"data: ") for s in streams)
        busy = _https(tls.http_port, pki["ca"], pki)
        assert busy.status == 429 and json.loads(busy.read())["error"]["type"] == "rate_limit_error"
        busy = _https(tls.http_port, pki["ca"], pki, "/generate", {"inputs": "x"})
        assert busy.status == 429 and json.loads(busy.read())["error_type"] == "overloaded"
    finally:
        for s in streams:
            s.close()
    # The closed streams' requests are cancelled, and their places free again.
    assert wait_until(lambda: _https(tls.http_port, pki["ca"], pki).status == 200, 30, interval_s=0.2)


def test_tls_serves_http_with_the_grpc_certificates_and_follows_their_rotation(servers, pki, tmp_path):
    _, tls = servers
    assert _https_completion(tls.http_port, pki["ca"], pki)["usage"]["completion_tokens"] == 3
    bare = ssl.create_default_context(cafile=pki["ca"])  # no client certificate: refused in the handshake
    with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
        conn = http.client.HTTPSConnection("127.0.0.1", tls.http_port, context=bare, timeout=30)
        conn.request("GET", "/v1/models")
        conn.getresponse().read()
    rotated = pki["next"].issue("rotated server")
    for data, target in ((rotated.cert, pki["cert"]), (rotated.key, pki["key"])):
        staged = tmp_path / Path(target).name
        staged.write_bytes(data)
        os.replace(staged, target)  # a whole new file, as secrets are rotated

    def new_certificate_served() -> bool:
        try:
            return _https_completion(tls.http_port, pki["next_ca"], pki)["usage"]["completion_tokens"] == 3
        except (ssl.SSLError, ConnectionError):
            return False

    assert wait_until(new_certificate_served, 20, interval_s=0.5)


def hostile_bodies() -> list[tuple[str, bytes, dict]]:
    """(path, body, extra headers): 100 requests no server should run or fail on."""
    deep_list = "[" * 2000 + "]" * 2000
    deep_schema = '{"type": "object", "properties": {"a": ' * 2000 + "{}" + "}}" * 2000
    msgs = [{"role": "user", "content": "hi"}]
    chat, comp, gen = "/v1/chat/completions", "/v1/completions", "/generate"
    raw = ["", "{", "[1, 2", "null", "42", '"text"', "[]", "{'single': 1}", "\xff\xfe", "{\"a\": NaN"]
    cases: list[tuple[str, bytes, dict]] = []
    for path in (chat, comp, gen, "/generate_stream", "/tokenize"):
        for body in raw[:4] if path != chat else raw:
            cases.append((path, body.encode("latin1"), {}))
    bodies = [
        (chat, {}), (chat, {"messages": "hi"}), (chat, {"messages": [1]}), (chat, {"messages": [{"content": "x"}]}),
        (chat, {"messages": msgs, "temperature": "hot"}), (chat, {"messages": msgs, "temperature": 3}),
        (chat, {"messages": msgs, "max_tokens": 0}), (chat, {"messages": msgs, "max_tokens": -5}),
        (chat, {"messages": msgs, "max_tokens": 10**9}), (chat, {"messages": msgs, "n": 0}),
        (chat, {"messages": msgs, "n": 100}), (chat, {"messages": msgs, "top_p": 2}),
        (chat, {"messages": msgs, "top_p": 0}), (chat, {"messages": msgs, "stop": 5}),
        (chat, {"messages": msgs, "stop": ["a"] * 50}), (chat, {"messages": msgs, "seed": -1}),
        (chat, {"messages": msgs, "seed": 2**70}), (chat, {"messages": msgs, "logprobs": "yes"}),
        (chat, {"messages": msgs, "top_logprobs": 3}), (chat, {"messages": msgs, "logprobs": True, "top_logprobs": 50}),
        (chat, {"messages": msgs, "stream": "yes"}), (chat, {"messages": msgs, "stream_options": {"include_usage": 1}}),
        (chat, {"messages": msgs, "presence_penalty": 1.0}), (chat, {"messages": msgs, "frequency_penalty": 9}),
        (chat, {"messages": msgs, "logit_bias": {"1": 5}}), (chat, {"messages": msgs, "model": "gpt-4o"}),
        (chat, {"messages": msgs, "response_format": {"type": "xml"}}),
        (chat, {"messages": msgs, "response_format": {"type": "json_schema"}}),
        (chat, {"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}),
        (chat, {"messages": msgs, "response_format": {"type": "json_schema",
                                                      "json_schema": {"schema": {"type": "strin"}}}}),
        (chat, {"messages": msgs, "tools": "x"}), (chat, {"messages": msgs, "tools": [{"type": "retrieval"}]}),
        (chat, {"messages": msgs, "tools": [{"function": {"name": "bad name"}}]}),
        (chat, {"messages": msgs, "tools": [{"function": {"name": "f", "parameters": {"type": "string"}}}]}),
        (chat, {"messages": msgs, "tools": [{"function": {"name": "f", "parameters": {"type": "object", "properties":
                                                                                       {"a": {"type": "nope"}}}}}]}),
        (chat, {"messages": msgs, "tools": TOOLS + TOOLS}), (chat, {"messages": msgs, "tool_choice": "required"}),
        (chat, {"messages": msgs, "tools": TOOLS, "tool_choice": "sometimes"}),
        (chat, {"messages": msgs, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
        (chat, {"messages": msgs, "tools": TOOLS, "tool_choice": "required",
                "response_format": {"type": "json_object"}}),
        (chat, {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f",
                                                                                       "arguments": "{x"}}]}]}),
        (chat, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        (chat, {"messages": [{"role": "user", "content": "x" * 1_200_000}]}),
        (comp, {}), (comp, {"prompt": 5}), (comp, {"prompt": [1, 2, 3]}), (comp, {"prompt": []}),
        (comp, {"prompt": ""}), (comp, {"prompt": "x", "suffix": "y"}), (comp, {"prompt": "x", "best_of": 3}),
        (comp, {"prompt": "x", "logprobs": 9}), (comp, {"prompt": "x", "echo": "no"}),
        (comp, {"prompt": "x", "max_tokens": 100000}), (comp, {"prompt": ["a"] * 5}),
        (comp, {"prompt": "x", "model": "unknown"}),
        (gen, {}), (gen, {"inputs": 5}), (gen, {"inputs": ""}), (gen, {"inputs": "x", "parameters": []}),
        (gen, {"inputs": "x", "parameters": {"max_new_tokens": 0}}),
        (gen, {"inputs": "x", "parameters": {"top_k": 0}}), (gen, {"inputs": "x", "parameters": {"top_p": 1.5}}),
        (gen, {"inputs": "x", "parameters": {"temperature": -1}}),
        (gen, {"inputs": "x", "parameters": {"best_of": 2}}), (gen, {"inputs": "x", "parameters": {"watermark": True}}),
        (gen, {"inputs": "x", "parameters": {"truncate": 10**6}}),
        (gen, {"inputs": "x", "parameters": {"grammar": {"type": "yaml", "value": "a"}}}),
        (gen, {"inputs": "x", "parameters": {"grammar": {"type": "regex", "value": "(ab"}}}),
        (gen, {"inputs": "x", "parameters": {"grammar": {"type": "json", "value": {"type": "strin"}}}}),
        (gen, {"inputs": "x", "parameters": {"decoder_input_details": True}}),
        ("/tokenize", {"inputs": ["a"]}),
    ]
    cases += [(path, json.dumps(body).encode(), {}) for path, body in bodies]
    cases += [
        (chat, b'{"messages": ' + deep_list.encode() + b"}", {}),
        (comp, b'{"prompt": "x", "stop": ' + deep_list.encode() + b"}", {}),
        (gen, json.dumps({"inputs": "x", "parameters": {"grammar": {"type": "json", "value": "@"}}}).encode()
         .replace(b'"@"', deep_schema.encode()), {}),
        (chat, json.dumps({"messages": msgs, "tools": [{"function": {"name": "f", "parameters": "@"}}]}).encode()
         .replace(b'"@"', deep_schema.encode()), {}),
        (comp, json.dumps({"prompt": "x" * 1_100_000}).encode(), {}),  # over --max-message-bytes: 413
        (chat, json.dumps({"messages": msgs}).encode(), {"Authorization": "Bearer nope"}),
        (comp, json.dumps({"prompt": "x"}).encode(), {"Authorization": "Basic abc"}),
        ("/v1/embeddings", b"{}", {}), ("/v1/chat/completions/x", b"{}", {}), ("/info", b"{}", {}),
    ]
    return cases


def test_hostile_bodies_get_4xx_and_the_server_keeps_serving(server):
    cases = hostile_bodies()
    assert len(cases) >= 100
    failures = []
    for path, body, headers in cases:
        status, _, answer = post(server, path, body, headers=headers)
        shaped = json.loads(answer) if answer else {}
        named = shaped.get("error")
        if not 400 <= status < 500 or not named:
            failures.append((path, body[:80], status, answer[:200]))
    assert not failures, failures
    assert server.proc.poll() is None
    text, _, _ = grpc_tokens(server, "def fibonacci(n):", 6)
    assert oai(server).completions.create(model="tiny-pycoder-tools", prompt="def fibonacci(n):",
                                          max_tokens=6).choices[0].text == text


def _dropped(snap) -> float:
    return snap.value("tgi_request_failure_total", err="dropped")


def test_a_client_that_goes_away_cancels_its_request(server):
    prompt = "def fibonacci(n):"
    before = _dropped(scrape(server))
    counted = scrape(server).value("tgi_request_count_total")
    for path, body in (("/v1/completions", {"prompt": prompt, "max_tokens": 1000, "ignore_eos": True, "stream": True}),
                       ("/v1/completions", {"prompt": prompt, "max_tokens": 1000, "ignore_eos": True})):
        sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=60)
        data = json.dumps(body).encode()
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        counted += 1
        if body.get("stream"):
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # the stream has begun
        else:  # queued (1000 tokens take seconds), then the client goes
            poll_metrics(server, lambda s, want=counted: s.value("tgi_request_count_total") >= want, timeout_s=30)
        sock.close()
        before += 1
        poll_metrics(server, lambda s, want=before: _dropped(s) >= want, timeout_s=30)
    assert generate(client_stub(server), request(prompt, max_new_tokens=4)).token_ids  # still serving
