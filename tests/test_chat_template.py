"""Chat templates (chat_template.py) and the Chat / ChatStream RPCs (router/service.py).

The rendering must be transformers' own: each template here is rendered by
`PreTrainedTokenizerFast.apply_chat_template` from a copy of the embedded model's folder that
carries it, and our text and token ids must equal transformers' (special tokens, generation
prompt, raise_exception, tojson, strftime_now, namespace, loop controls, {% generation %},
trim_blocks/lstrip_blocks whitespace). Then the service: Chat's tokens are Generate's on the
prompt transformers renders, ChatStream streams the same tokens, a model without a template
answers FAILED_PRECONDITION naming where it looked, a template's refusal INVALID_ARGUMENT with
its message; and `generate --chat` on the command line.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import grpc
import pytest
import torch

from text_generation_server.generation.chat_template import (
    ChatTemplate,
    ChatTemplateBroken,
    ChatTemplateError,
    ChatTemplateMissing,
)
from text_generation_server.utils.locate import embedded_model_path

transformers = pytest.importorskip("transformers", reason="transformers renders the reference prompts")

torch.set_num_threads(1)

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
# Multi-line, so trim_blocks / lstrip_blocks decide the whitespace; every helper transformers gives.
LLAMA3 = """{{- bos_token }}
{%- set date_string = strftime_now("%d %b %Y") %}
{%- set ns = namespace(found=false) %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}{% set ns.found = true %}{% endif %}
{%- endfor %}
<|start_header_id|>system<|end_header_id|>

Today Date: {{ date_string }}
{% if not ns.found %}You are a helpful assistant.{% endif %}
{{ {"roles": messages | map(attribute='role') | list, "meta": dict(lang="fr", note="déjà vu ✓")} | tojson }}
<|eot_id|>
{%- for message in messages %}
    {%- if message['role'] == 'system' %}{% continue %}{% endif %}
    {%- if loop.index > 8 %}{% break %}{% endif %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim }}{% endgeneration %}\
{% else %}{{ message['content'] | trim }}{% endif %}<|eot_id|>
{%- endfor %}
{%- if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""
TEMPLATES = {"chatml": CHATML, "llama2": LLAMA2, "llama3": LLAMA3}
CONVERSATIONS = [
    [{"role": "user", "content": "Write a function that adds two numbers."}],
    [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add("},
     {"role": "assistant", "content": " a, b): return a + b "},
     {"role": "user", "content": "Now with types. ünïcödé"}],
]


def model_copy(folder: Path, template: str | None = None, where: str = "tokenizer_config") -> Path:
    """The embedded model's folder, its weights linked, with `template` in tokenizer_config.json
    or chat_template.jinja."""
    src = embedded_model_path()
    folder.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.suffix == ".safetensors":
            (folder / item.name).symlink_to(item)
        else:
            shutil.copy(item, folder / item.name)
    if template is not None and where == "tokenizer_config":
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    elif template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    return {name: model_copy(root / name, text) for name, text in TEMPLATES.items()}


def hf_tokenizer(folder: Path):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


# -- rendering ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_and_tokens_equal_transformers(folders, name, conversation, add_generation_prompt):
    messages = CONVERSATIONS[conversation]
    hf = hf_tokenizer(folders[name])
    ours = ChatTemplate.load(folders[name])
    text = ours.render(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    tokenizer = hf.backend_tokenizer
    assert tokenizer.encode(text, add_special_tokens=False).ids == list(want)
    if name == "llama2":
        assert text.count("<|endoftext|>") >= 1  # bos_token reached the template


def test_a_template_refusal_carries_its_message(folders):
    template = ChatTemplate.load(folders["llama2"])
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ChatTemplateError, match="failed on the conversation"):
        ChatTemplate.from_string("{{ messages[0]['content'] + 1 }}").render([{"role": "user", "content": "a"}])
    with pytest.raises(ChatTemplateError, match="refused the conversation: list object has no element 5"):
        ChatTemplate.from_string("{{ messages[5]['content'] }}").render([{"role": "user", "content": "a"}])


def test_the_sandbox_holds(tmp_path):
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ChatTemplateError):
        ChatTemplate.from_string(escape).render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="underscore"):
        ChatTemplate.from_string("{% set ns = namespace(_x=1) %}").render([])
    with pytest.raises(ChatTemplateError):  # the template cannot modify what it is given
        ChatTemplate.from_string("{{ messages.append(1) }}").render([{"role": "user", "content": "x"}])


def test_where_templates_are_found(tmp_path):
    missing = model_copy(tmp_path / "none")
    with pytest.raises(ChatTemplateMissing) as info:
        ChatTemplate.load(missing)
    for looked in ("chat_template.jinja", "tokenizer_config.json", "chat_template.json"):
        assert str(missing / looked) in str(info.value)
    # chat_template.jinja wins over tokenizer_config.json, as in transformers.
    both = model_copy(tmp_path / "both", "from config")
    (both / "chat_template.jinja").write_text("from file")
    assert ChatTemplate.load(both).render([]) == "from file"
    assert hf_tokenizer(both).apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "from file"
    named = model_copy(tmp_path / "named")
    config = json.loads((named / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    (named / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.load(named).render([]) == "plain"
    legacy = model_copy(tmp_path / "legacy")
    (legacy / "chat_template.json").write_text(json.dumps({"chat_template": "legacy {{ eos_token }}"}))
    assert ChatTemplate.load(legacy).render([]) == "legacy <|endoftext|>"
    broken = model_copy(tmp_path / "broken", "{% for %}", where="file")
    with pytest.raises(ChatTemplateBroken, match="does not compile"):
        ChatTemplate.load(broken)


# -- the service ------------------------------------------------------------------------------------
class Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(details)
        self.code, self.details = code, details


class Context:
    async def abort(self, code, details):
        raise Aborted(code, details)

    def set_trailing_metadata(self, metadata):
        pass

    def add_done_callback(self, callback) -> None:
        pass  # the streams here are read to their end


@pytest.fixture(scope="module")
def lm():
    from text_generation_server.models.loader import get_model

    return get_model(None)


def service_for(lm, folder: Path | None):
    from test_scheduler_prefix import LIMITS, make

    from text_generation_server.router.metrics import Metrics
    from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb
    from text_generation_server.router.service import TextGenerationService

    scheduler, _, _, _ = make(lm, 200, True, 64)
    return scheduler, TextGenerationService(scheduler, lm.tokenizer, LIMITS, cpb.InfoResponse(), Metrics("test"),
                                            model_folder=folder, eos_token_ids=lm.eos_token_ids)


def test_chat_tokens_equal_generate_on_the_rendered_prompt(lm, folders):
    from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb

    messages = CONVERSATIONS[1]
    prompt = hf_tokenizer(folders["llama3"]).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    params = cpb.GenerateParameters(max_new_tokens=12, details=True, decoder_input_details=True)
    chat = cpb.ChatRequest(messages=[cpb.Message(**m) for m in messages], parameters=params)

    async def scenario():
        scheduler, service = service_for(lm, folders["llama3"])
        scheduler.start()
        try:
            ctx = Context()
            by_chat = await service.Chat(chat, ctx)
            by_generate = await service.Generate(cpb.GenerateRequest(inputs=prompt, parameters=params), ctx)
            streamed = [m async for m in service.ChatStream(chat, ctx)]
            return by_chat, by_generate, streamed
        finally:
            await scheduler.stop()

    by_chat, by_generate, streamed = asyncio.run(scenario())
    assert [t.id for t in by_chat.details.prefill] == \
        lm.tokenizer.encode(prompt, add_special_tokens=False).ids  # the template's tokens, nothing added
    assert [t.id for t in by_chat.details.tokens] == [t.id for t in by_generate.details.tokens]
    assert by_chat.generated_text == by_generate.generated_text
    assert [m.token.id for m in streamed] == [t.id for t in by_chat.details.tokens]
    assert streamed[-1].generated_text == by_chat.generated_text


def test_chat_refusals(lm, folders):
    from text_generation_server.pb.text_generation.v1 import text_generation_pb2 as cpb

    def chat(*messages: tuple[str, str]) -> cpb.ChatRequest:
        return cpb.ChatRequest(messages=[cpb.Message(role=r, content=c) for r, c in messages],
                               parameters=cpb.GenerateParameters(max_new_tokens=2))

    async def refusal(folder, request) -> Aborted:
        _, service = service_for(lm, folder)
        with pytest.raises(Aborted) as info:
            await service.Chat(request, Context())
        return info.value

    no_template = asyncio.run(refusal(embedded_model_path(), chat(("user", "hi"))))
    assert no_template.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "no chat template" in no_template.details and "tokenizer_config.json" in no_template.details
    refused = asyncio.run(refusal(folders["llama2"], chat(("user", "a"), ("user", "b"))))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "Conversation roles must alternate" in refused.details
    for request, field in ((chat(), "messages must hold at least one message"),
                           (chat(("", "x")), "messages[0].role must not be empty")):
        empty = asyncio.run(refusal(folders["chatml"], request))
        assert (empty.code, empty.details) == (grpc.StatusCode.INVALID_ARGUMENT, field)


def test_generate_chat_on_the_command_line(lm, folders, tmp_path):
    from typer.testing import CliRunner

    from text_generation_server.cli.main import app
    from text_generation_server.engine.types import GenerationRequest

    runner = CliRunner()
    result = runner.invoke(app, ["generate", "--chat", "--model", str(folders["chatml"]), "--json",
                                 "--max-new-tokens", "6", "def add("])
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout.strip().splitlines()[-1])
    prompt = ChatTemplate.load(folders["chatml"]).render([{"role": "user", "content": "def add("}])
    want = lm.generate([GenerationRequest(id=0, inputs=prompt, max_new_tokens=6, add_special_tokens=False)])[0]
    assert row["token_ids"] == want.token_ids
    missing = runner.invoke(app, ["generate", "--chat", "--max-new-tokens", "2", "hi"])
    assert missing.exit_code == 2 and "no chat template" in missing.output
