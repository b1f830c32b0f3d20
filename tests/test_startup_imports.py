"""What a start imports before it serves: the launcher checks the model argument without torch
(it would delay every rank's start by its own torch import), and a CPU rank never imports Triton
(0.3-0.8 s of a start, for kernels only a GPU or the test interpreter runs)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_the_launcher_checks_the_model_without_torch(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert _run(f"""
        import sys
        from text_generation_server.launcher.supervisor import check_model, check_dtype
        check_model(None)
        check_model({str(tmp_path)!r})
        check_dtype("bfloat16")
        print(sorted(m for m in ("torch", "numpy", "tokenizers") if m in sys.modules))
    """) == "[]"


def test_a_missing_model_is_refused_by_name_without_torch(tmp_path):
    assert _run(f"""
        import sys
        from text_generation_server.launcher.supervisor import check_model
        try:
            check_model({str(tmp_path / "nothing")!r})
        except ValueError as exc:
            print("nothing" in str(exc), "torch" in sys.modules)
    """) == "True False"


def test_a_cpu_rank_loads_and_runs_without_importing_triton():
    assert _run("""
        import sys
        from text_generation_server.models.loader import get_model
        import text_generation_server.shard.service, text_generation_server.engine.warmup
        from text_generation_server.kernels import paged_attention
        lm = get_model(None, max_batch_size=4)
        print(paged_attention.paged_attention_available("cpu")[0], "triton" in sys.modules)
    """) == "False False"
