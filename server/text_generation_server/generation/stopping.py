"""When a request stops generating: EOS, a stop sequence, or its token budget."""

from __future__ import annotations

import enum


class FinishReason(enum.IntEnum):
    """Values are the generate.v3 FinishReason wire values, so they go into protobuf unchanged."""

    LENGTH = 0
    EOS_TOKEN = 1
    STOP_SEQUENCE = 2


class StoppingCriteria:
    """Per-request stop check, called once for every generated token.

    When several reasons hold for the same token, the most specific one is
    reported: EOS, then a stop sequence, then length. (TGI checks length first;
    reporting the token the model actually chose is more useful to clients and
    changes nothing about when generation ends.) Stop-sequence text stays in the
    output, as in TGI.

    max_new_tokens and stop_sequences were validated where the request entered
    (generation/request_fields.py); they are not checked again here.
    """

    def __init__(
        self,
        eos_token_ids: set[int],
        stop_sequences: list[str],
        max_new_tokens: int,
        ignore_eos_token: bool = False,
    ) -> None:
        for token in eos_token_ids:
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"eos_token_ids must hold token ids >= 0, got {token!r}")
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_sequences = list(stop_sequences)
        self.max_new_tokens = max_new_tokens
        self.ignore_eos_token = ignore_eos_token
        self.current_tokens = 0
        # A stop sequence not yet seen can start at most (longest - 1) characters
        # before the new text, so that is all the past text worth keeping.
        self._keep = max((len(stop) for stop in self.stop_sequences), default=1) - 1
        self._tail = ""

    def fork(self) -> "StoppingCriteria":
        """An independent copy: a step computed ahead must not advance the real counters."""
        twin = object.__new__(type(self))  # copy.copy's reduce protocol costs more than the fields
        twin.__dict__.update(self.__dict__)
        twin.stop_sequences = list(self.stop_sequences)
        return twin

    def __call__(self, token_id: int, text_delta: str) -> tuple[bool, FinishReason | None]:
        """Count the token and say whether generation ends with it, and why.

        text_delta is the text this token made visible (possibly "", when the
        detokenizer holds back an incomplete character); a stop sequence may span
        several deltas.
        """
        self.current_tokens += 1
        if not self.ignore_eos_token and token_id in self.eos_token_ids:
            return True, FinishReason.EOS_TOKEN
        if self.stop_sequences and text_delta:
            # Matches lying wholly in the old tail were reported on an earlier call,
            # so any match found here ends in the new text.
            window = self._tail + text_delta
            self._tail = window[-self._keep :] if self._keep else ""
            if any(stop in window for stop in self.stop_sequences):
                return True, FinishReason.STOP_SEQUENCE
        if self.current_tokens >= self.max_new_tokens:
            return True, FinishReason.LENGTH
        return False, None
