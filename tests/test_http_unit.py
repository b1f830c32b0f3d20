"""The HTTP APIs' pieces without a server: OpenAI's and TGI's fields read into the client API's
parameters, errors shaped per API, the listening socket's failure. The served behaviour is
integration-tests/test_http_serve.py."""

from __future__ import annotations

import json
import socket

import grpc
import pytest

from text_generation_server.generation.tool_calls import Choice
from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
from text_generation_server.router.http import openai_requests as reqs
from text_generation_server.router.http.body import Fields
from text_generation_server.router.http.errors import HttpError, from_status, openai_body, tgi_status_and_body
from text_generation_server.router.http.openai_api import openai_error
from text_generation_server.router.http.server import HttpServer
from text_generation_server.router.http.tgi_api import parameters as tgi_parameters


def openai_params(body: dict, chat: bool = True) -> tuple[cpb.GenerateParameters, reqs.Options]:
    return reqs.parameters(Fields(body), chat=chat, max_top_n=5, max_n=4)


def test_openai_sampling_fields_map_onto_the_client_api():
    p, opts = openai_params({"max_completion_tokens": 7, "max_tokens": 9, "temperature": 0.5, "top_p": 0.9,
                             "seed": 3, "frequency_penalty": 0.5, "stop": "\n", "n": 2, "logprobs": True,
                             "top_logprobs": 2, "ignore_eos": True})
    assert (p.max_new_tokens, p.temperature, p.top_p, p.seed, p.frequency_penalty) == (7, 0.5, pytest.approx(0.9), 3,
                                                                                         0.5)
    assert list(p.stop) == ["\n"] and p.top_n_tokens == 2 and p.details and p.ignore_eos_token
    assert opts.n == 2 and opts.logprobs and opts.stop == ["\n"]
    greedy, _ = openai_params({"temperature": 0, "top_p": 1})
    assert greedy.do_sample is False and not greedy.HasField("temperature") and not greedy.HasField("top_p")
    default, opts = openai_params({}, chat=False)
    assert default.max_new_tokens == reqs.COMPLETIONS_DEFAULT_MAX_TOKENS and not opts.logprobs
    _, opts = openai_params({"logprobs": 3}, chat=False)
    assert opts.logprobs and opts.top_logprobs == 3


@pytest.mark.parametrize("body, field", [
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"logit_bias": {"1": 2}}, "logit_bias"),
    ({"temperature": "hot"}, "temperature"), ({"temperature": 2.5}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"n": 5}, "n"), ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"seed": -1}, "seed"),
    ({"stop": [1]}, "stop"), ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 6},
                                                                      "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_openai_refusals_name_the_field(body, field):
    with pytest.raises(HttpError) as err:
        openai_params(body)
    assert err.value.status == 400 and err.value.param == field and field in err.value.message


def test_presence_penalty_zero_is_accepted_and_never_mapped():
    p, _ = openai_params({"presence_penalty": 0})
    assert not p.HasField("frequency_penalty") and not p.HasField("repetition_penalty")


def test_response_format_and_tools():
    p, _ = openai_params({"response_format": {"type": "json_object"}})
    assert p.grammar.type == cpb.GRAMMAR_TYPE_JSON and json.loads(p.grammar.value) == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p, _ = openai_params({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert json.loads(p.grammar.value) == schema
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    assert reqs.tools_and_choice(Fields({"tools": tools}))[1:] == (None, None)
    named = {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}
    assert reqs.tools_and_choice(Fields(named))[1:] == (Choice.FUNCTION, "f")
    assert reqs.tools_and_choice(Fields({"tools": tools, "tool_choice": "required"}))[1:] == (Choice.REQUIRED, None)
    with pytest.raises(HttpError, match="tool_choice must be none, auto, required"):
        reqs.tools_and_choice(Fields({"tools": tools, "tool_choice": "sometimes"}))


def test_messages_take_text_parts_and_tool_calls():
    messages = reqs.messages(Fields({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]}))
    assert messages[0] == {"role": "user", "content": "a\nb"}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert messages[2] == {"role": "tool", "content": "2", "tool_call_id": "c1"}
    with pytest.raises(HttpError, match=r"messages\[0\]\.content\[0\] must be a text part"):
        reqs.messages(Fields({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}))


def test_tgi_parameters_keep_tgi_names():
    p, full = tgi_parameters(Fields({"max_new_tokens": 5, "top_k": 3, "details": True, "stop": ["x"],
                                     "return_full_text": True, "grammar": {"type": "json_schema", "value": {
                                         "name": "n", "schema": {"type": "object"}}}}))
    assert (p.max_new_tokens, p.top_k, p.details, list(p.stop), full) == (5, 3, True, ["x"], True)
    assert p.grammar.type == cpb.GRAMMAR_TYPE_JSON and json.loads(p.grammar.value) == {"type": "object"}
    p, _ = tgi_parameters(Fields({"grammar": {"type": "regex", "value": "a+"}}))
    assert (p.grammar.type, p.grammar.value) == (cpb.GRAMMAR_TYPE_REGEX, "a+")
    for body in ({"best_of": 2}, {"watermark": True}, {"top_k": 0}, {"grammar": {"type": "yaml", "value": "x"}}):
        with pytest.raises(HttpError):
            tgi_parameters(Fields(body))


def test_errors_are_shaped_per_api():
    error = from_status(grpc.StatusCode.INVALID_ARGUMENT, "parameters.top_p must be <= 1.0, got 1.5")
    assert error.status == 400
    assert tgi_status_and_body(error) == (422, {"error": error.message, "error_type": "validation"})
    assert openai_body(error)["error"]["type"] == "invalid_request_error"
    renamed = openai_error(from_status(grpc.StatusCode.INVALID_ARGUMENT, "parameters.max_new_tokens (9) + 3 input "
                                       "tokens exceeds max_total_tokens (10)"), chat=True)
    assert renamed.message.startswith("max_tokens (9)") and renamed.param == "max_tokens"
    assert openai_error(from_status(grpc.StatusCode.INVALID_ARGUMENT, "inputs must not be empty"),
                        chat=False).message == "prompt must not be empty"
    busy = from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, "at max_concurrent_requests")
    assert busy.status == 429 and tgi_status_and_body(busy)[0] == 429
    assert from_status(grpc.StatusCode.UNAVAILABLE, "draining").status == 503
    assert tgi_status_and_body(HttpError(413, "too big", "request_too_large"))[0] == 413


def test_a_port_in_use_fails_naming_it():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        with pytest.raises(OSError, match=f"cannot serve HTTP on 127.0.0.1:{port}"):
            HttpServer(None, "127.0.0.1", port, None)  # type: ignore[arg-type]
    finally:
        taken.close()
