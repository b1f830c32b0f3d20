"""Streaming detokenisation with tokenizers built here: byte-level BPE, Metaspace BPE, Llama-style byte fallback."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from text_generation_server.generation.detokenize import IncrementalDetokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Streaming text must never break a character in half.",
    "中文字符在字节级分词器中会被拆开。你好，世界！",
    "日本語のテキストもあります。",
    "Emoji 😀🎉🚀 and accents: café, naïve, jalapeño.",
] * 20
ASCII_CORPUS = [line for line in CORPUS if line.isascii()]
SPECIALS = ["<unk>", "<s>", "</s>"]


def train(tokenizer: Tokenizer, corpus: list[str], vocab_size: int, **extra) -> Tokenizer:
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False, **extra)
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def build_byte_level() -> Tokenizer:
    """GPT-2 style: every byte is a symbol, so multi-byte characters split across tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return train(tokenizer, CORPUS, 420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())


def build_metaspace() -> Tokenizer:
    """SentencePiece style: the decoder drops the leading space of the first token it sees."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    return train(tokenizer, CORPUS, 300)


def build_byte_fallback() -> Tokenizer:
    """Llama style: SentencePiece BPE whose unknown characters fall back to <0xNN> byte tokens."""
    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    model = json.loads(train(base, ASCII_CORPUS, 200).to_str())["model"]
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab |= {f"<0x{b:02X}>": len(SPECIALS) + b for b in range(256)}
    for token in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return tokenizer


BYTE_LEVEL = build_byte_level()
METASPACE = build_metaspace()
BYTE_FALLBACK = build_byte_fallback()
TOKENIZERS = {"byte_level": BYTE_LEVEL, "metaspace": METASPACE, "byte_fallback": BYTE_FALLBACK}


def stream(tokenizer: Tokenizer, prompt: list[int], generated: list[int], skip: bool = False) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    pieces = [detok.step(token) for token in generated]
    tail = detok.flush()
    assert detok.generated_ids == generated
    return pieces, tail


def expected_text(tokenizer: Tokenizer, prompt: list[int], generated: list[int], skip: bool = False) -> str:
    full = tokenizer.decode(prompt + generated, skip_special_tokens=skip)
    return full[len(tokenizer.decode(prompt, skip_special_tokens=skip)) :]


def test_byte_level_emoji_is_held_until_complete() -> None:
    prompt = BYTE_LEVEL.encode("Say:").ids
    generated = BYTE_LEVEL.encode(" hi 😀!").ids
    emoji_tokens = BYTE_LEVEL.encode("😀").ids
    assert len(emoji_tokens) > 1  # the emoji really is split across tokens
    assert any("\ufffd" in BYTE_LEVEL.decode([t]) for t in generated)  # naive per-token decode breaks it
    pieces, tail = stream(BYTE_LEVEL, prompt, generated)
    assert all("\ufffd" not in piece for piece in pieces) and tail == ""
    assert "".join(pieces) == " hi 😀!"
    emoji_at = [i for i, piece in enumerate(pieces) if "😀" in piece]
    assert len(emoji_at) == 1 and all(pieces[i] == "" for i in range(emoji_at[0] - len(emoji_tokens) + 1, emoji_at[0]))


@pytest.mark.parametrize("text", ["中文字符", "你好，世界！", "日本語のテキスト", "naïve café"])
def test_byte_level_cjk_and_accents_never_emit_broken_characters(text: str) -> None:
    prompt = BYTE_LEVEL.encode("Text:").ids
    generated = BYTE_LEVEL.encode(text).ids
    pieces, tail = stream(BYTE_LEVEL, prompt, generated)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + tail == text


def test_metaspace_keeps_the_leading_space_of_the_first_generated_token() -> None:
    ids = METASPACE.encode("The quick brown fox jumps").ids
    prompt, generated = ids[:2], ids[2:]
    assert METASPACE.decode([generated[0]]) == "brown"  # decoded alone the space is lost
    pieces, tail = stream(METASPACE, prompt, generated)
    assert pieces == [" brown", " fox", " jumps"] and tail == ""


def test_metaspace_without_prompt_matches_plain_decode() -> None:
    generated = METASPACE.encode("over the lazy dog").ids
    pieces, tail = stream(METASPACE, [], generated)
    assert "".join(pieces) + tail == METASPACE.decode(generated) == "over the lazy dog"


def clean_splits(tokenizer: Tokenizer, ids: list[int]) -> list[int]:
    """Prompt/generation splits where the prompt ends on a whole character.

    Elsewhere "the text after the prompt" is not defined: the prompt alone decodes
    to U+FFFD where the full sequence has a real character.
    """
    return [i for i in range(len(ids)) if not tokenizer.decode(ids[:i], skip_special_tokens=False).endswith("\ufffd")]


def test_byte_fallback_cjk_and_spaces() -> None:
    ids = BYTE_FALLBACK.encode("The dog 中文 jumps 😀 over").ids
    assert any(BYTE_FALLBACK.id_to_token(i).startswith("<0x") for i in ids)
    for split in clean_splits(BYTE_FALLBACK, ids)[1:]:
        pieces, tail = stream(BYTE_FALLBACK, ids[:split], ids[split:])
        assert all("\ufffd" not in piece for piece in pieces)
        assert "".join(pieces) + tail == expected_text(BYTE_FALLBACK, ids[:split], ids[split:])


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
@pytest.mark.parametrize("text", CORPUS[:5])
def test_whole_stream_equals_decode_at_every_split(name: str, text: str) -> None:
    tokenizer = TOKENIZERS[name]
    ids = tokenizer.encode(text).ids
    splits = clean_splits(tokenizer, ids)
    assert splits[0] == 0 and (len(splits) >= 2 or len(ids) == 1)
    for split in splits:
        pieces, tail = stream(tokenizer, ids[:split], ids[split:])
        assert "".join(pieces) + tail == expected_text(tokenizer, ids[:split], ids[split:])


def test_byte_fallback_prompt_context_never_starts_inside_a_character() -> None:
    ids = BYTE_FALLBACK.encode("x 中文字符 ok").ids
    split = next(i for i in range(len(ids)) if BYTE_FALLBACK.decode(ids[:i]) == "x 中文")
    # the default 5-token context would start on a continuation byte of 中
    assert BYTE_FALLBACK.decode(ids[split - 5 : split]).startswith("\ufffd")
    pieces, tail = stream(BYTE_FALLBACK, ids[:split], ids[split:])
    assert "字" in pieces and "符" in pieces
    assert "".join(pieces) == "字符 ok" and tail == ""


@pytest.mark.parametrize("skip", [False, True])
def test_special_tokens(skip: bool) -> None:
    eos = BYTE_LEVEL.token_to_id("</s>")
    prompt = BYTE_LEVEL.encode("Hello").ids
    generated = BYTE_LEVEL.encode(" world").ids + [eos]
    pieces, tail = stream(BYTE_LEVEL, prompt, generated, skip=skip)
    assert pieces[-1] == ("" if skip else "</s>")
    assert "".join(pieces) + tail == expected_text(BYTE_LEVEL, prompt, generated, skip=skip)


def test_flush_releases_an_incomplete_character() -> None:
    emoji = BYTE_LEVEL.encode("😀").ids
    prompt = BYTE_LEVEL.encode("x").ids
    pieces, tail = stream(BYTE_LEVEL, prompt, emoji[:-1])
    assert pieces == [""] * (len(emoji) - 1)
    assert tail == BYTE_LEVEL.decode(emoji[:-1]) and tail.endswith("\ufffd")


def test_bad_token_ids_are_rejected() -> None:
    vocab = BYTE_LEVEL.get_vocab_size(with_added_tokens=True)
    with pytest.raises(ValueError, match="token_id"):
        IncrementalDetokenizer(BYTE_LEVEL, [1]).step(vocab)
    with pytest.raises(ValueError, match=r"prompt_ids\[1\]"):
        IncrementalDetokenizer(BYTE_LEVEL, [1, -2])


def _ids(tokenizer: Tokenizer) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, tokenizer.get_vocab_size(with_added_tokens=True) - 1), max_size=40)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt_text=st.text(max_size=30), generated=_ids(BYTE_LEVEL))
def test_property_byte_level_random_ids(prompt_text: str, generated: list[int]) -> None:
    prompt = BYTE_LEVEL.encode(prompt_text).ids
    pieces, tail = stream(BYTE_LEVEL, prompt, generated)
    assert not any(piece.endswith("\ufffd") for piece in pieces)
    assert "".join(pieces) + tail == expected_text(BYTE_LEVEL, prompt, generated)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt_text=st.text(max_size=30), generated=_ids(METASPACE), skip=st.booleans())
def test_property_metaspace_random_ids(prompt_text: str, generated: list[int], skip: bool) -> None:
    prompt = METASPACE.encode(prompt_text).ids
    pieces, tail = stream(METASPACE, prompt, generated, skip=skip)
    assert "".join(pieces) + tail == expected_text(METASPACE, prompt, generated, skip=skip)
