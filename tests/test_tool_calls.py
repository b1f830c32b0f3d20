"""Tool calling without a server: the chat template with tools against transformers'
apply_chat_template(tools=...), token for token, on the embedded tokenizer given Qwen2.5-Coder-1.5B-Instruct's template
and a Llama-3.1-style one; each call parser on outputs written here, whole and streamed piece
by piece; the forced-choice schemas; and deep client JSON refused by name."""

from __future__ import annotations

import json
import shutil

import jsonschema
import pytest
from tokenizers import Tokenizer

from text_generation_server.generation import tool_calls
from text_generation_server.generation.chat_template import ChatTemplate
from text_generation_server.generation.grammar import GrammarError, GrammarSpec, GrammarType, llguidance_grammar
from text_generation_server.generation.tool_calls import (
    Choice, HermesParser, Llama3JsonParser, MistralParser, ToolCallStream, ToolError,
)
from text_generation_server.router.http.core import StopTrimmer, trim_stop
from text_generation_server.utils import bounded_json
from text_generation_server.utils.locate import embedded_model_path

# Qwen2.5-Coder-1.5B-Instruct's chat template, as its GGUF file carries it (tokenizer.chat_template):
# tools in the system prompt, <tool_call> JSON in assistant turns, tool results in a user turn.
QWEN25_TEMPLATE = (
    '{%- if tools %}\n'
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    '    {%- else %}\n'
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    '    {%- endif %}\n'
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n'
    '        {{- "\\n" }}\n'
    '        {{- tool | tojson }}\n'
    '    {%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}}\\n</tool_call><|im_end|>\\n" }}\n'
    '{%- else %}\n'
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    '    {%- else %}\n'
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    '    {%- endif %}\n'
    '{%- endif %}\n'
    '{%- for message in messages %}\n'
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    '        {%- if message.content %}\n'
    "            {{- '\\n' + message.content }}\n"
    '        {%- endif %}\n'
    '        {%- for tool_call in message.tool_calls %}\n'
    '            {%- if tool_call.function is defined %}\n'
    '                {%- set tool_call = tool_call.function %}\n'
    '            {%- endif %}\n'
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    '            {{- tool_call.name }}\n'
    '            {{- \'", "arguments": \' }}\n'
    '            {{- tool_call.arguments | tojson }}\n'
    "            {{- '}\\n</tool_call>' }}\n"
    '        {%- endfor %}\n'
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    '        {%- endif %}\n'
    "        {{- '\\n<tool_response>\\n' }}\n"
    '        {{- message.content }}\n'
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    '        {%- endif %}\n'
    '    {%- endif %}\n'
    '{%- endfor %}\n'
    '{%- if add_generation_prompt %}\n'
    "    {{- '<|im_start|>assistant\\n' }}\n"
    '{%- endif %}\n'
)
# Llama 3.1's JSON tool calling, in the shape of its template: tools in the first user turn,
# calls as {"name", "parameters"}, results under the ipython role.
LLAMA31_TEMPLATE = (
    "{{- bos_token }}\n{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n{%- else %}\n    {%- set system_message = \"\" %}\n{%- endif %}\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{%- if tools is not none %}\n    {{- \"Environment: ipython\\n\" }}\n{%- endif %}\n"
    "{{- system_message }}\n{{- \"<|eot_id|>\" }}\n"
    "{%- if tools is not none %}\n    {%- set first_user_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}\n"
    "    {{- \"Given the following functions, please respond with a JSON for a function call \" }}\n"
    "    {{- 'in the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.' }}\n"
    "    {%- for t in tools %}\n        {{- t | tojson(indent=4) }}\n        {{- \"\\n\\n\" }}\n    {%- endfor %}\n"
    "    {{- first_user_message + \"<|eot_id|>\"}}\n{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}\n"
    "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim "
    "+ '<|eot_id|>' }}\n"
    "    {%- elif 'tool_calls' in message %}\n        {%- set tool_call = message.tool_calls[0].function %}\n"
    "        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    "        {{- '{\"name\": \"' + tool_call.name + '\", ' }}\n        {{- '\"parameters\": ' }}\n"
    "        {{- tool_call.arguments | tojson }}\n        {{- \"}\" }}\n        {{- \"<|eot_id|>\" }}\n"
    "    {%- elif message.role == \"tool\" or message.role == \"ipython\" %}\n"
    "        {{- \"<|start_header_id|>ipython<|end_header_id|>\\n\\n\" }}\n"
    "        {%- if message.content is mapping or message.content is iterable %}\n"
    "            {{- message.content | tojson }}\n        {%- else %}\n            {{- message.content }}\n"
    "        {%- endif %}\n        {{- \"<|eot_id|>\" }}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [tool_calls.tool("get_weather", "The weather in a city.", WEATHER, "tools[0].function"),
         tool_calls.tool("add", "", {"type": "object", "properties": {"a": {"type": "integer"},
                                                                      "b": {"type": "integer"}}}, "tools[1].function")]
OPENAI_CONVERSATION = [
    {"role": "system", "content": "You answer with tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    {"role": "user", "content": "And in Zürich?"},
]


def _template_messages(conversation: list[dict]) -> list[dict]:
    """As the server reads OpenAI messages: tool call arguments parsed from their JSON text."""
    out = []
    for i, message in enumerate(conversation):
        message = dict(message)
        if "tool_calls" in message:
            message["tool_calls"] = tool_calls.message_calls(message["tool_calls"], f"messages[{i}]")
        out.append(message)
    return out


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(embedded_model_path() / "tokenizer.json"), bos_token="<|endoftext|>",
        eos_token="<|endoftext|>")


@pytest.mark.parametrize("template", [QWEN25_TEMPLATE, LLAMA31_TEMPLATE], ids=["qwen2.5", "llama3.1"])
@pytest.mark.parametrize("with_history", [False, True])
def test_template_with_tools_equals_transformers(tmp_path, hf_tokenizer, template, with_history):
    folder = tmp_path / "model"
    shutil.copytree(embedded_model_path(), folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    conversation = OPENAI_CONVERSATION if with_history else OPENAI_CONVERSATION[:2]
    if template is LLAMA31_TEMPLATE and with_history:
        conversation = [m for m in conversation if m["role"] != "system"]
    messages = _template_messages(conversation)
    tools = [t.for_template() for t in TOOLS]
    ours = ChatTemplate.load(folder).render(messages, tools=tools)
    theirs = hf_tokenizer.apply_chat_template(messages, tools=tools, chat_template=template,
                                              add_generation_prompt=True, tokenize=False)
    assert ours == theirs
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    ids = hf_tokenizer.apply_chat_template(messages, tools=tools, chat_template=template, add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    assert tokenizer.encode(ours, add_special_tokens=False).ids == list(ids)
    assert "get_weather" in ours and ('"city": "Paris"' in ours) == with_history


def test_message_calls_parse_arguments_and_name_the_field():
    calls = tool_calls.message_calls([{"id": "c", "function": {"name": "f", "arguments": '{"x": [1]}'}}],
                                     "messages[2]")
    assert calls == [{"id": "c", "type": "function", "function": {"name": "f", "arguments": {"x": [1]}}}]
    with pytest.raises(ToolError, match=r"messages\[2\]\.tool_calls\[0\]\.function\.arguments is not JSON"):
        tool_calls.message_calls([{"function": {"name": "f", "arguments": "{x"}}], "messages[2]")
    with pytest.raises(ToolError, match="must be a JSON object"):
        tool_calls.message_calls([{"function": {"name": "f", "arguments": "[1]"}}], "messages[2]")


def test_tools_and_choice_are_checked():
    with pytest.raises(ToolError, match=r"tools\[0\]\.function\.name"):
        tool_calls.tool("bad name!", "", None, "tools[0].function")
    with pytest.raises(ToolError, match="must describe an object"):
        tool_calls.tool("f", "", {"type": "string"}, "tools[0].function")
    with pytest.raises(ToolError, match="given twice"):
        tool_calls.check_unique([TOOLS[0], TOOLS[0]])
    with pytest.raises(ToolError, match="needs tools"):
        tool_calls.choice(Choice.REQUIRED, None, [])
    with pytest.raises(ToolError, match="not among the tools"):
        tool_calls.choice(Choice.FUNCTION, "nope", TOOLS)
    assert tool_calls.choice(None, None, TOOLS) == (Choice.AUTO, None)
    assert tool_calls.choice(None, None, []) == (Choice.NONE, None)
    assert tool_calls.choice(Choice.FUNCTION, "add", TOOLS) == (Choice.FUNCTION, TOOLS[1])


def test_forced_schemas_accept_exactly_the_calls():
    schema = tool_calls.forced_schema(Choice.REQUIRED, TOOLS, None)
    good = {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}
    jsonschema.validate(good, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo"}}, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "other", "arguments": {}}, schema)
    llguidance_grammar(GrammarSpec(GrammarType.JSON, json.dumps(schema)))  # llguidance takes it
    assert tool_calls.forced_schema(Choice.FUNCTION, TOOLS, TOOLS[0]) == WEATHER
    assert tool_calls.forced_schema(Choice.AUTO, TOOLS, None) is None
    [call] = tool_calls.forced_call(Choice.REQUIRED, None, json.dumps(good))
    assert (call.name, json.loads(call.arguments)) == ("get_weather", good["arguments"])
    assert call.id.startswith("call_") and len(call.id) == 29
    [call] = tool_calls.forced_call(Choice.FUNCTION, TOOLS[1], '{"a":1,"b":2}')
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 1, "b": 2})
    assert tool_calls.forced_call(Choice.REQUIRED, None, '{"name": "get_w') == []  # cut short


HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
LLAMA = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; {"name": "add", "parameters": {"a": 1}}'
MISTRAL_V3 = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, ' \
             '{"name": "add", "arguments": {"a": 1, "b": 2}}]'
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}'


@pytest.mark.parametrize("parser, text, content, names", [
    (HermesParser(), HERMES, "Let me check.", ["get_weather", "add"]),
    (HermesParser(), '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 3}"}', "", ["add"]),  # unclosed, text args
    (Llama3JsonParser(), LLAMA, "", ["get_weather", "add"]),
    (Llama3JsonParser(), '<|python_tag|>{"name": "add", "parameters": {"a": 1}}', "", ["add"]),
    (MistralParser(), MISTRAL_V3, "", ["get_weather", "add"]),
    (MistralParser(), "Sure. " + MISTRAL_V11, "Sure.", ["get_weather", "add"]),
])
def test_parsers_read_calls(parser, text, content, names):
    parsed, calls = parser.parse(text)
    assert parsed == content and [c.name for c in calls] == names
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict)
    assert len({c.id for c in calls}) == len(calls)
    # Streamed a few characters at a time: the content goes out before the calls, never a marker.
    stream = ToolCallStream(parser)
    sent = "".join(stream.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    rest, streamed = stream.finish()
    assert [c.name for c in streamed] == names and rest == ""
    assert sent.strip() == content and not any(m in sent for m in parser.markers if m != "{")


@pytest.mark.parametrize("parser, text", [
    (HermesParser(), "plain answer with <b>tags</b> and a < sign"),
    (HermesParser(), "<tool_call>\n{not json}\n</tool_call>"),
    (HermesParser(), '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    (Llama3JsonParser(), "The answer is {42}."),
    (Llama3JsonParser(), '{"a": 1}'),  # JSON, but no call
    (MistralParser(), "[TOOL_CALLS] [oops"),
])
def test_text_that_is_not_a_call_stays_content(parser, text):
    assert parser.parse(text) == (text, [])
    stream = ToolCallStream(parser)
    sent = "".join(stream.feed(c) for c in text)
    rest, calls = stream.finish()
    assert calls == [] and sent + rest == text


def test_parser_is_read_from_the_template_or_the_flag():
    assert tool_calls.parser_for(QWEN25_TEMPLATE, None).name == "hermes"
    assert tool_calls.parser_for(LLAMA31_TEMPLATE, None).name == "llama3_json"
    assert tool_calls.parser_for("{{ '[TOOL_CALLS]' }}", None).name == "mistral"
    assert tool_calls.parser_for("{{ messages }}", None).name == "hermes"
    assert tool_calls.parser_for(QWEN25_TEMPLATE, "mistral").name == "mistral"
    with pytest.raises(ValueError, match="--tool-call-parser"):
        tool_calls.parser_for("", "nope")


def test_stop_sequences_end_the_text_as_openai_does():
    # The engine stops on the token that completes a stop sequence and keeps it; OpenAI's text ends before it.
    assert trim_stop("abc\ndef", ["\n"], stopped=True) == "abc"
    assert trim_stop("abc\ndef", ["\n"], stopped=False) == "abc\ndef"
    trimmer = StopTrimmer(["END", "\n\n"])
    pieces = ["hello E", "N", "x wor", "ld\n", "\nmore"]
    sent = "".join(trimmer.feed(p) for p in pieces)
    assert sent == "hello ENx world" and trimmer.finish(stopped=True) == ""
    trimmer = StopTrimmer(["END"])
    assert trimmer.feed("a E") == "a " and trimmer.finish(stopped=False) == "E"


def test_deep_json_is_a_named_client_error():
    deep = "[" * 2000 + "]" * 2000
    with pytest.raises(bounded_json.JsonTooDeep, match="the body nests deeper than 128 levels"):
        bounded_json.loads(deep, "the body")
    shallow_but_over = "[" * 200 + "]" * 200  # parses, then the bound refuses it
    with pytest.raises(bounded_json.JsonTooDeep):
        bounded_json.loads(shallow_but_over, "x")
    assert bounded_json.loads('{"a": [[1]]}', "x") == {"a": [[1]]}
    assert bounded_json.depth({"a": [[1]]}) == 3
    schema = '{"type": "object", "properties": {"a": ' * 1000 + '{}' + "}}" * 1000
    with pytest.raises(GrammarError, match="nests deeper than"):
        llguidance_grammar(GrammarSpec(GrammarType.JSON, schema))
    with pytest.raises(ValueError, match="not valid JSON"):
        bounded_json.loads("{", "x")
