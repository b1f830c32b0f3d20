"""A GGUF model's chat template comes from its own metadata (tokenizer.chat_template), with the special
tokens its ids name, rendering what transformers renders for the same file; and the parsed metadata
and converted tokenizer of a GGUF are read back from the cache (quantizers/gguf_cache.py) unchanged.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import transformers
from gguf_writer import T, write_gguf

from text_generation_server.generation.chat_template import ChatTemplate, ChatTemplateMissing, load_chat_template
from text_generation_server.quantizers import gguf_arch, gguf_cache, gguf_file
from text_generation_server.utils.locate import open_checkpoint

# ChatML with the tokens the file names by id, as Qwen's templates write them.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% else %}{{ eos_token }}{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "ünïcode?"}],
]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("chat") / "tiny.gguf", qtype=T.Q8_0, chat_template=TEMPLATE)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=range(len(CONVERSATIONS)))
def test_the_gguf_template_renders_as_transformers(gguf_path, conversation, add_generation_prompt):
    template = ChatTemplate.load(gguf_path)
    assert template.source == f"{gguf_path} (tokenizer.chat_template)"
    reference = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    want = reference.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = template.render(conversation, add_generation_prompt=add_generation_prompt)
    assert got == want
    assert template.special_tokens["eos_token"] in got or add_generation_prompt
    # a folder holding the file finds it too
    assert ChatTemplate.load(gguf_path.parent).render(conversation, add_generation_prompt) == want


def test_serving_a_gguf_has_its_chat_template(gguf_path):
    """The router reads the template where the checkpoint says the model is (the .gguf file)."""
    checkpoint = open_checkpoint(str(gguf_path))
    template, why = load_chat_template(Path(checkpoint.folder))
    assert template is not None and why == ""
    assert template.render(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")


def test_generate_chat_renders_with_the_gguf_template(gguf_path):
    from text_generation_server.cli.generate import _chat_prompts

    assert _chat_prompts(str(gguf_path), ["hello there"]) == [ChatTemplate.load(gguf_path).render(CONVERSATIONS[0])]


def test_a_gguf_without_a_template_says_so(tmp_path):
    path = write_gguf(tmp_path / "plain.gguf", qtype=T.Q8_0)
    with pytest.raises(ChatTemplateMissing, match="plain.gguf has no tokenizer.chat_template"):
        ChatTemplate.load(path)
    template, why = load_chat_template(path)
    assert template is None and "tokenizer.chat_template" in why


def test_metadata_reads_as_the_gguf_package_reads_it(gguf_path):
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    want = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    file = gguf_file.GGUFFile([gguf_path])
    assert file.metadata == want
    assert file.readers[0].data_offset == reader.data_offset
    assert [t.name for t in file.readers[0].tensors] == [t.name for t in reader.tensors]


def test_a_truncated_metadata_section_is_refused_by_key(tmp_path, gguf_path):
    broken = tmp_path / "cut.gguf"
    broken.write_bytes(gguf_path.read_bytes()[:2000])
    with pytest.raises(gguf_file.CheckpointError, match=r"cut.gguf: metadata key '[^']+' cannot be read .*truncated"):
        gguf_file.GGUFFile([broken])


def test_the_tokenizer_cache_round_trips_and_follows_the_file(tmp_path, gguf_path, monkeypatch):
    monkeypatch.setenv(gguf_cache.CACHE_ENV, str(tmp_path / "cache"))
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "m.gguf"
    shutil.copy(gguf_path, path)
    file = gguf_file.open_gguf([path])
    calls = []

    def convert():
        calls.append(1)
        return gguf_arch._convert_tokenizer(file)

    first, template = gguf_cache.cached_tokenizer(file, convert)
    again, template_again = gguf_cache.cached_tokenizer(file, convert)
    assert len(calls) == 1 and template == template_again == TEMPLATE
    assert again.to_str() == first.to_str()
    text = "hello there, ünïcode <|im_end|>"
    assert again.encode(text).ids == first.encode(text).ids
    # a file with other metadata is another entry; a tokenizer file beside it changes the key too, a log does not
    other = write_gguf(tmp_path / "other.gguf", qtype=T.Q8_0, chat_template=TEMPLATE + " ")
    assert gguf_cache.cache_path(gguf_file.GGUFFile([other])) != gguf_cache.cache_path(file)
    before = gguf_cache.cache_path(file)
    (folder / "server.log").write_text("a log beside the model")
    assert gguf_cache.cache_path(file) == before
    (folder / "tokenizer_config.json").write_text("{}")
    assert gguf_cache.cache_path(file) != before
    # a corrupt entry is converted again, and "off" skips the cache
    gguf_cache.cache_path(file).parent.mkdir(parents=True, exist_ok=True)
    gguf_cache.cache_path(file).write_text("not json")
    gguf_cache.cached_tokenizer(file, convert)
    assert len(calls) == 2
    monkeypatch.setenv(gguf_cache.CACHE_ENV, "off")
    assert gguf_cache.cache_path(file) is None
    gguf_cache.cached_tokenizer(file, convert)
    assert len(calls) == 3
