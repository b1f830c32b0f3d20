"""The same-GGUF pairing's arithmetic (benchmarks/vs_llamacpp_gguf.py): medians over rounds, ratios
against the issue's targets, and a missing figure reported as missing, not as a ratio."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import vs_llamacpp_gguf as same  # noqa: E402


def test_medians_and_ratios_against_the_targets():
    ours, theirs = same.Figures(), same.Figures()
    for value in (10.0, 30.0, 20.0):
        ours.add("decode c=1", value)
    for value in (15.0, 25.0, 16.0):
        theirs.add("decode c=1", value)
    ours.add("prefill", 100.0)
    theirs.add("prefill", 50.0)
    ours.add("decode c=8", None, "2 request(s) generated [3] tokens instead of 64")
    theirs.add("decode c=8", 40.0)
    rows = same.ratio_rows(ours, theirs, [("prefill", "prefill", 1.2), ("decode c=1", "c=1", 1.0),
                                          ("decode c=8", "c=8", 1.3)])
    assert rows[0] == ["prefill", "100.0", "50.0", "2.00x", ">= 1.2x", "yes"]
    assert rows[1] == ["c=1", "20.0", "16.0", "1.25x", ">= 1.0x", "yes"]
    assert rows[2] == ["c=8", "n/a", "40.0", "n/a", ">= 1.3x", ""]
    assert ours.errors == ["decode c=8: 2 request(s) generated [3] tokens instead of 64"]


def test_a_ratio_short_of_its_target_says_no():
    ours, theirs = same.Figures(), same.Figures()
    ours.add("prefill", 50.0)
    theirs.add("prefill", 100.0)
    assert same.ratio_rows(ours, theirs, [("prefill", "prefill", 1.2)])[0][-2:] == [">= 1.2x", "NO"]
