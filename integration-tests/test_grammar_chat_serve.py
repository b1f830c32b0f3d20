"""Grammar-constrained generation and Chat through real `serve` processes and gRPC clients.

Two servers start side by side: one on a copy of the embedded model that carries a chat
template (ChatML, in tokenizer_config.json), with a prefill budget of 24 tokens so prompts are
chunked and prefix caching on; one on the embedded model itself (no template) with
--disable-grammar-support. JSON-schema outputs of concurrent requests parse and validate,
regex outputs match fully, Generate and GenerateStream agree, an invalid schema or regex is
INVALID_ARGUMENT naming the problem while the requests running beside it get exactly the tokens
they get alone, Chat and ChatStream give Generate's tokens on the prompt transformers'
apply_chat_template renders, and the second server refuses grammars (naming the flag) and Chat
(FAILED_PRECONDITION naming where it looked).
"""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
from serve_client import client_stub, generate, launch_serve, request, rpc_error, scrape, stream_completion

from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.utils.locate import embedded_model_path

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "kind": {"enum": ["function", "class", "module"]},
        "public": {"type": "boolean"},
        "args": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "kind", "public", "args"],
    "additionalProperties": False,
}
JSON_GRAMMAR = cpb.Grammar(type=cpb.GRAMMAR_TYPE_JSON, value=json.dumps(SCHEMA))
SYSTEM = "# Helpers for reading configuration files.\nimport os\nimport sys\n\n"
PROMPTS = [SYSTEM + p for p in ("def load(path):", "class Config:", "def main():", "def merge(a, b):")] + \
    ["x = ", "The quick brown fox"]
FLAGS = ["--max-batch-prefill-tokens", "24", "--max-total-tokens", "256", "--max-input-tokens", "200",
         "--prefix-caching"]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat-model") / "tiny-pycoder-chat"
    folder.mkdir()
    for item in embedded_model_path().iterdir():
        shutil.copy(item, folder / item.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHATML
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def servers(chat_model, tmp_path_factory):
    sock_dir = tmp_path_factory.mktemp("sock")
    log_dir = tmp_path_factory.mktemp("logs")
    main = launch_serve(chat_model, sock_dir, log_dir, *FLAGS, name="grammar")
    plain = launch_serve(None, sock_dir, log_dir, "--disable-grammar-support", name="nogrammar")
    try:
        main.wait_serving(timeout_s=120)
        plain.wait_serving(timeout_s=120)
        yield main, plain
    finally:
        main.cleanup()
        plain.cleanup()


def with_grammar(prompt: str, grammar: cpb.Grammar, **parameters) -> cpb.GenerateRequest:
    req = request(prompt, **parameters)
    req.parameters.grammar.CopyFrom(grammar)
    return req


def test_json_schema_outputs_validate_for_concurrent_requests(servers):
    server, _ = servers
    stub = client_stub(server)
    reqs = [with_grammar(p, JSON_GRAMMAR, max_new_tokens=150) for p in PROMPTS]
    reqs += [with_grammar(p, JSON_GRAMMAR, max_new_tokens=150, do_sample=True, seed=s, temperature=1.2)
             for s, p in enumerate(PROMPTS[:3])]
    plain = request(PROMPTS[0], max_new_tokens=40)
    with ThreadPoolExecutor(len(reqs) + 1) as pool:
        futures = [pool.submit(generate, stub, r) for r in reqs + [plain]]
        done = [f.result() for f in futures]
    for completion in done[:-1]:
        jsonschema.validate(json.loads(completion.text), SCHEMA)
        assert completion.finish_reason == cpb.FINISH_REASON_EOS_TOKEN
    assert done[-1].token_ids == generate(stub, plain).token_ids  # batched beside grammars == alone
    # Seeded and greedy constrained requests replay exactly (alone now, batched before).
    assert generate(stub, reqs[-1]).token_ids == done[-2].token_ids
    assert generate(stub, reqs[0]).token_ids == done[0].token_ids


@pytest.mark.parametrize("regex", [r"\d{3}-\d{4}", r"(GET|POST) /[a-z]{1,8}", r"(yes|no)"])
def test_regex_outputs_match_fully_and_streams_agree(servers, regex):
    server, _ = servers
    stub = client_stub(server)
    grammar = cpb.Grammar(type=cpb.GRAMMAR_TYPE_REGEX, value=regex)
    for prompt in PROMPTS[:3]:
        req = with_grammar(prompt, grammar, max_new_tokens=30)
        unary = generate(stub, req)
        assert re.fullmatch(regex, unary.text), unary.text
        assert stream_completion(stub, req) == unary


def test_grammar_with_stop_sequences(servers):
    server, _ = servers
    grammar = cpb.Grammar(type=cpb.GRAMMAR_TYPE_REGEX, value=r"[a-z]{1,3},[a-z]{1,3},[a-z]{1,3}")
    done = generate(client_stub(server), with_grammar("x = ", grammar, max_new_tokens=20, stop=[","]))
    assert done.finish_reason == cpb.FINISH_REASON_STOP_SEQUENCE and re.fullmatch(r"[a-z]{1,3},", done.text)


def test_invalid_grammars_are_invalid_argument_and_leave_other_requests_alone(servers):
    server, _ = servers
    stub = client_stub(server)
    long_request = request(PROMPTS[1], max_new_tokens=60, ignore_eos_token=True)
    alone = generate(stub, long_request)
    bad = [
        (cpb.Grammar(type=cpb.GRAMMAR_TYPE_JSON, value='{"type": "strin"}'),
         "invalid JSON schema: Invalid type: strin"),
        (cpb.Grammar(type=cpb.GRAMMAR_TYPE_JSON, value='{"properties": '), "the JSON schema is not valid JSON"),
        (cpb.Grammar(type=cpb.GRAMMAR_TYPE_REGEX, value="(ab"), "unclosed group"),
        (cpb.Grammar(value="a+"), "parameters.grammar.type must be"),
    ]
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(stream_completion, stub, long_request)
        for grammar, message in bad:
            error = rpc_error(stub.Generate, with_grammar(PROMPTS[0], grammar, max_new_tokens=5), timeout=30)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in error.details() and error.details().startswith("parameters.grammar")
            stream_error = rpc_error(stub.GenerateStream, with_grammar(PROMPTS[0], grammar, max_new_tokens=5),
                                     timeout=30)
            assert stream_error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert running.result().token_ids == alone.token_ids


def test_three_at_once_only_the_bad_grammar_fails_and_never_reaches_a_prefill(servers):
    """Admission: the router compiles each grammar (with the shards' compiler, on their tokenizer)
    before it queues the request, so of three sent together the middle one, whose regex does not
    compile, is refused alone and no Prefill fails; the other two get the tokens they get alone."""
    server, _ = servers
    stub = client_stub(server)
    goods = [request(PROMPTS[2], max_new_tokens=10), request(PROMPTS[3], max_new_tokens=10)]
    alone = [generate(stub, r).token_ids for r in goods]
    bad = with_grammar(PROMPTS[0], cpb.Grammar(type=cpb.GRAMMAR_TYPE_REGEX, value="(ab"), max_new_tokens=10)
    failed_before = scrape(server).value("tgi_batch_inference_failure", method="prefill")
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(generate, stub, goods[0])
        middle = pool.submit(rpc_error, stub.Generate, bad, timeout=30)
        last = pool.submit(generate, stub, goods[1])
        error = middle.result()
        assert [first.result().token_ids, last.result().token_ids] == alone
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("parameters.grammar.value: invalid regex") and "unclosed group" in error.details()
    assert scrape(server).value("tgi_batch_inference_failure", method="prefill") == failed_before


def test_chat_equals_generate_on_the_prompt_transformers_renders(servers, chat_model):
    transformers = pytest.importorskip("transformers")
    server, _ = servers
    stub = client_stub(server)
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add("}]
    prompt = transformers.AutoTokenizer.from_pretrained(str(chat_model)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    params = cpb.GenerateParameters(max_new_tokens=16, details=True)
    chat = cpb.ChatRequest(messages=[cpb.Message(**m) for m in messages], parameters=params)
    by_chat = stub.Chat(chat, timeout=60)
    by_generate = stub.Generate(cpb.GenerateRequest(inputs=prompt, parameters=params), timeout=60)
    assert [t.id for t in by_chat.details.tokens] == [t.id for t in by_generate.details.tokens]
    assert by_chat.generated_text == by_generate.generated_text
    streamed = list(stub.ChatStream(chat, timeout=60))
    assert [m.token.id for m in streamed] == [t.id for t in by_chat.details.tokens]
    # Chat takes every Generate parameter, a grammar included.
    constrained = cpb.ChatRequest(messages=chat.messages, parameters=cpb.GenerateParameters(
        max_new_tokens=150, grammar=JSON_GRAMMAR))
    jsonschema.validate(json.loads(stub.Chat(constrained, timeout=60).generated_text), SCHEMA)
    refused = rpc_error(stub.Chat, cpb.ChatRequest(parameters=params), timeout=30)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "messages" in refused.details()


def test_a_server_without_grammars_or_a_chat_template_says_why(servers):
    _, server = servers
    stub = client_stub(server)
    error = rpc_error(stub.Generate, with_grammar("x = ", JSON_GRAMMAR, max_new_tokens=5), timeout=30)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "--disable-grammar-support" in error.details()
    chat = cpb.ChatRequest(messages=[cpb.Message(role="user", content="hi")],
                           parameters=cpb.GenerateParameters(max_new_tokens=4))
    for call in (stub.Chat, stub.ChatStream):
        missing = rpc_error(call, chat, timeout=30)
        assert missing.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no chat template" in missing.details() and "tokenizer_config.json" in missing.details()
    assert generate(stub, request("x = ", max_new_tokens=4)).token_ids  # everything else serves


def test_generate_chat_against_the_server(servers):
    from typer.testing import CliRunner

    from text_generation_server.cli.main import app

    server, _ = servers
    result = CliRunner().invoke(app, ["generate", "--chat", "--server", f"127.0.0.1:{server.port}", "--json",
                                      "--max-new-tokens", "6", "def add("])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout.strip().splitlines()[-1])
    chat = cpb.ChatRequest(messages=[cpb.Message(role="user", content="def add(")],
                           parameters=cpb.GenerateParameters(max_new_tokens=6, details=True))
    assert row["token_ids"] == [t.id for t in client_stub(server).Chat(chat, timeout=60).details.tokens]
