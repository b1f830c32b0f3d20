"""benchmarks/gpu_step_profile.py's logic on the CPU (the device run is gpu_all.sh's step-profile):
it builds its seeded checkpoint, times decode steps (host wall against the engine's own forward
time) and lists what a profiled step ran, writing both as JSON and Markdown."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_step_profile as gsp  # noqa: E402


def test_cpu_dry_run_times_and_profiles_decode_steps(tmp_path, monkeypatch):
    # The dry run stands in for a GPU's step, whose linears are torch ops: on the CPU float32 decode
    # rows would take the native matrix-vector product, which torch's profiler does not see.
    from text_generation_server.kernels import cpu_native

    monkeypatch.setattr(cpu_native, "F32_GEMV_MAX_ROWS", 0)
    out = tmp_path / "out"
    assert gsp.main(["--device", "cpu", "--dtype", "float32", "--hidden", "64", "--layers", "2", "--heads", "4",
                     "--kv-heads", "2", "--intermediate", "128", "--vocab", "512", "--batches", "1,2",
                     "--steps", "4", "--warm-steps", "1", "--profile-steps", "2", "--prompt-tokens", "8",
                     "--work-dir", str(tmp_path / "model"), "--out", str(out)]) == 0
    result = json.loads((out / "gpu_step_profile.json").read_text())
    assert [r["batch"] for r in result["graphs"]] == [1, 2]  # "graphs": the first load's timings (eager on a CPU)
    for r in result["graphs"]:
        assert r["steps"] == 4 and r["wall_us"] > 0 and 0 < r["device_us"] <= r["wall_us"]
        assert r["gap_us"] == r["wall_us"] - r["device_us"]
    for b in (1, 2):
        p = result[f"profile_graphs_{b}"]
        assert p["launches_per_step"] > 0 and p["top"], p
        assert any(row["name"] in ("aten::mm", "aten::addmm", "aten::linear") for row in p["top"])
    text = (out / "gpu_step_profile.md").read_text()
    assert "| mode | batch | wall us | device us | host gap us |" in text and "launches a step" in text
