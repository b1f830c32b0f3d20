"""The model's chat template: a conversation to the prompt text, as transformers renders it.

Chat templates are Jinja programs shipped with the checkpoint, i.e. untrusted code, so they run
in Jinja's immutable sandbox with exactly the environment transformers gives them
(`transformers.utils.chat_template_utils`): trim_blocks and lstrip_blocks, the loop-control
extension, the `{% generation %}` tag (rendered as its body), a `tojson` that keeps non-ASCII text
and takes indent/separators/sort_keys, and the globals `raise_exception`, `strftime_now`, `dict`
and `namespace`. The template sees `messages`, `add_generation_prompt` and the tokenizer's special
tokens by name (`bos_token`, `eos_token`, ...), as `apply_chat_template` passes them, so the text
here is transformers' text and tokenizing it without special tokens gives its ids.

Where the template is looked for, in transformers' order: `chat_template.jinja` in the model
folder, then `chat_template` in tokenizer_config.json (a string, or a list of named templates of
which "default" is used), then the legacy `chat_template.json`. A GGUF model (the path is a .gguf
file, or a folder holding one) carries its template in its metadata, `tokenizer.chat_template`, and
its special tokens as ids into `tokenizer.ggml.tokens` (bos, eos, unknown, padding): read from there,
as transformers' `from_pretrained(..., gguf_file=...)` reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from loguru import logger

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
LEGACY_TEMPLATE_FILE = "chat_template.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# The special tokens apply_chat_template hands the template by name (transformers'
# SPECIAL_TOKENS_ATTRIBUTES that a tokenizer config can set).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The ones a GGUF names, by the metadata key of their id (transformers' gguf tokenizer mapping).
GGUF_SPECIAL_TOKEN_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                          "pad_token": "padding_token_id"}


class ChatTemplateMissing(LookupError):
    """The model ships no chat template (FAILED_PRECONDITION: the server, not the request, lacks it)."""


class ChatTemplateBroken(ValueError):
    """The model's template does not compile (FAILED_PRECONDITION too: no request can fix it)."""


class ChatTemplateError(ValueError):
    """The template refused this conversation (raise_exception, or a failure while rendering):
    INVALID_ARGUMENT with the template's own message."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with it to build
    assistant masks; rendering a prompt only needs its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` without handing the template the dict type itself (no attribute access to it)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore names (a way towards CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold the underscore name {name!r}")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


def _token_text(value: Any) -> str | None:
    """A special token as a config writes it: a string, or an AddedToken dict with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ChatTemplateBroken(f"{path} cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ChatTemplateBroken(f"{path} must hold a JSON object")
    return data


def _pick(template: Any, where: str) -> str:
    """A template from a config value: the string, or the "default" of a list of named ones."""
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        default = named.get("default")
        if isinstance(default, str):
            return default
        raise ChatTemplateBroken(f"{where} lists templates {sorted(map(str, named))} but none named 'default'")
    raise ChatTemplateBroken(f"{where} must be a string or a list of named templates")


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template and the special tokens it is rendered with."""

    source: str  # where the template came from (a file, or file and key), for messages
    template: jinja2.Template
    special_tokens: dict[str, str]
    text: str = ""  # the template's source, where the tool-call syntax its model uses is read

    @classmethod
    def from_string(cls, text: str, special_tokens: Mapping[str, str] | None = None,
                    source: str = "<string>") -> "ChatTemplate":
        try:
            template = _environment().from_string(text)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateBroken(f"the chat template in {source} does not compile: {exc} (line {exc.lineno})") \
                from None
        return cls(source, template, dict(special_tokens or {}), text)

    @classmethod
    def load(cls, folder: Path) -> "ChatTemplate":
        """The template of the checkpoint in `folder` (or of the GGUF file it names). ChatTemplateMissing
        names every place it looked; ChatTemplateBroken when the one found is unusable."""
        from text_generation_server.quantizers.gguf_file import gguf_files

        files = gguf_files(Path(folder))
        if files is not None:
            return cls.from_gguf(files)
        config_path = folder / TOKENIZER_CONFIG
        config = _read_json(config_path) if config_path.is_file() else {}
        special: dict[str, str] = {}
        map_path = folder / SPECIAL_TOKENS_MAP
        if map_path.is_file():  # legacy; tokenizer_config.json wins where both name a token
            for name, value in _read_json(map_path).items():
                if name in SPECIAL_TOKEN_NAMES and (text := _token_text(value)) is not None:
                    special[name] = text
        for name in SPECIAL_TOKEN_NAMES:
            if (text := _token_text(config.get(name))) is not None:
                special[name] = text
        extra = config.get("extra_special_tokens")
        if isinstance(extra, Mapping):  # named model-specific tokens (image_token, ...) reach templates too
            for name, value in extra.items():
                if isinstance(name, str) and (text := _token_text(value)) is not None:
                    special[name] = text

        file = folder / TEMPLATE_FILE
        if file.is_file():
            return cls.from_string(file.read_text(encoding="utf-8"), special, str(file))
        if config.get("chat_template") is not None:
            where = f"{config_path} (chat_template)"
            return cls.from_string(_pick(config["chat_template"], where), special, where)
        legacy = folder / LEGACY_TEMPLATE_FILE
        if legacy.is_file():
            data = _read_json(legacy)
            if data.get("chat_template") is not None:
                where = f"{legacy} (chat_template)"
                return cls.from_string(_pick(data["chat_template"], where), special, where)
        raise ChatTemplateMissing(
            f"the model has no chat template: looked for {file}, 'chat_template' in {config_path} and {legacy}"
        )

    @classmethod
    def from_gguf(cls, files: Sequence[Path]) -> "ChatTemplate":
        """The template in a GGUF's metadata, with the special tokens its ids name."""
        from text_generation_server.quantizers.gguf_file import open_gguf

        file = open_gguf(files)
        where = f"{file.name} (tokenizer.chat_template)"
        text = file.get("tokenizer.chat_template")
        if text is None:
            raise ChatTemplateMissing(f"the model has no chat template: {file.name} has no tokenizer.chat_template")
        if not isinstance(text, str):
            raise ChatTemplateBroken(f"the chat template in {where} is a {type(text).__name__}, not text")
        tokens = file.get("tokenizer.ggml.tokens") or []
        special: dict[str, str] = {}
        for name, key in GGUF_SPECIAL_TOKEN_IDS.items():
            index = file.get(f"tokenizer.ggml.{key}")
            if isinstance(index, int) and 0 <= index < len(tokens):
                special[name] = tokens[index]
        return cls.from_string(text, special, where)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The prompt for `messages` (dicts with role and content, and tool_calls / tool_call_id
        where given); ChatTemplateError with the template's own message when it refuses them.
        `tools`: JSON-schema tools ({"type": "function", "function": {...}}), handed over as
        transformers' apply_chat_template(tools=...) hands dict tools: unchanged, or None."""
        try:
            return self.template.render(messages=[dict(m) for m in messages],
                                        tools=[dict(t) for t in tools] if tools else None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.exceptions.TemplateError as exc:  # raise_exception, undefined names, sandbox refusals
            raise ChatTemplateError(f"the chat template refused the conversation: {exc}") from None
        except RecursionError:  # messages nested past what the renderer follows
            raise ChatTemplateError("the chat template failed on the conversation: it nests too deeply") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError) as exc:
            # A template's own bug on this input (e.g. messages[0] of an odd conversation).
            raise ChatTemplateError(f"the chat template failed on the conversation: {type(exc).__name__}: {exc}") \
                from None


def load_chat_template(folder: Path) -> tuple[ChatTemplate | None, str]:
    """The template of `folder`, or None and why not (the message Chat answers with); logged."""
    try:
        template = ChatTemplate.load(folder)
    except ChatTemplateMissing as exc:  # many base models have none: nothing is wrong
        logger.info("Chat and ChatStream unavailable: {}", exc)
        return None, str(exc)
    except ChatTemplateBroken as exc:
        logger.warning("Chat and ChatStream unavailable: {}", exc)
        return None, str(exc)
    logger.info("chat template from {}", template.source)
    return template, ""
