"""Opt-in, not in CI: tool calling on a real instruction-tuned model (Qwen2.5-Coder-1.5B-Instruct is the
one the issue names) through `serve --http-port` and the `openai` package.

    TGS_TOOL_MODEL=/models/qwen2.5-coder-1.5b-instruct pytest integration-tests/test_tool_calls_real_model.py

The model must ship a chat template with tools. `required` must give a call whose arguments validate
against the tool's schema (the grammar guarantees it); `auto` must give the call the model chose to
write in its own syntax, parsed, for a question only the tool answers.
"""

from __future__ import annotations

import json
import os

import jsonschema
import openai
import pytest
from conftest import free_port
from serve_client import launch_serve

MODEL = os.environ.get("TGS_TOOL_MODEL")
pytestmark = pytest.mark.skipif(not MODEL, reason="opt-in: TGS_TOOL_MODEL=<folder of a tool-calling model>")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_current_weather", "description": "Current weather in a city.",
                                           "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    port = free_port()
    server = launch_serve(MODEL, tmp_path_factory.mktemp("sock"), tmp_path_factory.mktemp("logs"), "--http-port",
                          str(port), "--max-total-tokens", "4096", "--max-input-tokens", "3500",
                          "--max-batch-prefill-tokens", "4096", "--max-batch-total-tokens", "16384", name="tools")
    try:
        server.wait_serving(timeout_s=900)
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    finally:
        server.cleanup()


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_the_model_calls_the_tool(client, choice):
    done = client.chat.completions.create(
        model="tgi", messages=[{"role": "user", "content": "What is the weather like in Paris right now, in celsius?"}],
        tools=TOOLS, tool_choice=choice, max_tokens=200, temperature=0)
    answer = done.choices[0]
    assert answer.finish_reason == "tool_calls", answer
    [call] = answer.message.tool_calls
    assert call.function.name == "get_current_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert "paris" in arguments["city"].lower()
