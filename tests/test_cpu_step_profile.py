"""benchmarks/cpu_step_profile.py on the embedded model: every part of a decode step is counted once
(the parts' exclusive times add up to the step), the prefill is not counted, and the classes it
wraps are put back."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def test_parts_add_up_to_the_step(capsys):
    import cpu_step_profile

    from text_generation_server.layers.attention import TorchAttention

    decode = TorchAttention.__dict__["decode"]
    tiny = ROOT / "server" / "text_generation_server" / "assets" / "tiny-pycoder"
    threads = torch.get_num_threads()
    try:
        assert cpu_step_profile.main([str(tiny), "--prompt", "24", "--steps", "4", "--rounds", "1", "--no-ops",
                                      "--bandwidth-mib", "16", "--threads", "1",
                                      "--compare", "TGS_CPU_NATIVE_ATTENTION=0"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    found = re.findall(r"step ([\d.]+) ms \([\d.]+ tok/s; sum of the parts ([\d.]+) ms\)", out)
    assert len(found) == 2  # as is, and the --compare setting
    for step, parts in found:
        # The prefill's forward (24 tokens: several decode steps' worth) would push the sum far past
        # the step if it were counted; what is left outside the parts is the loop around the step.
        assert abs(float(parts) - float(step)) <= 0.1 * float(step)
    for part in ("linear gate_up", "linear down", "head", "attention (paged decode)", "norms", "rotary"):
        assert f"| {part} |" in out
    assert TorchAttention.__dict__["decode"] is decode
