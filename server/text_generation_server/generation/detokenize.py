"""Streaming detokenisation: text for a growing token sequence, one token at a time.

Decoding each new token on its own is wrong twice over: a byte-level token may
hold only part of a UTF-8 character, and SentencePiece/Metaspace decoders drop
the leading space of the first token they see. So every step decodes a small
window that starts a few tokens back (the prefix offset) twice, once up to the
last emitted token (the read offset) and once to the end, and emits the
difference. While the window's text ends in U+FFFD, the character is not yet
complete and nothing is emitted; the offsets stay put until it is.
"""

from __future__ import annotations


import tokenizers

# Prompt tokens that seed the window, so the first generated token is decoded in
# context (keeps its leading space) rather than as the first token of a text.
PROMPT_CONTEXT_TOKENS = 5
# How far before the usual context start to look for a usable one.
_MAX_CONTEXT_EXTENSION = 32
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Streams text for a growing token sequence without broken UTF-8 or lost spaces."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_ids: list[int],
        skip_special_tokens: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        for index, token in enumerate(prompt_ids):
            self._check_id(token, f"prompt_ids[{index}]")
        self._skip_special_tokens = skip_special_tokens
        self._special_ids = {
            token_id for token_id, token in tokenizer.get_added_tokens_decoder().items() if token.special
        }
        context = list(prompt_ids[self._context_start(prompt_ids) :])
        # _ids holds the prompt context followed by every generated id.
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._context_length = len(context)

    def fork(self) -> "IncrementalDetokenizer":
        """An independent copy sharing the tokenizer (a step computed ahead works on the copy)."""
        twin = object.__new__(type(self))  # copy.copy's reduce protocol costs more than the fields
        twin.__dict__.update(self.__dict__)
        twin._ids = list(self._ids)
        return twin

    def _context_start(self, prompt_ids: list[int]) -> int:
        """Where the prompt context starts: a few tokens back, but never a context that misleads.

        Two contexts do: one that starts on a continuation byte (it decodes to
        U+FFFD there, and with a byte-fallback decoder, as in Llama, the whole run
        of byte tokens turns into U+FFFD, characters generated into that run
        included), and one made only of skipped special tokens (the decoder then
        sees the first generated token as the first token and drops its space).
        So walk back a little, or failing that forward, to a usable start.
        """
        end = len(prompt_ids)
        start = max(0, end - PROMPT_CONTEXT_TOKENS)
        lowest = max(0, start - _MAX_CONTEXT_EXTENSION)
        for candidate in [*range(start, lowest - 1, -1), *range(start + 1, end)]:
            context = prompt_ids[candidate:end]
            if self._skip_special_tokens and all(token in self._special_ids for token in context):
                continue
            if not self._decode(context).startswith(_REPLACEMENT):
                return candidate
        return start

    def _check_id(self, token: object, what: str) -> None:
        if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < self._vocab_size:
            raise ValueError(f"{what} must be a token id in [0, {self._vocab_size}), got {token!r}")

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _pending_text(self) -> tuple[str, str]:
        """(text already emitted from the window, text of the whole window)."""
        emitted = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        return emitted, window

    def step(self, token_id: int) -> str:
        """Add one generated token; return the text it made visible ("" while a character is incomplete)."""
        self._check_id(token_id, "token_id")
        self._ids.append(token_id)
        emitted, window = self._pending_text()
        if len(window) > len(emitted) and not window.endswith(_REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return window[len(emitted) :]
        return ""

    def flush(self) -> str:
        """At the end of generation, emit whatever was held back (an incomplete character becomes U+FFFD)."""
        emitted, window = self._pending_text()
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if len(window) > len(emitted):
            return window[len(emitted) :]
        return ""

    @property
    def generated_ids(self) -> list[int]:
        return self._ids[self._context_length :]
