"""Stopping criteria: EOS, ignore_eos, token budget, stop sequences across tokens."""

from __future__ import annotations

import pytest

from text_generation_server.generation.stopping import FinishReason, StoppingCriteria


def feed(criteria: StoppingCriteria, steps: list[tuple[int, str]]) -> list[tuple[bool, FinishReason | None]]:
    return [criteria(token, text) for token, text in steps]


def test_wire_values() -> None:
    assert (FinishReason.LENGTH, FinishReason.EOS_TOKEN, FinishReason.STOP_SEQUENCE) == (0, 1, 2)


def test_eos_stops() -> None:
    criteria = StoppingCriteria({2, 7}, [], max_new_tokens=10)
    assert feed(criteria, [(5, "a"), (6, "b")]) == [(False, None), (False, None)]
    assert criteria(7, "") == (True, FinishReason.EOS_TOKEN)
    assert criteria.current_tokens == 3


def test_ignore_eos_runs_to_length() -> None:
    criteria = StoppingCriteria({2}, [], max_new_tokens=3, ignore_eos_token=True)
    assert feed(criteria, [(2, ""), (2, ""), (2, "")]) == [(False, None), (False, None), (True, FinishReason.LENGTH)]


@pytest.mark.parametrize("budget", [1, 4])
def test_max_new_tokens(budget: int) -> None:
    criteria = StoppingCriteria(set(), [], max_new_tokens=budget)
    results = feed(criteria, [(i, "x") for i in range(budget)])
    assert results[:-1] == [(False, None)] * (budget - 1)
    assert results[-1] == (True, FinishReason.LENGTH)
    assert criteria.current_tokens == budget


def test_eos_on_the_last_allowed_token_reports_eos() -> None:
    criteria = StoppingCriteria({0}, [], max_new_tokens=2)
    assert feed(criteria, [(5, "a"), (0, "")]) == [(False, None), (True, FinishReason.EOS_TOKEN)]


def test_stop_sequence_split_across_tokens() -> None:
    criteria = StoppingCriteria({0}, ["###END"], max_new_tokens=50)
    steps = [(1, "hello "), (2, "#"), (3, "##"), (4, ""), (5, "E"), (6, "N")]
    assert all(done is False for done, _ in feed(criteria, steps))
    assert criteria(7, "D and more") == (True, FinishReason.STOP_SEQUENCE)


def test_stop_sequence_inside_one_delta() -> None:
    criteria = StoppingCriteria(set(), ["\n\n"], max_new_tokens=50)
    assert criteria(1, "line one") == (False, None)
    assert criteria(2, "\n\nline two") == (True, FinishReason.STOP_SEQUENCE)


def test_multiple_stop_sequences() -> None:
    stops = ["Observation:", "</s>", "STOP"]
    for text, tokens_until_stop in [("I think. Observation: x", 3), ("a </", None), ("xx ST", None)]:
        criteria = StoppingCriteria(set(), stops, max_new_tokens=100)
        chunks = [text[i : i + 8] for i in range(0, len(text), 8)]
        results = [criteria(i, chunk) for i, chunk in enumerate(chunks)]
        if tokens_until_stop is None:
            assert all(done is False for done, _ in results)
        else:
            assert results[tokens_until_stop - 1] == (True, FinishReason.STOP_SEQUENCE)
    criteria = StoppingCriteria(set(), stops, max_new_tokens=100)
    assert feed(criteria, [(1, "a </"), (2, "s"), (3, ">")])[-1] == (True, FinishReason.STOP_SEQUENCE)
    criteria = StoppingCriteria(set(), stops, max_new_tokens=100)
    assert feed(criteria, [(1, "S"), (2, "T"), (3, "O"), (4, "P")])[-1] == (True, FinishReason.STOP_SEQUENCE)


def test_long_output_keeps_only_a_bounded_tail_and_still_matches() -> None:
    criteria = StoppingCriteria(set(), ["needle"], max_new_tokens=10_000)
    for i in range(2000):
        assert criteria(i, "hay stack ") == (False, None)
        assert len(criteria._tail) <= len("needle") - 1
    assert feed(criteria, [(1, "nee"), (2, "dle")])[-1] == (True, FinishReason.STOP_SEQUENCE)


def test_stop_sequence_beats_length_on_the_last_token() -> None:
    criteria = StoppingCriteria(set(), ["ab"], max_new_tokens=2)
    assert feed(criteria, [(1, "a"), (2, "b")])[-1] == (True, FinishReason.STOP_SEQUENCE)


def test_partial_match_does_not_stop() -> None:
    criteria = StoppingCriteria(set(), ["abc"], max_new_tokens=100)
    assert feed(criteria, [(1, "ab"), (2, "x"), (3, "ab"), (4, "d")]) == [(False, None)] * 4


def test_bad_eos_ids_name_the_field() -> None:
    """The model's EOS ids; a request's max_new_tokens and stop sequences were checked where it
    entered (tests/test_request_fields.py)."""
    with pytest.raises(ValueError, match="eos_token_ids"):
        StoppingCriteria({-3}, [], max_new_tokens=5)


def test_stop_sequence_completes_after_text_shorter_than_it():
    """The first token is shorter than the stop sequence: the kept tail must hold all of it."""
    crit = StoppingCriteria(set(), [" returnel"], max_new_tokens=10)
    assert crit(1, " return") == (False, None)
    assert crit(2, "el") == (True, FinishReason.STOP_SEQUENCE)
